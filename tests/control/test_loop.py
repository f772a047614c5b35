"""The control loop on both backends: hysteresis, crossing -> one migration, dry-run, restart,
unplanned and planned (drain) paths, the breaker. Risks come from a fake scorer."""

from __future__ import annotations

import time
from types import SimpleNamespace

from api.routes.policy import _read as policy_read
from control.loop import ArrivalCursor, ControlLoop
from control.policy import Policy
from store import Store
from store import control as db
from store.outbox import events_after
from tests.control.conftest import make_loop

NOW = int(time.time() * 1000)


def outbox_types(store: Store) -> list[str]:
    with store.engine.connect() as c:
        return [e["type"] for e in events_after(c, 0, limit=10_000)]


def migrations(store: Store) -> list[dict]:  # type: ignore[type-arg]
    with store.engine.connect() as c:
        return db.list_migrations(c)


def audit(store: Store, **kw) -> list[dict]:  # type: ignore[no-untyped-def, type-arg]
    with store.engine.connect() as c:
        return db.read_audit(c, **kw)


def test_hysteresis_then_exactly_one_preventive_migration(registered: Store) -> None:
    loop, scorer = make_loop(registered, hysteresis=3)
    scorer.risk[("n0", 1)] = 0.9
    loop.tick(NOW)
    loop.tick(NOW + 1000)
    assert migrations(registered) == []  # two scores above: not yet
    loop.tick(NOW + 2000)
    (m,) = migrations(registered)
    assert (m["state"], m["trigger"], m["rank"]) == ("requested", "preventive", 1)
    assert (m["source_node"], m["source_gpu"], m["target_slot"]) == ("n0", 1, 2)
    assert m["risk"] == 0.9 and m["reasons"] == ["ECC errors rising"]
    for k in range(3, 8):
        loop.tick(NOW + k * 1000)
    assert len(migrations(registered)) == 1
    types = outbox_types(registered)
    assert types.count("risk.threshold_crossed") == 1
    assert types.count("migration.requested") == 1
    with registered.engine.connect() as c:
        (row,) = [r for r in db.risk_rows(c) if (r["node"], r["gpu"]) == ("n0", 1)]
    assert row["crossed"] and row["streak"] >= 3


def test_a_dip_resets_the_streak(registered: Store) -> None:
    loop, scorer = make_loop(registered, hysteresis=2)
    for k, risk in enumerate([0.9, 0.1, 0.9, 0.1, 0.9]):
        scorer.risk[("n0", 1)] = risk
        loop.tick(NOW + k * 1000)
    assert migrations(registered) == []


def test_dry_run_records_one_decision_and_moves_nothing(registered: Store) -> None:
    loop, scorer = make_loop(registered, hysteresis=1, dry_run=True)
    scorer.risk[("n0", 1)] = 0.9
    for k in range(6):
        loop.tick(NOW + k * 1000)
    assert migrations(registered) == []
    (entry,) = audit(registered, kind="migration")
    assert entry["action"] == "dry_run" and entry["job_id"] == "j"
    assert entry["data"]["target"]["slot"] == 2


def test_declines_are_audited_once_per_reason(registered: Store) -> None:
    loop, scorer = make_loop(registered, hysteresis=1)
    with registered.begin() as c:
        db.set_drain(c, node="n1", drained=True, ts_ms=NOW, reason="maintenance")
    scorer.risk[("n0", 1)] = 0.9
    for k in range(4):
        loop.tick(NOW + k * 1000)
    (entry,) = audit(registered, kind="migration")
    assert entry["action"] == "declined" and "no free spare" in entry["reason"]


def test_restart_neither_loses_nor_repeats(registered: Store) -> None:
    loop, scorer = make_loop(registered, hysteresis=1)
    scorer.risk[("n0", 1)] = 0.9
    loop.tick(NOW)
    loop.leadership.release()  # the process "dies"
    again, scorer2 = make_loop(registered, hysteresis=1)
    scorer2.risk[("n0", 1)] = 0.9
    for k in range(1, 4):
        again.tick(NOW + k * 1000)
    (m,) = migrations(registered)
    assert m["state"] == "requested"
    assert outbox_types(registered).count("risk.threshold_crossed") == 1


def test_unplanned_on_a_fatal_xid_bypasses_hysteresis(registered: Store) -> None:
    loop, _ = make_loop(registered, hysteresis=5)
    registered.write(events=[("n0", 0, NOW - 500, "xid", 79, "fallen off the bus", "kmsg")])
    loop.tick(NOW)
    (m,) = migrations(registered)
    assert (m["trigger"], m["rank"], m["source_gpu"]) == ("unplanned", 0, 0)
    assert "gpu.failed" in outbox_types(registered)


