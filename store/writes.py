"""Bulk writes into the store: samples, events, the GPU registry and collector heartbeats.

Every write is idempotent: rows already stored (same node, GPU and timestamp; for events the
same node, GPU, timestamp, kind and Xid) are skipped, not errors, and the functions return how
many rows were new. SQLite takes one ``executemany`` of ``INSERT OR IGNORE`` through the raw
driver cursor (the SQLAlchemy layer costs more than the insert itself at 50k rows/s).
PostgreSQL takes a binary ``COPY`` with typed columns straight into ``samples`` (read from the
catalogue, so it also fits a partitioned ``samples``) inside a savepoint; only when that meets
a row already stored does it go the slower way: ``COPY`` into a per-connection staging table,
then one ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

from sqlalchemy import Connection, insert, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from forewarn.wire import Event, GpuSample
from store.schema import NO_GPU, NO_XID, SAMPLE_COLUMNS, agents, events
from store.tiers import note_late_hours

__all__ = [
    "Charge",
    "EventRow",
    "SampleColumns",
    "SampleRow",
    "charge",
    "delete_before",
    "event_row",
    "insert_events",
    "insert_sample_groups",
    "insert_samples",
    "sample_row",
    "upsert_agent",
    "write_extras",
]

SampleRow = tuple[Any, ...]
"""A sample as a tuple in :data:`store.schema.SAMPLE_COLUMNS` order."""

EventRow = tuple[str, int | None, int, str, int | None, str | None, str | None]
"""(node, gpu, ts_ms, kind, xid, message, source)."""


class Charge(NamedTuple):
    """GPUs a batch adds to the fleet, charged to the token that sent it in the batch's own
    transaction (:func:`store.tokens.charge_gpus`): a batch that fails charges nothing, one
    sent again after it committed changes nothing."""

    token_sha256: str
    gpus: list[tuple[str, int]]
    now_ms: int


def charge(connection: Connection, what: Charge) -> None:
    from store.tokens import charge_gpus

    gpus = [(str(node), int(gpu)) for node, gpu in what.gpus]
    charge_gpus(connection, what.token_sha256, gpus, now_ms=int(what.now_ms))


def write_extras(connection: Connection, agent: Any, what: Any) -> None:
    """What a batch brings beside its rows, in its transaction: the collector's heartbeat
    (``agent``: (node, status) or None) and the GPUs charged to its token (``what``: a
    :class:`Charge`, or its fields as the writer process receives them, or None)."""
    if agent is not None:
        upsert_agent(connection, node=agent[0], status=agent[1])
    if what is not None:
        charge(connection, Charge(*what))


class SampleColumns:
    """One node's samples as columns: what ingest's columnar fast path hands to the writer.

    ``columns`` holds one list per :data:`store.schema.SAMPLE_COLUMNS` after ``node`` (gpu,
    ts_ms, uuid, …), each of length ``n``, except where ``constant`` is true: there the list
    holds one value, the same in every row. Iterating yields the store rows one at a time,
    so a batch reaches the database without a tuple per row ever being kept (on the ingest
    path those tuples were what kept the garbage collector busy). It sizes and iterates like
    a list of rows, so every writer takes either.
    """

    __slots__ = ("columns", "constant", "n", "node")

    def __init__(
        self, node: str, columns: Sequence[Sequence[Any]], n: int, constant: Sequence[bool]
    ) -> None:
        self.node = node
        self.columns = columns
        self.n = n
        self.constant = constant

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[SampleRow]:
        n = self.n
        columns = [
            repeat(c[0], n) if k else c for c, k in zip(self.columns, self.constant, strict=True)
        ]
        return zip(repeat(self.node, n), *columns, strict=False)

    def __repr__(self) -> str:
        return f"SampleColumns(node={self.node!r}, n={self.n})"

    def to_wire(self) -> list[Any]:
        """A msgpack-able form, for a writer process (:meth:`from_wire` reads it back)."""
        return [self.node, self.n, self.columns, self.constant]

    @classmethod
    def from_wire(cls, wire: list[Any]) -> SampleColumns:
        return cls(wire[0], wire[2], wire[1], wire[3])


_COLS = ", ".join(SAMPLE_COLUMNS)
_SQLITE_INSERT = (
    f"INSERT OR IGNORE INTO samples ({_COLS}) VALUES ({', '.join('?' * len(SAMPLE_COLUMNS))})"
)
_PG_STAGE = (
    "CREATE TEMP TABLE IF NOT EXISTS samples_stage "
    "(LIKE samples INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
)
_PG_MERGE = (
    f"INSERT INTO samples ({_COLS}) SELECT {_COLS} FROM samples_stage ON CONFLICT DO NOTHING"
)
_GPU_UPSERT = {
    "sqlite": (
        "INSERT INTO gpus (node, gpu, uuid, vendor, first_seen_ms, last_seen_ms) "
        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (node, gpu) DO UPDATE SET "
        "first_seen_ms = MIN(gpus.first_seen_ms, excluded.first_seen_ms), "
        "last_seen_ms = MAX(gpus.last_seen_ms, excluded.last_seen_ms), "
        "uuid = COALESCE(excluded.uuid, gpus.uuid), vendor = COALESCE(excluded.vendor, gpus.vendor)"
    ),
    "postgresql": (
        "INSERT INTO gpus (node, gpu, uuid, vendor, first_seen_ms, last_seen_ms) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (node, gpu) DO UPDATE SET "
        "first_seen_ms = LEAST(gpus.first_seen_ms, excluded.first_seen_ms), "
        "last_seen_ms = GREATEST(gpus.last_seen_ms, excluded.last_seen_ms), "
        "uuid = COALESCE(excluded.uuid, gpus.uuid), vendor = COALESCE(excluded.vendor, gpus.vendor)"
    ),
}


def _gpu_spans(groups: Sequence[Sequence[SampleRow] | SampleColumns]) -> list[tuple[Any, ...]]:
    """One (node, gpu, uuid, vendor, first_ms, last_ms) per GPU present in ``groups``."""
    spans: dict[tuple[str, int], list[Any]] = {}
    for rows in groups:
        if isinstance(rows, SampleColumns):
            # Only the key, time and identity columns, not whole rows.
            head = SampleColumns(rows.node, rows.columns[:4], rows.n, rows.constant[:4])
            keyed: Any = head
        else:
            keyed = rows
        for row in keyed:
            key = (row[0], row[1])
            span = spans.get(key)
            if span is None:
                spans[key] = [row[0], row[1], row[3], row[4], row[2], row[2]]
            else:
                if row[2] < span[4]:
                    span[4] = row[2]
                if row[2] > span[5]:
                    span[5] = row[2]
    return [tuple(s) for s in sorted(spans.values(), key=lambda s: (s[0], s[1]))]


def insert_samples(connection: Connection, rows: Sequence[SampleRow] | SampleColumns) -> int:
    """Store ``rows`` inside the caller's transaction; returns how many were new.

    Also moves each GPU's ``last_seen_ms`` forward in the ``gpus`` registry.
    """
    return insert_sample_groups(connection, [rows])[0]


def insert_sample_groups(
    connection: Connection, groups: Sequence[Sequence[SampleRow] | SampleColumns]
) -> list[int]:
    """Store several callers' rows in the caller's transaction; how many of each were new.

    One ``COPY`` (PostgreSQL) or one prepared statement (SQLite) serves every group, and the
    ``gpus`` registry is updated once for all of them.
    """
    if not any(groups):
        return [0] * len(groups)
    dialect = connection.dialect.name
    driver = connection.connection.driver_connection
    cursor = driver.cursor()  # type: ignore[union-attr]
    spans = _gpu_spans(groups)
    try:
        if dialect == "sqlite":
            stored = []
            for rows in groups:
                if rows:
                    cursor.executemany(_SQLITE_INSERT, rows)
                    stored.append(int(cursor.rowcount))
                else:
                    stored.append(0)
            cursor.executemany(_GPU_UPSERT[dialect], spans)
        elif dialect == "postgresql":
            # The registry first: it also opens the transaction, so that the COPY below runs
            # in a savepoint of it rather than in a transaction of its own.
            cursor.executemany(_GPU_UPSERT[dialect], spans)
            info = connection.connection.info
            types = info.get("samples_types")
            if types is None:
                types = info["samples_types"] = _pg_types(cursor)
            stored = _pg_copy(driver, cursor, types, groups)
        else:  # pragma: no cover - guarded by make_engine
            raise ValueError(f"unsupported database: {dialect}")
        note_late_hours(cursor, dialect, [(s[4], s[5]) for s in spans])
    finally:
        cursor.close()
    return stored


def _pg_types(cursor: Any) -> list[str]:
    """The PostgreSQL type of every column of ``samples``, in insert order (for binary COPY)."""
    cursor.execute(
        "SELECT a.attname, t.typname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "WHERE a.attrelid = 'samples'::regclass AND a.attnum > 0 AND NOT a.attisdropped"
    )
    types = dict(cursor.fetchall())
    return [types[c] for c in SAMPLE_COLUMNS]


def _pg_copy(
    driver: Any,
    cursor: Any,
    types: list[str],
    groups: Sequence[Sequence[SampleRow] | SampleColumns],
) -> list[int]:
    try:
        with driver.transaction():  # a savepoint: a row already stored undoes only this attempt
            _copy_rows(cursor, "samples", types, (r for g in groups for r in g))
        return [len(g) for g in groups]
    except _unique_violation():
        pass
    cursor.execute(_PG_STAGE)
    stored = []
    for rows in groups:
        if not rows:
            stored.append(0)
            continue
        _copy_rows(cursor, "samples_stage", types, rows)
        cursor.execute(_PG_MERGE)
        stored.append(int(cursor.rowcount))
        cursor.execute("DELETE FROM samples_stage")
    return stored


def _copy_rows(cursor: Any, table: str, types: list[str], rows: Any) -> None:
    with cursor.copy(f"COPY {table} ({_COLS}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(types)
        write = copy.write_row
        for row in rows:
            write(row)


def _unique_violation() -> type[Exception]:
    from psycopg.errors import UniqueViolation

    return UniqueViolation


def insert_events(connection: Connection, rows: Sequence[EventRow]) -> int:
    """Store events inside the caller's transaction; returns how many were new."""
    if not rows:
        return 0
    values = [
        {
            "node": node,
            "gpu": NO_GPU if gpu is None else gpu,
            "ts_ms": ts_ms,
            "kind": kind,
            "xid": NO_XID if xid is None else xid,
            "message": message,
            "source": source,
        }
        for node, gpu, ts_ms, kind, xid, message, source in rows
    ]
    stored = 0
    if connection.dialect.name == "sqlite":
        for chunk in _chunks(values, 500):
            result = connection.execute(insert(events).prefix_with("OR IGNORE").values(chunk))
            stored += result.rowcount
    else:
        for chunk in _chunks(values, 500):
            statement = pg_insert(events).values(chunk).on_conflict_do_nothing()
            stored += len(connection.execute(statement.returning(events.c.id)).all())
    return stored


