"""Storage tiers: raw samples for a short window, per-minute rollups beyond it, events whole.

The tiering task (:mod:`store.tiering`, run by the service every few minutes) walks time an
hour at a time, behind two marks:

- ``rolled_until_ms``: once an hour has closed (and ``rollup_lag_s`` more passed, for
  stragglers) its raw samples are rolled up per GPU and minute (:mod:`store.rollups`) into one
  packed chunk per GPU in ``sample_rollups``. Minute-resolution reads use the chunks at once.
  In the same transaction the hour's samples are packed, losslessly, one blob per GPU and
  minute in ``sample_blocks`` (:mod:`store.blocks`), and its wide rows dropped.
- ``archived_until_ms``, the start of the raw tier: once an hour has left the raw window
  (default 24 h) it is read once more, written to the Parquet history (:mod:`store.history`)
  when one is configured, and rolled up again with whatever arrived late (a collector's spool
  replayed after an outage), replacing its chunks; then the raw partitions behind the mark
  are dropped (one hour stays: its last samples are the counters' predecessors).

- ``hourly_until_ms``: once a whole UTC day is behind ``archived_until_ms`` (its minutes
  final), its minute rollups are combined per GPU and hour (:func:`store.rollups.coarsen`)
  into one chunk per GPU and day in ``hourly_rollups``.

Minute rollups older than their window (default 30 days; a whole daily partition at a time on
PostgreSQL, and never a day not yet in the hourly tier) go, hourly rollups older than theirs
(default 365 days), and events and the GPU registry when both have. Each step is idempotent: a
killed task redoes its hour or day.

Reads choose the tier by the window asked (:func:`gpu_series`): a window that starts inside
the raw tier is served raw; one reaching further back is served per minute while the minute
tier holds its start, per hour beyond. Each coarser read takes the stored chunks where they
are and makes the rest on the fly from the finer tier by the same code (raw rows rolled up
after ``rolled_until_ms``, minutes combined after ``hourly_until_ms``), so the same window
reads the same before and after its hours move tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    PrimaryKeyConstraint,
    String,
    Table,
    text,
)

from store import partitions, reads
from store.blocks import last_samples
from store.blocks import merge as blocks_merge
from store.rawread import fetch_samples, samples_between
from store.rollups import (
    COUNTER_COLUMNS,
    HOUR_MS,
    MINUTE_MS,
    STAT_COLUMNS,
    coarsen_frame,
    newest_known,
    representative,
    rollup,
    unpack,
)
from store.schema import chunk_table, metadata

__all__ = [
    "ARCHIVED_MARK",
    "HOURLY_MARK",
    "MINUTES_MARK",
    "ROLLED_MARK",
    "Resolution",
    "TierPolicy",
    "TierReport",
    "choose_resolution",
    "gpu_series",
    "had_precursors",
    "hourly_rollups",
    "hourly_until",
    "late_hours",
    "minutes_since",
    "note_late_hours",
    "oldest_hour",
    "predecessors",
    "raw_since",
    "rolled_until",
    "sample_rollups",
    "set_mark",
    "take_late_hours",
    "tier_marks",
    "tiered_window",
]


Resolution = Literal["raw", "1m", "1h"]

SPAN_MS = partitions.LAYOUT["samples"][1]

sample_rollups = chunk_table("sample_rollups", "minutes", end_ms=True, start_index=False)
"""One packed chunk of per-minute rollups per GPU and hour (see :mod:`store.rollups`)."""

hourly_rollups = chunk_table("hourly_rollups", "hours", end_ms=True, start_index=True)
"""One packed chunk of per-hour rollups per GPU and UTC day (the same blobs, hour offsets)."""

tier_marks = Table(
    "tier_marks",
    metadata,
    Column("name", String(64), nullable=False),
    Column("value_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("name", name="pk_tier_marks"),
)
"""How far the tiering task got (``rolled_until_ms``)."""

late_hours = Table(
    "late_hours",
    metadata,
    Column("start_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("start_ms", name="pk_late_hours"),
)
"""Rolled hours that rows reached after their roll-up (a collector's spool replayed): the
writer notes the hour, the next tiering pass rolls it up again (:func:`note_late_hours`)."""


@dataclass(frozen=True)
class TierPolicy:
    """How long each tier keeps data.

    Args:
        raw_window_s: raw samples are kept this long (then rolled up and dropped).
        rollup_window_s: per-minute rollups are kept this long (longer while their day is
            not in the hourly tier yet).
        hourly_window_s: per-hour rollups are kept this long; events and the GPU registry as
            long as the longer of the two.
        history_url: where closed raw hours are written as Parquet; None: nowhere.
        history_window_s: Parquet parts are kept this long; None: forever.
        rollup_lag_s: an hour is rolled up this long after it closed (rows that reach it
            later are noted by the writer and the hour is rolled up again at the next pass).
        ahead_s: partitions are created this far ahead of now.
        max_hours_per_run: an idle store catching up rolls at most this many hours per run.
        max_days_per_run: days of minutes combined into hours per run at most.
        slice_rows: a roll-up reads at most about this many rows at once.
    """

    raw_window_s: float = 24 * 3600.0
    rollup_window_s: float = 30 * 86400.0
    hourly_window_s: float = 365 * 86400.0
    history_url: str | None = None
    history_window_s: float | None = 30 * 86400.0
    rollup_lag_s: float = 600.0
    ahead_s: float = 6 * 3600.0
    max_hours_per_run: int = 24
    max_days_per_run: int = 7
    slice_rows: int = 1_000_000


@dataclass
class TierReport:
    """What one :func:`maintain` run did."""

    hours_rolled: int = 0
    hours_packed: int = 0
    hours_rerolled: int = 0
    hours_archived: int = 0
    samples_rolled: int = 0
    chunks_written: int = 0
    days_coarsened: int = 0
    history_rows: int = 0
    raw_dropped: int = 0
    rollups_dropped: int = 0
    hourly_dropped: int = 0
    events_deleted: int = 0
    partitions_created: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.hours_rolled
            or self.hours_rerolled
            or self.hours_archived
            or self.days_coarsened
            or self.raw_dropped
            or self.rollups_dropped
            or self.hourly_dropped
            or self.events_deleted
            or self.partitions_created
        )


# Marks -------------------------------------------------------------------------------------


ROLLED_MARK = "rolled_until_ms"
ARCHIVED_MARK = "archived_until_ms"
HOURLY_MARK = "hourly_until_ms"
MINUTES_MARK = "minutes_since_ms"


def _mark(connection: Connection, name: str) -> int | None:
    row = connection.execute(
        text("SELECT value_ms FROM tier_marks WHERE name = :n"), {"n": name}
    ).first()
    return None if row is None else int(row[0])


def rolled_until(connection: Connection) -> int | None:
    """Every closed hour before this is in the rollup tier; None: nothing rolled yet."""
    return _mark(connection, ROLLED_MARK)


def raw_since(connection: Connection) -> int | None:
    """The raw tier starts here (what is older was archived); None: nothing archived yet."""
    return _mark(connection, ARCHIVED_MARK)


def hourly_until(connection: Connection) -> int | None:
    """Every day before this is in the hourly tier; None: none is yet."""
    return _mark(connection, HOURLY_MARK)


def minutes_since(connection: Connection) -> int | None:
    """The minute tier holds every minute from here on (what was older went to retention);
    None: retention never trimmed it."""
    return _mark(connection, MINUTES_MARK)


def set_mark(connection: Connection, name: str, value_ms: int) -> None:
    updated = connection.execute(
        text("UPDATE tier_marks SET value_ms = :v WHERE name = :n"), {"v": value_ms, "n": name}
    )
    if not updated.rowcount:
        connection.execute(
            text("INSERT INTO tier_marks (name, value_ms) VALUES (:n, :v)"),
            {"v": value_ms, "n": name},
        )


_NOTE_LATE = {
    "sqlite": (
        "INSERT OR IGNORE INTO late_hours (start_ms) SELECT ? FROM tier_marks "
        f"WHERE name = '{ROLLED_MARK}' AND ? < value_ms"
    ),
    "postgresql": (
        "INSERT INTO late_hours (start_ms) SELECT %s FROM tier_marks "
        f"WHERE name = '{ROLLED_MARK}' AND %s < value_ms ON CONFLICT DO NOTHING"
    ),
}
LATE_SPAN_HOURS = 48
"""A GPU's rows in one batch are checked for late hours this far back from its newest row
(a spool replays a day at most by default; a wild timestamp does not make thousands)."""


def note_late_hours(cursor: Any, dialect: str, spans: Sequence[tuple[int, int]]) -> None:
    """Note in ``late_hours`` each hour that the rows just written reach and that is already
    rolled up, so that the next tiering pass rolls it up again.

    Args:
        cursor: the writer's driver cursor, inside its transaction.
        spans: (first ts_ms, last ts_ms) of each GPU's rows in the batch.
    """
    hours: set[int] = set()
    for first, last in spans:
        top = partitions.floor(int(last), SPAN_MS)
        low = max(partitions.floor(int(first), SPAN_MS), top - LATE_SPAN_HOURS * SPAN_MS)
        hours.update(range(low, top + SPAN_MS, SPAN_MS))
    if hours:
        cursor.executemany(_NOTE_LATE[dialect], [(h, h) for h in sorted(hours)])


def take_late_hours(
    connection: Connection, *, since_ms: int, until_ms: int, limit: int
) -> list[int]:
    """Remove and return the oldest ``limit`` noted late hours in ``[since_ms, until_ms)``;
    forget older ones (archiving rolls those up again anyway). A row that lands while its hour
    is being rolled up again notes the hour anew: it is taken before, never after."""
    connection.execute(text("DELETE FROM late_hours WHERE start_ms < :a"), {"a": since_ms})
    taken = [
        int(h)
        for h in connection.execute(
            text(
                "SELECT start_ms FROM late_hours WHERE start_ms >= :a AND start_ms < :b "
                "ORDER BY start_ms LIMIT :n"
            ),
            {"a": since_ms, "b": until_ms, "n": limit},
        ).scalars()
    ]
    for hour in taken:
        connection.execute(text("DELETE FROM late_hours WHERE start_ms = :h"), {"h": hour})
    return taken


def oldest_hour(connection: Connection, after_ms: int | None = None) -> int | None:
    """The first hour (at or after ``after_ms``) that holds a raw sample, wide or packed;
    None: none does."""
    found = [
        hour
        for hour in (
            partitions.oldest(connection, "sample_blocks", after_ms),
            partitions.oldest(connection, "samples", after_ms),
        )
        if hour is not None
    ]
    return min(found) if found else None


_WARNING_COUNTERS = (
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "remap_correctable",
    "remap_uncorrectable",
    "nvlink_crc_flit",
    "nvlink_crc_data",
    "nvlink_replay",
    "nvlink_recovery",
    "pcie_replay",
)
PRECURSOR_WINDOW_MS = 2 * SPAN_MS
"""How far before a failure :func:`had_precursors` looks."""


def had_precursors(connection: Connection, *, node: str, gpu: int, ts_ms: int) -> bool:
    """Whether a GPU warned in the two hours before ``ts_ms``, by its rollups: an error
    counter grew (ECC, row remaps, NVLink, PCIe replays), a row remap went pending, or its
    temperature climbed by more than 10 °C.

    Read per minute while the minute tier holds the window (the hours not rolled up yet on
    the fly), per hour once it has left it: the whole hours that overlap the window, so an
    older failure's look back spans up to three hours, the failure's own included."""
    since_ms = ts_ms - PRECURSOR_WINDOW_MS
    start = minutes_since(connection)
    read = _minutes if start is None or since_ms >= start else _hours
    rolled = read(connection, since_ms=since_ms, until_ms=ts_ms, node=node, gpu=gpu)
    if not len(rolled):
        return False
    grew = rolled[[f"{c}_delta" for c in _WARNING_COUNTERS]].fillna(0).to_numpy().sum() > 0
    pending = bool((rolled["remap_pending_max"].fillna(0) > 0).any())
    heat = rolled["temp_gpu_c_max"].max() - rolled["temp_gpu_c_min"].min()
    return bool(grew or pending or (heat == heat and heat > 10.0))


def predecessors(
    connection: Connection,
    start_ms: int,
    *,
    node: str | None = None,
    gpu: int | None = None,
    following: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Each GPU's last raw sample in the hour before ``start_ms`` (counters only matter),
    wide or packed.

    Args:
        following: the samples to be rolled up after ``start_ms``: a GPU whose last sample
            lacks a counter that it reports there (the collector failed to read it once) has
            that counter from the newest sample of the hour that holds it.
    """
    params: dict[str, Any] = {"a": start_ms - SPAN_MS, "b": start_ms}
    columns = list(reads.FRAME_COLUMNS)
    if node is not None and gpu is not None:
        sql = (
            f"SELECT {', '.join(columns)} FROM samples WHERE node = :node AND gpu = :gpu "
            "AND ts_ms >= :a AND ts_ms < :b ORDER BY ts_ms DESC LIMIT 1"
        )
        wide = fetch_samples(connection, sql, {**params, "node": node, "gpu": gpu}, columns)
    else:
        sql = (
            f"SELECT {', '.join(f's.{c}' for c in columns)} FROM samples s "
            "JOIN (SELECT node, gpu, MAX(ts_ms) AS newest FROM samples "
            "WHERE ts_ms >= :a AND ts_ms < :b GROUP BY node, gpu) last "
            "ON s.node = last.node AND s.gpu = last.gpu AND s.ts_ms = last.newest"
        )
        wide = fetch_samples(connection, sql, params, columns)
        wide = wide if node is None else wide[wide["node"] == node]
    packed = last_samples(connection, since_ms=params["a"], until_ms=start_ms, node=node, gpu=gpu)
    if len(packed):
        both = blocks_merge(wide, packed)
        wide = both.drop_duplicates(["node", "gpu"], keep="last").reset_index(drop=True)
    if following is None or not len(wide) or not len(following):
        return wide
    counters = list(COUNTER_COLUMNS)
    key = pd.MultiIndex.from_frame(wide[["node", "gpu"]])
    reported = following.groupby(["node", "gpu"])[counters].count().reindex(key).fillna(0) > 0
    lacking = (wide[counters].isna().to_numpy() & reported.to_numpy()).any(axis=1)
    if not lacking.any():
        return wide
    hours = [
        samples_between(connection, since_ms=params["a"], until_ms=start_ms, node=n, gpu=int(g))
        for n, g in wide.loc[lacking, ["node", "gpu"]].itertuples(index=False)
    ]
    found = newest_known(pd.concat(hours, ignore_index=True))
    return pd.concat([wide[~lacking], found], ignore_index=True)


# Reads -------------------------------------------------------------------------------------


_CHUNKS: dict[str, tuple[int, int]] = {
    "sample_rollups": (MINUTE_MS, SPAN_MS),
    "hourly_rollups": (HOUR_MS, partitions.DAY_MS),
}
"""Rollup table -> (the step of its rows, the span of one chunk)."""


def _chunks(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int,
    node: str | None,
    gpu: int | None,
    table: str = "sample_rollups",
) -> pd.DataFrame:
    """Stored rollup rows of ``table`` with ``since_ms <= ts_ms < until_ms`` (sorted by node,
    gpu, ts)."""
    step, span = _CHUNKS[table]
    sql = f"SELECT node, gpu, start_ms, data FROM {table} WHERE start_ms >= :lo AND start_ms < :hi"
    params: dict[str, Any] = {"lo": since_ms - span, "hi": until_ms}
    if node is not None:
        sql += " AND node = :node"
        params["node"] = node
    if gpu is not None:
        sql += " AND gpu = :gpu"
        params["gpu"] = gpu
    sql += " ORDER BY node, gpu, start_ms"
    result = connection.execute(text(sql), params)
    found = result.cursor.fetchall() if result.cursor is not None else []
    result.close()
    ts_parts, value_parts, nodes, gpus = [], [], [], []
    for n, g, start, blob in found:
        offsets, values = unpack(bytes(blob))
        ts = start + offsets * step
        keep = (ts >= since_ms) & (ts < until_ms)
        if not keep.all():
            ts, values = ts[keep], values[keep]
        if not len(ts):
            continue
        ts_parts.append(ts)
        value_parts.append(values)
        nodes.append(np.full(len(ts), n, dtype=object))
        gpus.append(np.full(len(ts), int(g), dtype=np.int64))
    if not ts_parts:
        return pd.DataFrame(columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])
    frame = pd.DataFrame(np.concatenate(value_parts), columns=list(STAT_COLUMNS))
    frame.insert(0, "gpu", np.concatenate(gpus))
    frame.insert(0, "node", np.concatenate(nodes))
    frame.insert(0, "ts_ms", np.concatenate(ts_parts))
    return frame


