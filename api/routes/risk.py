"""Risk routes: the latest score of every GPU and one GPU's risk history (read scope).

The fleet's latest scores are read once per control tick (:class:`RiskSnapshot`, kept by
:class:`api.tickcache.TickCache`) and served from memory to every reader until the next
tick's scores land; ``GET /v1/risk`` pages through them as ``GET /v1/gpus`` pages, serialised
with orjson directly.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import orjson
from anyio import to_thread
from fastapi import APIRouter, Path, Query
from pydantic import BaseModel
from starlette.responses import Response

from api.deps import AppStateDep, StoreDep, require
from api.routes._common import Since, Until, iso, now_ms, window
from api.routes.fleet import PAGE_LIMIT, _page_params, encode_cursor, json_response
from api.state import AppState
from forewarn.errors import InvalidInput
from store import control as db

__all__ = ["RiskPublic", "RiskSnapshot", "gpu_risk_fields", "router", "snapshot"]

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
    next: str | None
    """The next page's ``cursor``; null on the last page."""


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


@dataclass(frozen=True)
class RiskSnapshot:
    """The latest score of every scored GPU, as ``GET /v1/risk`` says it, read once a tick."""

    rows: list[dict[str, Any]]
    """Public rows (:class:`RiskPublic`), ordered by (node, gpu) as Python orders them."""
    keys: list[tuple[str, int]]
    """(node, gpu) of each row, for the cursor's bisection."""
    flagged: list[bool]
    """The loop's own ``failed`` flag of each row (``GET /v1/gpus`` reads it beside events)."""
    index: dict[tuple[str, int], int]
    failures: dict[tuple[str, int], tuple[int, str]]
    """(time, cause) of each GPU's newest fatal event of :data:`FAILURE_LOOKBACK_MS`."""

    def span(self, node: str | None) -> tuple[int, int]:
        """The rows of ``node`` (all of them for None), as a range."""
        if node is None:
            return 0, len(self.keys)
        return bisect_left(self.keys, (node, -1)), bisect_left(self.keys, (node, math.inf))


def _stamps(values: list[int | None]) -> list[str | None]:
    """Milliseconds since the epoch -> ISO 8601 as :func:`api.routes._common.iso` writes them,
    all at once."""
    array = np.array([-1 if v is None else v for v in values], dtype="int64")
    text = np.datetime_as_string(array.astype("datetime64[ms]"), unit="ms").tolist()
    return [None if v is None else t + "+00:00" for v, t in zip(values, text, strict=True)]


def read_snapshot(connection: Any, *, stale_after_s: float) -> RiskSnapshot:
    """The latest scores, with ``failed`` and ``recovered`` read from the GPUs' events as the
    fleet map reads them (:func:`api.dashboard.cells.failure_state`): the loop's flag stays
    set after a GPU came back."""
    from api.dashboard.cells import FAILURE_LOOKBACK_MS, failure_state, last_failures

    raw = db.risk_fleet(connection)
    failures = last_failures(connection, since_ms=now_ms() - FAILURE_LOOKBACK_MS)
    raw.sort(key=lambda r: (r[0], r[1]))  # the cursor compares in Python's order
    scored = _stamps([r[5] for r in raw])
    last_seen = _stamps([r[6] for r in raw])
    stale_ms = stale_after_s * 1000
    reasons_of: dict[str, list[str]] = {}  # most GPUs share "[]"
    rows, keys, flagged = [], [], []
    for i, r in enumerate(raw):
        node, gpu, risk, alarm, reasons, _, seen, stale, streak, crossed, flag, gpu_seen = r
        key = (node, gpu)
        reasons_list = reasons_of.get(reasons)
        if reasons_list is None:
            reasons_list = reasons_of.setdefault(reasons, orjson.loads(reasons))
        failure = failures.get(key)
        if failure is None:  # most GPUs: the loop's flag says it
            failed, recovered = bool(flag), False
        else:
            failed, recovered = failure_state(
                bool(flag), failure, seen if gpu_seen is None else gpu_seen, stale_ms
            )
        rows.append(
            {
                "node": node,
                "gpu": gpu,
                "risk": risk,
                "alarm": bool(alarm),
                "crossed": bool(crossed),
                "reasons": reasons_list,
                "scored_at": scored[i],
                "last_seen_at": last_seen[i],
                "stale": bool(stale),
                "failed": failed,
                "recovered": recovered,
                "streak": streak,
            }
        )
        keys.append(key)
        flagged.append(bool(flag))
    index = {k: i for i, k in enumerate(keys)}
    return RiskSnapshot(rows, keys, flagged, index, failures)