def upsert_agent(connection: Connection, *, node: str, status: dict[str, Any]) -> None:
    """Record a collector's heartbeat (``status`` holds the AgentStatus fields, times in ms)."""
    values = {"node": node, **status}
    update = {k: v for k, v in values.items() if k not in ("node", "agent_id")}
    upsert = sqlite_insert if connection.dialect.name == "sqlite" else pg_insert
    statement = upsert(agents).values(values)
    connection.execute(
        statement.on_conflict_do_update(index_elements=["node", "agent_id"], set_=update)
    )


def delete_before(connection: Connection, cutoff_ms: int) -> dict[str, int]:
    """Retention: drop samples and events older than ``cutoff_ms``; returns rows removed."""
    removed = {}
    for table in ("samples", "events"):
        result = connection.execute(text(f"DELETE FROM {table} WHERE ts_ms < :c"), {"c": cutoff_ms})
        removed[table] = result.rowcount
    # A GPU with no sample left is no longer part of the fleet.
    result = connection.execute(text("DELETE FROM gpus WHERE last_seen_ms < :c"), {"c": cutoff_ms})
    removed["gpus"] = result.rowcount
    return removed


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


_values = itemgetter(*SAMPLE_COLUMNS[5:])


def sample_row(sample: GpuSample) -> SampleRow:
    """A validated sample as a row in :data:`SAMPLE_COLUMNS` order."""
    d = sample.__dict__
    return (
        d["node"],
        d["gpu"],
        int(d["ts"].timestamp() * 1000),
        d["uuid"],
        d["vendor"].value,
        *_values(d),
    )


def event_row(event: Event) -> EventRow:
    return (
        event.node,
        event.gpu,
        int(event.ts.timestamp() * 1000),
        event.kind.value,
        event.xid,
        event.message,
        event.source,
    )