def _minutes(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int,
    node: str | None = None,
    gpu: int | None = None,
) -> pd.DataFrame:
    """Per-minute rows of ``[since_ms, until_ms)``: stored chunks before the rolled mark, raw
    rows rolled up on the fly after it."""

    def on_the_fly(c: Connection, since_ms: int, until_ms: int) -> pd.DataFrame:
        raw = samples_between(c, since_ms=since_ms, until_ms=until_ms, node=node, gpu=gpu)
        return rollup(raw, before=predecessors(c, since_ms, node=node, gpu=gpu, following=raw))

    mark = rolled_until(connection)
    return _stored_then_fresh(
        connection, "sample_rollups", mark, on_the_fly, since_ms, until_ms, node, gpu
    )


def _hours(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int,
    node: str | None = None,
    gpu: int | None = None,
) -> pd.DataFrame:
    """Per-hour rows of ``[since_ms, until_ms)``: stored chunks before the hourly mark, the
    minutes combined on the fly after it (an hour not over yet: its minutes so far)."""

    def on_the_fly(c: Connection, since_ms: int, until_ms: int) -> pd.DataFrame:
        minutes = _minutes(c, since_ms=since_ms, until_ms=until_ms, node=node, gpu=gpu)
        return coarsen_frame(minutes, HOUR_MS)

    mark = hourly_until(connection)
    return _stored_then_fresh(
        connection, "hourly_rollups", mark, on_the_fly, since_ms, until_ms, node, gpu
    )


