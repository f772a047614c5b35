"""Migrations as a persisted state machine (both backends): transitions, idempotence, reports
that overtake progress, agent-initiated recoveries, and reconciliation after silence."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from control import orchestrator
from forewarn.errors import Conflict, NotFound
from forewarn.wire import MigrationReport, Placement
from store import Store
from store import control as db
from store.outbox import events_after
from tests.control.conftest import request_move

NOW = 1_800_000_000_000


def new(store: Store) -> dict:  # type: ignore[type-arg]
    with store.begin() as c:
        return request_move(c, now_ms=NOW)


def step(store: Store, mid: str, state: str, **fields) -> dict:  # type: ignore[no-untyped-def, type-arg]
    with store.begin() as c:
        return orchestrator.advance(c, mid, state, now_ms=NOW + 1000, **fields)


def report(mid: str, outcome: str = "completed", **fields) -> MigrationReport:  # type: ignore[no-untyped-def]
    return MigrationReport(
        migration_id=mid,
        job_id="j",
        rank=1,
        outcome=outcome,  # type: ignore[arg-type]
        step=7,
        source=Placement(rank=1, node="n0", gpu=1, slot=1, role="retired"),
        target=Placement(rank=1, node="n1", gpu=0, slot=2),
        pause_s=0.25,
        bytes_moved=1234,
        finished_at=datetime.now(UTC),
        **fields,
    )


def test_the_happy_path_is_recorded_with_events_and_audit(registered: Store) -> None:
    m = new(registered)
    step(registered, m["id"], "acknowledged")
    step(registered, m["id"], "transferring", step=7)
    with registered.begin() as c:
        done = orchestrator.apply_report(c, report(m["id"]), now_ms=NOW + 2000)
    assert done["state"] == "completed" and done["pause_s"] == 0.25 and done["bytes_moved"] == 1234
    assert done["acknowledged_ms"] and done["transferring_ms"] and done["finished_ms"]
    with registered.engine.connect() as c:
        kinds = [e["type"] for e in events_after(c, 0)]
        trail = [a["action"] for a in db.read_audit(c, migration_id=m["id"])]
        ranks = {r["slot"]: r for r in db.get_jobs(c, job_id="j")[0]["ranks"]}
    assert kinds == [
        "migration.requested",
        "migration.acknowledged",
        "migration.transferring",
        "migration.completed",
    ]
    assert trail == ["requested", "acknowledged", "transferring", "completed"]
    assert ranks[1]["role"] == "retired"
    assert (ranks[2]["role"], ranks[2]["rank"]) == ("active", 1)


def test_transitions_are_idempotent_and_never_go_back(registered: Store) -> None:
    m = new(registered)
    step(registered, m["id"], "acknowledged")
    step(registered, m["id"], "acknowledged")  # a retried report: no second event
    with pytest.raises(Conflict):
        step(registered, m["id"], "cancelled")  # the agent has it
    with registered.begin() as c:
        orchestrator.apply_report(c, report(m["id"], "failed", error="spare died"), now_ms=NOW)
    with pytest.raises(Conflict):
        step(registered, m["id"], "transferring")
    with registered.engine.connect() as c:
        assert [e["type"] for e in events_after(c, 0)].count("migration.acknowledged") == 1
    with pytest.raises(NotFound):
        step(registered, "mig_nope", "acknowledged")


def test_a_report_may_overtake_the_progress(registered: Store) -> None:
    m = new(registered)
    with registered.begin() as c:
        done = orchestrator.apply_report(c, report(m["id"]), now_ms=NOW)
    assert done["state"] == "completed"


def test_cancel_before_the_agent_takes_it(registered: Store) -> None:
    m = new(registered)
    assert step(registered, m["id"], "cancelled")["state"] == "cancelled"


def test_an_agent_recovery_is_recorded_as_unplanned(registered: Store) -> None:
    with registered.begin() as c:
        m = orchestrator.apply_report(c, report("agent-own-id"), now_ms=NOW)
    assert (m["trigger"], m["state"]) == ("unplanned", "completed")


def test_reconcile_fails_what_can_no_longer_finish(registered: Store) -> None:
    m = new(registered)
    with registered.begin() as c:
        db.heartbeat_job(c, job_id="j", values={"heartbeat_ms": NOW})
        assert (
            orchestrator.reconcile(c, now_ms=NOW + 5000, ack_timeout_s=60, agent_timeout_s=60) == []
        )
        (ended,) = orchestrator.reconcile(
            c, now_ms=NOW + 61_000, ack_timeout_s=600, agent_timeout_s=60
        )
    assert ended["id"] == m["id"] and ended["state"] == "failed"
    assert "heartbeat" in ended["error"]
