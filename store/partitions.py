"""Time partitions: created ahead, dropped whole for retention.

PostgreSQL: ``samples`` (by ``ts_ms``, one partition an hour), ``sample_blocks`` (by ``start_ms``,
one an hour), ``sample_rollups`` (by ``start_ms``, one a day) and ``hourly_rollups`` (by
``start_ms``, one a week) are declaratively partitioned parents. Writers insert into the parent
(plain ``INSERT``, ``COPY``, ``ON CONFLICT``: PostgreSQL routes each row); retention detaches
nothing and deletes nothing row by row: it drops the partitions that ended before the cutoff,
which frees their files at once and leaves no dead tuples for vacuum. A ``DEFAULT`` partition
takes rows no partition covers (a spool replayed after its hour was dropped, a clock far ahead);
creating a partition over rows already in the default moves them first.

SQLite has no partitions. The same calls keep one table and delete by time range on the
``ts_ms`` index, and the database runs with ``auto_vacuum = INCREMENTAL`` so the freed pages go
back to the file system (``PRAGMA incremental_vacuum``) instead of waiting for a full
``VACUUM``. An hour of a small fleet is a short delete; fleets beyond a few hundred GPUs at 1 s
belong on PostgreSQL (``docs/storage.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, text

__all__ = [
    "DAY_MS",
    "HOUR_MS",
    "WEEK_MS",
    "Partition",
    "drop_before",
    "ensure",
    "existing",
    "floor",
    "partition_name",
    "vacuum",
]

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
WEEK_MS = 7 * DAY_MS

# parent table -> (time column, partition span)
LAYOUT: dict[str, tuple[str, int]] = {
    "samples": ("ts_ms", HOUR_MS),
    "sample_rollups": ("start_ms", DAY_MS),
    "sample_blocks": ("start_ms", HOUR_MS),
    "hourly_rollups": ("start_ms", WEEK_MS),
}

_BOUNDS = re.compile(r"FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")


@dataclass(frozen=True)
class Partition:
    """One partition: its table and the time range ``[start_ms, end_ms)`` it holds."""

    table: str
    start_ms: int
    end_ms: int


def floor(ms: int, span_ms: int) -> int:
    return ms - ms % span_ms


def partition_name(parent: str, start_ms: int) -> str:
    """``samples_p20261203t06`` (hourly), ``sample_rollups_p20261203`` (daily, weekly)."""
    span = LAYOUT[parent][1]
    at = datetime.fromtimestamp(start_ms / 1000, UTC)
    return f"{parent}_p{at:%Y%m%d}" if span % DAY_MS == 0 else f"{parent}_p{at:%Y%m%dt%H}"


def _is_postgres(connection: Connection) -> bool:
    return connection.dialect.name == "postgresql"


def existing(connection: Connection, parent: str) -> list[Partition]:
    """The partitions of ``parent`` in time order (without the default one); on SQLite none."""
    if not _is_postgres(connection):
        return []
    sql = (
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
        "WHERE p.relname = :parent"
    )
    out = []
    for name, bound in connection.execute(text(sql), {"parent": parent}):
        match = _BOUNDS.search(bound or "")
        if match:
            out.append(Partition(name, int(match.group(1)), int(match.group(2))))
    return sorted(out, key=lambda p: p.start_ms)


def oldest(connection: Connection, parent: str, after_ms: int | None = None) -> int | None:
    """The start of the oldest span of ``parent`` (its partitions' span, :data:`LAYOUT`) that
    holds a row at or after ``after_ms``; None: no row does. On PostgreSQL the default
    partition's minimum, then the partitions probed oldest first for one row each: no scan
    for a minimum over the whole table."""
    column, span = LAYOUT[parent]
    params = {"a": -(2**62) if after_ms is None else after_ms}
    where = f"WHERE {column} >= :a"
    if not _is_postgres(connection):
        low = connection.execute(text(f"SELECT MIN({column}) FROM {parent} {where}"), params)
        found = low.scalar()
        return None if found is None else floor(int(found), span)
    stray = connection.execute(
        text(f"SELECT MIN({column}) FROM {parent}_default {where}"), params
    ).scalar()
    for part in existing(connection, parent):
        if part.end_ms <= params["a"]:
            continue
        if stray is not None and stray < part.start_ms:
            break
        if connection.execute(text(f"SELECT 1 FROM {part.table} {where} LIMIT 1"), params).first():
            return max(part.start_ms, floor(params["a"], span))
    return None if stray is None else floor(int(stray), span)


def ensure(connection: Connection, parent: str, *, start_ms: int, end_ms: int) -> list[str]:
    """Create the missing partitions of ``parent`` covering ``[start_ms, end_ms)``.

    Returns:
        The tables created (none on SQLite).
    """
    if not _is_postgres(connection):
        return []
    column, span = LAYOUT[parent]
    have = {p.start_ms for p in existing(connection, parent)}
    created = []
    at = floor(start_ms, span)
    while at < end_ms:
        if at not in have:
            created.append(_create(connection, parent, column, at, at + span))
        at += span
    return created


def _create(connection: Connection, parent: str, column: str, start: int, end: int) -> str:
    name = partition_name(parent, start)
    default = f"{parent}_default"
    bounds = {"a": start, "b": end}
    strays = connection.execute(
        text(f"SELECT 1 FROM {default} WHERE {column} >= :a AND {column} < :b LIMIT 1"), bounds
    ).first()
    if strays is None:
        connection.execute(
            text(f"CREATE TABLE {name} PARTITION OF {parent} FOR VALUES FROM ({start}) TO ({end})")
        )
        return name
    # Rows for this range wait in the default partition: move them into the new table, then
    # attach it (PostgreSQL refuses a partition whose rows the default still holds). The parent
    # is locked whole for the move: a read planned with the partitions before it but run
    # after its commit would find the rows neither in the default nor in a partition it knows
    # (reads of the hour came back empty); locked, it waits and is planned with the new one.
    connection.execute(text(f"LOCK TABLE {parent} IN ACCESS EXCLUSIVE MODE"))
    connection.execute(text(f"CREATE TABLE {name} (LIKE {parent} INCLUDING ALL)"))
    where = f"{column} >= :a AND {column} < :b"
    connection.execute(text(f"INSERT INTO {name} SELECT * FROM {default} WHERE {where}"), bounds)
    connection.execute(text(f"DELETE FROM {default} WHERE {where}"), bounds)
    connection.execute(
        text(f"ALTER TABLE {parent} ATTACH PARTITION {name} FOR VALUES FROM ({start}) TO ({end})")
    )
    return name


def drop_before(connection: Connection, parent: str, cutoff_ms: int) -> int:
    """Retention: remove what ``parent`` holds from before ``cutoff_ms``.

    PostgreSQL drops every partition that ended at or before the cutoff (whole tables, no
    row deletes) and deletes the default partition's few stray rows; a partition straddling the
    cutoff stays until it has ended. SQLite deletes the rows by time range.

    Returns:
        Partitions dropped (PostgreSQL) or rows deleted (SQLite).
    """
    column, _ = LAYOUT[parent]
    if not _is_postgres(connection):
        result = connection.execute(
            text(f"DELETE FROM {parent} WHERE {column} < :c"), {"c": cutoff_ms}
        )
        return int(result.rowcount)
    dropped = 0
    for partition in existing(connection, parent):
        if partition.end_ms <= cutoff_ms:
            connection.execute(text(f"DROP TABLE {partition.table}"))
            dropped += 1
    connection.execute(text(f"DELETE FROM {parent}_default WHERE {column} < :c"), {"c": cutoff_ms})
    return dropped


def vacuum(connection: Connection) -> None:
    """SQLite: give freed pages back to the file system (a no-op elsewhere)."""
    if connection.dialect.name == "sqlite":
        connection.exec_driver_sql("PRAGMA incremental_vacuum")
