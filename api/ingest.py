"""``POST /v1/ingest``: a node's samples and events, validated row by row, stored once.

The path of a batch, and what each step refuses:

1. body: at most ``max_body_bytes`` as sent and after decompression (413); encodings
   ``identity`` and ``gzip`` (several members allowed, nothing after the last; else 400/415);
   at most ``max_body_objects`` JSON objects and arrays and at most
   :data:`~api.guard.MAX_JSON_DEPTH` levels deep (413 / 422, before anything is parsed), JSON
   (400 ``malformed_json``; a key repeated in one object is refused, 422 ``repeated_key``; NaN
   and Infinity tokens are parsed so that only their rows fail); no string with a NUL or a
   lone surrogate (422, the whole batch: PostgreSQL cannot store them);
2. envelope (:class:`~forewarn.wire.IngestBatch`): schema version, node, lists (422);
3. rows, in either shape of :mod:`api.ingest_decode` (row objects or ``sample_columns``):
   each sample and event validated on its own, strictly (``true`` or ``"7"`` is not a
   counter); a bad row is reported by index with the reason and the rows beside it are kept.
   Beyond the schema, a row must belong to the batch's node and be stamped within
   ``[now - max_sample_age_s, now + max_clock_skew_s]``; a sample, also no earlier than the
   start of the oldest hour still in the raw window (``raw_window_h``): an older hour is
   rolled up, archived and dropped, and a sample stored into it would reach no tier;
4. store: one transaction (in the writer process); rows already stored are counted as
   duplicates, not errors. A database that is locked or down: 503 ``store_unavailable`` with
   ``Retry-After``; the collector keeps the batch and sends it again.

All rows valid: 200 with :class:`~forewarn.wire.IngestResult`. Some rows rejected: 422 with
``{"error": {"code": "rows_rejected", …}, "result": IngestResult}`` — the valid rows are
stored, and re-sending the batch is safe but will not make the rejected rows valid.

Nearly every batch is valid, and those take the fast path of :mod:`api.ingest_decode` (C
decoding into store rows); anything else takes the reference path here (pydantic, row by row),
which says what is wrong.
"""

from __future__ import annotations

import asyncio
import re
import time
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson
from fastapi import APIRouter, Request
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response

from api.deps import require
from api.fleetcaps import near
from api.guard import check_values, parse_exact
from api.ingest_decode import decode_fast, rows_from_columns, strict_type_error
from api.settings import Settings
from api.state import app_state
from forewarn.errors import InvalidInput, PayloadTooLarge, StoreUnavailable
from forewarn.wire import (
    AgentStatus,
    Event,
    GpuSample,
    IngestBatch,
    IngestResult,
    RowError,
)
from store import Store, partitions, reads
from store.tokens import digest, gpus_charged
from store.writes import Charge, SampleColumns, event_row, sample_row

__all__ = ["Prepared", "prepare_batch", "prepare_body", "process_batch", "router"]

router = APIRouter(tags=["ingest"])

_INLINE_BODY_BYTES = 256 * 1024
"""Bodies larger than this (as sent) are decoded in a thread, off the event loop."""

_SAMPLES = TypeAdapter(list[GpuSample])
_EVENTS = TypeAdapter(list[Event])


class UnsupportedEncoding(InvalidInput):
    code = "unsupported_encoding"
    status = 415


class BadEncoding(InvalidInput):
    code = "bad_encoding"


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
    """Inflate a gzip body of one or more members, refusing (413) past ``limit`` bytes.

    Anything after the last member that is not another gzip member is refused (400): a body
    is what its sender meant, entirely, or not at all.
    """
    out: list[bytes] = []
    size = 0
    rest = raw
    while True:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            chunk = inflater.decompress(rest, limit - size + 1)
        except zlib.error as exc:
            raise BadEncoding(f"body is not valid gzip: {exc}") from None
        size += len(chunk)
        if size > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(f"decompressed body exceeds the {limit}-byte limit")
        out.append(chunk)
        if not inflater.eof:
            raise BadEncoding("body is not valid gzip: truncated")
        rest = inflater.unused_data
        if not rest:
            return b"".join(out)
        if not rest.startswith(b"\x1f\x8b"):
            raise BadEncoding("body has data after its gzip stream")


