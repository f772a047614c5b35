"""The node agent's sampling loop: read every source at a fixed rate, hand rows to the pusher.

The loop owns the clock. Tick k is due at ``start + k * interval_s`` on the monotonic clock,
so the rate does not drift however long a read takes; a tick that falls more than one
interval behind (a stalled read, a suspended process) is skipped, counted and the schedule
realigned, never made up in a burst. Every sample of one tick carries the same wall-clock
timestamp, which is what makes the service's (node, gpu, ts) idempotency work on replay; a
tick's timestamp is always a millisecond or more after the previous tick's, so two ticks run
close together (the first one late) never share a key and lose a sample to deduplication.

A source that raises :class:`~forewarn.errors.SourceUnavailable` does not stop the agent: it
is retried on the next tick, and after ``stall_ticks`` failed ticks in a row a
``telemetry_stalled`` event is sent (once per stall). The pusher's heartbeat (an empty batch
with the :class:`~forewarn.wire.AgentStatus`) tells the service the agent itself is alive.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from collector.base import Reading, Source
from collector.push import BatchingPusher
from forewarn import __version__
from forewarn.errors import ForewarnError, SourceUnavailable
from forewarn.wire import AgentStatus, Event, EventKind

__all__ = ["SamplingLoop", "SamplingStats"]

log = logging.getLogger("forewarn.collector.agent")


class SamplingStats:
    """Counters of the loop itself (the pusher has its own)."""

    def __init__(self) -> None:
        self.ticks = 0
        self.skipped_ticks = 0
        self.readings = 0
        self.source_errors = 0
        self.read_s_total = 0.0


class SamplingLoop:
    """Samples ``sources`` every ``interval_s`` and feeds ``pusher``.

    Args:
        sources: read in order each tick; their readings are pushed together.
        pusher: a started or unstarted :class:`BatchingPusher` (the agent starts it).
        interval_s: sampling period, seconds.
        node: this node's name (for ``telemetry_stalled`` events and heartbeats).
        heartbeat: send heartbeats for ``node`` while it has no readings (False for a source
            that reports other nodes, such as the simulator: the host is not a GPU node).
        agent_id: stable identity reported to the service (default: ``<node>-<random>``).
        stall_ticks: failed ticks in a row before a ``telemetry_stalled`` event.
        clock, wall, sleep: monotonic clock, UTC wall clock and sleep (parameters for tests).
    """

    def __init__(
        self,
        sources: Sequence[Source],
        pusher: BatchingPusher,
        *,
        interval_s: float = 1.0,
        node: str,
        heartbeat: bool = True,
        agent_id: str | None = None,
        stall_ticks: int = 3,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.sources = list(sources)
        self.pusher = pusher
        self.interval_s = interval_s
        self.node = node
        self.agent_id = agent_id or f"{node}-{uuid.uuid4().hex[:8]}"
        self.stall_ticks = stall_ticks
        self.clock = clock
        self.wall = wall
        self.stats = SamplingStats()
        self.started_at = wall()
        self._failing = {id(s): 0 for s in self.sources}
        self._last_ts: datetime | None = None
        self._stop = threading.Event()
        self.pusher.agent_status = self.status
        if heartbeat:
            self.pusher.watch(node)

    @property
    def source_name(self) -> str:
        return "+".join(s.name for s in self.sources)[:64]

    def status(self, node: str | None = None) -> AgentStatus:
        """The self-metrics sent with every batch."""
        push = self.pusher.stats
        return AgentStatus(
            agent_id=self.agent_id,
            source=self.source_name,
            version=__version__,
            started_at=self.started_at,
            sent_total=push.sent_total,
            spooled=push.spooled + push.buffered,
            dropped_total=push.dropped_total,
            interval_s=self.interval_s,
        )

    def stop(self) -> None:
        self._stop.set()

    def tick(self, now: datetime | None = None) -> list[Reading]:
        """Read every source once and queue the readings; returns them."""
        now = now or self.wall()
        now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # the store keeps ms
        last = self._last_ts
        if last is not None and last - timedelta(seconds=self.interval_s) < now <= last:
            # A tick run late lands just before the next one: the store keys samples on
            # (node, gpu, ts), so a repeated millisecond would store only one of the two.
            now = last + timedelta(milliseconds=1)
        self._last_ts = now
        out: list[Reading] = []
        t0 = time.perf_counter()
        for source in self.sources:
            try:
                out.extend(source.read(now))
            except ForewarnError as exc:
                out.extend(self._source_failed(source, now, exc))
            except Exception as exc:  # a source bug must not stop the other sources
                log.exception("source %s failed", source.name)
                out.extend(self._source_failed(source, now, SourceUnavailable(str(exc))))
            else:
                self._failing[id(source)] = 0
        self.stats.read_s_total += time.perf_counter() - t0
        self.stats.ticks += 1
        self.stats.readings += len(out)
        if out:
            self.pusher.add(out)
        return out

    def _source_failed(self, source: Source, now: datetime, exc: ForewarnError) -> list[Event]:
        self.stats.source_errors += 1
        n = self._failing[id(source)] = self._failing[id(source)] + 1
        if n == 1:
            log.warning("source %s unavailable: %s", source.name, exc.message)
        if n != self.stall_ticks:
            return []
        message = f"{source.name}: no reading for {n} ticks: {exc.message}"
        return [
            Event(
                node=self.node,
                ts=now,
                kind=EventKind.TELEMETRY_STALLED,
                message=message[:2000],
                source=source.name[:64],
            )
        ]

    def run(self, *, duration_s: float | None = None, max_ticks: int | None = None) -> None:
        """Sample until :meth:`stop`, ``duration_s`` seconds or ``max_ticks`` ticks."""
        self.pusher.start()
        start = self.clock()
        k = 0
        try:
            while not self._stop.is_set():
                due = start + k * self.interval_s
                delay = due - self.clock()
                if delay > 0 and self._stop.wait(delay):
                    break
                behind = self.clock() - due
                if behind > self.interval_s:  # fell behind: skip, realign, never burst
                    missed = int(behind // self.interval_s)
                    self.stats.skipped_ticks += missed
                    k += missed
                    log.warning("sampling %.1f s late: skipped %d tick(s)", behind, missed)
                self.tick()
                k += 1
                if max_ticks is not None and self.stats.ticks >= max_ticks:
                    break
                if duration_s is not None and self.clock() - start >= duration_s:
                    break
        finally:
            self.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is buffered (spooling what cannot be sent) and release the sources."""
        self.pusher.close(timeout_s)
        for source in self.sources:
            try:
                source.close()
            except Exception:  # closing must not hide the reason we stop
                log.exception("closing source %s", source.name)

    def describe(self) -> dict[str, Any]:
        s = self.pusher.stats
        return {
            "ticks": self.stats.ticks,
            "skipped_ticks": self.stats.skipped_ticks,
            "readings": self.stats.readings,
            "sent_total": s.sent_total,
            "spooled": s.spooled,
            "dropped_total": s.dropped_total,
        }