def test_a_row_remap_is_a_precursor_not_a_failure(registered: Store) -> None:
    """Xid 63 (a row remap recorded, the GPU works on) neither fails the GPU nor moves its
    rank; a double-bit error (Xid 48) on the same GPU does."""
    loop, _ = make_loop(registered, hysteresis=5)
    registered.write(events=[("n0", 1, NOW - 500, "xid", 63, "row remap", "kmsg")])
    loop.tick(NOW)
    assert migrations(registered) == []
    assert "gpu.failed" not in outbox_types(registered)
    registered.write(events=[("n0", 1, NOW + 500, "xid", 48, "double-bit ECC", "kmsg")])
    loop.tick(NOW + 1000)
    (m,) = migrations(registered)
    assert (m["trigger"], m["rank"], m["source_gpu"]) == ("unplanned", 1, 1)


def test_drain_moves_ranks_off_the_node_as_planned(registered: Store) -> None:
    loop, _ = make_loop(registered)
    with registered.begin() as c:
        db.set_drain(c, node="n0", drained=True, ts_ms=NOW, reason=None)
    loop.tick(NOW)
    loop.tick(NOW + 1000)
    (m,) = migrations(registered)  # one at a time: max one in flight per job
    assert m["trigger"] == "planned" and m["target_node"] == "n1"


def test_the_breaker_stops_automatic_action(registered: Store) -> None:
    loop, scorer = make_loop(registered, hysteresis=1, breaker_pct=20, breaker_min_gpus=3)
    for gpu in (1, 2, 3):
        scorer.risk[("n0", gpu)] = 0.9
    loop.tick(NOW)
    assert migrations(registered) == []
    assert "policy.breaker_tripped" in outbox_types(registered)
    (entry,) = audit(registered, kind="policy")
    assert entry["action"] == "breaker_tripped"


def test_two_loops_one_leader(registered: Store) -> None:
    first = ControlLoop(registered, model=None, defaults=Policy(), tick_s=1.0)
    second = ControlLoop(registered, model=None, defaults=Policy(), tick_s=1.0)
    assert first.step(now_ms=NOW)
    assert not second.step(now_ms=NOW)
    first.leadership.release()
    assert second.step(now_ms=NOW)
    second.leadership.release()


def test_an_alarm_budget_sets_the_threshold_from_the_fleets_own_risks(registered: Store) -> None:
    """With ``alarm_budget`` the threshold follows this fleet's risks (the card's 0.5 means
    nothing here: healthy GPUs score 0.01-0.05), a GPU far above them crosses, and a
    threshold set by the operator still wins."""
    import numpy as np

    loop, scorer = make_loop(registered, hysteresis=1, alarm_budget=2.0)
    rng = np.random.default_rng(0)
    hour = 3_600_000
    for k in range(8):  # eight hours of 2,100 healthy GPUs, one tick an hour (six hours closed
        # before the last tick: 12,600 GPU-hours, more than the 12,000 a budget of 2 per 1,000
        # GPU-days stands on)
        for g in range(2100):
            scorer.risk[(f"h{g // 8}", g % 8)] = float(rng.uniform(0.01, 0.05))
        loop.tick(NOW + k * hour)
    assert loop.budget is not None and loop.budget.healthy_blocks == 0  # none confirmed yet
    threshold = loop.threshold_in_force
    assert threshold is not None and 0.04 < threshold < 0.2  # provisional: the tail
    scorer.risk[("n0", 1)] = 0.2
    loop.tick(NOW + 8 * hour)
    (m,) = migrations(registered)
    assert (m["source_node"], m["source_gpu"], m["trigger"]) == ("n0", 1, "preventive")
    crossed = [e for e in audit(registered) if e["action"] == "requested"]
    assert crossed
    with registered.begin() as c:
        db.write_policy(c, data=Policy(threshold=0.9, alarm_budget=2.0).model_dump(), ts_ms=NOW)
    loop.tick(NOW + 9 * hour)
    assert loop.threshold_in_force == 0.9 and loop.budget is None


