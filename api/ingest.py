"""``POST /v1/ingest``: a node's samples and events, validated row by row, stored once.

The path of a batch, and what each step refuses:

1. body: at most ``max_body_bytes`` after gzip decompression (413), JSON (400
   ``malformed_json``; NaN and Infinity tokens are parsed so that only their rows fail);
2. envelope (:class:`~forewarn.wire.IngestBatch`): schema version, node, lists (422);
3. rows: each sample and event validated on its own; a bad row is reported by index with the
   reason and the rows beside it are kept. Beyond the schema, a row must belong to the batch's
   node and be stamped within ``[now - max_sample_age_s, now + max_clock_skew_s]``;
4. store: one transaction; rows already stored are counted as duplicates, not errors.

All rows valid: 200 with :class:`~forewarn.wire.IngestResult`. Some rows rejected: 422 with
``{"error": {"code": "rows_rejected", …}, "result": IngestResult}`` — the valid rows are
stored, and re-sending the batch is safe but will not make the rejected rows valid.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson
from fastapi import APIRouter, Request
from pydantic import Field, TypeAdapter, ValidationError
from starlette.responses import Response

from api.deps import SettingsDep, StoreDep, require
from api.settings import Settings
from forewarn.errors import InvalidInput, PayloadTooLarge
from forewarn.wire import Event, GpuSample, IngestBatch, IngestResult, RowError
from store import Store
from store.writes import event_row, sample_row

__all__ = ["Prepared", "prepare_batch", "prepare_body", "process_batch", "router"]

router = APIRouter(tags=["ingest"])

_SAMPLES = TypeAdapter(list[GpuSample])
_EVENTS = TypeAdapter(list[Event])


class MalformedJson(InvalidInput):
    code = "malformed_json"
    status = 400


class UnsupportedEncoding(InvalidInput):
    code = "unsupported_encoding"
    status = 415


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def gunzip(raw: bytes, limit: int) -> bytes:
    """Inflate a gzip body, refusing (413) past ``limit`` bytes without inflating the rest."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"body is not valid gzip: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed body exceeds the {limit}-byte limit")
    return out


def decode(raw: bytes, encoding: str | None, limit: int) -> Any:
    """Decompress (gzip or identity) and parse JSON."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "gzip":
        raw = gunzip(raw, limit)
    elif encoding != "identity":
        raise UnsupportedEncoding(f"Content-Encoding '{encoding}' is not supported (use gzip)")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:  # the standard parser also reads NaN/Infinity tokens: let only those rows fail
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise MalformedJson(f"body is not valid JSON: {exc}") from None


def _validate_rows(
    adapter: TypeAdapter[Any], rows: list[Any], kind: str, errors: list[RowError]
) -> tuple[list[Any], list[int]]:
    """Validate ``rows`` in one call; on failure, report bad indices and keep the rest."""
    try:
        return adapter.validate_python(rows), list(range(len(rows)))
    except ValidationError as exc:
        bad: dict[int, str] = {}
        for err in exc.errors(include_url=False):
            loc = err["loc"]
            index = loc[0] if loc and isinstance(loc[0], int) else -1
            field = ".".join(str(p) for p in loc[1:]) or "row"
            bad.setdefault(int(index), f"{field}: {err['msg']}")
    keep = [i for i in range(len(rows)) if i not in bad]
    errors.extend(RowError(kind=kind, index=i, reason=r) for i, r in sorted(bad.items()))  # type: ignore[arg-type]
    return adapter.validate_python([rows[i] for i in keep]), keep


def _check_rows(
    rows: Sequence[tuple[Any, ...]],
    indices: list[int],
    *,
    node: str,
    kind: str,
    ts_pos: int,
    lo_ms: int,
    hi_ms: int,
    errors: list[RowError],
) -> list[tuple[Any, ...]]:
    kept = []
    for row, index in zip(rows, indices, strict=True):
        ts_ms = row[ts_pos]
        if row[0] != node:
            reason = f"node: row is for node '{row[0]}' in a batch from node '{node}'"
        elif ts_ms > hi_ms:
            reason = f"ts: {(ts_ms - hi_ms) / 1000 + 0.0:.0f} s past the allowed clock skew"
        elif ts_ms < lo_ms:
            reason = "ts: older than the maximum sample age"
        else:
            kept.append(row)
            continue
        errors.append(RowError(kind=kind, index=index, reason=reason))  # type: ignore[arg-type]
    return kept


class Prepared(NamedTuple):
    """A batch after validation: the rows to store and the rows refused."""

    samples: list[tuple[Any, ...]]
    events: list[tuple[Any, ...]]
    agent: tuple[str, dict[str, Any]] | None
    rejected: list[RowError]

    def result(self, stored_samples: int, stored_events: int) -> IngestResult:
        return IngestResult(
            stored_samples=stored_samples,
            duplicate_samples=len(self.samples) - stored_samples,
            stored_events=stored_events,
            duplicate_events=len(self.events) - stored_events,
            rejected=self.rejected,
        )


def process_batch(
    payload: Any, *, store: Store, settings: Settings, now_ms: int | None = None
) -> IngestResult:
    """Validate and store one decoded batch, waiting for the commit."""
    prepared = prepare_batch(payload, settings=settings, now_ms=now_ms)
    stored = store.write(samples=prepared.samples, events=prepared.events, agent=prepared.agent)
    return prepared.result(*stored)


class _ValidBatch(IngestBatch):
    """An ingest batch whose every row is valid: the fast path, parsed and checked in one pass."""

    samples: list[GpuSample] = Field(default_factory=list, max_length=100_000)  # type: ignore[assignment]
    events: list[Event] = Field(default_factory=list, max_length=100_000)  # type: ignore[assignment]


def prepare_body(
    raw: bytes, encoding: str | None, *, settings: Settings, now_ms: int | None = None
) -> Prepared:
    """Decompress, parse and validate a request body.

    Nearly every batch is entirely valid, and for those pydantic parses the JSON and checks
    every row in one pass (a third cheaper than parsing first). Anything it refuses goes the
    row-by-row way of :func:`prepare_batch`, which says what is wrong and keeps the rest.
    """
    limit = settings.max_body_bytes
    if (encoding or "identity").strip().lower() == "gzip":
        raw = gunzip(raw, limit)
        encoding = None
    try:
        batch = _ValidBatch.model_validate_json(raw)
    except ValidationError:
        return prepare_batch(decode(raw, encoding, limit), settings=settings, now_ms=now_ms)
    return _prepare(
        batch,
        batch.samples,
        list(range(len(batch.samples))),
        batch.events,
        list(range(len(batch.events))),
        [],
        settings=settings,
        now_ms=now_ms,
    )


def prepare_batch(payload: Any, *, settings: Settings, now_ms: int | None = None) -> Prepared:
    """Validate one decoded batch: the part of ingest that touches neither HTTP nor the DB."""
    if not isinstance(payload, dict):
        raise InvalidInput("body must be a JSON object (an IngestBatch)")
    try:
        batch = IngestBatch.model_validate(payload)
    except ValidationError as exc:
        details = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors(include_url=False)]
        first = details[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidInput(f"{where}: {first['msg']}", details=details) from None
    errors: list[RowError] = []
    samples, s_idx = _validate_rows(_SAMPLES, batch.samples, "sample", errors)
    events, e_idx = _validate_rows(_EVENTS, batch.events, "event", errors)
    return _prepare(batch, samples, s_idx, events, e_idx, errors, settings=settings, now_ms=now_ms)


def _prepare(
    batch: IngestBatch,
    samples: list[GpuSample],
    s_idx: list[int],
    events: list[Event],
    e_idx: list[int],
    errors: list[RowError],
    *,
    settings: Settings,
    now_ms: int | None,
) -> Prepared:
    """The checks beyond the schema (node, time bounds), and rows in store order."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    lo_ms = now_ms - int(settings.max_sample_age_s * 1000)
    hi_ms = now_ms + int(settings.max_clock_skew_s * 1000)
    checks = {"node": batch.node, "lo_ms": lo_ms, "hi_ms": hi_ms, "errors": errors, "ts_pos": 2}
    sample_rows = _check_rows([sample_row(s) for s in samples], s_idx, kind="sample", **checks)  # type: ignore[arg-type]
    event_rows = _check_rows([event_row(e) for e in events], e_idx, kind="event", **checks)  # type: ignore[arg-type]

    agent = None
    if batch.agent is not None:
        status = batch.agent.model_dump()
        started = status.pop("started_at")
        status["started_ms"] = int(started.timestamp() * 1000) if started else None
        status["last_seen_ms"] = now_ms
        agent = (batch.node, status)
    errors.sort(key=lambda e: (e.kind, e.index))
    return Prepared(sample_rows, event_rows, agent, errors)


