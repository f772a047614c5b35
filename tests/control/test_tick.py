"""The tick's correctness on both backends: a failed commit loses no event, a new leader
rebuilds the breaker's window, a deposed leader writes nothing, one active migration per
rank. Risks come from a fake scorer; two loops on one database stand for two replicas."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Connection, insert, text
from sqlalchemy.exc import IntegrityError

from control import orchestrator
from control.leader import Leadership
from forewarn.errors import Conflict
from store import Store
from store import control as db
from store.outbox import events_after
from tests.control.conftest import make_loop, request_move
from tests.control.test_loop import audit, migrations, outbox_types

NOW = int(time.time() * 1000)


def risk_row(store: Store, node: str, gpu: int) -> dict[str, Any] | None:
    with store.engine.connect() as c:
        rows = [r for r in db.risk_rows(c, node=node) if r["gpu"] == gpu]
    return rows[0] if rows else None


@contextmanager
def commit_fails(store: Store) -> Iterator[None]:
    """The store's next transaction does its work on the database, then its commit fails:
    the database rolls it back and the caller gets the error."""
    with pytest.MonkeyPatch.context() as patch:

        @contextmanager
        def begin() -> Iterator[Connection]:
            patch.undo()  # once
            with store.engine.connect() as c:
                c.begin()
                yield c
                c.rollback()
                raise RuntimeError("the commit failed")

        patch.setattr(store, "begin", begin)
        yield


def test_a_failed_commit_leaves_memory_as_it_was_and_the_next_tick_writes_once(
    registered: Store,
) -> None:
    loop, scorer = make_loop(registered, hysteresis=1)
    scorer.risk[("n0", 1)] = 0.9
    with commit_fails(registered), pytest.raises(RuntimeError, match="the commit failed"):
        loop.tick(NOW)
    assert outbox_types(registered).count("risk.threshold_crossed") == 0
    assert migrations(registered) == []
    state = loop.gpus.get(("n0", 1))
    assert state is None or not state.crossed  # memory as before the tick
    assert not loop._crossings
    for k in range(1, 4):
        loop.tick(NOW + k * 1000)
    assert outbox_types(registered).count("risk.threshold_crossed") == 1
    (m,) = migrations(registered)
    assert (m["trigger"], m["rank"]) == ("preventive", 1)
    assert loop.gpus[("n0", 1)].crossed and len(loop._crossings) == 1


def test_a_fatal_event_of_a_failed_tick_is_judged_again(registered: Store) -> None:
    loop, _ = make_loop(registered, hysteresis=5)
    registered.write(events=[("n0", 0, NOW - 500, "xid", 79, "fallen off the bus", "kmsg")])
    with commit_fails(registered), pytest.raises(RuntimeError, match="the commit failed"):
        loop.tick(NOW)
    loop.tick(NOW + 1000)  # the cursor is past the event; it is judged again all the same
    loop.tick(NOW + 2000)
    assert outbox_types(registered).count("gpu.failed") == 1
    (m,) = migrations(registered)
    assert (m["trigger"], m["rank"]) == ("unplanned", 0)


def test_a_new_leader_trips_the_breaker_as_the_old_one_would_have(registered: Store) -> None:
    breaker = {"hysteresis": 1, "breaker_pct": 20, "breaker_min_gpus": 3}
    # The take-over rebuilds the breaker's window back from its own clock (wall time here):
    # the crossings are stamped now, not at the module's import (NOW), which may be longer
    # ago than the window when the suite's workers come to this file late.
    now = int(time.time() * 1000)
    first, scorer = make_loop(registered, **breaker)
    scorer.risk[("n0", 2)] = scorer.risk[("n0", 3)] = 0.9  # two crossings: under the minimum
    first.tick(now)
    assert "policy.breaker_tripped" not in outbox_types(registered)
    first.leadership.release()  # the leader dies

    second, scorer2 = make_loop(registered, **breaker)
    assert len(second._crossings) == 2  # rebuilt from the store
    scorer2.risk.update(scorer.risk)
    scorer2.risk[("n1", 0)] = 0.9  # the third crossing within the window
    second.tick(now + 1000)
    assert outbox_types(registered).count("policy.breaker_tripped") == 1
    (entry,) = audit(registered, kind="policy")
    assert entry["action"] == "breaker_tripped" and entry["data"]["crossings"] == 3
    second.leadership.release()

    with registered.begin() as c:  # an operator re-arms: the window starts afresh
        db.set_state(c, "breaker_tripped_ms", "")
        db.write_audit(c, ts_ms=now + 1500, kind="policy", action="breaker_reset", reason="reset")
    third, _ = make_loop(registered, **breaker)
    assert len(third._crossings) == 0
    third.leadership.release()


def test_a_deposed_leader_writes_nothing(registered: Store) -> None:
    old, scorer = make_loop(registered, hysteresis=1)
    old.tick(NOW)
    Leadership.release(old.leadership)  # its lock is gone (its connection died, a pause) ...
    old.leadership.is_leader = True  # ... and it has not noticed yet
    new, scorer2 = make_loop(registered, hysteresis=1)  # another replica takes over
    before = risk_row(registered, "n0", 1)
    events = outbox_types(registered)
    scorer.risk[("n0", 1)] = 0.9
    assert not old.step(NOW + 1000)  # fenced: it steps down
    assert not old.leadership.is_leader
    assert outbox_types(registered) == events
    assert migrations(registered) == []
    assert risk_row(registered, "n0", 1) == before
    scorer2.risk[("n0", 1)] = 0.9
    assert new.step(NOW + 2000)  # the new leader acts
    assert outbox_types(registered).count("risk.threshold_crossed") == 1
    assert len(migrations(registered)) == 1
    new.leadership.release()


def test_one_active_migration_per_rank(registered: Store) -> None:
    def row(migration_id: str, state: str = "requested") -> dict[str, Any]:
        return {
            "id": migration_id,
            "job_id": "j",
            "rank": 1,
            "trigger": "manual",
            "state": state,
            "reasons": "[]",
            "requested_ms": NOW,
        }

    with registered.begin() as c:
        c.execute(insert(db.migrations).values(row("m1")))
        c.execute(insert(db.migrations).values(row("m0", "completed")))  # ended: not counted
    with pytest.raises(IntegrityError), registered.begin() as c:
        c.execute(insert(db.migrations).values(row("m2", "acknowledged")))
    with registered.begin() as c, pytest.raises(Conflict, match="already has a migration"):
        request_move(c, now_ms=NOW)
    assert {m["id"] for m in migrations(registered)} == {"m0", "m1"}
    assert outbox_types(registered).count("migration.requested") == 0


def test_a_refused_request_is_declined_and_audited(registered: Store) -> None:
    """A request the database refuses (another writer's migration of the rank committed
    between the tick's read and its insert) becomes a decline, and the tick commits."""
    loop, scorer = make_loop(registered, hysteresis=1)
    scorer.risk[("n0", 1)] = 0.9
    real = db.list_migrations

    def unseen(c: Any, **kw: Any) -> list[dict[str, Any]]:  # the tick read before it committed
        return [m for m in real(c, **kw) if m["trigger"] != "manual"]

    with registered.begin() as c:
        request_move(c, now_ms=NOW, why="an operator")
    mp = pytest.MonkeyPatch()
    mp.setattr(db, "list_migrations", unseen)
    try:
        loop.tick(NOW)
    finally:
        mp.undo()
    assert [m["trigger"] for m in migrations(registered)] == ["manual"]
    (entry,) = [e for e in audit(registered, kind="migration") if e["action"] == "declined"]
    assert "in flight" in entry["reason"]
    assert outbox_types(registered).count("risk.threshold_crossed") == 1


def test_a_recovery_the_agent_made_itself_ends_the_ranks_requested_move(
    registered: Store,
) -> None:
    from datetime import UTC, datetime

    from forewarn.wire import MigrationReport, Placement

    with registered.begin() as c:
        asked = request_move(c, now_ms=NOW, trigger="preventive", why="risk")
    report = MigrationReport(
        migration_id="mig_agent",
        job_id="j",
        rank=1,
        outcome="completed",
        source=Placement(rank=1, node="n0", gpu=1, slot=1),
        target=Placement(rank=1, node="n1", gpu=0, slot=2),
        finished_at=datetime.now(UTC),
    )
    with registered.begin() as c:
        orchestrator.apply_report(c, report, now_ms=NOW + 1000)
    states = {m["id"]: (m["state"], m["error"]) for m in migrations(registered)}
    assert states["mig_agent"] == ("completed", None)
    assert states[asked["id"]][0] == "failed"
    assert "recovered the rank itself" in states[asked["id"]][1]


def test_a_breaker_reset_reaches_the_running_loop_through_the_store(registered: Store) -> None:
    """The loop may run in another process than the route: an operator's reset is a time in
    the store that the next tick reads; the crossings before it no longer count, the ones
    after do, and the tick publishes the loop's status beside it."""
    breaker = {"hysteresis": 1, "breaker_pct": 20, "breaker_min_gpus": 3}
    now = int(time.time() * 1000)
    loop, scorer = make_loop(registered, **breaker)
    for gpu in (1, 2, 3):
        scorer.risk[("n0", gpu)] = 0.9
    loop.tick(now)
    assert outbox_types(registered).count("policy.breaker_tripped") == 1
    with registered.begin() as c:  # what POST /v1/policy/breaker/reset writes
        db.reset_breaker(c, ts_ms=now + 500)
    scorer.risk[("n1", 0)] = 0.9  # one more crossing after the reset: one of 3 needed
    loop.tick(now + 1000)
    assert outbox_types(registered).count("policy.breaker_tripped") == 1
    assert list(loop._crossings) == [now + 1000]
    with registered.engine.connect() as c:
        status = db.read_status(c)
        assert db.get_state(c, "breaker_tripped_ms") == ""
    assert status is not None
    assert (status["ticks"], status["tick_ms"], status["epoch"]) == (
        loop.ticks,
        now + 1000,
        loop.epoch,
    )
    assert status["durations"]["count"] == loop.ticks - 1  # the ticks before this one
    assert status["threshold_in_force"] == loop.threshold_in_force
    with registered.begin() as c:  # a status row garbled by hand reads as none ...
        db.set_state(c, db.STATUS_KEY, '{"pid": 1, "ti')
    with registered.engine.connect() as c:
        assert db.read_status(c) is None
    loop.tick(now + 2000)  # ... until the next tick writes it again
    with registered.engine.connect() as c:
        assert (db.read_status(c) or {}).get("ticks") == loop.ticks
    loop.leadership.release()


def test_a_fleet_that_came_up_together_writes_its_risk_history_spread_over_the_interval(
    registered: Store,
) -> None:
    loop, scorer = make_loop(registered)
    for node in range(25):
        for gpu in range(8):
            scorer.risk[(f"m{node:02d}", gpu)] = 0.01
    fleet = len(scorer.risk)
    every_ms = int(loop.history_interval_s * 1000)
    ticks = [NOW + k * 5_000 for k in range(every_ms // 5_000 + 1)]
    for at in ticks:
        loop.tick(at)
    with registered.engine.connect() as c:
        rows = (
            c.execute(db.risk_history.select().where(db.risk_history.c.ts_ms >= NOW))
            .mappings()
            .all()
        )
    per_tick = {at: sum(1 for r in rows if r["ts_ms"] == at) for at in ticks}
    assert per_tick[NOW] == fleet  # each GPU's first row at once
    later = [per_tick[at] for at in ticks[1:]]
    # ... and one more each within the interval, a share of the fleet a tick: together they
    # would all be due in the same tick, every interval.
    assert sum(later) == fleet
    assert max(later) <= fleet // 4, later


def test_gpus_at_rest_are_left_alone_and_every_write_is_as_if_each_was_looked_at(
    tmp_path: Path,
) -> None:
    """The tick leaves the GPUs at rest as they are without looking at each (QuietGpus): over
    80 ticks of risks that wander, cross and clear, rules that trip, GPUs that go stale and
    one that fails, it writes the same risk rows, history points and events, and keeps the
    same memory, as a loop that looks at every GPU every tick; and once the fleet settles it
    looks at a few GPUs a tick, not all of them."""
    rng = np.random.default_rng(5)
    keys = [(f"n{i // 8}", i % 8) for i in range(96)]
    drifting = set(keys[:6])
    stores = [Store.open(f"sqlite:///{tmp_path}/{name}.db") for name in ("skips", "looks")]
    loops = [make_loop(s, hysteresis=2) for s in stores]
    risk = {k: 0.01 for k in keys}
    looked = []
    for tick in range(80):
        now = NOW + tick * 5000
        for k in drifting:
            risk[k] = float(np.clip(risk[k] + rng.normal(0, 0.15), 0.0, 1.0))
        risk[keys[7]] = 0.01 + 1e-3 * tick  # creeps up through the risk step
        if tick >= 50:  # across the threshold (0.5) and back within one risk step
            risk[keys[15]] = 0.5 + (3e-5 if tick % 8 < 4 else -3e-5)
        floor = {keys[9]: "remap: a row remap awaits a reset"} if 20 <= tick < 26 else {}
        seen = {keys[k]: NOW + 30 * 5000 for k in (11, 12)} if tick >= 30 else {}
        if tick == 40:
            for s in stores:
                s.write(
                    events=[(keys[13][0], keys[13][1], now - 10, "xid", 79, "off the bus", "k")]
                )
        for (loop, scorer), s in zip(loops, stores, strict=True):
            scorer.risk, scorer.floor, scorer.last_seen = dict(risk), dict(floor), dict(seen)
            if s is stores[1]:
                loop._quiet = None  # every GPU looked at, every tick
            loop.tick(now)
        looked.append(loops[0][0].last_looked)

    def written(s: Store) -> tuple[list[Any], ...]:
        with s.engine.connect() as c:
            events = [(e["type"], e["node"], e["data"]) for e in events_after(c, 0, limit=10_000)]
            rows = [tuple(r) for r in c.execute(text("SELECT * FROM risk_latest ORDER BY 1, 2"))]
            points = c.execute(text("SELECT node, gpu, ts_ms, risk, alarm FROM risk_history "
                                    "ORDER BY node, gpu, ts_ms")).all()  # fmt: skip
        return events, rows, [tuple(p) for p in points]

    skipping, looking = written(stores[0]), written(stores[1])
    kinds = {e[0] for e in skipping[0]}
    assert {"risk.threshold_crossed", "risk.cleared", "gpu.stale", "gpu.failed"} <= kinds
    assert skipping == looking
    assert loops[0][0].gpus == loops[1][0].gpus
    # Each tick: those drifting, stale or failed, and those whose refresh (1 in 6 ticks) or
    # history point (1 in 12) falls due.
    assert looked[0] == len(keys) and np.mean(looked[60:]) < len(keys) / 2, looked
    for loop, _ in loops:
        loop.leadership.release()
    for s in stores:
        s.close()
