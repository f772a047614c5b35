"""Storage tiers: raw samples for a short window, per-minute rollups beyond it, events whole.

The tiering task (:func:`maintain`, run by the service every few minutes) walks time an hour
at a time. Once an hour has left the raw window (default 24 h) it

1. rolls the hour's raw samples up per GPU and minute (:mod:`store.rollups`) and stores one
   packed chunk per GPU in ``sample_rollups``,
2. writes the hour to the Parquet history (:mod:`store.history`), when one is configured,
3. moves the mark ``rolled_until_ms`` (in the same transaction as the chunks),

and then drops the raw partitions behind the mark (keeping one hour, whose last samples are
the counters' predecessors for the next roll-up), rollups older than the rollup window
(default 90 days, a whole daily partition at a time) and events as old. Each step is
idempotent: a task killed half-way redoes its hour.

Reads choose the tier by the window asked (:func:`gpu_series`): a window that starts at or
after the mark is served raw; one reaching further back is served per minute — the stored
chunks before the mark and the raw rows after it, rolled up on the fly by the same code, so
the same window reads the same before and after its hours move tiers.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    text,
)

from store import partitions, reads
from store.history import History
from store.rollups import MINUTE_MS, STAT_COLUMNS, pack, representative, rollup, unpack
from store.schema import metadata

__all__ = [
    "Resolution",
    "TierPolicy",
    "TierReport",
    "gpu_series",
    "maintain",
    "rolled_until",
    "sample_rollups",
    "tier_marks",
    "tiered_window",
]

log = logging.getLogger("forewarn.store.tiers")

Resolution = Literal["raw", "1m"]

SPAN_MS = partitions.LAYOUT["samples"][1]
_MARK = "rolled_until_ms"

sample_rollups = Table(
    "sample_rollups",
    metadata,
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger, nullable=False),
    Column("start_ms", BigInteger, nullable=False),
    Column("end_ms", BigInteger, nullable=False),
    Column("minutes", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
    PrimaryKeyConstraint("node", "gpu", "start_ms", name="pk_sample_rollups"),
)
"""One packed chunk of per-minute rollups per GPU and hour (see :mod:`store.rollups`)."""

tier_marks = Table(
    "tier_marks",
    metadata,
    Column("name", String(64), nullable=False),
    Column("value_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("name", name="pk_tier_marks"),
)
"""How far the tiering task got (``rolled_until_ms``)."""


@dataclass(frozen=True)
class TierPolicy:
    """How long each tier keeps data.

    Args:
        raw_window_s: raw samples are kept this long (then rolled up and dropped).
        rollup_window_s: per-minute rollups and events are kept this long.
        history_url: where closed raw hours are written as Parquet; None: nowhere.
        history_window_s: Parquet parts are kept this long; None: forever.
        ahead_s: partitions are created this far ahead of now.
        max_hours_per_run: an idle store catching up rolls at most this many hours per run.
        slice_rows: a roll-up reads at most about this many rows at once.
    """

    raw_window_s: float = 24 * 3600.0
    rollup_window_s: float = 90 * 86400.0
    history_url: str | None = None
    history_window_s: float | None = 30 * 86400.0
    ahead_s: float = 6 * 3600.0
    max_hours_per_run: int = 24
    slice_rows: int = 1_000_000


@dataclass
class TierReport:
    """What one :func:`maintain` run did."""

    hours_rolled: int = 0
    samples_rolled: int = 0
    chunks_written: int = 0
    history_rows: int = 0
    raw_dropped: int = 0
    rollups_dropped: int = 0
    events_deleted: int = 0
    partitions_created: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.hours_rolled
            or self.raw_dropped
            or self.rollups_dropped
            or self.events_deleted
            or self.partitions_created
        )


# Marks -------------------------------------------------------------------------------------


def rolled_until(connection: Connection) -> int | None:
    """Everything before this time is in the rollup tier; None: nothing rolled yet."""
    row = connection.execute(
        text("SELECT value_ms FROM tier_marks WHERE name = :n"), {"n": _MARK}
    ).first()
    return None if row is None else int(row[0])


def _set_mark(connection: Connection, value_ms: int) -> None:
    updated = connection.execute(
        text("UPDATE tier_marks SET value_ms = :v WHERE name = :n"), {"v": value_ms, "n": _MARK}
    )
    if not updated.rowcount:
        connection.execute(
            text("INSERT INTO tier_marks (name, value_ms) VALUES (:n, :v)"),
            {"v": value_ms, "n": _MARK},
        )


def _oldest_hour(connection: Connection, after_ms: int | None = None) -> int | None:
    """The first hour (at or after ``after_ms``) that holds a raw sample; None: none does."""
    after = -(2**62) if after_ms is None else after_ms
    if connection.dialect.name == "postgresql":
        # The default partition holds few rows; then probe partitions oldest first: no scan
        # for a minimum over the whole table.
        stray = connection.execute(
            text("SELECT MIN(ts_ms) FROM samples_default WHERE ts_ms >= :a"), {"a": after}
        ).scalar()
        for part in partitions.existing(connection, "samples"):
            if part.end_ms <= after:
                continue
            if stray is not None and stray < part.end_ms:
                break
            probe = f"SELECT 1 FROM {part.table} WHERE ts_ms >= :a LIMIT 1"
            if connection.execute(text(probe), {"a": after}).first():
                return max(part.start_ms, partitions.floor(after, SPAN_MS))
        return None if stray is None else partitions.floor(int(stray), SPAN_MS)
    low = connection.execute(
        text("SELECT MIN(ts_ms) FROM samples WHERE ts_ms >= :a"), {"a": after}
    ).scalar()
    return None if low is None else partitions.floor(int(low), SPAN_MS)


# Maintenance -------------------------------------------------------------------------------


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
    with engine.begin() as c:
        mark = rolled_until(c)
        if mark is None:
            mark = _oldest_hour(c)
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
    history = History(policy.history_url) if policy.history_url else None
    wrote_history = False
    while (
        mark is not None
        and mark + SPAN_MS <= raw_cutoff
        and report.hours_rolled < policy.max_hours_per_run
    ):
        with engine.begin() as c:
            # Hours with no sample are skipped, not rolled one by one.
            found = _oldest_hour(c, after_ms=mark)
            ready = partitions.floor(raw_cutoff, SPAN_MS)
            nearest = ready if found is None else min(found, ready)
            if nearest > mark:
                mark = nearest
                _set_mark(c, mark)
                continue
            hour = {"start_ms": mark, "end_ms": mark + SPAN_MS}
            report.partitions_created += partitions.ensure(c, "samples", **hour)
            report.partitions_created += partitions.ensure(c, "sample_rollups", **hour)
        rows, chunks, archived = _roll_hour(engine, mark, policy, history)
        report.hours_rolled += 1
        report.samples_rolled += rows
        report.chunks_written += chunks
        report.history_rows += archived
        wrote_history = wrote_history or archived > 0
        mark += SPAN_MS
    with engine.begin() as c:
        if mark is not None:
            # One rolled hour stays raw: its last samples are the next hour's predecessors.
            report.raw_dropped = partitions.drop_before(c, "samples", mark - SPAN_MS)
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


def _slices(engine: Engine, start: int, end: int, slice_rows: int) -> Iterator[pd.DataFrame]:
    """The raw rows of ``[start, end)`` in time order, a few minutes at a time."""
    with engine.connect() as c:
        gpus = max(reads.gpu_count(c), 1)
    step = max(MINUTE_MS, partitions.floor(slice_rows // gpus * 1000, MINUTE_MS))
    at = start
    while at < end:
        upper = min(at + step, end)
        with engine.connect() as c:
            yield reads.fleet_window(c, since_ms=at, until_ms=upper)
        at = upper


def _predecessors(connection: Connection, start_ms: int) -> pd.DataFrame:
    """Each GPU's last raw sample in the hour before ``start_ms`` (counters only matter)."""
    lookback = {"a": start_ms - SPAN_MS, "b": start_ms}
    cols = ", ".join(f"s.{c}" for c in reads.FRAME_COLUMNS)
    sql = (
        f"SELECT {cols} FROM samples s JOIN (SELECT node, gpu, MAX(ts_ms) AS newest "
        "FROM samples WHERE ts_ms >= :a AND ts_ms < :b GROUP BY node, gpu) last "
        "ON s.node = last.node AND s.gpu = last.gpu AND s.ts_ms = last.newest"
    )
    rows = connection.execute(text(sql), lookback).all()
    return reads._frame(rows, list(reads.FRAME_COLUMNS))


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
        before = _predecessors(c, start_ms)
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


