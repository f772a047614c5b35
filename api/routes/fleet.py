"""Read endpoints for the fleet: nodes, GPUs (latest sample), a GPU's samples, events.

Sample rows come back in the wire shape of :class:`forewarn.wire.GpuSample` (``ts`` as ISO
8601), so what a client reads it could send again. Lists are ``{"data": [...], "count": n}``.
Answers are serialised with orjson directly (a 16,384-GPU page through pydantic costs
seconds); each route's ``response_model`` says their shape in the OpenAPI document.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import numpy as np
import orjson
import pandas as pd
from anyio import to_thread
from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from api.deps import AppStateDep, SettingsDep, StoreDep, require
from api.guard import check_text
from api.routes._common import Since, Until
from forewarn.errors import InvalidInput, NotFound
from forewarn.wire import EventKind, GpuSample, to_ms
from store.reads import FRAME_COLUMNS

__all__ = [
    "AgentPublic",
    "EventPublic",
    "EventsPublic",
    "FailurePublic",
    "GpuPublic",
    "GpusPublic",
    "NodePublic",
    "NodesPublic",
    "SamplesPublic",
    "frame_records",
    "router",
]

router = APIRouter(tags=["fleet"], dependencies=[require("read")])

MAX_ROWS = 100_000


class AgentPublic(BaseModel):
    """A collector's last heartbeat (:class:`forewarn.wire.AgentStatus`, as stored)."""

    agent_id: str
    source: str
    version: str
    started_at: str | None
    last_seen: str | None
    sent_total: int
    spooled: int
    dropped_total: int
    interval_s: float | None


class NodePublic(BaseModel):
    node: str
    gpus: int
    """GPUs with a stored sample."""
    first_seen: str | None
    last_seen: str | None
    """Time of the node's newest sample."""
    agents: list[AgentPublic]


class NodesPublic(BaseModel):
    data: list[NodePublic]
    count: int
    next: str | None
    """The next page's ``cursor``; null on the last page."""


class FailurePublic(BaseModel):
    cause: str
    """The fatal event: ``gpu lost``, ``Xid 48``, …"""
    at: str | None


class GpuPublic(GpuSample):
    """A GPU's newest sample (``ts`` ISO 8601) with its latest risk and failure state."""

    model_config = ConfigDict(extra="allow", frozen=True)

    risk: float | None = None
    """Latest risk score; None: not scored yet."""
    alarm: bool = False
    """Crossed the threshold for the policy's hysteresis."""
    reasons: list[str] = Field(default_factory=list)
    scored_at: str | None = None
    stale: bool = False
    failed: bool = False
    """A fatal event, and no sample since (see ``recovered``)."""
    recovered: bool = False
    """Samples again after the last fatal event: the GPU came back."""
    failure: FailurePublic | None = None
    """The newest fatal event of the last week, if any."""


class GpusPublic(BaseModel):
    data: list[GpuPublic]
    count: int
    next: str | None
    """The next page's ``cursor``; null on the last page."""


class SamplesPublic(BaseModel):
    data: list[dict[str, Any]] | None = None
    """Raw: rows of :class:`forewarn.wire.GpuSample` (the fields asked for). Per minute (per
    hour): ``ts`` (the minute's start), ``node``, ``gpu``, each field's mean (gauges) or last
    value (counters), its ``<field>_min``/``_max``/``_mean``/``_last`` (counters ``_delta``,
    ``_last``; not with ``stats=false``) and ``n``, the samples the minute held. Absent with
    ``shape=columns``."""
    columns: dict[str, list[Any]] | None = None
    """With ``shape=columns``, in place of ``data``: each name of a row (``node`` and ``gpu``
    left out: they are the path's) to its values in row order."""
    count: int
    resolution: Literal["raw", "1m", "1h"]


class EventPublic(BaseModel):
    id: int
    node: str
    gpu: int | None
    """None: the whole node."""
    ts: str | None
    kind: str
    xid: int | None
    message: str | None
    source: str | None


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int
    next: str | None
    """Always null: events are read by time window and ``limit``."""


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _values(column: pd.Series) -> list[Any]:
    """A column as Python values, missing ones as None."""
    if column.dtype.kind == "f":
        values = column.to_numpy()
        missing = np.isnan(values)
        if not missing.any():
            return values.tolist()  # type: ignore[no-any-return]
        out = values.astype(object)
        out[missing] = None
        return out.tolist()  # type: ignore[no-any-return]
    if column.hasnans:
        return column.to_numpy(dtype=object, na_value=None).tolist()  # type: ignore[call-overload, no-any-return]
    return column.tolist()


def frame_columns(frame: pd.DataFrame, *, arrays: bool = False) -> tuple[list[str], list[Any]]:
    """Sample frame -> its wire names (``ts_ms`` as ``ts``) and each column's values (``ts``
    ISO 8601, nulls as None; with ``arrays`` float columns stay numpy arrays, whose NaNs
    orjson writes as null)."""
    names: list[str] = []
    columns: list[Any] = []
    for i, name in enumerate(frame.columns):
        column = frame.iloc[:, i]
        if name == "ts_ms":
            stamps = column.to_numpy(dtype="int64").astype("datetime64[ms]")
            names.append("ts")
            columns.append([t + "+00:00" for t in np.datetime_as_string(stamps, unit="ms")])
        elif arrays and column.dtype.kind == "f":
            names.append(str(name))
            columns.append(column.to_numpy())
        else:
            names.append(str(name))
            columns.append(_values(column))
    return names, columns