def test_the_alarm_budget_survives_a_restart_of_the_service(registered: Store) -> None:
    """The budget's confirmed healthy time is kept in the store: a restarted (or new) leader
    meets the same threshold at its first tick, not the card's until hundreds of GPU-hours
    are seen again; a budget the operator changes starts from the same healthy time."""
    import numpy as np

    loop, scorer = make_loop(registered, hysteresis=1, alarm_budget=2.0)
    rng = np.random.default_rng(1)
    hour = 3_600_000
    # 26 hours of 1,000 healthy GPUs: the first 13 hours are confirmed (13,000 GPU-hours, more
    # than the 12,000 a budget of 2 per 1,000 GPU-days stands on)
    for k in range(26):
        for g in range(1000):
            scorer.risk[(f"h{g // 8}", g % 8)] = float(rng.uniform(0.01, 0.05))
        loop.tick(NOW + k * hour)
    assert loop.budget is not None and loop.budget.warm, loop.budget.summary()
    warm = loop.budget.threshold
    assert 0.04 < warm < 0.2, warm
    loop.leadership.release()  # the service stops

    again, scorer2 = make_loop(registered, hysteresis=1, alarm_budget=2.0)
    scorer2.risk.update(scorer.risk)
    again.tick(NOW + 26 * hour)
    assert again.budget is not None and again.budget.warm
    assert again.threshold_in_force == warm  # met before this tick's risks are folded in
    kept = again.budget.healthy_blocks

    with registered.begin() as c:  # a stricter budget: a higher threshold on the same time
        db.write_policy(c, data=Policy(alarm_budget=1.5, hysteresis=1).model_dump(), ts_ms=NOW)
    again.tick(NOW + 27 * hour)
    assert again.budget is not None and again.budget.healthy_blocks >= kept
    assert again.budget.threshold > warm

    with registered.begin() as c:  # unreadable state: a fresh start, not a crash
        db.set_state(c, "alarm_budget", "{not json")
    again.leadership.release()
    fresh, _ = make_loop(registered, hysteresis=1, alarm_budget=2.0)
    fresh.tick(NOW + 28 * hour)
    assert fresh.budget is not None and not fresh.budget.warm
    assert fresh.threshold_in_force == fresh.budget.fallback  # until the fleet is seen again
    fresh.leadership.release()


def test_hard_evidence_crosses_at_any_threshold_with_the_rule_named(registered: Store) -> None:
    """The rules are a floor: a GPU whose model risk is low but which trips a rule (a row
    remap pending) is alarmed at the threshold in force, even one the operator set high, and
    the rule is among the reasons of its crossing and of its migration."""
    loop, scorer = make_loop(registered, hysteresis=2, threshold=0.95)
    scorer.floor[("n0", 1)] = "remap: row remap pending or failed (memory)"
    for k in range(3):
        loop.tick(NOW + k * 1000)
    (m,) = migrations(registered)
    assert (m["source_node"], m["source_gpu"], m["trigger"]) == ("n0", 1, "preventive")
    assert m["risk"] == 0.95 and m["reasons"][0].startswith("rule remap")
    with registered.engine.connect() as c:
        rows = {(r["node"], r["gpu"]): r for r in db.risk_rows(c)}
    assert rows[("n0", 1)]["alarm"] and rows[("n0", 1)]["risk"] == 0.95
    assert not rows[("n0", 0)]["alarm"] and rows[("n0", 0)]["risk"] == 0.01


def test_the_floors_false_alarms_use_up_the_alarm_budget(registered: Store) -> None:
    """A floored GPU counts at the top of the budget's scale: with a rule that trips on one
    healthy GPU of 2,100 every hour, the model's own threshold rises above the healthy tail it
    would otherwise sit in; a rule that trips on 21 at once is no floor (its alarms flood the
    budget) and leaves the model's threshold where it was."""
    import numpy as np

    def run(floor_every: int) -> float:
        loop, scorer = make_loop(registered, hysteresis=1, alarm_budget=2.0)
        rng = np.random.default_rng(0)
        for k in range(8):
            for g in range(2100):
                scorer.risk[(f"h{g // 8}", g % 8)] = float(rng.uniform(0.01, 0.05))
                if floor_every and g % floor_every == 0:
                    scorer.floor[(f"h{g // 8}", g % 8)] = "thermal"
            loop.tick(NOW + k * 3_600_000)
        threshold = loop.threshold_in_force
        loop.leadership.release()
        assert threshold is not None
        return threshold

    plain, one, flood = run(0), run(2100), run(100)
    assert one > 10 * plain  # one GPU of 2,100: the rule stays a floor, its alarms count
    # 21 GPUs at once, 120 times the budget: the rule is no longer a floor from the first
    # tick, and its first alarms were its own, not the model's (released from the budget)
    assert abs(flood - plain) < 1e-3 * plain


