"""Migration routes: request (manual), cancel, list, get with its audit trail; and the job
agent's transitions (``progress``) and outcome (``reports``).

Scopes: reads ``read``; requests, cancels and agent reports ``operate``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from api.deps import SettingsDep, StoreDep, require
from api.routes._common import iso, now_ms, stamp
from control import orchestrator
from control.policy import Policy, Situation, free_spare
from forewarn.errors import Conflict, InvalidInput, NoSpareAvailable, NotFound
from forewarn.wire import MAX_RANK, MigrationProgress, MigrationReport
from store import control as db

__all__ = ["MigrationPublic", "router"]

router = APIRouter(tags=["migrations"])

State = Literal["requested", "acknowledged", "transferring", "completed", "failed", "cancelled"]


class GpuRef(BaseModel):
    node: str | None
    gpu: int | None


class TargetRef(GpuRef):
    slot: int | None


class AuditPublic(BaseModel):
    seq: int
    at: str | None
    kind: str
    action: str
    reason: str
    node: str | None
    gpu: int | None
    job_id: str | None
    migration_id: str | None
    data: dict[str, Any]


class MigrationPublic(BaseModel):
    id: str
    job_id: str
    rank: int
    trigger: str
    """preventive, planned, unplanned, manual or straggler."""
    state: State
    risk: float | None
    reasons: list[str]
    source: GpuRef
    target: TargetRef
    requested_at: str | None
    acknowledged_at: str | None
    transferring_at: str | None
    finished_at: str | None
    step: int | None
    pause_s: float | None
    transfer_s: float | None
    bytes_moved: int | None
    error: str | None
    detail: str | None
    audit: list[AuditPublic] | None = None


class MigrationsPublic(BaseModel):
    data: list[MigrationPublic]
    count: int


class MigrationCreate(BaseModel):
    """``POST /v1/migrations``: move a rank of a job to one of its spares."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    rank: int = Field(ge=0, le=MAX_RANK)
    detail: str | None = Field(default=None, max_length=2000)


def public(row: db.Migration) -> dict[str, Any]:
    m: dict[str, Any] = dict(row)
    m["source"] = {"node": m.pop("source_node"), "gpu": m.pop("source_gpu")}
    m["target"] = {
        "node": m.pop("target_node"),
        "gpu": m.pop("target_gpu"),
        "slot": m.pop("target_slot"),
    }
    return stamp(m, "requested_ms", "acknowledged_ms", "transferring_ms", "finished_ms")