def snapshot(state: AppState, store: Any) -> RiskSnapshot:
    """This tick's :class:`RiskSnapshot`, from memory unless the scores moved
    (:class:`api.tickcache.TickCache`); call it from a worker thread."""
    stale_after_s = float(state.settings.policy.stale_after_s)
    return state.fleet_reads.get(
        store.engine,
        f"risk:{stale_after_s!r}",
        lambda c: read_snapshot(c, stale_after_s=stale_after_s),
        max_age_s=state.settings.control_tick_s,
    )


def _cursor_key(after: Any) -> tuple[str, int] | None:
    if after is None:
        return None
    if not (
        isinstance(after, list)
        and len(after) == 2
        and isinstance(after[0], str)
        and type(after[1]) is int
    ):
        raise InvalidInput("cursor: not a cursor this service gave out")
    return after[0], after[1]


@router.get(
    "/v1/risk",
    response_model=RisksPublic,
    summary="Latest risk of every GPU, a page at a time",
)
async def list_risk(
    state: AppStateDep,
    store: StoreDep,
    node: str | None = None,
    alarm: Annotated[
        bool | None, Query(description="Only GPUs whose latest score is (not) in alarm.")
    ] = None,
    crossed: Annotated[
        bool | None, Query(description="Only GPUs that have (not) crossed: alarm with hysteresis.")
    ] = None,
    limit: Annotated[int | None, Query(ge=1, le=PAGE_LIMIT, description="Items a page.")] = None,
    cursor: Annotated[
        str | None, Query(max_length=1024, description="The ``next`` of the page before.")
    ] = None,
) -> Response:
    """``limit`` GPUs a page (default 5000, at most 10,000), ordered by (node, gpu); ``next``
    is the next page's ``cursor``, null on the last page. Read once per control tick and
    served from memory until the next tick's scores land."""
    limit, after = _page_params(limit, cursor)
    start = _cursor_key(after)
    snap = await to_thread.run_sync(lambda: snapshot(state, store))
    lo, hi = snap.span(node)
    if start is not None:
        lo = max(lo, bisect_right(snap.keys, start))
    rows = snap.rows
    page: list[dict[str, Any]] = []
    for i in range(lo, hi):
        row = rows[i]
        if (alarm is None or row["alarm"] == alarm) and (
            crossed is None or row["crossed"] == crossed
        ):
            page.append(row)
            if len(page) > limit:
                break
    next_cursor = None
    if len(page) > limit:
        page = page[:limit]
        next_cursor = encode_cursor([page[-1]["node"], page[-1]["gpu"]])
    return json_response({"data": page, "count": len(page), "next": next_cursor})


@router.get(
    "/v1/gpus/{node}/{gpu}/risk",
    response_model=RiskHistoryPublic,
    summary="One GPU's risk over time (default: the last 24 h)",
)
async def gpu_risk(
    state: AppStateDep,
    store: StoreDep,
    node: str,
    gpu: Annotated[int, Path(ge=0, le=255)],
    since: Since = None,
    until: Until = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> dict[str, Any]:
    since_ms, until_ms = window(since, until, 86_400)

    def read() -> list[db.RiskPoint]:
        with store.engine.connect() as c:
            return db.history(
                c, node=node, gpu=gpu, since_ms=since_ms, until_ms=until_ms, limit=limit
            )

    points = await to_thread.run_sync(read)
    snap = await to_thread.run_sync(lambda: snapshot(state, store))
    at = snap.index.get((node, gpu))
    data = [{"ts": iso(p["ts_ms"]), "risk": p["risk"], "alarm": p["alarm"]} for p in points]
    return {
        "node": node,
        "gpu": gpu,
        "data": data,
        "count": len(data),
        "latest": None if at is None else snap.rows[at],
    }


UNSCORED: dict[str, Any] = {
    "risk": None,
    "alarm": False,
    "reasons": [],
    "scored_at": None,
    "stale": False,
    "flagged_failed": False,
}
"""The risk fields of a GPU not scored yet."""


def gpu_risk_fields(snap: RiskSnapshot, key: tuple[str, int]) -> dict[str, Any]:
    """The risk fields ``GET /v1/gpus`` items carry for the GPU ``key``."""
    at = snap.index.get(key)
    if at is None:
        return UNSCORED
    row = snap.rows[at]
    return {
        "risk": row["risk"],
        "alarm": row["crossed"],
        "reasons": row["reasons"],
        "scored_at": row["scored_at"],
        "stale": row["stale"],
        "flagged_failed": snap.flagged[at],
    }
