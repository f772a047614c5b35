"""The tick's correctness on both backends: a failed commit loses no event, a new leader
rebuilds the breaker's window, a deposed leader writes nothing, one active migration per
rank. Risks come from a fake scorer; two loops on one database stand for two replicas."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Connection, insert
from sqlalchemy.exc import IntegrityError

from control import orchestrator
from control.leader import Leadership
from control.loop import REFRESH_MS
from forewarn.errors import Conflict
from store import Store
from store import control as db
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
    """Its history points, and the refreshes of its unchanged risk rows: each GPU at its own
    phase of the interval, not the whole fleet in one tick of each interval."""
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
    # The risk rows (unchanged risks): each rewritten at least every REFRESH_MS, when its
    # phase comes, so at the end their last writes fall in several ticks, not one.
    with registered.engine.connect() as c:
        scored = [r["scored_ms"] for r in db.risk_rows(c)]
    assert len(scored) == fleet and min(scored) >= ticks[-1] - REFRESH_MS
    assert max(scored.count(at) for at in set(scored)) <= fleet // 4, sorted(set(scored))