def test_a_rule_that_spends_the_budget_on_healthy_gpus_stops_being_a_floor(
    registered: Store,
) -> None:
    """Hot nodes: thermal slowdown on 16 healthy GPUs from the first tick. They alarm once (the
    floor raises them, nothing is known yet), then the rule is no longer a floor on this fleet:
    the model decides them, their reasons say so, the loop's status names the rule, and a
    restarted service's first tick does not floor them again. A GPU with a row remap pending
    is still floored."""
    loop, scorer = make_loop(registered, hysteresis=1, alarm_budget=2.0)
    for g in range(1024):
        scorer.risk[(f"h{g // 8}", g % 8)] = 0.01
    for g in range(16):
        scorer.floor[(f"h{g // 8}", g % 8)] = "thermal: thermal slowdown (thermal)"
    scorer.floor[("n0", 1)] = "remap: row remap pending or failed (memory)"
    loop.tick(NOW)
    with registered.engine.connect() as c:
        rows = {(r["node"], r["gpu"]): r for r in db.risk_rows(c)}
    assert rows[("h0", 0)]["alarm"] and rows[("n0", 1)]["alarm"]
    loop.tick(NOW + 60_000)
    with registered.engine.connect() as c:
        rows = {(r["node"], r["gpu"]): r for r in db.risk_rows(c)}
        status = db.read_status(c)
        kept = db.get_state(c, "floor_budget")
    hot = rows[("h0", 0)]
    assert not hot["alarm"] and hot["risk"] == 0.01
    assert "not a floor on this fleet" in hot["reasons"][0]
    assert rows[("n0", 1)]["alarm"] and rows[("n0", 1)]["reasons"][0].startswith("rule remap")
    assert status is not None
    assert [d["rule"] for d in status["floor_budget"]["demoted"]] == ["thermal"]
    assert "risk.cleared" in outbox_types(registered)
    assert kept is not None and "thermal" in kept
    shown = policy_read(registered, SimpleNamespace(policy=Policy()))  # GET /v1/policy
    assert [d["rule"] for d in shown["floor_budget"]["demoted"]] == ["thermal"]
    loop.leadership.release()  # a restarted service does not floor them again
    again, scorer2 = make_loop(registered, hysteresis=1, alarm_budget=2.0)
    scorer2.risk.update(scorer.risk)
    scorer2.floor.update(scorer.floor)
    again.tick(NOW + 120_000)
    with registered.engine.connect() as c:
        rows = {(r["node"], r["gpu"]): r for r in db.risk_rows(c)}
    assert not rows[("h0", 0)]["alarm"] and rows[("n0", 1)]["alarm"]
    again.leadership.release()


