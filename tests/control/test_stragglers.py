"""Stragglers, pure: the window and the hysteresis of the judgement, the reason named from a
GPU's telemetry, the gain against the cost, and the policy's straggler guards."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from control.policy import (
    Policy,
    Situation,
    StragglerCase,
    decide,
    stragglers_should_trip,
)
from control.stragglers import (
    RankState,
    judge,
    move_cost,
    name_reason,
    projected_gain,
    summarise_history,
)

POLICY = Policy(straggler_window_s=10, straggler_margin=0.2, straggler_clear_margin=0.1)
SPARE = {"job_id": "j", "slot": 2, "rank": 2, "node": "n1", "gpu": 0, "role": "spare"}


def run(policy: Policy, series: list[dict[int, float]], step_ms: int = 5_000) -> list[RankState]:
    """Judge a job at each of ``series`` (compute_s by rank), 5 s apart; rank 1's states."""
    states: dict[int, RankState] = {}
    out = []
    for i, compute in enumerate(series):
        for j in judge(policy, compute, states, now_ms=i * step_ms):
            states[j.rank] = j.state
        out.append(states[1])
    return out


def test_a_rank_above_for_the_window_becomes_a_straggler() -> None:
    slow = {0: 1.0, 1: 1.5, 2: 1.0, 3: 1.02}
    states = run(POLICY, [slow] * 4)
    assert [s.straggling for s in states] == [False, False, True, True]
    assert states[2].straggling_ms == 10_000 and states[0].above_since_ms == 0


def test_a_dip_restarts_the_window() -> None:
    slow, even = {0: 1.0, 1: 1.5, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0}
    states = run(POLICY, [slow, slow, even, slow, slow])
    assert not any(s.straggling for s in states)
    assert states[-1].above_since_ms == 15_000


def test_it_clears_only_below_the_lower_margin() -> None:
    slow = {0: 1.0, 1: 1.5, 2: 1.0}
    between = {0: 1.0, 1: 1.15, 2: 1.0}  # under the 20 % margin, over the 10 % one
    recovered = {0: 1.0, 1: 1.05, 2: 1.0}
    states = run(POLICY, [slow, slow, slow, between, between, recovered])
    assert [s.straggling for s in states] == [False, False, True, True, True, False]
    assert states[-1] == RankState()


def test_small_absolute_differences_are_not_stragglers() -> None:
    tiny = {0: 0.001, 1: 0.002, 2: 0.001}  # twice its peers, but a millisecond
    assert not any(s.straggling for s in run(POLICY, [tiny] * 5))
    assert judge(POLICY, {0: 1.0}, {}, now_ms=0) == []  # one rank has no peers


def test_the_peers_median_leaves_the_rank_out() -> None:
    (first, second) = judge(POLICY, {0: 1.0, 1: 3.0}, {}, now_ms=0)
    assert (first.peers_median_s, second.peers_median_s) == (3.0, 1.0)


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ({"throttle_reasons": 0x40 | 0x4}, "HW thermal slowdown (0x40), SW power cap (0x4)"),
        ({"throttle_reasons": 0x80}, "HW power brake slowdown (0x80)"),
        ({"throttle_reasons": 0x1 | 0x10}, "unknown"),  # idle and sync boost are not faults
        ({"temp_gpu_c": 91.0}, "hot: 91 °C"),
        ({"pcie_link_width": 8, "pcie_link_width_max": 16}, "PCIe link at x8 of x16"),
        ({"pcie_link_width": 16, "pcie_link_width_max": 16, "temp_gpu_c": 60.0}, "unknown"),
    ],
)
def test_the_reason_is_named_from_the_newest_sample(sample: dict, expected: str) -> None:  # type: ignore[type-arg]
    assert expected in name_reason([sample], hot_c=85.0)


def test_reasons_over_the_window_and_none() -> None:
    samples: list[dict[str, int | None]] = [
        {"pcie_link_gen": 4, "nvlink_replay": 10, "pcie_replay": 5},
        {"pcie_link_gen": 4, "nvlink_replay": 2, "pcie_replay": 5},  # a reset
        {"pcie_link_gen": 3, "nvlink_replay": 9, "pcie_replay": 5, "throttle_reasons": None},
    ]
    assert name_reason(samples, hot_c=85.0) == (
        "PCIe link down to gen 3 (was gen 4); link errors rising: NVLink replay +7"
    )
    assert name_reason([], hot_c=85.0) == "unknown"
    assert name_reason([{"throttle_reasons": None, "temp_gpu_c": None}], hot_c=85.0) == "unknown"


def test_gain_over_the_steps_left_or_the_horizon() -> None:
    known = projected_gain(
        compute_s=1.5, peers_median_s=1.0, step=100, total_steps=300, horizon_steps=50
    )
    assert (known.seconds, known.remaining_steps, known.remaining_from) == (
        100.0,
        200,
        "total_steps",
    )
    unknown = projected_gain(
        compute_s=1.5, peers_median_s=1.0, step=100, total_steps=None, horizon_steps=50
    )
    assert (unknown.seconds, unknown.remaining_from) == (25.0, "horizon")
    done = projected_gain(
        compute_s=1.5, peers_median_s=1.0, step=400, total_steps=300, horizon_steps=1
    )
    assert done.seconds == 0.0


def test_the_cost_is_the_jobs_else_the_fleets_else_the_policys() -> None:
    assert move_cost(job_pauses_s=[2.0, 4.0, 9.0], fleet_pauses_s=[1.0], default_s=60) == (
        4.0,
        "job",
    )
    assert move_cost(job_pauses_s=[], fleet_pauses_s=[1.0, 3.0], default_s=60) == (2.0, "fleet")
    assert move_cost(job_pauses_s=[], fleet_pauses_s=[], default_s=60) == (60.0, "policy")


