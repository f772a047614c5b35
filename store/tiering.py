"""The tiering task: roll closed hours up and pack them, archive hours that left the raw
window, combine archived days' minutes into hours, drop what has left every tier. What it
keeps, and how reads use it, is :mod:`store.tiers` (and :mod:`store.blocks` for the packed
hours).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from store import partitions, reads
from store.blocks import block_rows
from store.failures import failure_records
from store.history import History
from store.rawread import samples_between
from store.rollups import (
    HOUR_MS,
    MINUTE_MS,
    STAT_COLUMNS,
    coarsen,
    newest_known,
    pack,
    rollup,
    unpack,
)
from store.tiers import (
    ARCHIVED_MARK,
    HOURLY_MARK,
    MINUTES_MARK,
    ROLLED_MARK,
    SPAN_MS,
    TierPolicy,
    TierReport,
    had_precursors,
    hourly_until,
    minutes_since,
    oldest_hour,
    predecessors,
    raw_since,
    rolled_until,
    set_mark,
    take_late_hours,
)

__all__ = ["maintain", "prepare_sqlite", "roll_span"]

_T = TypeVar("_T")

log = logging.getLogger("forewarn.store.tiering")


def prepare_sqlite(engine: Engine) -> None:
    """Switch an existing SQLite file to incremental auto-vacuum (one full VACUUM, once)."""
    if engine.dialect.name != "sqlite":
        return
    with engine.connect() as connection:
        mode = connection.exec_driver_sql("PRAGMA auto_vacuum").scalar()
        if mode == 2:
            return
    raw = engine.raw_connection()
    try:
        raw.isolation_level = None  # type: ignore[attr-defined]
        raw.execute("PRAGMA auto_vacuum = INCREMENTAL")  # type: ignore[attr-defined]
        raw.execute("VACUUM")  # type: ignore[attr-defined]
    finally:
        raw.close()


LOCK_TIMEOUT_MS = 1000
"""How long the task's DDL waits for a table's lock on PostgreSQL (see :func:`_guard`)."""
IDLE_TIMEOUT_MS = 10_000
"""How long the server lets one of the task's transactions sit idle (its process stopped)."""
_LOCK_NOT_AVAILABLE = "55P03"


def _guard(c: Connection) -> None:
    """PostgreSQL: bound how long this transaction's DDL waits for its locks.

    Creating or dropping a partition locks its parent whole, and while such a lock is waited
    for, every writer and reader that comes after waits behind it: a long read of ``samples``
    would stall ingest for as long as it ran. So the task waits :data:`LOCK_TIMEOUT_MS` at
    most, then gives up what it was doing (an hour is packed at its next try, partitions ahead
    at the next pass), and the server ends the transaction should the task's process stop
    half-way through it (``SIGSTOP``), rather than every writer waiting on it.
    """
    if c.dialect.name == "postgresql":
        c.execute(text(f"SET LOCAL lock_timeout = {int(LOCK_TIMEOUT_MS)}"))
        c.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {IDLE_TIMEOUT_MS}"))


