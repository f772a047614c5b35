"""Migrations as a persisted state machine::

    requested ──▶ acknowledged ──▶ transferring ──▶ completed
        │              │                 │
        ├──▶ cancelled ├──▶ failed ◀─────┘
        └──▶ failed

Every transition is a compare-and-set on the row (``UPDATE … WHERE state IN (…)``), written
in one transaction with its audit entry and its outbox event, so a restart of the service
loses nothing and a transition is never applied twice. ``requested`` commands are what job
agents long-poll; the agent reports ``acknowledged`` and ``transferring``
(:class:`forewarn.wire.MigrationProgress`) and the outcome
(:class:`forewarn.wire.MigrationReport`). A report may arrive with no earlier transition (the
agent was fast, or its progress post was lost): the machine jumps forward, never back.

:func:`reconcile` ends what can no longer finish: a command no agent took within
``ack_timeout_s``, or an in-flight migration whose job stopped heartbeating.

A rank has at most one active migration: the database refuses a second
(``ux_migrations_active_rank``, revision ``0006_control_fencing``), and :func:`request` turns
the refusal into a :class:`~forewarn.errors.Conflict` the caller declines with.
"""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import Connection

from forewarn.errors import Conflict, NotFound
from forewarn.wire import MigrationReport
from store import control as db
from store.outbox import emit_event

__all__ = ["TRANSITIONS", "advance", "apply_report", "event_data", "reconcile", "request"]

TRANSITIONS: dict[str, tuple[str, ...]] = {
    "requested": ("acknowledged", "transferring", "completed", "failed", "cancelled"),
    "acknowledged": ("transferring", "completed", "failed"),
    "transferring": ("completed", "failed"),
    "completed": (),
    "failed": (),
    "cancelled": (),
}
"""Allowed next states (a later state may skip the ones between: reports can overtake)."""

_STAMP = {
    "acknowledged": "acknowledged_ms",
    "transferring": "transferring_ms",
    "completed": "finished_ms",
    "failed": "finished_ms",
    "cancelled": "finished_ms",
}


def new_migration_id() -> str:
    return "mig_" + secrets.token_hex(8)


def event_data(m: db.Migration) -> dict[str, Any]:
    """What receivers of ``migration.*`` events get: enough to act without calling back."""
    return {
        "migration_id": m["id"],
        "job_id": m["job_id"],
        "rank": m["rank"],
        "trigger": m["trigger"],
        "state": m["state"],
        "risk": m["risk"],
        "reasons": m["reasons"],
        "source": {"node": m["source_node"], "gpu": m["source_gpu"]},
        "target": {"node": m["target_node"], "gpu": m["target_gpu"], "slot": m["target_slot"]},
        "step": m["step"],
        "pause_s": m["pause_s"],
        "bytes_moved": m["bytes_moved"],
        "error": m["error"],
    }


def request(
    connection: Connection,
    *,
    job_id: str,
    rank: int,
    trigger: str,
    now_ms: int,
    source: tuple[str, int | None] | None,
    target: db.RankSlot | None,
    risk: float | None = None,
    reasons: list[str] | None = None,
    detail: str | None = None,
    why: str,
) -> db.Migration:
    """Record a new ``requested`` migration, its audit entry and its event; returns the row.

    Raises:
        Conflict: the rank already has an active migration (nothing was written).
    """
    migration_id = new_migration_id()
    row: db.NewMigration = {
        "id": migration_id,
        "job_id": job_id,
        "rank": rank,
        "trigger": trigger,
        "state": "requested",
        "risk": risk,
        "reasons": db.dumps(reasons or []),
        "source_node": source[0] if source else None,
        "source_gpu": source[1] if source else None,
        "target_node": target["node"] if target else None,
        "target_gpu": target.get("gpu") if target else None,
        "target_slot": target["slot"] if target else None,
        "requested_ms": now_ms,
        "detail": detail,
    }
    if not db.insert_migration(connection, row):
        raise Conflict(
            f"job {job_id} rank {rank} already has a migration in flight",
            details={"job_id": job_id, "rank": rank},
        )
    m = db.get_migration(connection, migration_id)
    assert m is not None
    _record(connection, m, now_ms, action="requested", reason=why)
    return m


