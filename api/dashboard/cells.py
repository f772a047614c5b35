"""``GET /v1/dashboard/cells``: what the fleet map draws, for every GPU, in columns.

The risk map needs five facts a GPU (node, index, risk, alarm, staleness), 2 s apart, for
fleets of 16,384 GPUs. ``GET /v1/gpus`` answers with every GPU's whole newest sample (about
14 MB and several seconds at that size); this route reads the ``gpus`` registry joined to the
latest scores, and answers in columns (about 60 bytes a GPU), so one update of the map costs
a small fraction of its interval on both sides. The answer is read once per control tick and
served from memory to every dashboard until the next tick's scores land
(:class:`api.tickcache.TickCache`). Reasons come only for the GPUs a person would
look at first: those in alarm, the highest risks, and those that failed or came back.

A GPU's state after a failure comes from its events, as an operator would read them: a
fatal event (lost, a GPU-down Xid such as 48, a power loss or a thermal shutdown) and no
sample since is ``failed`` (not "at risk, stale": its risk no longer means anything); samples
again, for longer than the stale interval after it, is ``recovered``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from anyio import to_thread
from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import and_, or_, select
from starlette.responses import Response

from api.deps import AppStateDep, SettingsDep, StoreDep, require
from store import control as control_db
from store.schema import events as events_table
from store.schema import gpus as gpus_table

__all__ = ["FAILURE_LOOKBACK_MS", "CellsPublic", "failure_state", "last_failures", "router"]

router = APIRouter(tags=["dashboard"])

REASONS_FOR_TOP = 64
"""Besides every GPU in alarm, the highest-risk GPUs whose reasons are sent."""

FAILURE_LOOKBACK_MS = 7 * 86_400_000
"""How far back fatal events are read (an older failure is still flagged by the loop)."""


class CellsPublic(BaseModel):
    """Every GPU as parallel columns: entry i of each list describes GPU i."""

    now_ms: int
    """The service's clock when it read the columns (ages are measured against it): they are
    read once per control tick and served from memory until the next tick's scores land."""
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
    """The GPU was lost or reported a fatal Xid, and has sent no sample since."""
    recovered: list[bool]
    """The GPU failed and is reporting again (for longer than the stale interval)."""
    reasons: dict[int, list[str]]
    """GPU index -> reasons in words, for the GPUs in alarm and the highest risks."""


def read_cells(connection: Any, stale_after_s: float) -> dict[str, Any]:
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
    now = int(time.time() * 1000)
    rows = connection.execute(query).all()
    failures = last_failures(connection, since_ms=now - FAILURE_LOOKBACK_MS)
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
        "recovered": [],
        "reasons": {},
    }
    node_col, gpu_col, seen_col = out["node"], out["gpu"], out["last_seen_ms"]
    risk_col, alarm_col, stale_col, failed_col = (
        out["risk"],
        out["alarm"],
        out["stale"],
        out["failed"],
    )
    recovered_col = out["recovered"]
    told: dict[int, list[str]] = {}
    for i, (node, gpu, seen, score, crossed, stale, failed, _) in enumerate(rows):
        if not nodes or nodes[-1] != node:
            nodes.append(node)
        node_col.append(len(nodes) - 1)
        gpu_col.append(gpu)
        seen_col.append(seen)
        risk_col.append(score)
        failure = failures.get((node, gpu))
        down, back = failure_state(bool(failed), failure, seen, stale_ms)
        failed_col.append(down)
        recovered_col.append(back)
        alarm_col.append(bool(crossed) and not down)
        stale_col.append(not down and (bool(stale) or now - seen > stale_ms))
        if down:
            told[i] = [f"failed: {failure[1]}" if failure else "failed"]
        elif back and failure is not None:
            told[i] = [f"recovered: reporting again after {failure[1]}"]
    ranked = sorted(
        (i for i, r in enumerate(risk_col) if r is not None), key=lambda i: -risk_col[i]
    )[:REASONS_FOR_TOP]
    wanted = set(ranked) | {i for i, a in enumerate(alarm_col) if a} | set(told)
    for i in sorted(wanted):
        reasons = rows[i][7]
        said = told.get(i, [])
        out["reasons"][i] = said + (orjson.loads(reasons) if reasons and not failed_col[i] else [])
    return out


def failure_state(
    flagged: bool, failure: tuple[int, str] | None, last_seen_ms: int | None, stale_ms: float
) -> tuple[bool, bool]:
    """(failed, recovered) of a GPU, as the map, ``/v1/gpus`` and ``/v1/risk`` all say it.

    Args:
        flagged: the control loop marked it failed (a fatal event it saw).
        failure: (time, cause) of its newest fatal event (:func:`last_failures`), if any.
        last_seen_ms: time of its newest sample.
        stale_ms: samples for longer than this after the fatal event: it came back.
    """
    back = failure is not None and last_seen_ms is not None and last_seen_ms > failure[0] + stale_ms
    return (flagged or failure is not None) and not back, back


def last_failures(
    connection: Any, *, since_ms: int, node: str | None = None
) -> dict[tuple[str, int], tuple[int, str]]:
    """(node, gpu) -> (time, cause) of each GPU's newest fatal event since ``since_ms``."""
    from control.loop import FATAL_EVENT_KINDS
    from predictor.catalog import GPU_DOWN_XIDS

    ev = events_table
    fatal = or_(
        ev.c.kind.in_(sorted(FATAL_EVENT_KINDS)),
        and_(ev.c.kind == "xid", ev.c.xid.in_(sorted(GPU_DOWN_XIDS))),
    )
    query = select(ev.c.node, ev.c.gpu, ev.c.ts_ms, ev.c.kind, ev.c.xid).where(
        fatal, ev.c.ts_ms >= since_ms
    )
    if node is not None:
        query = query.where(ev.c.node == node)
    out: dict[tuple[str, int], tuple[int, str]] = {}
    for node, gpu, ts_ms, kind, xid in connection.execute(query):
        cause = f"Xid {xid}" if kind == "xid" else str(kind).replace("_", " ")
        if (node, gpu) not in out or ts_ms > out[(node, gpu)][0]:
            out[(node, gpu)] = (int(ts_ms), cause)
    return out


@router.get(
    "/v1/dashboard/cells",
    response_model=CellsPublic,
    dependencies=[require("read")],
    summary="Every GPU's node, risk, alarm and staleness in columns (the fleet map)",
)
async def cells(state: AppStateDep, store: StoreDep, settings: SettingsDep) -> Response:
    stale_after_s = float(getattr(getattr(settings, "policy", None), "stale_after_s", 30.0))

    def read(connection: Any) -> bytes:
        body = read_cells(connection, stale_after_s)
        return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)

    body = await to_thread.run_sync(
        lambda: state.fleet_reads.get(
            store.engine,
            f"cells:{stale_after_s!r}",
            read,
            max_age_s=float(getattr(settings, "control_tick_s", 5.0)),
        )
    )
    return Response(body, media_type="application/json")