def test_the_loop_follows_the_model_in_force_and_records_which_model_scored(
    registered: Store, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """An operator's pin (or a promotion, or a rollback) reaches the loop at its next tick;
    the crossing's event and the migration say which model scored."""
    from predictor import registry
    from predictor.lifecycle import ModelLifecycle

    shipped = registry.load_latest(registry.SHIPPED_DIR)
    for stem in ("forewarn-risk-20260101T000000Z", "forewarn-risk-20260102T000000Z"):
        registry.save(shipped, tmp_path, stem=stem)
    life = ModelLifecycle(tmp_path)
    loop, scorer = make_loop(registered, hysteresis=1, threshold=0.5)
    loop.lifecycle = life
    loop.tick(NOW)
    assert loop.model_id == "forewarn-risk-20260102T000000Z"  # the newest, nothing pinned
    life.pin("forewarn-risk-20260101T000000Z")
    scorer.risk[("n0", 1)] = 0.9
    loop.tick(NOW + 1000)
    assert loop.model_id == "forewarn-risk-20260101T000000Z"
    with registered.engine.connect() as c:
        crossed = [
            e for e in events_after(c, 0, limit=100) if e["type"] == "risk.threshold_crossed"
        ]
    assert crossed[0]["data"]["model"] == "forewarn-risk-20260101T000000Z"
    (m,) = migrations(registered)
    assert m["detail"] == "scored by model forewarn-risk-20260101T000000Z"
    life.rollback()
    loop.tick(NOW + 2000)
    assert loop.model_id == "forewarn-risk-20260102T000000Z"


def test_a_tick_at_its_read_limit_says_it_is_behind_and_the_next_ticks_catch_up(
    registered: Store,
) -> None:
    """Every sample reaches the scorer once, with the values stored (NULL as NaN), however
    many ticks the backlog takes; a tick that read its limit says so in the loop's status."""
    from datetime import UTC, datetime

    import numpy as np

    from predictor.state import VALUE_COLUMNS
    from store.writes import sample_row
    from tests.factories import sample

    loop, scorer = make_loop(registered)
    loop.read_limit = 10
    blocks: list = []  # type: ignore[type-arg]
    update = scorer.update

    def record(samples, events=None, *, now_ms):  # type: ignore[no-untyped-def]
        blocks.append(samples)
        update(samples, events, now_ms=now_ms)

    scorer.update = record  # type: ignore[method-assign]
    rows = [
        sample(
            node="n0",
            gpu=g,
            ts=datetime.fromtimestamp(NOW / 1000 - 30 + k, UTC),
            temp_gpu_c=40.0 + k,
        )
        for k in range(6)
        for g in range(4)
    ]
    registered.write(samples=[sample_row(r) for r in rows])
    behind = []
    for k in range(4):
        loop.tick(NOW + k * 1000)
        behind.append(loop.status(NOW)["behind"])
    assert [len(b) for b in blocks] == [10, 10, 4, 0]
    assert behind == [True, True, False, False]
    got = {
        (n, int(g), int(t)): v
        for b in blocks
        for n, g, t, v in zip(b.node, b.gpu, b.ts_ms, b.values, strict=True)
    }
    assert len(got) == 24
    at = {name: VALUE_COLUMNS.index(name) for name in VALUE_COLUMNS}
    for r in rows:
        v = got[(r.node, r.gpu, int(r.ts.timestamp() * 1000))]
        assert v[at["temp_gpu_c"]] == r.temp_gpu_c and v[at["ecc_sbe_volatile"]] == 2
        assert v[at["remap_pending"]] == 0.0  # a boolean as 0/1
        assert np.isnan(v[at["ecc_sbe_aggregate"]])  # not reported: NULL


def test_a_take_over_warms_the_scorer_page_by_page_as_from_the_whole_window(
    store: Store, monkeypatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The warm reads the window a page of fleet time at a time (bounded memory on a large
    fleet); the scorer ends where folding the whole window at once leaves it: counters,
    a reset between pages, a GPU that recovered, readings that vanish."""
    from datetime import UTC, datetime

    import numpy as np

    import control.loop as loop_module
    from predictor import registry
    from predictor.scoring import Scorer
    from store.writes import sample_row
    from tests.factories import sample

    start = NOW - 200_000
    rows = [
        sample(
            node=f"n{g // 4}",
            gpu=g % 4,
            ts=datetime.fromtimestamp((start + k * 1_000) / 1000, UTC),
            # counts, a reset at k = 90; n1:0 stops counting at k = 100 and recovers at 120
            ecc_sbe_volatile=min(k, 100) * g if g == 4 else (k % 90) * g,
            temp_gpu_c=None if (k + g) % 11 == 0 else 50.0 + g,
        )
        for k in range(180)
        for g in range(8)
    ]
    store.write(
        samples=[sample_row(r) for r in rows],
        events=[
            ("n1", 0, start + 120_000, "gpu_recovered", -1, "back", "kmsg"),
            ("n0", 1, start + 50_000, "xid", 63, "row remap", "kmsg"),
        ],
    )
    model = registry.load_default(tmp_path)  # nothing there: the shipped model
    whole = Scorer(model)
    with store.engine.connect() as c:
        events = db.events_window(c, since_ms=NOW - 190_000)
    whole.update(store.fleet_window(since_ms=NOW - 190_000), events, now_ms=NOW)
    monkeypatch.setattr(loop_module, "WARM_PAGE_ROWS", 100)  # pages of 12 s: 16 of them
    loop = ControlLoop(store, model=model, defaults=Policy(), tick_s=1.0, warm_window_s=190)
    loop.scorer = Scorer(model)
    with store.engine.connect() as c:  # as a take-over sets it: the events up to it are warmed
        loop.events = ArrivalCursor(db.max_event_seq(c))
    loop._warm(NOW)
    paged = loop.scorer
    assert paged.state.now_ms == whole.state.now_ms == NOW

    def by_gpu(s: Scorer) -> np.ndarray:
        order = np.lexsort((s.state.gpu_of[: s.state.size], s.state.node_of[: s.state.size]))
        return s.features()[order]

    np.testing.assert_allclose(by_gpu(paged), by_gpu(whole), rtol=1e-9, atol=1e-9, equal_nan=True)
