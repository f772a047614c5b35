"""Risk routes: the latest score of every GPU and one GPU's risk history (read scope)."""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Path, Query
from pydantic import BaseModel
from sqlalchemy import select

from api.deps import SettingsDep, StoreDep, require
from api.routes._common import Since, Until, iso, now_ms, stamp, window
from store import control as db
from store.schema import gpus

__all__ = ["RiskPublic", "router"]

router = APIRouter(tags=["risk"], dependencies=[require("read")])


class RiskPublic(BaseModel):
    node: str
    gpu: int
    risk: float | None
    alarm: bool
    """This score is at or above the threshold."""
    crossed: bool
    """The alarm held for the policy's hysteresis: the GPU counts as crossed."""
    reasons: list[str]
    scored_at: str | None
    last_seen_at: str | None
    stale: bool
    """No sample for the policy's ``stale_after_s``: the risk is unknown, not low."""
    failed: bool
    """A fatal event (or the loop's flag), and no sample since: the GPU is down."""
    recovered: bool
    """It failed and has sent samples since, for longer than the stale interval: it came
    back (the fleet map's ``recovered``)."""
    streak: int


class RisksPublic(BaseModel):
    data: list[RiskPublic]
    count: int


class RiskPoint(BaseModel):
    ts: str | None
    risk: float | None
    alarm: bool


class RiskHistoryPublic(BaseModel):
    node: str
    gpu: int
    data: list[RiskPoint]
    count: int
    latest: RiskPublic | None


def public(row: dict[str, Any]) -> dict[str, Any]:
    row = stamp(dict(row), "scored_ms", "last_seen_ms")
    row.pop("crossed_ms", None)
    return row


def risk_rows(connection: Any, *, node: str | None, stale_after_s: float) -> list[dict[str, Any]]:
    """The latest scores, with ``failed`` and ``recovered`` read from the GPUs' events as the
    fleet map reads them (:func:`api.dashboard.cells.failure_state`): the loop's flag stays
    set after a GPU came back."""
    from api.dashboard.cells import FAILURE_LOOKBACK_MS, failure_state, last_failures

    rows = db.risk_rows(connection, node=node)
    failures = last_failures(connection, since_ms=now_ms() - FAILURE_LOOKBACK_MS, node=node)
    query = select(gpus.c.node, gpus.c.gpu, gpus.c.last_seen_ms)
    if node is not None:
        query = query.where(gpus.c.node == node)
    seen = {(r[0], r[1]): r[2] for r in connection.execute(query)}
    for row in rows:
        key = (row["node"], row["gpu"])
        row["failed"], row["recovered"] = failure_state(
            bool(row["failed"]),
            failures.get(key),
            seen.get(key, row["last_seen_ms"]),
            stale_after_s * 1000,
        )
    return rows


@router.get("/v1/risk", response_model=RisksPublic, summary="Latest risk of every GPU")
async def list_risk(
    store: StoreDep, settings: SettingsDep, node: str | None = None
) -> dict[str, Any]:
    def read() -> list[dict[str, Any]]:
        with store.engine.connect() as c:
            return risk_rows(c, node=node, stale_after_s=settings.policy.stale_after_s)

    rows = [public(r) for r in await to_thread.run_sync(read)]
    return {"data": rows, "count": len(rows)}


@router.get(
    "/v1/gpus/{node}/{gpu}/risk",
    response_model=RiskHistoryPublic,
    summary="One GPU's risk over time (default: the last 24 h)",
)
async def gpu_risk(
    store: StoreDep,
    settings: SettingsDep,
    node: str,
    gpu: Annotated[int, Path(ge=0, le=255)],
    since: Since = None,
    until: Until = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> dict[str, Any]:
    since_ms, until_ms = window(since, until, 86_400)

    def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        with store.engine.connect() as c:
            points = db.history(
                c, node=node, gpu=gpu, since_ms=since_ms, until_ms=until_ms, limit=limit
            )
            stale_after_s = settings.policy.stale_after_s
            rows = risk_rows(c, node=node, stale_after_s=stale_after_s)
            latest = [r for r in rows if r["gpu"] == gpu]
            return points, latest

    points, latest = await to_thread.run_sync(read)
    data = [{"ts": iso(p["ts_ms"]), "risk": p["risk"], "alarm": p["alarm"]} for p in points]
    return {
        "node": node,
        "gpu": gpu,
        "data": data,
        "count": len(data),
        "latest": public(latest[0]) if latest else None,
    }


def gpu_risk_fields(
    store: Any, *, node: str | None = None
) -> dict[tuple[str, int], dict[str, Any]]:
    """(node, gpu) -> the risk fields ``GET /v1/gpus`` items carry."""
    with store.engine.connect() as c:
        rows = db.risk_rows(c, node=node)
    return {
        (r["node"], r["gpu"]): {
            "risk": r["risk"],
            "alarm": r["crossed"],
            "reasons": r["reasons"],
            "scored_at": iso(r["scored_ms"]),
            "stale": r["stale"],
            "flagged_failed": r["failed"],
        }
        for r in rows
    }


gpu_risk_fields.UNSCORED = {  # type: ignore[attr-defined]
    "risk": None,
    "alarm": False,
    "reasons": [],
    "scored_at": None,
    "stale": False,
    "flagged_failed": False,
}