def _busy(exc: OperationalError) -> bool:
    """Whether ``exc`` is a lock :func:`_guard` gave up waiting for."""
    return getattr(exc.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE


def maintain(engine: Engine, policy: TierPolicy, *, now_ms: int) -> TierReport:
    """One pass of the tiering task (see the module docstring); safe to repeat."""
    report = TierReport()
    prepare_sqlite(engine)
    raw_cutoff = now_ms - int(policy.raw_window_s * 1000)
    roll_cutoff = now_ms - int(policy.rollup_lag_s * 1000)
    try:
        with engine.begin() as c:
            # Partitions around now and ahead, not for hours packed already; an older hour
            # gets its partitions when it is rolled (rows of a store that was down wait in the
            # default partition till then).
            _guard(c)
            low = max(now_ms - 2 * SPAN_MS, rolled_until(c) or 0)
            created = partitions.ensure(
                c, "samples", start_ms=low, end_ms=now_ms + int(policy.ahead_s * 1000)
            )
            created += partitions.ensure(
                c,
                "sample_rollups",
                start_ms=now_ms - partitions.DAY_MS,
                end_ms=now_ms + 2 * partitions.DAY_MS,
            )
            # The week of the days about to be combined into hours, and the next: the day's
            # own transaction then runs no DDL, which would hold off every read of the tier.
            created += partitions.ensure(
                c,
                "hourly_rollups",
                start_ms=now_ms - 3 * partitions.DAY_MS,
                end_ms=now_ms + partitions.WEEK_MS,
            )
        report.partitions_created += created
    except OperationalError as exc:
        if not _busy(exc):
            raise
        log.info("partitions ahead: the tables stayed busy; the next pass creates them")
    with engine.begin() as c:
        rolled, archived = rolled_until(c), raw_since(c)
        if rolled is None or archived is None:
            oldest = oldest_hour(c)
            rolled = oldest if rolled is None else rolled
            archived = oldest if archived is None else archived
    history = History(policy.history_url) if policy.history_url else None

    # Closed hours: rolled up at once (provisional until archived).
    while rolled is not None and rolled + SPAN_MS <= roll_cutoff:
        if report.hours_rolled >= policy.max_hours_per_run:
            break
        skipped = _skip_empty(engine, ROLLED_MARK, rolled, roll_cutoff)
        if skipped != rolled:
            rolled = skipped
            continue
        _, chunks, _, packed = _roll_hour(engine, rolled, policy, None, mark=ROLLED_MARK, pack=True)
        report.hours_rolled += 1
        report.hours_packed += packed
        report.chunks_written += chunks
        rolled += SPAN_MS

    # Rolled hours that rows reached since (a spool replayed): rolled up again now, not at
    # their archiving a day later.
    if rolled is not None and archived is not None:
        with engine.begin() as c:
            late = take_late_hours(
                c, since_ms=archived, until_ms=rolled, limit=policy.max_hours_per_run
            )
        for hour in late:
            _roll_hour(engine, hour, policy, None, mark=None, pack=True)
            report.hours_rerolled += 1

    # Hours that left the raw window: archived, rolled up again with late rows, then dropped.
    wrote_history = False
    limit = raw_cutoff if rolled is None else min(raw_cutoff, rolled)
    while archived is not None and archived + SPAN_MS <= limit:
        if report.hours_archived >= policy.max_hours_per_run:
            break
        skipped = _skip_empty(engine, ARCHIVED_MARK, archived, limit)
        if skipped != archived:
            archived = skipped
            continue
        rows, chunks, written, _ = _roll_hour(engine, archived, policy, history, mark=ARCHIVED_MARK)
        report.hours_archived += 1
        report.samples_rolled += rows
        report.history_rows += written
        wrote_history = wrote_history or written > 0
        archived += SPAN_MS

    # Days whose minutes are final (behind the archived mark): combined into hours.
    hourly = _coarsen_days(engine, archived, policy.max_days_per_run, report)

    with engine.begin() as c:
        _guard(c)
        if archived is not None:
            # One archived hour stays raw: its last samples are the next hour's predecessors.
            report.raw_dropped = partitions.drop_before(c, "samples", archived - SPAN_MS)
            report.raw_dropped += partitions.drop_before(c, "sample_blocks", archived - SPAN_MS)
        # Minutes go when their window has passed and their day is in the hourly tier.
        minutes_cutoff = min(now_ms - int(policy.rollup_window_s * 1000), hourly or 0)
        minutes_cutoff = partitions.floor(minutes_cutoff + SPAN_MS - 1, SPAN_MS)
        if minutes_cutoff > (minutes_since(c) or 0):
            report.rollups_dropped = partitions.drop_before(c, "sample_rollups", minutes_cutoff)
            set_mark(c, MINUTES_MARK, minutes_cutoff)
        hourly_cutoff = now_ms - int(policy.hourly_window_s * 1000)
        report.hourly_dropped = partitions.drop_before(c, "hourly_rollups", hourly_cutoff)
        # Events and the registry stay while either rollup tier covers them.
        kept = now_ms - int(max(policy.rollup_window_s, policy.hourly_window_s) * 1000)
        report.events_deleted = int(
            c.execute(text("DELETE FROM events WHERE ts_ms < :c"), {"c": kept}).rowcount
        )
        c.execute(text("DELETE FROM gpus WHERE last_seen_ms < :c"), {"c": kept})
        partitions.vacuum(c)
    if history is not None:
        expired = 0
        if policy.history_window_s is not None:
            expired = history.expire(now_ms - int(policy.history_window_s * 1000))
        if wrote_history or expired:
            _refresh_labels(engine, history)
    return report


def _coarsen_days(
    engine: Engine, archived: int | None, max_days: int, report: TierReport
) -> int | None:
    """Combine the minute rollups of each whole day behind ``archived`` into hours, oldest
    first, at most ``max_days``; returns the hourly mark (None: nothing to combine yet)."""
    with engine.begin() as c:
        mark = hourly_until(c)
        if mark is None:
            oldest = partitions.oldest(c, "sample_rollups")  # a day: its partitions' span
            if oldest is None:
                return None
            mark = oldest
    while archived is not None and mark + partitions.DAY_MS <= archived:
        if report.days_coarsened >= max_days:
            break
        try:
            _coarsen_day(engine, mark)
        except OperationalError as exc:
            if not _busy(exc):
                raise
            log.info("day %d: the hourly table stayed busy; the next pass combines it", mark)
            break
        report.days_coarsened += 1
        mark += partitions.DAY_MS
    return mark


_DAY_CHUNKS = (
    "SELECT node, gpu, start_ms, data FROM sample_rollups "
    "WHERE start_ms >= :a AND start_ms < :b ORDER BY node, gpu, start_ms"
)
_INSERT_HOURLY = (
    "INSERT INTO hourly_rollups (node, gpu, start_ms, end_ms, hours, data) "
    "VALUES (:node, :gpu, :start_ms, :end_ms, :hours, :data)"
)


def _coarsen_day(engine: Engine, day_ms: int) -> None:
    """Write the hourly chunks of the day at ``day_ms`` (replacing any) and move the hourly
    mark past it. The day's minute chunks are read one GPU at a time."""
    end_ms = day_ms + partitions.DAY_MS
    rows: list[dict[str, Any]] = []
    with engine.connect() as c:
        result = c.execution_options(stream_results=True).execute(
            text(_DAY_CHUNKS), {"a": day_ms, "b": end_ms}
        )
        for (node, gpu), chunks in itertools.groupby(result, key=lambda r: (r[0], r[1])):
            times, values = [], []
            for _, _, start, blob in chunks:
                minutes, matrix = unpack(bytes(blob))
                times.append(int(start) + minutes * MINUTE_MS)
                values.append(matrix)
            hour = (np.concatenate(times) - day_ms) // HOUR_MS
            starts = np.flatnonzero(np.r_[True, hour[1:] != hour[:-1]])
            rows.append(
                {
                    "node": node,
                    "gpu": int(gpu),
                    "start_ms": day_ms,
                    "end_ms": end_ms,
                    "hours": len(starts),
                    "data": pack(hour[starts], coarsen(np.concatenate(values), starts)),
                }
            )
    with engine.begin() as c:
        _guard(c)
        partitions.ensure(c, "hourly_rollups", start_ms=day_ms, end_ms=end_ms)
        c.execute(text("DELETE FROM hourly_rollups WHERE start_ms = :d"), {"d": day_ms})
        if rows:
            c.execute(text(_INSERT_HOURLY), rows)
        set_mark(c, HOURLY_MARK, end_ms)


def _skip_empty(engine: Engine, name: str, mark: int, limit: int) -> int:
    """Move mark ``name`` past hours with no sample (up to ``limit``); returns where it is."""
    with engine.begin() as c:
        _guard(c)
        found = oldest_hour(c, after_ms=mark)
        ready = partitions.floor(limit, SPAN_MS)
        nearest = ready if found is None else min(found, ready)
        if nearest > mark:
            set_mark(c, name, nearest)
            return nearest
        hour = {"start_ms": mark, "end_ms": mark + SPAN_MS}
        if name == ROLLED_MARK:  # an archived hour was packed: its wide rows are gone
            partitions.ensure(c, "samples", **hour)
        partitions.ensure(c, "sample_rollups", **hour)
    return mark


def _slices(
    engine: Engine, start: int, end: int, slice_rows: int, counted: list[int] | None = None
) -> Iterator[pd.DataFrame]:
    """The raw rows of ``[start, end)`` in time order, whole minutes at a time (the wide rows
    read are counted into ``counted``)."""
    with engine.connect() as c:
        gpus = max(reads.gpu_count(c), 1)
    step = max(MINUTE_MS, partitions.floor(slice_rows // gpus * 1000, MINUTE_MS))
    at = start
    while at < end:
        upper = min(at + step, end)
        with engine.connect() as c:
            yield samples_between(c, since_ms=at, until_ms=upper, counted=counted)
        at = upper


def _pack_chunks(rolled: pd.DataFrame, start_ms: int, end_ms: int) -> list[dict[str, Any]]:
    if not len(rolled):
        return []
    values = rolled[list(STAT_COLUMNS)].to_numpy(np.float64)
    minutes = (rolled["ts_ms"].to_numpy(np.int64) - start_ms) // MINUTE_MS
    node = rolled["node"].to_numpy()
    gpu = rolled["gpu"].to_numpy(np.int64)
    edges = np.flatnonzero(np.r_[True, (node[1:] != node[:-1]) | (gpu[1:] != gpu[:-1]), True])
    out = []
    for a, b in itertools.pairwise(edges):
        out.append(
            {
                "node": node[a],
                "gpu": int(gpu[a]),
                "start_ms": start_ms,
                "end_ms": end_ms,
                "minutes": int(b - a),
                "data": pack(minutes[a:b], values[a:b]),
            }
        )
    return out


def roll_span(
    engine: Engine,
    start_ms: int,
    end_ms: int,
    *,
    slice_rows: int = 1_000_000,
    counted: list[int] | None = None,
    consume: Callable[[Iterator[pd.DataFrame]], _T] | None = None,
) -> tuple[pd.DataFrame, _T | None]:
    """Roll up the raw rows of ``[start_ms, end_ms)`` (the raw tier's view of a span; the
    wide rows read are counted into ``counted``), a slice at a time: no more than one slice
    of raw rows is held at once (an hour of 16,384 GPUs at 1 s is 59 million samples).

    Args:
        consume: given the raw slices as an iterator, in time order (each is rolled up as it
            passes): what it returns is returned beside the rollups. None: nothing else
            reads them.

    Returns:
        The rollup rows (sorted by node, gpu, ts_ms) and what ``consume`` returned.
    """
    before: pd.DataFrame | None = None
    rolled: list[pd.DataFrame] = []

    def pieces() -> Iterator[pd.DataFrame]:
        nonlocal before
        for piece in _slices(engine, start_ms, end_ms, slice_rows, counted):
            if not len(piece):
                continue
            if before is None:
                with engine.connect() as c:
                    before = predecessors(c, start_ms, following=piece)
            rolled.append(rollup(piece, before=before))
            # The newest sample of every GPU so far is the next slice's predecessor.
            tail = pd.concat([before, piece], ignore_index=True) if len(before) else piece
            before = newest_known(tail)
            yield piece

    result = consume(pieces()) if consume is not None else None
    if consume is None:
        for _ in pieces():
            pass
    if not rolled:
        return rollup(pd.DataFrame(columns=list(reads.FRAME_COLUMNS))), result
    frame = pd.concat(rolled, ignore_index=True)
    frame = frame.sort_values(["node", "gpu", "ts_ms"], kind="stable", ignore_index=True)
    return frame, result


def _packed(pieces: Iterator[pd.DataFrame]) -> list[dict[str, Any]]:
    """The ``sample_blocks`` rows of raw slices."""
    return [row for piece in pieces for row in block_rows(piece)]


def _samples(rolled: pd.DataFrame) -> int:
    """The raw samples an hour's rollup rows summarise."""
    return int(rolled["n"].sum()) if len(rolled) else 0


_UPSERT = (
    "INSERT INTO sample_rollups (node, gpu, start_ms, end_ms, minutes, data) "
    "VALUES (:node, :gpu, :start_ms, :end_ms, :minutes, :data) "
    "ON CONFLICT (node, gpu, start_ms) DO UPDATE SET end_ms = excluded.end_ms, "
    "minutes = excluded.minutes, data = excluded.data"
)


PACK_TRIES = 3
"""Reads of an hour to pack before it is rolled up without packing (rows kept reaching it)."""


class _Moved(Exception):
    """Wide rows reached the hour between its read and its packing."""


def _roll_hour(
    engine: Engine,
    start_ms: int,
    policy: TierPolicy,
    history: History | None,
    *,
    mark: str | None,
    pack: bool = False,
) -> tuple[int, int, int, bool]:
    """Roll one hour up (and archive it when ``history`` is given); move ``mark`` past it
    (None: an hour rolled up again, no mark moves). With ``pack``, the hour's samples are
    packed (:mod:`store.blocks`) and its wide rows dropped in the same transaction, provided
    no wide row reached it since it was read: else it is read again, up to
    :data:`PACK_TRIES` times, and then rolled up with its wide rows kept.

    Returns:
        (raw rows read, chunks written, rows written to the history, whether it was packed)
    """
    end_ms = start_ms + SPAN_MS
    for attempt in range(1, PACK_TRIES + 1 if pack else 1):
        wide: list[int] = []
        rolled, packed = roll_span(
            engine, start_ms, end_ms, slice_rows=policy.slice_rows, counted=wide, consume=_packed
        )
        assert packed is not None
        chunks = _pack_chunks(rolled, start_ms, end_ms)
        try:
            # The blocks' partition first, on its own: the packing transaction then locks
            # ``sample_blocks`` only for its rows, and a read that met the wide rows first
            # finds the blocks readable (no lock cycle with it).
            with engine.begin() as c:
                _guard(c)
                partitions.ensure(c, "sample_blocks", start_ms=start_ms, end_ms=end_ms)
            with engine.begin() as c:
                _store_hour(c, start_ms, chunks, packed, sum(wide), mark)
        except _Moved:
            log.info("hour %d: rows arrived while it was packed (try %d)", start_ms, attempt)
            continue
        except OperationalError as exc:
            if not _busy(exc):
                raise
            log.info("hour %d: its partition stayed busy (try %d)", start_ms, attempt)
            continue
        log.debug("%s: %d samples in %d blocks from %d", mark, sum(wide), len(packed), start_ms)
        return _samples(rolled), len(chunks), 0, True
    rolled, written = roll_span(
        engine,
        start_ms,
        end_ms,
        slice_rows=policy.slice_rows,
        consume=None if history is None else lambda pieces: history.write_part(start_ms, pieces),
    )
    rows, archived = _samples(rolled), written or 0
    chunks = _pack_chunks(rolled, start_ms, end_ms)
    with engine.begin() as c:
        _store_hour(c, start_ms, chunks, None, 0, mark)
    log.debug("%s: %d samples of %d GPUs from %d", mark, rows, len(chunks), start_ms)
    return rows, len(chunks), archived, False


def _store_hour(
    c: Connection,
    start_ms: int,
    chunks: list[dict[str, Any]],
    packed: list[dict[str, Any]] | None,
    wide_read: int,
    mark: str | None,
) -> None:
    """Write an hour's rollup chunks and, unless ``packed`` is None, replace its blocks with
    ``packed`` and drop its wide rows (raising :class:`_Moved` when they are no longer the
    ``wide_read`` rows read); then move ``mark`` past it."""
    end_ms = start_ms + SPAN_MS
    _guard(c)
    if chunks:
        c.execute(text(_UPSERT), chunks)
    if packed is not None:
        hour = {"a": start_ms, "b": end_ms}
        c.execute(text("DELETE FROM sample_blocks WHERE start_ms >= :a AND start_ms < :b"), hour)
        if packed:
            c.execute(text(_INSERT_BLOCK), packed)
        if _drop_wide(c, start_ms) != wide_read:
            raise _Moved
    if mark is not None:
        set_mark(c, mark, end_ms)


_INSERT_BLOCK = (
    "INSERT INTO sample_blocks (node, gpu, start_ms, n, data) "
    "VALUES (:node, :gpu, :start_ms, :n, :data)"
)


def _drop_wide(c: Connection, start_ms: int) -> int:
    """Remove the hour's wide rows; returns how many there were.

    SQLite deletes them (the write lock, taken by the transaction's first write, keeps the
    writer out until commit). PostgreSQL locks the hour's partition and the default one
    against writers (readers go on), counts, and drops the partition whole: no row deletes,
    no dead tuples. A writer that meets the lock waits for the commit; one whose row was
    routed to the partition just dropped fails its batch, which its collector sends again.
    """
    hour = {"a": start_ms, "b": start_ms + SPAN_MS}
    where = "ts_ms >= :a AND ts_ms < :b"
    if c.dialect.name != "postgresql":
        return int(c.execute(text(f"DELETE FROM samples WHERE {where}"), hour).rowcount)
    name = partitions.partition_name("samples", start_ms)
    attached = any(p.table == name for p in partitions.existing(c, "samples"))
    if attached:
        c.execute(text(f"LOCK TABLE {name} IN SHARE MODE"))
    c.execute(text("LOCK TABLE samples_default IN SHARE MODE"))
    count = int(c.execute(text(f"SELECT count(*) FROM samples WHERE {where}"), hour).scalar_one())
    if attached:
        c.execute(text(f"DROP TABLE {name}"))
    c.execute(text(f"DELETE FROM samples_default WHERE {where}"), hour)
    return count


def _refresh_labels(engine: Engine, history: History) -> None:
    with engine.connect() as c:
        events = pd.DataFrame(reads.read_events(c, limit=10_000_000))
        gpus = pd.DataFrame(
            c.execute(text("SELECT node, gpu, uuid FROM gpus ORDER BY node, gpu")).all(),
            columns=["node", "gpu", "uuid"],
        )
        records = failure_records(c, since_ms=0, until_ms=2**62)
    columns = ["ts_ms", "node", "gpu", "kind", "xid", "message", "source"]
    events = events[columns] if len(events) else pd.DataFrame(columns=columns)
    events = events.sort_values(["ts_ms", "node"], kind="stable", ignore_index=True)

    def precursors(node: str, gpu: int, ts_ms: int) -> bool:
        with engine.connect() as c:
            return had_precursors(c, node=node, gpu=gpu, ts_ms=ts_ms)

    history.write_labels(events, gpus, precursors, records=records)
