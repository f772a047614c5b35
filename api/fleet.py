"""Read endpoints for the fleet: nodes, GPUs (latest sample), a GPU's samples, events.

Sample rows come back in the wire shape of :class:`forewarn.wire.GpuSample` (``ts`` as ISO
8601), so what a client reads it could send again. Lists are ``{"data": [...], "count": n}``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import orjson
import pandas as pd
from anyio import to_thread
from fastapi import APIRouter, Path, Query
from starlette.responses import Response

from api.deps import StoreDep, require
from forewarn.errors import InvalidInput, NotFound
from forewarn.wire import EventKind, to_ms

__all__ = ["frame_records", "router"]

router = APIRouter(tags=["fleet"], dependencies=[require("read")])

MAX_ROWS = 100_000


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def frame_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Sample frame -> wire-shaped dicts (``ts`` ISO 8601, nulls as None)."""
    if frame.empty:
        return []
    out = frame.astype(object).where(frame.notna(), None)
    records: list[dict[str, Any]] = out.to_dict("records")  # type: ignore[assignment]
    for r in records:
        r["ts"] = _iso(int(r.pop("ts_ms")))
    return records


def json_response(data: Any) -> Response:
    return Response(
        orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS),
        media_type="application/json",
    )


def _page(items: list[Any]) -> Response:
    return json_response({"data": items, "count": len(items)})


@router.get("/v1/nodes", summary="Every node with its GPU count and collectors")
async def list_nodes(store: StoreDep) -> Response:
    rows = await to_thread.run_sync(store.nodes)
    for row in rows:
        row["first_seen"] = _iso(row.pop("first_seen_ms"))
        row["last_seen"] = _iso(row.pop("last_seen_ms"))
        for agent in row["agents"]:
            agent["last_seen"] = _iso(agent.pop("last_seen_ms"))
            agent["started_at"] = _iso(agent.pop("started_ms"))
    return _page(rows)


@router.get("/v1/gpus", summary="The latest sample of every GPU, with its risk")
async def list_gpus(store: StoreDep, node: str | None = None) -> Response:
    from api.routes.risk import gpu_risk_fields  # the control loop's risk, merged per GPU

    frame = await to_thread.run_sync(lambda: store.latest_samples(node=node))
    records = frame_records(frame)
    risk = await to_thread.run_sync(lambda: gpu_risk_fields(store, node=node))
    for record in records:
        record.update(risk.get((record["node"], record["gpu"]), gpu_risk_fields.UNSCORED))
    return _page(records)


Since = Annotated[datetime | None, Query(description="ISO 8601 or Unix seconds (inclusive).")]
Until = Annotated[datetime | None, Query(description="ISO 8601 or Unix seconds (exclusive).")]


def _aware(ts: datetime) -> datetime:
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts


def _window(since: datetime | None, until: datetime | None) -> tuple[int, int]:
    end = _aware(until or datetime.now(UTC))
    start = _aware(since) if since else end - timedelta(hours=1)
    if start > end:
        raise InvalidInput("since must not be after until")
    return to_ms(start), to_ms(end)


@router.get("/v1/gpus/{node}/{gpu}/samples", summary="One GPU's samples in a time window")
async def gpu_samples(
    store: StoreDep,
    node: str,
    gpu: Annotated[int, Path(ge=0, le=255)],
    since: Since = None,
    until: Until = None,
    fields: Annotated[str | None, Query(description="Comma-separated sample fields.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 10_000,
    resolution: Annotated[
        Literal["auto", "raw", "1m"],
        Query(
            description="auto: raw samples while the window lies in the raw tier (default the "
            "last 24 h), one row a minute with min/max/mean/last (counters: delta/last) beyond."
        ),
    ] = "auto",
) -> Response:
    since_ms, until_ms = _window(since, until)
    wanted = [f.strip() for f in fields.split(",") if f.strip()] if fields else None

    def read() -> tuple[pd.DataFrame, str]:
        try:
            return store.gpu_series(
                node=node,
                gpu=gpu,
                since_ms=since_ms,
                until_ms=until_ms,
                fields=wanted,
                limit=limit,
                resolution=None if resolution == "auto" else resolution,
            )
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None

    frame, served = await to_thread.run_sync(read)
    if frame.empty and not await to_thread.run_sync(lambda: store.has_gpu(node=node, gpu=gpu)):
        raise NotFound(f"no GPU {gpu} on node '{node}'")
    records = frame_records(frame)
    return json_response({"data": records, "count": len(records), "resolution": served})


@router.get("/v1/events", summary="Events (Xids, lost GPUs, resets), newest first")
async def list_events(
    store: StoreDep,
    node: str | None = None,
    gpu: Annotated[int | None, Query(ge=0, le=255)] = None,
    kind: EventKind | None = None,
    since: Since = None,
    until: Until = None,
    limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 1000,
) -> Response:
    params = {
        "node": node,
        "gpu": gpu,
        "kind": kind.value if kind else None,
        "since_ms": to_ms(_aware(since)) if since else None,
        "until_ms": to_ms(_aware(until)) if until else None,
        "limit": limit,
    }
    rows = await to_thread.run_sync(lambda: store.events(**params))
    for row in rows:
        row["ts"] = _iso(row.pop("ts_ms"))
    return _page(rows)
