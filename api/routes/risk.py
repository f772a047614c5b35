"""Risk routes: the latest score of every GPU and one GPU's risk history (read scope)."""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Path, Query
from pydantic import BaseModel

from api.deps import StoreDep, require
from api.routes._common import Since, Until, iso, stamp, window
from store import control as db

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


@router.get("/v1/risk", response_model=RisksPublic, summary="Latest risk of every GPU")
async def list_risk(store: StoreDep, node: str | None = None) -> dict[str, Any]:
    def read() -> list[dict[str, Any]]:
        with store.engine.connect() as c:
            return db.risk_rows(c, node=node)

    rows = [public(r) for r in await to_thread.run_sync(read)]
    return {"data": rows, "count": len(rows)}


@router.get(
    "/v1/gpus/{node}/{gpu}/risk",
    response_model=RiskHistoryPublic,
    summary="One GPU's risk over time (default: the last 24 h)",
)
async def gpu_risk(
    store: StoreDep,
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
            latest = [r for r in db.risk_rows(c, node=node) if r["gpu"] == gpu]
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
        }
        for r in rows
    }


gpu_risk_fields.UNSCORED = {  # type: ignore[attr-defined]
    "risk": None,
    "alarm": False,
    "reasons": [],
    "scored_at": None,
    "stale": False,
}