def audit_public(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    row["at"] = iso(row.pop("ts_ms"))
    return row


@router.get(
    "/v1/migrations",
    response_model=MigrationsPublic,
    dependencies=[require("read")],
    summary="Migrations, newest first",
)
async def list_migrations(
    store: StoreDep,
    job: str | None = None,
    state: State | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    def read() -> list[db.Migration]:
        with store.engine.connect() as c:
            return db.list_migrations(c, job_id=job, states=[state] if state else None, limit=limit)

    rows = [public(m) for m in await to_thread.run_sync(read)]
    return {"data": rows, "count": len(rows)}


@router.get(
    "/v1/migrations/{migration_id}",
    response_model=MigrationPublic,
    dependencies=[require("read")],
    summary="One migration with its audit trail",
)
async def get_migration(store: StoreDep, migration_id: str) -> dict[str, Any]:
    def read() -> tuple[db.Migration | None, list[dict[str, Any]]]:
        with store.engine.connect() as c:
            m = db.get_migration(c, migration_id)
            return m, db.read_audit(c, migration_id=migration_id) if m else []

    m, trail = await to_thread.run_sync(read)
    if m is None:
        raise NotFound(f"no migration {migration_id!r}")
    return public(m) | {"audit": [audit_public(a) for a in trail]}


@router.post(
    "/v1/migrations",
    status_code=201,
    response_model=MigrationPublic,
    dependencies=[require("operate")],
    summary="Request a manual migration of one rank to a free spare",
)
async def request_migration(
    store: StoreDep, settings: SettingsDep, body: MigrationCreate
) -> dict[str, Any]:
    def write() -> db.Migration:
        ts = now_ms()
        with store.begin() as c:
            stored = db.read_policy(c)
            policy = Policy.model_validate(stored) if stored else settings.policy
            jobs = db.get_jobs(c, job_id=body.job_id)
            if not jobs:
                raise NotFound(f"no job {body.job_id!r}")
            ranks = jobs[0]["ranks"]
            source = next(
                (r for r in ranks if r["rank"] == body.rank and r["role"] == "active"), None
            )
            if source is None:
                raise NotFound(f"job {body.job_id} has no active rank {body.rank}")
            inflight = db.list_migrations(c, states=db.ACTIVE_STATES)
            mine = [m for m in inflight if m["job_id"] == body.job_id]
            if len(mine) >= policy.max_inflight_per_job:
                raise Conflict(
                    f"job {body.job_id} already has {len(mine)} migration(s) in flight",
                    details={"in_flight": [m["id"] for m in mine]},
                )
            promised = {m["target_slot"] for m in mine}
            spares: list[db.RankSlot] = [
                r for r in ranks if r["role"] == "spare" and r["slot"] not in promised
            ]
            unsafe = {
                (r["node"], r["gpu"])
                for r in db.risk_rows(c)
                if r["crossed"] or r["failed"] or r["stale"]
            }
            situation = Situation(
                now_ms=ts,
                breaker_tripped=False,
                inflight_by_job={},
                inflight_fleet=0,
                last_request_ms={},
                spares_by_job={body.job_id: spares},
                drained=db.drained_nodes(c),
                unsafe=unsafe,
            )
            target = free_spare(situation, body.job_id)
            if target is None:
                raise NoSpareAvailable(f"job {body.job_id} has no free spare")
            risk = [r for r in db.risk_rows(c, node=source["node"]) if r["gpu"] == source["gpu"]]
            return orchestrator.request(
                c,
                job_id=body.job_id,
                rank=body.rank,
                trigger="manual",
                now_ms=ts,
                source=(source["node"], source["gpu"]),
                target=target,
                risk=risk[0]["risk"] if risk else None,
                reasons=risk[0]["reasons"] if risk else [],
                detail=body.detail,
                why="manual request by an operator",
            )

    return public(await to_thread.run_sync(write))


@router.post(
    "/v1/migrations/{migration_id}/cancel",
    response_model=MigrationPublic,
    dependencies=[require("operate")],
    summary="Cancel a migration the job agent has not taken yet (409 after that)",
)
async def cancel(store: StoreDep, migration_id: str) -> dict[str, Any]:
    def write() -> db.Migration:
        with store.begin() as c:
            return orchestrator.advance(c, migration_id, "cancelled", now_ms=now_ms())

    return public(await to_thread.run_sync(write))


@router.post(
    "/v1/migrations/{migration_id}/progress",
    response_model=MigrationPublic,
    dependencies=[require("operate")],
    summary="A job agent reports a transition (acknowledged, transferring, failed)",
)
async def progress(store: StoreDep, migration_id: str, body: MigrationProgress) -> dict[str, Any]:
    if body.migration_id != migration_id:
        raise InvalidInput("the body's migration_id differs from the path's")

    def write() -> db.Migration:
        fields: dict[str, Any] = {}
        if body.error:
            fields["error"] = body.error
        if body.step is not None:
            fields["step"] = body.step
        with store.begin() as c:
            m = db.get_migration(c, migration_id)
            if m is not None and m["state"] in ("completed", "failed", "cancelled"):
                return m  # a late transition after the outcome: nothing to do
            return orchestrator.advance(c, migration_id, body.state, now_ms=now_ms(), **fields)

    return public(await to_thread.run_sync(write))


@router.post(
    "/v1/migrations/reports",
    response_model=MigrationPublic,
    dependencies=[require("operate")],
    summary="A job agent reports how a migration ended (and the new placement)",
)
async def report(store: StoreDep, body: MigrationReport) -> dict[str, Any]:
    def write() -> db.Migration:
        with store.begin() as c:
            return orchestrator.apply_report(c, body, now_ms=now_ms())

    return public(await to_thread.run_sync(write))