def _roll_hour(
    engine: Engine, start_ms: int, policy: TierPolicy, history: History | None
) -> tuple[int, int, int]:
    end_ms = start_ms + SPAN_MS
    rolled, raw = roll_span(engine, start_ms, end_ms, slice_rows=policy.slice_rows)
    rows = sum(len(r) for r in raw)
    archived = history.write_part(start_ms, iter(raw)) if history is not None and rows else 0
    chunks = _pack_chunks(rolled, start_ms, end_ms)
    with engine.begin() as c:
        if c.dialect.name == "postgresql":
            statement = (
                "INSERT INTO sample_rollups (node, gpu, start_ms, end_ms, minutes, data) "
                "VALUES (:node, :gpu, :start_ms, :end_ms, :minutes, :data) "
                "ON CONFLICT DO NOTHING"
            )
        else:
            statement = (
                "INSERT OR IGNORE INTO sample_rollups (node, gpu, start_ms, end_ms, minutes, "
                "data) VALUES (:node, :gpu, :start_ms, :end_ms, :minutes, :data)"
            )
        if chunks:
            c.execute(text(statement), chunks)
        _set_mark(c, end_ms)
    log.info("rolled %d samples of %d GPUs up from %d", rows, len(chunks), start_ms)
    return rows, len(chunks), archived