def frame_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Sample frame -> wire-shaped dicts (``ts`` ISO 8601, nulls as None), column by column
    (a week of one GPU per minute is 10,080 rows of up to 80 columns)."""
    if frame.empty:
        return []
    names, columns = frame_columns(frame)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]


def json_response(data: Any) -> Response:
    return Response(
        orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS),
        media_type="application/json",
    )


def _page(items: list[Any], next_cursor: str | None = None) -> Response:
    return json_response({"data": items, "count": len(items), "next": next_cursor})


def encode_cursor(key: Any) -> str:
    """An opaque page cursor: where the next page starts (after ``key``)."""
    return base64.urlsafe_b64encode(orjson.dumps(key)).decode().rstrip("=")


def decode_cursor(cursor: str) -> Any:
    """The key a cursor holds; its strings and integers as a query may take them (a NUL
    character in a crafted cursor reached PostgreSQL, and a 500, before)."""
    try:
        key = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, TypeError):
        raise InvalidInput("cursor: not a cursor this service gave out") from None
    for part in key if isinstance(key, list) else [key]:
        if isinstance(part, str):
            check_text(part, "cursor")
        elif isinstance(part, int) and not -(2**63) <= part < 2**63:
            raise InvalidInput("cursor: not a cursor this service gave out")
    return key


PAGE_LIMIT = 10_000
PageLimit = Annotated[int | None, Query(ge=1, le=PAGE_LIMIT, description="Items a page.")]
PageCursor = Annotated[
    str | None, Query(max_length=1024, description="The ``next`` of the page before.")
]


def _page_params(limit: int | None, cursor: str | None) -> tuple[int, Any]:
    """The page size and the decoded cursor (plain parameters, checked here)."""
    if limit is None:
        limit = DEFAULT_PAGE
    if not 1 <= limit <= PAGE_LIMIT:
        raise InvalidInput(f"limit: between 1 and {PAGE_LIMIT}")
    if cursor is not None and len(cursor) > 1024:
        raise InvalidInput("cursor: not a cursor this service gave out")
    return limit, decode_cursor(cursor) if cursor else None


DEFAULT_PAGE = 5000


@router.get(
    "/v1/nodes",
    response_model=NodesPublic,
    summary="Every node with its GPU count and collectors, a page at a time",
)
async def list_nodes(
    store: StoreDep, limit: PageLimit = None, cursor: PageCursor = None
) -> Response:
    """``limit`` items a page (default 5000, at most 10,000); ``next`` is the next page's
    ``cursor``, null on the last page."""
    limit, after = _page_params(limit, cursor)
    if after is not None and not isinstance(after, str):
        raise InvalidInput("cursor: not a cursor this service gave out")
    every = await to_thread.run_sync(store.nodes)
    rows = [r for r in every if after is None or r["node"] > after][: limit + 1]
    next_cursor = encode_cursor(rows[limit - 1]["node"]) if len(rows) > limit else None
    rows = rows[:limit]
    for row in rows:
        row["first_seen"] = _iso(row.pop("first_seen_ms"))
        row["last_seen"] = _iso(row.pop("last_seen_ms"))
        for agent in row["agents"]:
            agent["last_seen"] = _iso(agent.pop("last_seen_ms"))
            agent["started_at"] = _iso(agent.pop("started_ms"))
    return _page(rows, next_cursor)


@router.get(
    "/v1/gpus",
    response_model=GpusPublic,
    summary="The latest sample of every GPU, with its risk, a page at a time",
)
async def list_gpus(
    state: AppStateDep,
    store: StoreDep,
    settings: SettingsDep,
    node: str | None = None,
    limit: PageLimit = None,
    cursor: PageCursor = None,
) -> Response:
    """``limit`` GPUs a page (default 5000, at most 10,000), ordered by (node, gpu); ``next``
    is the next page's ``cursor``, null on the last page."""
    from api.routes.risk import gpu_risk_fields, snapshot  # the control loop's risk, per GPU

    limit, after = _page_params(limit, cursor)
    if after is not None and not (
        isinstance(after, list)
        and len(after) == 2
        and isinstance(after[0], str)
        and type(after[1]) is int
    ):
        raise InvalidInput("cursor: not a cursor this service gave out")
    key = (after[0], after[1]) if after else None
    frame = await to_thread.run_sync(
        lambda: store.latest_samples(node=node, after=key, limit=limit + 1)
    )
    records = frame_records(frame)
    next_cursor = None
    if len(records) > limit:
        records = records[:limit]
        next_cursor = encode_cursor([records[-1]["node"], int(records[-1]["gpu"])])
    snap = await to_thread.run_sync(lambda: snapshot(state, store))  # once a tick
    for record in records:
        key = (record["node"], record["gpu"])
        record.update(gpu_risk_fields(snap, key))
        record.update(
            _failure_fields(record, snap.failures.get(key), settings.policy.stale_after_s)
        )
    return _page(records, next_cursor)