def decompress(raw: bytes, encoding: str | None, limit: int) -> bytes:
    """The body as sent by the client, before any ``Content-Encoding`` (identity or gzip)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "gzip":
        return gunzip(raw, limit)
    if encoding != "identity":
        raise UnsupportedEncoding(f"Content-Encoding '{encoding}' is not supported (use gzip)")
    return raw


def parse_json(raw: bytes, *, max_objects: int) -> Any:
    """Parse a JSON body exactly: repeated keys refused, NaN/Infinity tokens read as floats
    (the rows that hold them are refused one by one), strings checked (:mod:`api.guard`).

    Refuses (413) a body of more than ``max_objects`` objects and arrays before parsing it,
    so that a body of millions of ``{}`` or ``[]`` cannot take the process's memory with it.
    """
    _count_containers(raw, max_objects)
    payload = parse_exact(raw, constants=True)
    check_values(payload, numbers=False)
    return payload


def _count_containers(raw: bytes, max_objects: int) -> None:
    if raw.count(b"{") + raw.count(b"[") > max_objects:
        raise PayloadTooLarge(f"body holds more than {max_objects} JSON objects and arrays")


_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
"""A NUL or a surrogate written as an escape: the body's strings are then checked one by one."""


def decode(raw: bytes, encoding: str | None, limit: int, *, max_objects: int = 10**9) -> Any:
    """Decompress (gzip or identity) and parse JSON."""
    return parse_json(decompress(raw, encoding, limit), max_objects=max_objects)


def _validate_rows(
    adapter: TypeAdapter[Any], rows: list[Any], kind: str, errors: list[RowError]
) -> tuple[list[Any], list[int]]:
    """Validate ``rows`` in one call; on failure, report bad indices and keep the rest."""
    bad: dict[int, str] = {}
    for i, row in enumerate(rows):
        reason = strict_type_error(kind, row)
        if reason is not None:
            bad[i] = reason
    candidates = [i for i in range(len(rows)) if i not in bad]
    try:
        valid = adapter.validate_python([rows[i] for i in candidates])
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            loc = err["loc"]
            at = candidates[loc[0]] if loc and isinstance(loc[0], int) else -1
            field = ".".join(str(p) for p in loc[1:]) or "row"
            bad.setdefault(at, f"{field}: {err['msg']}")
        valid = None
    keep = [i for i in range(len(rows)) if i not in bad]
    errors.extend(RowError(kind=kind, index=i, reason=r) for i, r in sorted(bad.items()))  # type: ignore[arg-type]
    if valid is None:
        valid = adapter.validate_python([rows[i] for i in keep])
    return valid, keep


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
    raw_lo_ms: int | None = None,
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
        elif raw_lo_ms is not None and ts_ms < raw_lo_ms:
            reason = (
                "ts: older than the raw window (raw_window_h): a sample that old is no "
                "longer rolled up or archived"
            )
        else:
            kept.append(row)
            continue
        errors.append(RowError(kind=kind, index=index, reason=reason))  # type: ignore[arg-type]
    return kept


class Prepared(NamedTuple):
    """A batch after validation: the rows to store and the rows refused."""

    samples: list[tuple[Any, ...]] | SampleColumns
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


_NODE_SCHEMA = IngestBatch.model_json_schema()["properties"]["node"]
_NODE_PATTERN = re.compile(_NODE_SCHEMA["pattern"])


def _node_valid(node: str) -> bool:
    """The envelope's node check of :class:`IngestBatch`, without building a validator per use."""
    return (
        _NODE_SCHEMA["minLength"] <= len(node) <= _NODE_SCHEMA["maxLength"]
        and _NODE_PATTERN.fullmatch(node) is not None
    )