def _refresh_labels(engine: Engine, history: History) -> None:
    with engine.connect() as c:
        events = pd.DataFrame(reads.read_events(c, limit=10_000_000))
        gpus = pd.DataFrame(
            c.execute(text("SELECT node, gpu, uuid FROM gpus ORDER BY node, gpu")).all(),
            columns=["node", "gpu", "uuid"],
        )
    columns = ["ts_ms", "node", "gpu", "kind", "xid", "message", "source"]
    events = events[columns] if len(events) else pd.DataFrame(columns=columns)
    events = events.sort_values(["ts_ms", "node"], kind="stable", ignore_index=True)
    history.write_labels(events, gpus)


# Reads -------------------------------------------------------------------------------------


def _chunks(
    connection: Connection, *, since_ms: int, until_ms: int, node: str | None, gpu: int | None
) -> pd.DataFrame:
    """Stored rollup rows with ``since_ms <= ts_ms < until_ms`` (sorted by node, gpu, ts)."""
    sql = (
        "SELECT node, gpu, start_ms, data FROM sample_rollups "
        "WHERE start_ms >= :lo AND start_ms < :hi"
    )
    params: dict[str, Any] = {"lo": since_ms - SPAN_MS, "hi": until_ms}
    if node is not None:
        sql += " AND node = :node"
        params["node"] = node
    if gpu is not None:
        sql += " AND gpu = :gpu"
        params["gpu"] = gpu
    sql += " ORDER BY node, gpu, start_ms"
    parts = []
    for n, g, start, blob in connection.execute(text(sql), params):
        minutes, values = unpack(bytes(blob))
        ts = start + minutes * MINUTE_MS
        keep = (ts >= since_ms) & (ts < until_ms)
        if not keep.any():
            continue
        part = pd.DataFrame(values[keep], columns=list(STAT_COLUMNS))
        part.insert(0, "gpu", int(g))
        part.insert(0, "node", n)
        part.insert(0, "ts_ms", ts[keep])
        parts.append(part)
    if not parts:
        return pd.DataFrame(columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])
    return pd.concat(parts, ignore_index=True)


def _minutes(
    engine_or_connection: Connection,
    *,
    since_ms: int,
    until_ms: int,
    node: str | None = None,
    gpu: int | None = None,
) -> pd.DataFrame:
    """Per-minute rows of ``[since_ms, until_ms)``: stored chunks before the mark, raw rows
    rolled up on the fly after it."""
    c = engine_or_connection
    since_ms = partitions.floor(since_ms, MINUTE_MS)
    mark = rolled_until(c)
    boundary = since_ms if mark is None else min(max(mark, since_ms), until_ms)
    parts = []
    if boundary > since_ms:
        parts.append(_chunks(c, since_ms=since_ms, until_ms=boundary, node=node, gpu=gpu))
    if boundary < until_ms:
        if node is not None and gpu is not None:
            raw = reads.gpu_window(c, node=node, gpu=gpu, since_ms=boundary, until_ms=until_ms)
            before = reads.gpu_window(
                c, node=node, gpu=gpu, since_ms=boundary - SPAN_MS, until_ms=boundary
            ).tail(1)
        else:
            raw = reads.fleet_window(c, since_ms=boundary, until_ms=until_ms)
            before = _predecessors(c, boundary)
            if node is not None:
                raw, before = raw[raw["node"] == node], before[before["node"] == node]
        parts.append(rollup(raw, before=before))
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])
    frame = pd.concat(parts, ignore_index=True)
    return frame.sort_values(["ts_ms", "node", "gpu"], kind="stable", ignore_index=True)