def _failure_fields(
    record: dict[str, Any], failure: tuple[int, str] | None, stale_after_s: float
) -> dict[str, Any]:
    """``failed`` (a fatal event, no sample since), ``recovered`` (samples again after it)
    and ``failure`` (its cause and time), as the fleet map has them."""
    from api.dashboard.cells import failure_state

    seen_ms = to_ms(datetime.fromisoformat(str(record["ts"]).replace("Z", "+00:00")))
    flagged = bool(record.pop("flagged_failed", False))
    failed, back = failure_state(flagged, failure, seen_ms, stale_after_s * 1000)
    cause = None if failure is None else {"cause": failure[1], "at": _iso(failure[0])}
    return {"failed": failed, "recovered": back, "failure": cause}


def _aware(ts: datetime) -> datetime:
    """``ts`` if it says where it is; a naive time is refused, as ingest refuses it."""
    if ts.tzinfo is None:
        raise InvalidInput(f"{ts.isoformat()}: a time needs a UTC offset ('Z' or '+00:00')")
    return ts


def _window(since: datetime | None, until: datetime | None) -> tuple[int, int]:
    end = _aware(until) if until else datetime.now(UTC)
    try:
        start = _aware(since) if since else end - timedelta(hours=1)
        window = to_ms(start), to_ms(end)
    except (OverflowError, ValueError, OSError):
        raise InvalidInput("since/until: outside the times this service can represent") from None
    if start > end:
        raise InvalidInput("since must not be after until")
    return window


_FIELD = "(?:" + "|".join(FRAME_COLUMNS) + ")"
_FIELDS_PATTERN = rf"^\s*{_FIELD}?\s*(?:,\s*{_FIELD}?\s*)*$"
"""Names of :data:`store.reads.FRAME_COLUMNS`, comma-separated (blank items are skipped)."""


@router.get(
    "/v1/gpus/{node}/{gpu}/samples",
    response_model=SamplesPublic,
    summary="One GPU's samples in a time window",
)
async def gpu_samples(
    store: StoreDep,
    node: str,
    gpu: Annotated[int, Path(ge=0, le=255)],
    since: Since = None,
    until: Until = None,
    fields: Annotated[
        str | None,
        # The pattern is documented, not enforced by the framework: the store's check names
        # the unknown field ("unknown sample field 'nope'"), where a pattern error would
        # quote this whole expression back at the caller.
        Query(
            description="Comma-separated sample fields.",
            json_schema_extra={"pattern": _FIELDS_PATTERN},
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 10_000,
    resolution: Annotated[
        Literal["auto", "raw", "1m", "1h"],
        Query(
            description="auto: raw samples while the window lies in the raw tier (default the "
            "last 24 h), one row a minute with min/max/mean/last (counters: delta/last) while "
            "it lies in the minute tier (30 days), one row an hour beyond."
        ),
    ] = "auto",
    shape: Annotated[
        Literal["rows", "columns"],
        Query(description="rows: ``data``, a list of rows; columns: ``columns``, name -> values."),
    ] = "rows",
    stats: Annotated[
        bool,
        Query(
            description="false: per-minute and per-hour rows without each field's "
            "min/max/mean/last (counters delta/last): the field's value and n only."
        ),
    ] = True,
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
    if not stats and served != "raw":  # the statistics' columns are named after their field
        named = {"ts_ms", "node", "gpu", "n", *(wanted or FRAME_COLUMNS)}
        frame = frame[[c for c in frame.columns if c in named]]
    if shape == "columns":
        frame = frame.drop(columns=[c for c in ("node", "gpu") if c in frame.columns])
        names, columns = frame_columns(frame, arrays=True)
        by_name = dict(zip(names, columns, strict=True))
        return json_response({"columns": by_name, "count": len(frame), "resolution": served})
    records = frame_records(frame)
    return json_response({"data": records, "count": len(records), "resolution": served})


@router.get(
    "/v1/events",
    response_model=EventsPublic,
    summary="Events (Xids, lost GPUs, resets), newest first",
)
async def list_events(
    store: StoreDep,
    node: str | None = None,
    gpu: Annotated[int | None, Query(ge=0, le=255)] = None,
    kind: EventKind | None = None,
    since: Since = None,
    until: Until = None,
    limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = 1000,
) -> Response:
    since_ms = to_ms(_aware(since)) if since else None
    until_ms = to_ms(_aware(until)) if until else None
    if since_ms is not None and until_ms is not None and since_ms > until_ms:
        raise InvalidInput("since must not be after until")
    params = {
        "node": node,
        "gpu": gpu,
        "kind": kind.value if kind else None,
        "since_ms": since_ms,
        "until_ms": until_ms,
        "limit": limit,
    }
    rows = await to_thread.run_sync(lambda: store.events(**params))
    for row in rows:
        row["ts"] = _iso(row.pop("ts_ms"))
    return _page(rows)