def advance(
    connection: Connection, migration_id: str, state: str, *, now_ms: int, **fields: Any
) -> db.Migration:
    """Move a migration to ``state`` (idempotent if it is already there).

    Raises:
        NotFound: no such migration.
        Conflict: the transition is not allowed from its current state.
    """
    m = db.get_migration(connection, migration_id, for_update=True)
    if m is None:
        raise NotFound(f"no migration {migration_id!r}")
    if m["state"] == state:
        return m
    allowed_from = [s for s, nxt in TRANSITIONS.items() if state in nxt]
    if m["state"] not in allowed_from:
        raise Conflict(
            f"migration {migration_id} is {m['state']}; it cannot become {state}",
            details={"state": m["state"]},
        )
    values = {"state": state, _STAMP[state]: now_ms, **fields}
    if not db.update_migration(connection, migration_id, expect=allowed_from, values=values):
        raise Conflict(f"migration {migration_id} changed concurrently; retry")
    m = db.get_migration(connection, migration_id)
    assert m is not None
    reason = fields.get("error") or {
        "acknowledged": "the job agent accepted the command",
        "transferring": "the ranks agreed on the handover step",
        "completed": "the spare took over the rank",
        "cancelled": "cancelled by an operator",
    }.get(state, state)
    _record(connection, m, now_ms, action=state, reason=str(reason))
    return m


def apply_report(connection: Connection, report: MigrationReport, *, now_ms: int) -> db.Migration:
    """The agent's final word on a migration: its outcome, timings and the new placement.

    A report of a migration the service never requested (the agent's own recovery of a dead
    rank) is recorded as an ``unplanned`` migration.
    """
    fields = {
        "step": report.step,
        "pause_s": report.pause_s,
        "transfer_s": report.transfer_s,
        "bytes_moved": report.bytes_moved,
        "error": report.error,
    }
    if report.target is not None:
        fields.update(target_node=report.target.node, target_gpu=report.target.gpu)
        fields.update(target_slot=report.target.slot)
    if db.get_migration(connection, report.migration_id) is None:
        src = report.source
        # The agent moved the rank itself: a move the service asked for is moot now.
        for other in db.list_migrations(connection, job_id=report.job_id, states=db.ACTIVE_STATES):
            if other["rank"] == report.rank:
                advance(
                    connection,
                    other["id"],
                    "failed",
                    now_ms=now_ms,
                    error=f"the job agent recovered the rank itself ({report.migration_id})",
                )
        db.insert_migration(
            connection,
            {
                "id": report.migration_id,
                "job_id": report.job_id,
                "rank": report.rank,
                "trigger": "unplanned",
                "state": "requested",
                "reasons": "[]",
                "source_node": src.node if src else None,
                "source_gpu": src.gpu if src else None,
                "requested_ms": now_ms,
                "detail": "recovered by the job agent",
            },
        )
        recovered = db.get_migration(connection, report.migration_id)
        assert recovered is not None
        _record(
            connection, recovered, now_ms, action="requested", reason="the job agent lost a rank"
        )
    m = advance(connection, report.migration_id, report.outcome, now_ms=now_ms, **fields)
    if report.outcome == "completed":
        _move_placement(connection, report)
    return m


def _move_placement(connection: Connection, report: MigrationReport) -> None:
    src, tgt = report.source, report.target
    if src is not None and src.slot is not None:
        db.set_rank(connection, job_id=report.job_id, slot=src.slot, values={"role": "retired"})
    if tgt is not None and tgt.slot is not None:
        db.set_rank(
            connection,
            job_id=report.job_id,
            slot=tgt.slot,
            values={"role": "active", "rank": report.rank},
        )


def reconcile(
    connection: Connection, *, now_ms: int, ack_timeout_s: float, agent_timeout_s: float
) -> list[db.Migration]:
    """Fail in-flight migrations that can no longer finish; returns the ones it ended."""
    ended = []
    heartbeats = {j["job_id"]: j for j in db.get_jobs(connection)}
    for m in db.list_migrations(connection, states=db.ACTIVE_STATES):
        job = heartbeats.get(m["job_id"])
        silent = job is None or now_ms - job["heartbeat_ms"] > agent_timeout_s * 1000
        unacked = m["state"] == "requested" and now_ms - m["requested_ms"] > ack_timeout_s * 1000
        finished = job is not None and job["status"] in ("completed", "failed")
        if silent or unacked or finished:
            why = (
                f"the job is {job['status']}"
                if finished and job is not None
                else "no job agent took the command"
                if unacked
                else "the job agent stopped heartbeating"
            )
            ended.append(advance(connection, m["id"], "failed", now_ms=now_ms, error=why))
    return ended


def _record(
    connection: Connection, m: db.Migration, now_ms: int, *, action: str, reason: str
) -> None:
    db.write_audit(
        connection,
        ts_ms=now_ms,
        kind="migration",
        action=action,
        reason=reason,
        node=m["source_node"],
        gpu=m["source_gpu"],
        job_id=m["job_id"],
        migration_id=m["id"],
        data=event_data(m),
    )
    emit_event(
        connection, f"migration.{action}", event_data(m), job_id=m["job_id"], node=m["source_node"]
    )