def _stored_then_fresh(
    connection: Connection,
    table: str,
    mark: int | None,
    on_the_fly: Callable[[Connection, int, int], pd.DataFrame],
    since_ms: int,
    until_ms: int,
    node: str | None,
    gpu: int | None,
) -> pd.DataFrame:
    """A rolled-up tier's rows of ``[since_ms, until_ms)`` (``since_ms`` floored to its
    step): ``table``'s chunks before ``mark``, ``on_the_fly(connection, mark, until_ms)``
    after it; sorted by time, node, GPU."""
    since_ms = partitions.floor(since_ms, _CHUNKS[table][0])
    boundary = since_ms if mark is None else min(max(mark, since_ms), until_ms)
    parts = []
    if boundary > since_ms:
        parts.append(
            _chunks(
                connection, since_ms=since_ms, until_ms=boundary, node=node, gpu=gpu, table=table
            )
        )
    if boundary < until_ms:
        parts.append(on_the_fly(connection, boundary, until_ms))
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])
    frame = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
    return frame.sort_values(["ts_ms", "node", "gpu"], kind="stable", ignore_index=True)


def choose_resolution(connection: Connection, since_ms: int) -> Resolution:
    """The finest tier that holds a window starting at ``since_ms``: raw while the raw tier
    does, per minute while the minute tier does, per hour beyond."""
    start = raw_since(connection)
    if start is None or since_ms >= start:
        return "raw"
    minutes = minutes_since(connection)
    return "1m" if minutes is None or since_ms >= minutes else "1h"


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
        resolution: ``raw``, ``1m`` or ``1h``; None chooses (:func:`choose_resolution`).

    Returns:
        The frame and its resolution. Raw: :func:`store.reads.gpu_window`'s frame. Per
        minute (hour): ``ts_ms`` (the minute's start), ``node``, ``gpu``, each field as its
        minute's mean (gauges) or last value (counters, flags, bitmask, link state), then the
        field's rollup stats (``<field>_min``, ``_max``, ``_mean``, ``_last``; counters
        ``<field>_delta``, ``_last``) and ``n``, the samples the minute held.
    """
    if resolution is None:
        resolution = choose_resolution(connection, since_ms)
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
    read = _minutes if resolution == "1m" else _hours
    rolled = read(connection, since_ms=since_ms, until_ms=until_ms, node=node, gpu=gpu)
    out = representative(rolled, wanted)
    # A stat named like a field (pcie_link_width's ``_max`` is the field pcie_link_width_max)
    # is left out: one column a name, and the field is what was asked for.
    stats = [s for s in STAT_COLUMNS if s.rsplit("_", 1)[0] in wanted and s not in out.columns]
    out = pd.concat([out, rolled[["n", *stats]]], axis=1)
    if limit is not None:
        out = out.head(limit)
    return out.reset_index(drop=True), resolution


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
    mark = raw_since(connection)
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
        frames.append(samples_between(connection, since_ms=boundary, until_ms=until_ms, node=node))
    frames = [f for f in frames if len(f)]
    if not frames:
        return reads._frame([], list(reads.FRAME_COLUMNS))
    frame = pd.concat(frames, ignore_index=True)
    return frame.sort_values(["ts_ms", "node", "gpu"], kind="stable", ignore_index=True)