def situation(**kw) -> Situation:  # type: ignore[no-untyped-def]
    base = {
        "now_ms": 1_000_000,
        "breaker_tripped": False,
        "inflight_by_job": {},
        "inflight_fleet": 0,
        "last_request_ms": {},
        "spares_by_job": {"j": [SPARE]},
        "drained": set(),
    }
    return Situation(**{**base, **kw})


def case(gain_s: float, cost_s: float = 10.0, cost_from: str = "job") -> StragglerCase:
    return StragglerCase(gain_s, 200, "total_steps", cost_s, cost_from)


def straggler(policy: Policy, sit: Situation, c: StragglerCase):  # type: ignore[no-untyped-def]
    return decide(policy, sit, job_id="j", node="n0", gpu=1, trigger="straggler", straggler=c)


def test_a_straggler_moves_when_the_gain_exceeds_the_cost() -> None:
    moved = straggler(POLICY, situation(), case(100.0))
    assert moved.action == "request" and moved.target == SPARE
    assert "gain 100 s over 200 steps left, cost 10 s (this job's measured pause)" in moved.reason
    kept = straggler(POLICY, situation(), case(5.0, cost_from="policy"))
    assert kept.action == "declined"
    assert kept.reason == (
        "straggler: the projected gain does not exceed the move's cost (the policy's default)"
    )
    # the same reason at any figures: a standing decline is audited once
    assert straggler(POLICY, situation(), case(6.0, cost_from="policy")).reason == kept.reason
    dry = straggler(POLICY.model_copy(update={"dry_run": True}), situation(), case(100.0))
    assert dry.action == "dry_run"
    with pytest.raises(ValueError, match="gain and cost"):
        decide(POLICY, situation(), job_id="j", node="n0", gpu=1, trigger="straggler")


def test_a_straggler_passes_the_same_guards_as_a_risk() -> None:
    assert "breaker" in straggler(POLICY, situation(breaker_tripped=True), case(100.0)).reason
    cooling = situation(last_request_ms={("j", "n0", 1): 1_000_000 - 5_000})
    assert "cooldown" in straggler(POLICY, cooling, case(100.0)).reason
    busy = situation(inflight_by_job={"j": 1}, inflight_fleet=1)
    assert "in flight" in straggler(POLICY, busy, case(100.0)).reason
    assert "no free spare" in straggler(POLICY, situation(spares_by_job={}), case(100.0)).reason


def test_many_stragglers_at_once_hold_every_straggler_move() -> None:
    policy = Policy(straggler_breaker_pct=25, straggler_breaker_min=3)
    assert stragglers_should_trip(policy, stragglers=2, judged=4) is None  # under the minimum
    assert stragglers_should_trip(policy, stragglers=3, judged=100) is None  # 3 %
    why = stragglers_should_trip(policy, stragglers=3, judged=8)
    assert why is not None and "shared cause" in why
    held = straggler(policy, situation(stragglers_tripped=why), case(100.0))
    assert (held.action, held.reason) == ("declined", why)
    # a risk-driven move is not held by the stragglers' breaker
    risk = decide(
        policy,
        situation(stragglers_tripped=why),
        job_id="j",
        node="n0",
        gpu=1,
        trigger="preventive",
    )
    assert risk.action == "request"


def test_the_clear_margin_must_be_below_the_margin() -> None:
    with pytest.raises(ValidationError, match="straggler_clear_margin"):
        Policy(straggler_margin=0.1, straggler_clear_margin=0.1)
    with pytest.raises(ValidationError):
        Policy(straggler_window_s=-1)


def test_peer_medians_equal_the_median_of_the_others() -> None:
    import random
    import statistics

    from control.stragglers import peer_medians

    rng = random.Random(3)
    for n in (2, 3, 4, 7, 10):
        values = [round(rng.uniform(0, 2), 1) for _ in range(n)]  # ties included
        got = peer_medians(values).tolist()
        want = [statistics.median(values[:i] + values[i + 1 :]) for i in range(n)]
        assert got == pytest.approx(want)


def test_the_history_sums_episodes_over_the_rank_time_watched() -> None:
    """Two episodes over 4 rank-days: 0.5 a rank-day; the slowdown their median at
    announcement; the mean length the ended span plus the open one's time so far over the
    one ended (the exponential's estimate when spans are cut short)."""
    day = 86_400_000
    started = {"job_id": "j", "rank": 1, "above_since_ms": 0, "reason": "HW thermal slowdown"}
    episodes = [
        {
            "started": {**started, "compute_s": 1.5, "peers_median_s": 1.0},
            "ended": {"ended_ms": 600_000, "straggling_ms": 120_000, "ended_by": "moved"},
        },
        {
            "started": {**started, "rank": 2, "above_since_ms": 1_000_000, "reason": None}
            | {"compute_s": 2.5, "peers_median_s": 1.0},
            "ended": None,
        },
    ]
    h = summarise_history(
        episodes, {"rank_ms": 4 * day, "since_ms": 5, "last_ms": 0}, now_ms=1_300_000
    )
    assert (h.episodes, h.ended, h.rank_days, h.since_ms) == (2, 1, 4.0, 5)
    assert h.episodes_per_gpu_day == 0.5 and h.slowdown == 2.0
    assert h.duration_mean_s == (600 + 300) / 1 and h.detect_median_s == 120.0
    assert h.ended_by == {"moved": 1}
    assert h.reasons == {"HW thermal slowdown": 1, "unknown": 1}
    empty = summarise_history([], None, now_ms=0)
    assert empty.episodes_per_gpu_day is None and empty.duration_mean_s is None
    assert (
        summarise_history([], {"rank_ms": day, "since_ms": 0}, now_ms=0).episodes_per_gpu_day == 0
    )
