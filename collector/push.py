"""Pushing telemetry to the service: the HTTP client and the batching, spooling sender.

Two layers, usable apart:

- :class:`IngestClient` sends one :class:`~forewarn.wire.IngestBatch` to ``POST /v1/ingest``
  (gzip, bearer token, a timeout on every call) and turns every answer into an
  :class:`~forewarn.wire.IngestResult` or an error of :mod:`forewarn.errors`;
- :class:`BatchingPusher` takes samples and events from any number of nodes, batches them by
  count and by time, sends from its own thread so the sampling loop never waits on the
  network, and on failure keeps batches in a bounded :mod:`spool <collector.spool>` that is
  replayed oldest first with exponential backoff and jitter.

Delivery is at-least-once; the service stores each (node, gpu, ts) once, so a batch re-sent
after a timeout whose answer was lost is counted as duplicates, never stored twice. With a
:class:`~collector.spool.DiskSpool`, what is at risk when the agent is killed outright is only
what sat in memory for the last ``max_delay_s``.

What happens to a batch the service refuses:

===========================  ====================================================
answer                        action
===========================  ====================================================
200                           sent; per-row rejections counted as dropped
422 ``rows_rejected``         the good rows are stored; the rejected counted as dropped
413 body too large            split in halves and sent again; one row too large: dropped
401 / 403                     kept in the spool and retried (an operator fixes the token)
other 4xx                     dropped (re-sending cannot make it valid), logged
429, 5xx, no connection       kept in the spool, retried with backoff (Retry-After honoured)
===========================  ====================================================
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from collector.spool import MemorySpool, Spool
from forewarn.errors import (
    Forbidden,
    ForewarnError,
    InvalidInput,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
)
from forewarn.wire import (
    AgentStatus,
    Event,
    GpuSample,
    IngestBatch,
    IngestResult,
    sample_columns,
)

__all__ = [
    "Backoff",
    "BatchingPusher",
    "IngestClient",
    "PushStats",
    "ServiceUnavailable",
    "batch_body",
]

log = logging.getLogger("forewarn.collector.push")


def batch_body(
    node: str,
    samples: Iterable[GpuSample] = (),
    events: Iterable[Event] = (),
    agent: AgentStatus | None = None,
) -> dict[str, Any]:
    """The JSON object of an IngestBatch, unset fields left out (they mean "not reported")."""
    return {
        "schema_version": 1,
        "node": node,
        "samples": [s.model_dump(mode="json", exclude_none=True) for s in samples],
        "events": [e.model_dump(mode="json", exclude_none=True) for e in events],
        "agent": agent.model_dump(mode="json") if agent is not None else None,
    }


def _column_body(node: str, columns: dict[str, list[Any]]) -> dict[str, Any]:
    """A batch of samples in the ``sample_columns`` shape (events travel in row batches)."""
    return {"schema_version": 1, "node": node, "sample_columns": columns, "events": []}


def _concat_columns(parts: list[tuple[int, Mapping[str, list[Any]]]]) -> dict[str, list[Any]]:
    """One ``sample_columns`` object from several; a field a part lacks is null there."""
    if len(parts) == 1:
        return dict(parts[0][1])
    out: dict[str, list[Any]] = {k: [] for _, cols in parts for k in cols}
    for n, cols in parts:
        for k, values in out.items():
            values.extend(cols.get(k) or [None] * n)
    return out


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class IngestClient:
    """A client of ``POST /v1/ingest``.

    Args:
        service_url: the service's base URL, e.g. ``http://forewarn:8765``.
        token: a bearer token with the ``ingest`` scope.
        timeout_s: limit for connecting and for the whole answer of one call, seconds.
        gzip: compress request bodies (``Content-Encoding: gzip``).
        columns: send samples as ``sample_columns`` (smaller, decoded faster by the service);
            rows again if the service is older and refuses them.
        transport: an httpx transport (tests: ``httpx.MockTransport``; default: network).

    Example::

        client = IngestClient("http://127.0.0.1:8765", "secret")
        result = client.send(IngestBatch(node="n1", samples=[sample.model_dump(mode="json")]))
    """

    def __init__(
        self,
        service_url: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        gzip: bool = True,
        columns: bool = False,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = service_url.rstrip("/") + "/v1/ingest"
        self.gzip = gzip
        self.columns = columns
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            transport=transport,
        )

    def send(self, batch: IngestBatch | dict[str, Any]) -> IngestResult:
        """Send one batch and return what the service stored.

        Raises:
            ServiceUnavailable: no connection, a timeout, 429 or 5xx (retryable).
            Unauthorized, Forbidden: the token is missing, unknown or lacks ``ingest``.
            PayloadTooLarge: the body is over the service's limit.
            InvalidInput: the envelope was refused (re-sending the same body cannot succeed).
        """
        body = batch.model_dump(mode="json") if isinstance(batch, IngestBatch) else batch
        columns = sample_columns(body.get("samples") or [], body.get("node", ""))
        if self.columns and columns is not None:
            as_columns = {k: v for k, v in body.items() if k != "samples"}
            try:
                return self._post({**as_columns, "sample_columns": columns})
            except InvalidInput as exc:
                if "sample_columns" not in exc.message:
                    raise
                # A service older than the columns shape: send rows from now on.
                log.warning("the service does not take sample_columns; sending rows")
                self.columns = False
        return self._post(body)

    def _post(self, body: dict[str, Any]) -> IngestResult:
        data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        headers = {}
        if self.gzip:
            data = gzip.compress(data, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        try:
            response = self._http.post(self.url, content=data, headers=headers)
        except httpx.TransportError as exc:
            raise ServiceUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from None
        return self._result(response)

    def _result(self, response: httpx.Response) -> IngestResult:
        status = response.status_code
        try:
            payload = response.json()
        except ValueError:
            payload = {}
        error = payload.get("error", {}) if isinstance(payload, dict) else {}
        message = f"{self.url}: {status} {error.get('code', '')}: {error.get('message', '')}"
        if status == 200:
            return IngestResult.model_validate(payload)
        if status == 422 and error.get("code") == "rows_rejected" and "result" in payload:
            return IngestResult.model_validate(payload["result"])
        if status == 429 or status >= 500:
            raise ServiceUnavailable(message, retry_after_s=_retry_after(response))
        if status == 401:
            raise Unauthorized(message)
        if status == 403:
            raise Forbidden(message)
        if status == 413:
            raise PayloadTooLarge(message)
        raise InvalidInput(message, details=error or None)

    def close(self) -> None:
        self._http.close()


@dataclass
class Backoff:
    """Exponential backoff with jitter: attempt n waits a random time in [d/2, d],
    d = min(max_s, initial_s * factor**n). The jitter keeps a fleet of agents that lost the
    service together from hammering it together when it returns."""

    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random)

    def delay_s(self, attempt: int) -> float:
        d = min(self.max_s, self.initial_s * self.factor ** min(attempt, 64))
        return self.rng.uniform(d / 2, d)


@dataclass
class PushStats:
    """What the pusher has done so far (rows = samples + events)."""

    sent_total: int = 0
    """Rows the service acknowledged (stored or already stored)."""
    duplicate_total: int = 0
    dropped_total: int = 0
    """Rows that will never reach the store: refused rows, spool overflow, invalid batches."""
    spooled: int = 0
    """Rows waiting in the spool now."""
    buffered: int = 0
    batches_sent: int = 0
    failures: int = 0
    last_error: str | None = None


Reading = GpuSample | Event
AgentStatusFn = Callable[[str], AgentStatus | None]


class BatchingPusher:
    """Batches readings per node and sends them from a thread, spooling what fails.

    Args:
        client: where batches go.
        spool: where batches wait during an outage (default: a :class:`MemorySpool`).
        max_rows: rows per batch; a full buffer is sent at once.
        max_delay_s: the longest a reading waits in memory before it is sent or spooled.
        heartbeat_s: send an empty batch carrying the agent status for a node that has sent
            nothing for this long (``None``: never). Call :meth:`watch` for each node.
        agent_status: ``node -> AgentStatus | None``, attached to every batch.
        backoff: retry schedule while the service is unreachable.
        max_buffer_rows: readings held in memory before the oldest are dropped.

    Example::

        with BatchingPusher(IngestClient(url, token), spool=DiskSpool(path)) as pusher:
            pusher.add(source.read(now))
    """

    def __init__(
        self,
        client: IngestClient,
        *,
        spool: Spool | None = None,
        max_rows: int = 5000,
        max_delay_s: float = 1.0,
        heartbeat_s: float | None = None,
        agent_status: AgentStatusFn | None = None,
        backoff: Backoff | None = None,
        max_buffer_rows: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_rows <= 0 or max_delay_s < 0:
            raise ValueError("max_rows must be positive and max_delay_s not negative")
        self.client = client
        self.spool: Spool = spool if spool is not None else MemorySpool()
        self.max_rows = max_rows
        self.max_delay_s = max_delay_s
        self.heartbeat_s = heartbeat_s
        self.agent_status = agent_status or (lambda node: None)
        self.backoff = backoff or Backoff()
        self.max_buffer_rows = max_buffer_rows
        self.clock = clock
        self._stats = PushStats()
        self._cond = threading.Condition()
        self._buffer: dict[str, tuple[list[GpuSample], list[Event]]] = {}
        self._columns: dict[str, list[tuple[int, Mapping[str, list[Any]]]]] = {}
        self._buffered = 0
        self._first_at: float | None = None
        self._flush_requested = False
        self._busy = False
        self._closing = False
        self._attempt = 0
        self._retry_at = 0.0
        self._last_sent: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    # -- the producer's side ---------------------------------------------------------------

    def start(self) -> BatchingPusher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="forewarn-push", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> BatchingPusher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def watch(self, node: str) -> None:
        """Send heartbeats for ``node`` (its agent status) even when it has no readings."""
        with self._cond:
            self._last_sent.setdefault(node, self.clock())

    def add(self, readings: Iterable[Reading]) -> None:
        """Queue readings; never blocks on the network."""
        with self._cond:
            for r in readings:
                samples, events = self._buffer.setdefault(r.node, ([], []))
                (samples if isinstance(r, GpuSample) else events).append(r)  # type: ignore[arg-type]
                self._buffered += 1
            if self._buffered and self._first_at is None:
                self._first_at = self.clock()
            if self._buffered > self.max_buffer_rows:
                self._shed(self._buffered - self.max_buffer_rows)
            self._cond.notify_all()

    def add_columns(
        self, node: str, columns: Mapping[str, list[Any]], events: Iterable[Event] = ()
    ) -> None:
        """Queue samples of ``node`` already in the ``sample_columns`` shape, and its events.

        ``columns`` is what :class:`~forewarn.wire.IngestBatch` calls ``sample_columns``:
        ``gpu``, ``ts_ms`` and one equal-length list per reported field. A node's column
        chunks are sent together, up to ``max_rows`` samples a request (a chunk is never cut);
        the events go in a batch of rows. Never blocks on the network.
        """
        n = len(columns.get("gpu") or ())
        with self._cond:
            if n:
                self._columns.setdefault(node, []).append((n, columns))
                self._buffered += n
            if events:
                self.add(events)  # a re-entrant lock: the rows path queues the events
                return
            if self._buffered and self._first_at is None:
                self._first_at = self.clock()
            if self._buffered > self.max_buffer_rows:
                self._shed(self._buffered - self.max_buffer_rows)
            self._cond.notify_all()

    def _shed(self, excess: int) -> None:
        # Only reached when the sender thread cannot keep up even with the spool.
        for chunks in self._columns.values():
            while chunks and excess > 0:
                n, _ = chunks.pop(0)
                excess -= n
                self._buffered -= n
                self._stats.dropped_total += n
        for samples, events in self._buffer.values():
            for rows in (samples, events):
                n = min(excess, len(rows))
                del rows[:n]
                excess -= n
                self._buffered -= n
                self._stats.dropped_total += n
        log.error("push buffer over %d rows: dropped the oldest", self.max_buffer_rows)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Send (or spool) everything buffered now; wait at most ``timeout_s``.

        Returns True when nothing is left buffered or spooled (all delivered).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flush_requested = True
            self._retry_at = 0.0  # an explicit flush tries the service now
            self._cond.notify_all()
            while self._buffered or self._busy or self._flush_requested:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    break
                self._cond.wait(left)
            return not self._buffered and len(self.spool) == 0

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush, stop the thread, close the client. What could not be sent stays spooled."""
        if self._thread is not None:
            self.flush(timeout_s)
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join(timeout_s)
            self._thread = None
        self.client.close()

    @property
    def stats(self) -> PushStats:
        with self._cond:
            s = PushStats(**vars(self._stats))
            s.spooled, s.buffered = self.spool.rows, self._buffered
            return s

    # -- the sender thread -----------------------------------------------------------------

    def _due(self, now: float) -> float | None:
        """Seconds until there is work (0: now), None: nothing scheduled."""
        waits = []
        if self._flush_requested or self._buffered >= self.max_rows:
            return 0.0
        if self._first_at is not None:
            waits.append(self._first_at + self.max_delay_s - now)
        if len(self.spool):
            waits.append(self._retry_at - now)
        if self.heartbeat_s is not None:
            waits.extend(
                max(t + self.heartbeat_s, self._retry_at) - now for t in self._last_sent.values()
            )
        return max(0.0, min(waits)) if waits else None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing:
                    wait = self._due(self.clock())
                    if wait == 0.0:
                        break
                    self._cond.wait(wait)
                if self._closing:
                    return
                flushing = self._flush_requested
                taken = self._take()
                self._busy = True
            try:
                for node, body, rows in taken:
                    self._deliver(node, body, rows)
                self._replay()
                self._heartbeats()
            except Exception:  # the sender must outlive any surprise; nothing is lost by it
                log.exception("push: unexpected error")
            finally:
                with self._cond:
                    self._busy = False
                    if flushing:
                        self._flush_requested = False
                    self._cond.notify_all()

    def _take(self) -> list[tuple[str, dict[str, Any], int]]:
        now = self.clock()
        due = (
            self._flush_requested
            or self._buffered >= self.max_rows
            or (self._first_at is not None and now - self._first_at >= self.max_delay_s)
        )
        if not due or not self._buffered:
            return []
        out = []
        for node, (samples, events) in self._buffer.items():
            rows: list[Reading] = [*samples, *events]
            for i in range(0, len(rows), self.max_rows):
                chunk = rows[i : i + self.max_rows]
                s = [r for r in chunk if isinstance(r, GpuSample)]
                e = [r for r in chunk if isinstance(r, Event)]
                out.append((node, batch_body(node, s, e), len(chunk)))
        for node, chunks in self._columns.items():
            part: list[tuple[int, Mapping[str, list[Any]]]] = []
            for i, (n, cols) in enumerate(chunks):
                part.append((n, cols))
                total = sum(k for k, _ in part)
                if i + 1 == len(chunks) or total + chunks[i + 1][0] > self.max_rows:
                    out.append((node, _column_body(node, _concat_columns(part)), total))
                    part = []
        self._buffer.clear()
        self._columns.clear()
        self._buffered = 0
        self._first_at = None
        return out

    def _deliver(self, node: str, body: dict[str, Any], rows: int) -> None:
        if len(self.spool) or self.clock() < self._retry_at:
            self._keep(body, rows)  # keep arrival order: older batches go first
            return
        if not self._attempt_send(node, body, rows):
            self._keep(body, rows)

    def _keep(self, body: dict[str, Any], rows: int) -> None:
        body = {**body, "agent": None}  # a stale status is replaced when replayed
        with self._cond:
            try:
                self._stats.dropped_total += self.spool.put(body, rows)
                return
            except OSError as exc:  # a full or read-only disk must not stop the sender
                why = f"spool write failed: {exc}"
                self._stats.dropped_total += rows
                self._stats.last_error = why
        log.error("push: service unreachable and %s: dropped %d row(s)", why, rows)

    def _replay(self) -> None:
        while len(self.spool) and self.clock() >= self._retry_at:
            entries = self.spool.head(64)
            if not entries:
                return
            # Coalesce consecutive batches of one node (up to max_rows) into one request.
            node = entries[0][1]["node"]
            columnar = "sample_columns" in entries[0][1]
            group: list[tuple[str, dict[str, Any]]] = []
            total = 0
            for key, body, rows in entries:
                if (
                    body["node"] != node
                    or ("sample_columns" in body) != columnar
                    or (group and total + rows > self.max_rows)
                ):
                    break
                group.append((key, body))
                total += rows
            merged = {**group[0][1], "events": [e for _, b in group for e in b.get("events", ())]}
            if columnar:
                parts = [(len(b["sample_columns"]["gpu"]), b["sample_columns"]) for _, b in group]
                merged["sample_columns"] = _concat_columns(parts)
            else:
                merged["samples"] = [s for _, b in group for s in b.get("samples", ())]
            if not self._attempt_send(node, merged, total):
                return
            with self._cond:
                for key, _ in group:
                    self.spool.remove(key)

    def _heartbeats(self) -> None:
        if self.heartbeat_s is None or self.clock() < self._retry_at:
            return
        now = self.clock()
        for node, last in list(self._last_sent.items()):
            if now - last >= self.heartbeat_s and not self._attempt_send(node, batch_body(node), 0):
                return

    def _attempt_send(self, node: str, body: dict[str, Any], rows: int) -> bool:
        """One request. True: the batch is settled (sent, or dropped for good); False: keep it."""
        body = {**body, "agent": self._status_json(node)}
        try:
            result = self.client.send(body)
        except PayloadTooLarge:
            if rows <= 1:
                self._dropped(rows, "a single row is over the service's body limit")
                return True
            return self._split(node, body, rows)
        except InvalidInput as exc:
            self._dropped(rows, f"batch refused: {exc}")
            return True
        except ForewarnError as exc:  # unreachable, 5xx, or a token problem: keep and retry
            self._failed(exc)
            return False
        with self._cond:
            rejected = len(result.rejected)
            self._stats.sent_total += rows - rejected
            self._stats.duplicate_total += result.duplicate_samples + result.duplicate_events
            self._stats.dropped_total += rejected
            self._stats.batches_sent += 1
            self._attempt = 0
            self._retry_at = 0.0
            self._last_sent[node] = self.clock()
        if result.rejected:
            first = result.rejected[0]
            log.warning(
                "%d row(s) refused; first: %s %d: %s",
                rejected,
                first.kind,
                first.index,
                first.reason,
            )
        return True

    def _split(self, node: str, body: dict[str, Any], rows: int) -> bool:
        if "sample_columns" in body:  # its events are always none (see add_columns)
            cols = body["sample_columns"]
            n = len(cols["gpu"])
            for a, b in ((0, n // 2), (n // 2, n)):
                sub = {**body, "sample_columns": {k: v[a:b] for k, v in cols.items()}}
                if not self._attempt_send(node, sub, b - a):
                    self._keep(sub, b - a)
            return True
        items = [("samples", x) for x in body["samples"]] + [("events", x) for x in body["events"]]
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            sub = {
                **body,
                "samples": [x for k, x in part if k == "samples"],
                "events": [x for k, x in part if k == "events"],
            }
            if not self._attempt_send(node, sub, len(part)):
                self._keep(sub, len(part))
        return True

    def _dropped(self, rows: int, why: str) -> None:
        with self._cond:
            self._stats.dropped_total += rows
            self._stats.last_error = why
        log.error("push: dropped %d row(s): %s", rows, why)

    def _failed(self, exc: ForewarnError) -> None:
        with self._cond:
            delay = self.backoff.delay_s(self._attempt)
            if isinstance(exc, Unauthorized | Forbidden):
                delay = self.backoff.max_s  # needs an operator; do not spin
            retry_after = getattr(exc, "retry_after_s", None)
            if retry_after is not None:
                delay = max(delay, retry_after)
            self._attempt += 1
            self._retry_at = self.clock() + delay
            self._stats.failures += 1
            first = self._stats.last_error != exc.message
            self._stats.last_error = exc.message
        level = logging.ERROR if isinstance(exc, Unauthorized | Forbidden) else logging.WARNING
        if first:
            log.log(level, "push failed (%s); spooling, next try in %.1f s", exc.message, delay)

    def _status_json(self, node: str) -> dict[str, Any] | None:
        status = self.agent_status(node)
        return status.model_dump(mode="json") if status is not None else None
