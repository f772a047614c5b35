"""``/v1/failures``: the operator's failure records, the ground truth that training labels use.

Record a GPU (or, with ``gpu`` null, a whole node) that really failed (``operate``), list the
records (``read``), retract one (``operate``; the row stays, it stops labelling). The Parquet
history's ``failures.parquet`` takes them over the failures derived from events
(:mod:`store.history`). Each record and retraction is in the audit log.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from api.deps import StoreDep, require
from api.routes._common import Since, Timestamp, Until, aware, iso, now_ms
from forewarn.errors import InvalidInput, NotFound
from forewarn.wire import Name, to_ms
from store import control as db
from store.failures import list_failures, record_failure, retract_failure

__all__ = ["FailureCreate", "FailurePublic", "router"]

router = APIRouter(tags=["failures"])

Kind = Literal["memory", "pcie", "nvlink", "thermal", "power_loss", "gpu_lost", "other"]


class FailureCreate(BaseModel):
    """``POST /v1/failures``: a GPU (or a node) that really failed."""

    model_config = ConfigDict(extra="forbid")

    node: Name
    gpu: int | None = Field(default=None, ge=0, le=255, description="None: the whole node.")
    ts: Timestamp = Field(description="When it failed (ISO 8601 with a zone).")
    kind: Kind
    note: str | None = Field(default=None, max_length=2000)


class FailurePublic(BaseModel):
    id: str
    node: str
    gpu: int | None
    ts: str
    kind: str
    note: str | None
    recorded_at: str
    retracted_at: str | None


class FailuresPublic(BaseModel):
    data: list[FailurePublic]
    count: int


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "node": row["node"],
        "gpu": row["gpu"],
        "ts": iso(row["ts_ms"]),
        "kind": row["kind"],
        "note": row["note"],
        "recorded_at": iso(row["recorded_ms"]),
        "retracted_at": iso(row["retracted_ms"]),
    }


def _audit(c: Any, action: str, row: dict[str, Any], ts_ms: int) -> None:
    where = row["node"] if row["gpu"] is None else f"{row['node']}:{row['gpu']}"
    db.write_audit(
        c,
        ts_ms=ts_ms,
        kind="failure",
        action=action,
        reason=f"operator: {row['kind']} failure of {where}",
        node=row["node"],
        gpu=row["gpu"],
        data=_public(row),
    )


@router.post(
    "/v1/failures",
    status_code=201,
    response_model=FailurePublic,
    dependencies=[require("operate")],
    summary="Record a GPU or node that really failed (a training label)",
)
async def create_failure(store: StoreDep, body: FailureCreate) -> dict[str, Any]:
    if body.ts.tzinfo is None:
        raise InvalidInput("ts needs a time zone (e.g. 2026-12-03T10:00:00Z)")
    ts_ms = to_ms(body.ts)
    now = now_ms()
    if ts_ms > now + 60_000:
        raise InvalidInput("ts is in the future")

    def write() -> dict[str, Any]:
        with store.begin() as c:
            row = record_failure(
                c, node=body.node, gpu=body.gpu, ts_ms=ts_ms, kind=body.kind, now_ms=now,
                note=body.note,
            )  # fmt: skip
            _audit(c, "recorded", row, now)
            return row

    return _public(await to_thread.run_sync(write))


@router.get(
    "/v1/failures",
    response_model=FailuresPublic,
    dependencies=[require("read")],
    summary="The operator's failure records, oldest failure first",
)
async def get_failures(
    store: StoreDep,
    since: Since = None,
    until: Until = None,
    retracted: Annotated[bool, Query(description="Include retracted records.")] = False,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    since_ms = to_ms(aware(since)) if since else None
    until_ms = to_ms(aware(until)) if until else None
    if since_ms is not None and until_ms is not None and since_ms > until_ms:
        raise InvalidInput("since must not be after until")

    def read() -> list[dict[str, Any]]:
        with store.engine.connect() as c:
            return list_failures(
                c, since_ms=since_ms, until_ms=until_ms, include_retracted=retracted, limit=limit
            )

    rows = [_public(r) for r in await to_thread.run_sync(read)]
    return {"data": rows, "count": len(rows)}


@router.delete(
    "/v1/failures/{record_id}",
    response_model=FailurePublic,
    dependencies=[require("operate")],
    summary="Retract a failure record (it stays listed with ?retracted=true)",
    responses={404: {"description": "No such record"}},
)
async def delete_failure(
    store: StoreDep, record_id: Annotated[str, Path(max_length=32)]
) -> dict[str, Any]:
    def write() -> dict[str, Any] | None:
        now = now_ms()
        with store.begin() as c:
            row = retract_failure(c, record_id, now_ms=now)
            if row is not None:
                _audit(c, "retracted", row, now)
            return row

    row = await to_thread.run_sync(write)
    if row is None:
        raise NotFound(f"no failure record {record_id!r}")
    return _public(row)