@router.post(
    "/v1/ingest",
    response_model=IngestResult,
    dependencies=[require("ingest")],
    summary="Store a node's samples and events",
    responses={
        400: {"description": "Body is not JSON"},
        401: {"description": "Missing or unknown token"},
        413: {"description": "Body too large"},
        422: {"description": "Envelope invalid, or some rows rejected (the rest stored)"},
    },
)
async def ingest(request: Request, store: StoreDep, settings: SettingsDep) -> Response:
    metrics = request.app.state.metrics
    try:
        raw = await read_body(request, settings.max_body_bytes)
        # Validation is CPU-bound Python: it runs on the event loop (a thread would only add
        # GIL hand-offs); the database write runs off it and is awaited.
        prepared = prepare_body(raw, request.headers.get("content-encoding"), settings=settings)
        future = store.submit(
            samples=prepared.samples, events=prepared.events, agent=prepared.agent
        )
        result = prepared.result(*await asyncio.wrap_future(future))
    except InvalidInput:
        metrics.batches.labels("4xx").inc()
        raise
    rejected_samples = sum(1 for e in result.rejected if e.kind == "sample")
    metrics.samples.labels("stored").inc(result.stored_samples)
    metrics.samples.labels("duplicate").inc(result.duplicate_samples)
    metrics.samples.labels("rejected").inc(rejected_samples)
    metrics.events.labels("stored").inc(result.stored_events)
    metrics.events.labels("duplicate").inc(result.duplicate_events)
    metrics.events.labels("rejected").inc(len(result.rejected) - rejected_samples)
    body = result.model_dump(mode="json")
    if result.rejected:
        metrics.batches.labels("4xx").inc()
        first = result.rejected[0]
        stored = result.stored_samples + result.duplicate_samples
        message = (
            f"{len(result.rejected)} row(s) rejected, {stored} sample(s) kept; "
            f"first: {first.kind} {first.index}: {first.reason}"
        )
        error = {"code": "rows_rejected", "message": message, "retryable": False}
        return Response(
            orjson.dumps({"error": error, "result": body}), 422, media_type="application/json"
        )
    metrics.batches.labels("2xx").inc()
    return Response(orjson.dumps(body), 200, media_type="application/json")
