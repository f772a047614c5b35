"""The tiering task: roll closed hours up, archive hours that left the raw window, drop what
has left every tier. What it keeps, and how reads use it, is :mod:`store.tiers`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text

from store import partitions, reads
from store.failures import failure_records
from store.history import History
from store.rawread import samples_between
from store.rollups import MINUTE_MS, STAT_COLUMNS, pack, rollup
from store.tiers import (
    ARCHIVED_MARK,
    ROLLED_MARK,
    SPAN_MS,
    TierPolicy,
    TierReport,
    had_precursors,
    oldest_hour,
    predecessors,
    raw_since,
    rolled_until,
    set_mark,
    take_late_hours,
)

__all__ = ["maintain", "prepare_sqlite", "roll_span"]

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


def maintain(engine: Engine, policy: TierPolicy, *, now_ms: int) -> TierReport:
    """One pass of the tiering task (see the module docstring); safe to repeat."""
    report = TierReport()
    prepare_sqlite(engine)
    raw_cutoff = now_ms - int(policy.raw_window_s * 1000)
    roll_cutoff = now_ms - int(policy.rollup_lag_s * 1000)
    with engine.begin() as c:
        # Partitions around now and ahead; an older hour gets its partitions when it is
        # rolled (rows of a store that was down wait in the default partition till then).
        report.partitions_created += partitions.ensure(
            c, "samples", start_ms=now_ms - 2 * SPAN_MS, end_ms=now_ms + int(policy.ahead_s * 1000)
        )
        report.partitions_created += partitions.ensure(
            c,
            "sample_rollups",
            start_ms=now_ms - partitions.DAY_MS,
            end_ms=now_ms + 2 * partitions.DAY_MS,
        )
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
        rows, chunks, _ = _roll_hour(engine, rolled, policy, None, mark=ROLLED_MARK)
        report.hours_rolled += 1
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
            _roll_hour(engine, hour, policy, None, mark=None)
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
        rows, chunks, written = _roll_hour(engine, archived, policy, history, mark=ARCHIVED_MARK)
        report.hours_archived += 1
        report.samples_rolled += rows
        report.history_rows += written
        wrote_history = wrote_history or written > 0
        archived += SPAN_MS

    with engine.begin() as c:
        if archived is not None:
            # One archived hour stays raw: its last samples are the next hour's predecessors.
            report.raw_dropped = partitions.drop_before(c, "samples", archived - SPAN_MS)
        rollup_cutoff = now_ms - int(policy.rollup_window_s * 1000)
        report.rollups_dropped = partitions.drop_before(c, "sample_rollups", rollup_cutoff)
        report.events_deleted = int(
            c.execute(text("DELETE FROM events WHERE ts_ms < :c"), {"c": rollup_cutoff}).rowcount
        )
        c.execute(text("DELETE FROM gpus WHERE last_seen_ms < :c"), {"c": rollup_cutoff})
        partitions.vacuum(c)
    if history is not None:
        expired = 0
        if policy.history_window_s is not None:
            expired = history.expire(now_ms - int(policy.history_window_s * 1000))
        if wrote_history or expired:
            _refresh_labels(engine, history)
    return report


def _skip_empty(engine: Engine, name: str, mark: int, limit: int) -> int:
    """Move mark ``name`` past hours with no sample (up to ``limit``); returns where it is."""
    with engine.begin() as c:
        found = oldest_hour(c, after_ms=mark)
        ready = partitions.floor(limit, SPAN_MS)
        nearest = ready if found is None else min(found, ready)
        if nearest > mark:
            set_mark(c, name, nearest)
            return nearest
        hour = {"start_ms": mark, "end_ms": mark + SPAN_MS}
        partitions.ensure(c, "samples", **hour)
        partitions.ensure(c, "sample_rollups", **hour)
    return mark


def _slices(engine: Engine, start: int, end: int, slice_rows: int) -> Iterator[pd.DataFrame]:
    """The raw rows of ``[start, end)`` in time order, a few minutes at a time."""
    with engine.connect() as c:
        gpus = max(reads.gpu_count(c), 1)
    step = max(MINUTE_MS, partitions.floor(slice_rows // gpus * 1000, MINUTE_MS))
    at = start
    while at < end:
        upper = min(at + step, end)
        with engine.connect() as c:
            yield samples_between(c, since_ms=at, until_ms=upper)
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
    engine: Engine, start_ms: int, end_ms: int, *, slice_rows: int = 1_000_000
) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
    """Roll up the raw rows of ``[start_ms, end_ms)`` (the raw tier's view of a span).

    Returns:
        The rollup rows (sorted by node, gpu, ts_ms) and the raw slices read, in time order.
    """
    with engine.connect() as c:
        before = predecessors(c, start_ms)
    rolled: list[pd.DataFrame] = []
    raw: list[pd.DataFrame] = []
    for piece in _slices(engine, start_ms, end_ms, slice_rows):
        if not len(piece):
            continue
        rolled.append(rollup(piece, before=before))
        raw.append(piece)
        # The newest sample of every GPU so far is the next slice's predecessor.
        tail = pd.concat([before, piece], ignore_index=True) if len(before) else piece
        before = tail.sort_values("ts_ms", kind="stable").drop_duplicates(
            ["node", "gpu"], keep="last"
        )
    if not rolled:
        return rollup(pd.DataFrame(columns=list(reads.FRAME_COLUMNS))), raw
    frame = pd.concat(rolled, ignore_index=True)
    return frame.sort_values(["node", "gpu", "ts_ms"], kind="stable", ignore_index=True), raw


_UPSERT = (
    "INSERT INTO sample_rollups (node, gpu, start_ms, end_ms, minutes, data) "
    "VALUES (:node, :gpu, :start_ms, :end_ms, :minutes, :data) "
    "ON CONFLICT (node, gpu, start_ms) DO UPDATE SET end_ms = excluded.end_ms, "
    "minutes = excluded.minutes, data = excluded.data"
)


def _roll_hour(
    engine: Engine,
    start_ms: int,
    policy: TierPolicy,
    history: History | None,
    *,
    mark: str | None,
) -> tuple[int, int, int]:
    """Roll one hour up (and archive it when ``history`` is given); move ``mark`` past it
    (None: an hour rolled up again, no mark moves).

    Returns:
        (raw rows read, chunks written, rows written to the history)
    """
    end_ms = start_ms + SPAN_MS
    rolled, raw = roll_span(engine, start_ms, end_ms, slice_rows=policy.slice_rows)
    rows = sum(len(r) for r in raw)
    archived = history.write_part(start_ms, iter(raw)) if history is not None and rows else 0
    chunks = _pack_chunks(rolled, start_ms, end_ms)
    with engine.begin() as c:
        if chunks:
            c.execute(text(_UPSERT), chunks)
        if mark is not None:
            set_mark(c, mark, end_ms)
    log.debug("%s: %d samples of %d GPUs from %d", mark, rows, len(chunks), start_ms)
    return rows, len(chunks), archived


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
