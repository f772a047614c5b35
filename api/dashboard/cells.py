"""``GET /v1/dashboard/cells``: what the fleet map draws, for every GPU, in columns.

The risk map needs five facts a GPU (node, index, risk, alarm, staleness), 2 s apart, for
fleets of 16,384 GPUs. ``GET /v1/gpus`` answers with every GPU's whole newest sample (about
14 MB and several seconds at that size); this route reads the ``gpus`` registry joined to the
latest scores, and answers in columns (about 60 bytes a GPU), so one update of the map costs
a small fraction of its interval on both sides. Reasons come only for the GPUs a person would
look at first: those in alarm, and the highest risks.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from anyio import to_thread
from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import select
from starlette.responses import Response

from api.deps import SettingsDep, StoreDep, require
from store import control as control_db
from store.schema import gpus as gpus_table

__all__ = ["CellsPublic", "router"]

router = APIRouter(tags=["dashboard"])

REASONS_FOR_TOP = 64
"""Besides every GPU in alarm, the highest-risk GPUs whose reasons are sent."""


class CellsPublic(BaseModel):
    """Every GPU as parallel columns: entry i of each list describes GPU i."""

    now_ms: int
    """The service's clock when it answered (ages are measured against it)."""
    count: int
    nodes: list[str]
    """Node names, sorted; ``node`` holds indexes into this list."""
    node: list[int]
    gpu: list[int]
    last_seen_ms: list[int]
    """Time of the GPU's newest sample (ms since the epoch)."""
    risk: list[float | None]
    """Latest risk score; None: not scored yet."""
    alarm: list[bool]
    """Crossed the threshold for the policy's hysteresis."""
    stale: list[bool]
    """No sample for the policy's ``stale_after_s``: its risk is unknown, not low."""
    failed: list[bool]
    """The GPU was lost or reported a fatal Xid."""
    reasons: dict[int, list[str]]
    """GPU index -> reasons in words, for the GPUs in alarm and the highest risks."""


def read_cells(store: Any, stale_after_s: float) -> dict[str, Any]:
    risk = control_db.risk_latest
    g = gpus_table
    query = (
        select(
            g.c.node,
            g.c.gpu,
            g.c.last_seen_ms,
            risk.c.risk,
            risk.c.crossed,
            risk.c.stale,
            risk.c.failed,
            risk.c.reasons,
        )
        .select_from(g.outerjoin(risk, (risk.c.node == g.c.node) & (risk.c.gpu == g.c.gpu)))
        .order_by(g.c.node, g.c.gpu)
    )
    with store.engine.connect() as connection:
        rows = connection.execute(query).all()
    now = int(time.time() * 1000)
    stale_ms = stale_after_s * 1000
    nodes: list[str] = []
    out: dict[str, Any] = {
        "now_ms": now,
        "count": len(rows),
        "nodes": nodes,
        "node": [],
        "gpu": [],
        "last_seen_ms": [],
        "risk": [],
        "alarm": [],
        "stale": [],
        "failed": [],
        "reasons": {},
    }
    node_col, gpu_col, seen_col = out["node"], out["gpu"], out["last_seen_ms"]
    risk_col, alarm_col, stale_col, failed_col = (
        out["risk"],
        out["alarm"],
        out["stale"],
        out["failed"],
    )
    for node, gpu, seen, score, crossed, stale, failed, _ in rows:
        if not nodes or nodes[-1] != node:
            nodes.append(node)
        node_col.append(len(nodes) - 1)
        gpu_col.append(gpu)
        seen_col.append(seen)
        risk_col.append(score)
        alarm_col.append(bool(crossed))
        stale_col.append(bool(stale) or now - seen > stale_ms)
        failed_col.append(bool(failed))
    ranked = sorted(
        (i for i, r in enumerate(risk_col) if r is not None), key=lambda i: -risk_col[i]
    )[:REASONS_FOR_TOP]
    wanted = set(ranked) | {i for i, a in enumerate(alarm_col) if a}
    for i in sorted(wanted):
        reasons = rows[i][7]
        out["reasons"][i] = orjson.loads(reasons) if reasons else []
    return out


@router.get(
    "/v1/dashboard/cells",
    response_model=CellsPublic,
    dependencies=[require("read")],
    summary="Every GPU's node, risk, alarm and staleness in columns (the fleet map)",
)
async def cells(store: StoreDep, settings: SettingsDep) -> Response:
    stale_after_s = float(getattr(getattr(settings, "policy", None), "stale_after_s", 30.0))
    body = await to_thread.run_sync(lambda: read_cells(store, stale_after_s))
    return Response(
        orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), media_type="application/json"
    )