def prepare_body(
    raw: bytes, encoding: str | None, *, settings: Settings, now_ms: int | None = None
) -> Prepared:
    """Decompress, parse and validate a request body.

    Nearly every batch is entirely valid and takes the fast path (:mod:`api.ingest_decode`).
    Anything it does not accept goes the row-by-row way of :func:`prepare_batch`, which says
    what is wrong and keeps the rest.
    """
    raw = decompress(raw, encoding, settings.max_body_bytes)
    _count_containers(raw, settings.max_body_objects)
    # Nesting is bounded on the exact path (parse_json): the fast decoder hands a body nested
    # past its own limit over to it.
    if _SUSPECT_ESCAPE.search(raw):  # a NUL or a lone surrogate: refused with 422, whole
        check_values(parse_exact(raw, constants=True), numbers=False)
    fast = decode_fast(raw, max_rows=settings.max_batch_rows, node_ok=_node_valid)
    agent = None
    if fast is not None and fast.agent is not None:
        try:
            agent = AgentStatus.model_validate(fast.agent)
        except ValidationError:
            fast = None
    if fast is None:
        payload = parse_json(raw, max_objects=settings.max_body_objects)
        return prepare_batch(payload, settings=settings, now_ms=now_ms)
    errors = [RowError(kind="sample", index=i, reason=r) for i, r in fast.rejected]
    events, e_idx = _validate_rows(_EVENTS, fast.events, "event", errors)
    return _prepare(
        fast.node,
        agent,
        fast.samples,
        fast.sample_index,
        [event_row(e) for e in events],
        e_idx,
        errors,
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
    if batch.sample_columns is not None:
        if batch.samples:
            raise InvalidInput("a batch sends samples as rows or as sample_columns, not both")
        try:
            sample_rows, s_idx, bad = rows_from_columns(
                batch.node, payload["sample_columns"], settings.max_batch_rows
            )
        except ValueError as exc:
            raise InvalidInput(f"sample_columns: {exc}") from None
        errors.extend(RowError(kind="sample", index=i, reason=r) for i, r in bad)
    else:
        samples, s_idx = _validate_rows(_SAMPLES, batch.samples, "sample", errors)
        sample_rows = [sample_row(s) for s in samples]
    events, e_idx = _validate_rows(_EVENTS, batch.events, "event", errors)
    return _prepare(
        batch.node,
        batch.agent,
        sample_rows,
        s_idx,
        [event_row(e) for e in events],
        e_idx,
        errors,
        settings=settings,
        now_ms=now_ms,
    )


def _raw_window_start(now_ms: int, settings: Settings) -> int:
    """The start of the oldest hour a sample may still join: the tiering task archives an hour
    (rolls it up, writes it to the history, drops its raw rows) once it has ended more than
    ``raw_window_h`` ago, so a sample of such an hour would be stored and then reach no
    tier. Refused at once instead, its reason said (the collector counts it dropped)."""
    return partitions.floor(now_ms - int(settings.raw_window_h * 3600 * 1000), partitions.HOUR_MS)


def _prepare(
    node: str,
    agent_status: AgentStatus | None,
    sample_rows: list[tuple[Any, ...]] | SampleColumns,
    s_idx: list[int],
    event_rows: list[tuple[Any, ...]],
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
    raw_lo_ms = _raw_window_start(now_ms, settings)
    checks = {"node": node, "lo_ms": lo_ms, "hi_ms": hi_ms, "errors": errors, "ts_pos": 2}
    if isinstance(sample_rows, SampleColumns):
        # Columns are the batch's node by construction: only time can refuse a row, and
        # nearly always none is refused; else the rows are checked one by one below.
        ts = sample_rows.columns[1]
        if sample_rows.n and not (max(lo_ms, raw_lo_ms) <= min(ts) and max(ts) <= hi_ms):
            sample_rows = list(sample_rows)
    if not isinstance(sample_rows, SampleColumns):
        sample_rows = _check_rows(
            sample_rows,  # type: ignore[arg-type]
            s_idx,
            kind="sample",
            raw_lo_ms=raw_lo_ms,
            **checks,  # type: ignore[arg-type]
        )
    event_rows = _check_rows(event_rows, e_idx, kind="event", **checks)  # type: ignore[arg-type]

    agent = None
    if agent_status is not None:
        status = agent_status.model_dump()
        started = status.pop("started_at")
        status["started_ms"] = int(started.timestamp() * 1000) if started else None
        status["last_seen_ms"] = now_ms
        agent = (node, status)
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
async def ingest(request: Request) -> Response:
    # The store and settings come from the app directly, not as dependencies: at several
    # hundred batches a second, FastAPI's dependency solving is a fifth of the request.
    state = app_state(request.app)
    store = state.store
    if store is None:
        raise StoreUnavailable("the store is not open yet")
    settings = state.settings
    counters = state.metrics.ingest
    try:
        raw = await read_body(request, settings.max_body_bytes)
        encoding = request.headers.get("content-encoding")
        # Validation of a usual batch takes well under a millisecond on the fast path: it runs
        # on the event loop (a thread would only add GIL hand-offs). A large body goes to a
        # thread, so the loop keeps answering (/healthz, other batches) while it is decoded.
        # The database write runs in the writer process and is awaited.
        if len(raw) > _INLINE_BODY_BYTES:
            prepared = await asyncio.to_thread(prepare_body, raw, encoding, settings=settings)
        else:
            prepared = prepare_body(raw, encoding, settings=settings)
        new_gpus = await _admit_new_gpus(request, store, prepared)
        charge = None
        if new_gpus:  # charged to the token in the batch's own transaction
            charge = Charge(_token_digest(request), sorted(new_gpus), int(time.time() * 1000))
        future = store.submit(
            samples=prepared.samples, events=prepared.events, agent=prepared.agent, charge=charge
        )
        result = prepared.result(*await asyncio.wrap_future(future))
        if new_gpus and state.known_gpus is not None:
            state.known_gpus.update(new_gpus)
    except InvalidInput:
        counters.batches_4xx.inc()
        raise
    rejected_samples = sum(1 for e in result.rejected if e.kind == "sample")
    counters.stored.inc(result.stored_samples)
    counters.duplicate.inc(result.duplicate_samples)
    counters.rejected.inc(rejected_samples)
    counters.events_stored.inc(result.stored_events)
    counters.events_duplicate.inc(result.duplicate_events)
    counters.events_rejected.inc(len(result.rejected) - rejected_samples)
    body = result.model_dump(mode="json")
    if result.rejected:
        counters.batches_4xx.inc()
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
    counters.batches_2xx.inc()
    return Response(orjson.dumps(body), 200, media_type="application/json")


class FleetLimit(InvalidInput):
    code = "fleet_limit"


def _token_digest(request: Request) -> str:
    """The stored form (:func:`store.tokens.digest`) of the request's bearer secret."""
    return digest(request.headers.get("authorization", "").partition(" ")[2].strip())


async def _admit_new_gpus(
    request: Request, store: Store, prepared: Prepared
) -> set[tuple[str, int]]:
    """The GPUs this batch adds to the fleet, refused (422) past the fleet's or token's cap.

    Only checked here: the GPUs are charged to the token in the batch's own transaction
    (:class:`store.writes.Charge`), so a batch that fails and is sent again is charged once.
    The counts come from the database (:class:`api.fleetcaps.CapCounts`: at most a second old
    away from the caps, afresh near them), so every replica on it enforces the same caps.
    """
    state = app_state(request.app)
    known = state.known_gpus
    if known is None:

        def load() -> set[tuple[str, int]]:
            with store.engine.connect() as connection:
                return reads.stored_gpus(connection)

        known = state.known_gpus = await asyncio.to_thread(load)
    samples = prepared.samples
    if isinstance(samples, SampleColumns):
        new = {(samples.node, gpu) for gpu in set(samples.columns[0])} - known
    else:
        new = {(row[0], row[1]) for row in samples} - known
    if not new:
        return new
    who = _token_digest(request)
    settings = state.settings
    caps = state.cap_counts
    now = time.monotonic()
    fresh = caps.fresh(
        who, now, fleet_cap=settings.max_fleet_gpus, token_cap=settings.max_gpus_per_token
    )
    if (
        fresh is None
        or near(fresh[0] + len(new), settings.max_fleet_gpus)
        or near(fresh[1] + len(new), settings.max_gpus_per_token)
    ):

        def counts() -> tuple[set[tuple[str, int]], int, int]:
            with store.engine.connect() as connection:
                stored = reads.stored_gpus(connection, nodes={node for node, _ in new})
                return stored, reads.gpu_count(connection), gpus_charged(connection, who)

        stored, fleet, charged = await asyncio.to_thread(counts)
        caps.counted(who, fleet, charged, now)
        known |= stored  # added by another replica since this one loaded the fleet
        new -= stored
        if not new:
            return new
    else:
        fleet, charged = fresh
    if fleet + len(new) > settings.max_fleet_gpus:
        raise FleetLimit(
            f"the fleet holds {fleet} GPUs and this batch would add {len(new)}: past the "
            f"limit of {settings.max_fleet_gpus} (FOREWARN_MAX_FLEET_GPUS)"
        )
    if charged + len(new) > settings.max_gpus_per_token:
        raise FleetLimit(
            f"this token has added {charged} GPUs: past the limit of "
            f"{settings.max_gpus_per_token} (FOREWARN_MAX_GPUS_PER_TOKEN)"
        )
    caps.admitted(who, len(new))
    return new
