"""The floor's rules held to the alarm budget (predictor/floor_budget.py)."""

from __future__ import annotations

import numpy as np

from predictor.features import FEATURE_NAMES
from predictor.floor import FLOOR_RULES, floor_hits
from predictor.floor_budget import FloorBudget, floor_mask, replay

H = 3_600_000
T0 = 1_800_000_000_000 - 1_800_000_000_000 % H  # the start of a block
BIT = {r.name: 1 << j for j, r in enumerate(FLOOR_RULES)}


def masks(n: int, tripped: dict[int, str]) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    for slot, rule in tripped.items():
        out[slot] |= BIT[rule]
    return out


def active(rules: FloorBudget) -> set[str]:
    return {r.name for r, a in zip(FLOOR_RULES, rules.active, strict=True) if a}


def test_floor_mask_has_one_bit_per_tripped_rule() -> None:
    hits = np.zeros((3, len(FLOOR_RULES)), dtype=bool)
    hits[1, 0] = hits[2, 1] = hits[2, 4] = True
    assert floor_mask(hits).tolist() == [0, 1, 2 | 16]
    assert floor_mask(floor_hits(np.zeros((0, len(FEATURE_NAMES))))).tolist() == []


def test_a_rule_tripping_on_many_healthy_gpus_stops_being_a_floor_in_the_first_hour() -> None:
    """Hot nodes: thermal slowdown on 16 of 1,024 GPUs from the first minute, far more than a
    budget of 2 per 1,000 GPU-days explains; one GPU's pending remap is not."""
    rules = FloorBudget(2.0)
    tripped = {g: "thermal" for g in range(16)} | {500: "remap"}
    assert active(rules) == {r.name for r in FLOOR_RULES}  # nothing seen: every rule a floor
    for minute in range(3):
        rules.observe(masks(1024, tripped), now_ms=T0 + minute * 60_000)
    assert "thermal" not in active(rules)
    assert "remap" in active(rules)
    assert rules.active_mask & BIT["thermal"] == 0
    (demoted,) = rules.demoted()
    assert demoted["rule"] == "thermal" and demoted["unconfirmed_gpus"] == 16


def test_a_few_gpus_are_not_enough_nor_those_that_failed() -> None:
    """Two GPUs with a rule tripping may be two failures to come; GPUs that failed foretold
    their failure (the rule is kept, and raise the bar for the others in the same hours)."""
    rules = FloorBudget(2.0)
    rules.observe(masks(1024, {1: "remap", 2: "remap"}), now_ms=T0)
    assert "remap" in active(rules)
    rules.observe(masks(1024, {g: "remap" for g in range(1, 7)}), now_ms=T0 + 60_000)
    rules.discard([1, 2, 3])  # three of them failed: 3 more up are what 3 failures explain
    assert "remap" in active(rules)
    spread = dict(zip([r.name for r in FLOOR_RULES], rules.early_spread, strict=True))
    assert spread["remap"] == 3 + 2 * 3 and spread["thermal"] == 3  # its own failures only
    rules.observe(masks(1024, {g: "remap" for g in range(4, 14)}), now_ms=T0 + 120_000)
    assert "remap" not in active(rules)  # 10 up: more than the failures explain


def test_confirmed_healthy_time_demotes_a_rule_over_the_budget_and_keeps_one_within() -> None:
    """One GPU a rule trips on every hour (different GPUs, none failing): 24 a day on 256 GPUs
    is 94 per 1,000 GPU-days, a flood of 47 times the budget; another rule trips once in the
    whole day. With the early test off (spread too high), only confirmation can demote, 12 h
    after a block ends."""
    rules = FloorBudget(2.0, spread=10_000)
    for hour in range(30):
        tripped = {hour % 256: "remap"}
        if hour == 3:
            tripped[100] = "fatal_xid"
        rules.observe(masks(256, tripped), now_ms=T0 + hour * H)
        if hour <= 12:
            assert active(rules) == {r.name for r in FLOOR_RULES}, hour
    assert "remap" not in active(rules)
    assert "fatal_xid" in active(rules)
    (demoted,) = rules.demoted()
    assert demoted["false_alarms_per_1000_gpu_days"] > 20 * 2


def test_a_rule_a_few_times_over_the_budget_stays_a_floor() -> None:
    """Precise evidence that costs a few false alarms more than the budget (a remap pending on
    one healthy GPU of 256 every 6 hours: 16 per 1,000 GPU-days, 8 times a budget of 2) is
    kept: only a flood of more than ten times the budget is demoted."""
    rules = FloorBudget(2.0)
    for hour in range(48):
        rules.observe(masks(256, {hour: "remap"} if hour % 6 == 0 else {}), now_ms=T0 + hour * H)
    assert "remap" in active(rules)


def test_the_confirmed_counts_survive_a_restart() -> None:
    rules = FloorBudget(2.0, spread=10_000)
    for hour in range(30):
        rules.observe(masks(256, {hour % 256: "remap"}), now_ms=T0 + hour * H)
    assert "remap" not in active(rules)
    again = FloorBudget(2.0, spread=10_000)
    assert again.restore(rules.state())
    assert "remap" not in active(again)
    assert again.released()[1] == 0.0  # released by the leader that kept it, not again
    assert not again.restore({**rules.state(), "rules": ["dbe"]})
    assert not again.restore({**rules.state(), "hits": [-1.0] * len(FLOOR_RULES)})
    assert not again.restore({**rules.state(), "block_ms": 60_000})


def test_replay_judges_each_row_by_what_was_known_before_its_tick() -> None:
    """The evaluation's replay gives the same floor as the live loop: the first tick of hot
    GPUs is still floored, the next is not."""
    ts = np.repeat([T0, T0 + 60_000], 1024)
    slot = np.tile(np.arange(1024), 2)
    m = np.tile(masks(1024, {g: "thermal" for g in range(16)}), 2)
    out, released, forgot = replay(FloorBudget(2.0), ts, slot, m)
    first, second = out[:1024], out[1024:]
    assert np.all(first & BIT["thermal"])
    assert not np.any(second & BIT["thermal"])
    assert np.all(second & BIT["remap"])
    assert sorted(released[1].tolist()) == list(range(16))  # their blocks: the rule's alarms
    assert np.all(released[0] == T0 + 1)
    assert not len(forgot[0])  # nothing confirmed to take back


def test_an_early_demotion_is_kept_until_its_evidence_would_be_confirmed() -> None:
    """A new leader does not floor the hot nodes again while it gathers their evidence anew;
    once the kept evidence would have been confirmed, the confirmed counts decide."""
    rules = FloorBudget(2.0)
    rules.observe(masks(1024, {g: "thermal" for g in range(16)}), now_ms=T0)
    state = rules.state()
    assert state["early_until_ms"] == {"thermal": T0 + H + 12 * H}
    again = FloorBudget(2.0)
    assert again.restore(state)
    again.observe(masks(1024, {}), now_ms=T0 + 60_000)
    assert "thermal" not in active(again)
    again.observe(masks(1024, {}), now_ms=T0 + 13 * H + 1)
    assert "thermal" in active(again)
    assert not again.restore({**state, "early_until_ms": {"thermal": "soon"}})
