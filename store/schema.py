"""Tables of the time-series store (SQLAlchemy Core; Alembic owns their evolution).

``samples`` is one wide row per GPU per tick, keyed on (node, gpu, ts_ms): a sample sent twice
lands once. Time is integer milliseconds since the Unix epoch (UTC) on both backends, which keeps
the key compact, comparisons cheap and the two backends identical. ``gpus`` keeps one row per
GPU with the time of its newest sample, so "latest sample of every GPU" is a key lookup rather
than a scan. ``events`` uses ``-1`` for "no GPU" (a node-level event) and "no Xid" so that its
de-duplication key has no NULLs (NULLs are distinct in a PostgreSQL unique index).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from forewarn.wire import GpuSample

__all__ = [
    "BOOL_COLUMNS",
    "FLOAT_COLUMNS",
    "FRAME_COLUMNS",
    "INT_COLUMNS",
    "NO_GPU",
    "NO_XID",
    "SAMPLE_COLUMNS",
    "agents",
    "chunk_table",
    "events",
    "gpus",
    "metadata",
    "outbox",
    "samples",
]

metadata = MetaData()

NO_GPU = -1
NO_XID = -1

# Column groups of a sample row, in wire-schema order (ts becomes ts_ms; node/gpu are the key).
_META = ("uuid", "vendor")
FLOAT_COLUMNS: tuple[str, ...] = tuple(
    name
    for name, f in GpuSample.model_fields.items()
    if f.annotation is not None and "float" in str(f.annotation)
)
BOOL_COLUMNS: tuple[str, ...] = tuple(
    name
    for name, f in GpuSample.model_fields.items()
    if f.annotation is not None and "bool" in str(f.annotation)
)
INT_COLUMNS: tuple[str, ...] = tuple(
    name
    for name in GpuSample.model_fields
    if name not in ("node", "gpu", "ts", *_META, *FLOAT_COLUMNS, *BOOL_COLUMNS)
)
SAMPLE_COLUMNS: tuple[str, ...] = (
    "node",
    "gpu",
    "ts_ms",
    *_META,
    *(n for n in GpuSample.model_fields if n in FLOAT_COLUMNS + BOOL_COLUMNS + INT_COLUMNS),
)
"""Every column of ``samples``, in insert order."""

FRAME_COLUMNS: tuple[str, ...] = ("ts_ms", "node", "gpu", *SAMPLE_COLUMNS[3:])
"""Column order of every sample frame (the dataset's, ``docs/datasets.md``)."""


def _value_column(name: str) -> Column[Any]:
    if name in FLOAT_COLUMNS:
        return Column(name, Float)
    if name in BOOL_COLUMNS:
        return Column(name, Boolean)
    return Column(name, BigInteger)


def chunk_table(name: str, count: str, *, end_ms: bool, start_index: bool) -> Table:
    """A table of packed chunks (:mod:`store.blocks`, :mod:`store.rollups`): one row per GPU
    and span, keyed (node, gpu, start_ms), ``count`` the rows its blob holds; with ``end_ms``
    the span's end, with ``start_index`` an index on the start for retention and scans."""
    return Table(
        name,
        metadata,
        Column("node", String(253), nullable=False),
        Column("gpu", SmallInteger, nullable=False),
        Column("start_ms", BigInteger, nullable=False),
        *([Column("end_ms", BigInteger, nullable=False)] if end_ms else []),
        Column(count, Integer, nullable=False),
        Column("data", LargeBinary, nullable=False),
        PrimaryKeyConstraint("node", "gpu", "start_ms", name=f"pk_{name}"),
        *([Index(f"ix_{name}_start", "start_ms")] if start_index else []),
    )


samples = Table(
    "samples",
    metadata,
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger, nullable=False),
    Column("ts_ms", BigInteger, nullable=False),
    Column("uuid", String(96)),
    Column("vendor", String(16)),
    *(_value_column(n) for n in SAMPLE_COLUMNS[5:]),
    PrimaryKeyConstraint("node", "gpu", "ts_ms", name="pk_samples"),
    Index("ix_samples_ts", "ts_ms"),
)

gpus = Table(
    "gpus",
    metadata,
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger, nullable=False),
    Column("uuid", String(96)),
    Column("vendor", String(16)),
    Column("first_seen_ms", BigInteger, nullable=False),
    Column("last_seen_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("node", "gpu", name="pk_gpus"),
)

events = Table(
    "events",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger, nullable=False, default=NO_GPU),
    Column("ts_ms", BigInteger, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("xid", Integer, nullable=False, default=NO_XID),
    Column("message", Text),
    Column("source", String(64)),
    UniqueConstraint("node", "gpu", "ts_ms", "kind", "xid", name="uq_events_key"),
    Index("ix_events_ts", "ts_ms"),
)

agents = Table(
    "agents",
    metadata,
    Column("node", String(253), nullable=False),
    Column("agent_id", String(128), nullable=False),
    Column("source", String(64), nullable=False),
    Column("version", String(32), nullable=False, default=""),
    Column("started_ms", BigInteger),
    Column("last_seen_ms", BigInteger, nullable=False),
    Column("sent_total", BigInteger, nullable=False, default=0),
    Column("spooled", BigInteger, nullable=False, default=0),
    Column("dropped_total", BigInteger, nullable=False, default=0),
    Column("interval_s", Float),
    PrimaryKeyConstraint("node", "agent_id", name="pk_agents"),
)

outbox = Table(
    "outbox",
    metadata,
    Column(
        "seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("id", String(48), nullable=False),
    Column("type", String(64), nullable=False),
    Column("ts_ms", BigInteger, nullable=False),
    Column("job_id", String(253)),
    Column("node", String(253)),
    Column("data", Text, nullable=False),
    UniqueConstraint("id", name="uq_outbox_id"),
    Index("ix_outbox_ts", "ts_ms"),
)
"""Every announced event (see ``store.outbox``); ``seq`` is the dispatchers' arrival cursor."""