def gpu_series(
    connection: Connection,
    *,
    node: str,
    gpu: int,
    since_ms: int,
    until_ms: int,
    fields: Sequence[str] | None = None,
    limit: int | None = None,
    resolution: Resolution | None = None,
) -> tuple[pd.DataFrame, Resolution]:
    """One GPU's window at the resolution its tiers hold.

    Args:
        resolution: ``raw`` or ``1m``; None chooses: raw when the window starts at or after
            the raw tier's start (:func:`rolled_until`), per minute otherwise.

    Returns:
        The frame and its resolution. Raw: :func:`store.reads.gpu_window`'s frame. Per
        minute: ``ts_ms`` (the minute's start), ``node``, ``gpu``, each field as its minute's
        mean (gauges) or last value (counters, flags, bitmask, link state), then the
        field's rollup stats (``<field>_min``, ``_max``, ``_mean``, ``_last``; counters
        ``<field>_delta``, ``_last``) and ``n``, the samples the minute held.
    """
    if resolution is None:
        mark = rolled_until(connection)
        resolution = "raw" if mark is None or since_ms >= mark else "1m"
    if resolution == "raw":
        frame = reads.gpu_window(
            connection,
            node=node,
            gpu=gpu,
            since_ms=since_ms,
            until_ms=until_ms,
            fields=fields,
            limit=limit,
        )
        return frame, "raw"
    wanted = [c for c in reads._columns(fields) if c not in ("ts_ms", "node", "gpu")]
    wanted = [c for c in wanted if c not in ("uuid", "vendor")]
    rolled = _minutes(connection, since_ms=since_ms, until_ms=until_ms, node=node, gpu=gpu)
    out = representative(rolled, wanted)
    stats = [s for s in STAT_COLUMNS if s.rsplit("_", 1)[0] in wanted]
    out = pd.concat([out, rolled[["n", *stats]]], axis=1)
    if limit is not None:
        out = out.head(limit)
    return out.reset_index(drop=True), "1m"


def tiered_window(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int,
    node: str | None = None,
) -> pd.DataFrame:
    """Every GPU's samples in the window from what the tiers hold, in the sample-frame shape
    (:data:`store.reads.FRAME_COLUMNS`): raw rows from the raw tier's start on, and one row a
    minute before it (each field its minute's mean or last value, as :func:`gpu_series`).

    What a scorer warming its windows after a restart reads.
    """
    mark = rolled_until(connection)
    boundary = since_ms if mark is None else min(max(mark, since_ms), until_ms)
    frames = []
    if boundary > since_ms:
        rolled = _chunks(connection, since_ms=since_ms, until_ms=boundary, node=node, gpu=None)
        fields = [c for c in reads.FRAME_COLUMNS if c not in ("ts_ms", "node", "gpu")]
        fields = [c for c in fields if c not in ("uuid", "vendor")]
        shaped = representative(rolled, fields)
        registry = pd.DataFrame(
            connection.execute(text("SELECT node, gpu, uuid, vendor FROM gpus")).all(),
            columns=["node", "gpu", "uuid", "vendor"],
        )
        shaped = shaped.merge(registry, on=["node", "gpu"], how="left")
        columns = list(reads.FRAME_COLUMNS)
        frames.append(reads._frame(list(shaped[columns].itertuples(index=False)), columns))
    if boundary < until_ms:
        raw = reads.fleet_window(connection, since_ms=boundary, until_ms=until_ms)
        if node is not None:
            raw = raw[raw["node"] == node]
        frames.append(raw)
    frames = [f for f in frames if len(f)]
    if not frames:
        return reads._frame([], list(reads.FRAME_COLUMNS))
    frame = pd.concat(frames, ignore_index=True)
    return frame.sort_values(["ts_ms", "node", "gpu"], kind="stable", ignore_index=True)
