"""Tables and reads/writes of the control loop: risk, jobs and placement, the ranks' step
timings and straggler state, migrations, audit, node drain state, policy, and the arrival
cursor over samples and events.

Every function takes the caller's connection, so a state change, its audit entry and its
outbox event (``store.outbox.emit_event``) commit together. Times are integer milliseconds
since the epoch (UTC), as everywhere in the store. JSON columns are text (orjson).

Arrival order: the scorer follows the rows the store *received*, not their timestamps, so a
collector's spool replayed late still reaches it. SQLite numbers rows as it appends them
(``rowid``); PostgreSQL gets an identity column ``samples.arrival_seq`` (revision
``0003_control``). ``events.id`` is already an arrival sequence on both.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, NotRequired, TypedDict, cast

import numpy as np
import orjson
import pandas as pd
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    Float,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    delete,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from store.reads import FRAME_COLUMNS, _frame
from store.schema import BOOL_COLUMNS, NO_GPU, NO_XID, gpus, metadata, outbox

log = logging.getLogger("forewarn.store")

__all__ = [
    "ACTIVE_STATES",
    "BREAKER_RESET_KEY",
    "LEADER_EPOCH_KEY",
    "MIGRATION_STATES",
    "RISK_FLEET_COLUMNS",
    "RISK_VERSION_KEY",
    "STATUS_KEY",
    "SampleArrays",
    "Shard",
    "audit",
    "events_after",
    "job_ranks",
    "jobs",
    "migrations",
    "node_drain",
    "policy",
    "rank_timings",
    "risk_history",
    "risk_latest",
    "sample_arrays_after",
    "sample_arrays_in",
    "samples_after",
    "score_shards",
]

_ID = BigInteger().with_variant(Integer, "sqlite")

risk_latest = Table(
    "risk_latest",
    metadata,
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger, nullable=False),
    Column("risk", Float),
    Column("alarm", Boolean, nullable=False, default=False),
    Column("reasons", Text, nullable=False, default="[]"),
    Column("scored_ms", BigInteger, nullable=False),
    Column("last_seen_ms", BigInteger),
    Column("stale", Boolean, nullable=False, default=False),
    Column("streak", Integer, nullable=False, default=0),
    Column("crossed", Boolean, nullable=False, default=False),
    Column("crossed_ms", BigInteger),
    Column("failed", Boolean, nullable=False, default=False),
    PrimaryKeyConstraint("node", "gpu", name="pk_risk_latest"),
)
"""The newest score of every GPU; ``streak`` counts consecutive scores above the threshold,
``crossed`` is the alarm after hysteresis, ``failed`` a GPU lost or a fatal Xid seen."""


class _RiskColumns(TypedDict):
    node: str
    gpu: int
    risk: float | None
    alarm: bool
    scored_ms: int
    last_seen_ms: int | None
    stale: bool
    streak: int
    crossed: bool
    crossed_ms: int | None
    failed: bool


class StoredRisk(_RiskColumns):
    """A ``risk_latest`` row to write (:func:`upsert_risk`): ``reasons`` as its JSON text."""

    reasons: str


class Risk(_RiskColumns):
    """A ``risk_latest`` row as read (:func:`risk_rows`): ``reasons`` decoded."""

    reasons: list[str]


class RiskPoint(TypedDict):
    """One point of a GPU's risk history (:func:`append_history` adds the GPU's key)."""

    ts_ms: int
    risk: float | None
    alarm: bool


class HistoryRow(RiskPoint):
    node: str
    gpu: int


risk_history = Table(
    "risk_history",
    metadata,
    Column("id", _ID, primary_key=True, autoincrement=True),
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger, nullable=False),
    Column("ts_ms", BigInteger, nullable=False),
    Column("risk", Float),
    Column("alarm", Boolean, nullable=False),
    Index("ix_risk_history_gpu", "node", "gpu", "ts_ms"),
    Index("ix_risk_history_ts", "ts_ms"),
)
"""Bounded: one row per GPU per history interval (and on every alarm change), pruned by age."""

jobs = Table(
    "jobs",
    metadata,
    Column("job_id", String(253), primary_key=True),
    Column("world_size", Integer, nullable=False),
    Column("spares", Integer, nullable=False),
    Column("agent_url", Text),
    Column("status", String(32), nullable=False, default="running"),
    Column("generation", Integer, nullable=False, default=0),
    Column("message", Text),
    Column("registered_ms", BigInteger, nullable=False),
    Column("heartbeat_ms", BigInteger, nullable=False),
)

job_ranks = Table(
    "job_ranks",
    metadata,
    Column("job_id", String(253), nullable=False),
    Column("slot", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger),
    Column("uuid", String(96)),
    Column("pid", Integer),
    Column("role", String(16), nullable=False),
    PrimaryKeyConstraint("job_id", "slot", name="pk_job_ranks"),
    Index("ix_job_ranks_gpu", "node", "gpu"),
)

rank_timings = Table(
    "rank_timings",
    metadata,
    Column("job_id", String(253), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("window", Integer, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("total_steps", BigInteger),
    Column("compute_s", Float, nullable=False),
    Column("wait_s", Float, nullable=False),
    Column("step_s", Float, nullable=False),
    Column("received_ms", BigInteger, nullable=False),
    Column("above_since_ms", BigInteger),
    Column("straggling", Boolean, nullable=False, default=False),
    Column("straggling_ms", BigInteger),
    Column("reason", Text),
    PrimaryKeyConstraint("job_id", "rank", name="pk_rank_timings"),
)
"""The newest step timing of every active rank (``JobHeartbeat.timings``, written by the
heartbeat) and its straggler state (written by the control loop: since when its compute stayed
above its peers', whether it is a straggler, since when and why), so a new leader judges on
from where the last one stopped. Revision ``0005_stragglers``."""


class RankTiming(TypedDict):
    """A ``rank_timings`` row: a rank's newest step timing and its straggler state."""

    job_id: str
    rank: int
    window: int
    step: int
    total_steps: int | None
    compute_s: float
    wait_s: float
    step_s: float
    received_ms: int
    above_since_ms: int | None
    straggling: bool
    straggling_ms: int | None
    reason: str | None


class RankSlot(TypedDict):
    """A slot of a job: where it runs and what it is (active, spare, ...)."""

    slot: int
    rank: int
    node: str
    gpu: int | None
    uuid: str | None
    pid: int | None
    role: str


class RankPlacement(RankSlot):
    """A ``job_ranks`` row."""

    job_id: str


class JobRank(RankSlot):
    """A slot of :class:`Job`: its placement, and an active rank's newest timing."""

    timing: RankTiming | None


class Job(TypedDict):
    """A ``jobs`` row with its slots and its ranks' timings (:func:`get_jobs`)."""

    job_id: str
    world_size: int
    spares: int
    agent_url: str | None
    status: str
    generation: int
    message: str | None
    registered_ms: int
    heartbeat_ms: int
    ranks: list[JobRank]
    timings: list[RankTiming]


_TIMING_COLUMNS = (
    "window",
    "step",
    "total_steps",
    "compute_s",
    "wait_s",
    "step_s",
    "received_ms",
)
STRAGGLER_COLUMNS = ("above_since_ms", "straggling", "straggling_ms", "reason")

MIGRATION_STATES = ("requested", "acknowledged", "transferring", "completed", "failed", "cancelled")
ACTIVE_STATES = ("requested", "acknowledged", "transferring")
_ACTIVE_SQL = "state IN ('requested', 'acknowledged', 'transferring')"

migrations = Table(
    "migrations",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("job_id", String(253), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("trigger", String(16), nullable=False),
    Column("state", String(16), nullable=False),
    Column("risk", Float),
    Column("reasons", Text, nullable=False, default="[]"),
    Column("source_node", String(253)),
    Column("source_gpu", SmallInteger),
    Column("target_node", String(253)),
    Column("target_gpu", SmallInteger),
    Column("target_slot", Integer),
    Column("requested_ms", BigInteger, nullable=False),
    Column("acknowledged_ms", BigInteger),
    Column("transferring_ms", BigInteger),
    Column("finished_ms", BigInteger),
    Column("step", BigInteger),
    Column("pause_s", Float),
    Column("transfer_s", Float),
    Column("bytes_moved", BigInteger),
    Column("error", Text),
    Column("detail", Text),
    Index("ix_migrations_job", "job_id", "state"),
    Index("ix_migrations_state", "state"),
    Index(
        "ux_migrations_active_rank",
        "job_id",
        "rank",
        unique=True,
        postgresql_where=text(_ACTIVE_SQL),
        sqlite_where=text(_ACTIVE_SQL),
    ),
)
"""``ux_migrations_active_rank`` (revision ``0006_control_fencing``): one active migration per
(job, rank) at most, whoever writes it."""


class _MigrationKey(TypedDict):
    id: str
    job_id: str
    rank: int
    trigger: str
    state: str
    requested_ms: int


class NewMigration(_MigrationKey):
    """A ``migrations`` row to insert: ``reasons`` as its stored JSON text; the columns left
    out (the outcome's, and those not given) are NULL."""

    reasons: str
    risk: NotRequired[float | None]
    source_node: NotRequired[str | None]
    source_gpu: NotRequired[int | None]
    target_node: NotRequired[str | None]
    target_gpu: NotRequired[int | None]
    target_slot: NotRequired[int | None]
    detail: NotRequired[str | None]


class Migration(_MigrationKey):
    """A ``migrations`` row as read: every column, ``reasons`` decoded."""

    risk: float | None
    reasons: list[str]
    source_node: str | None
    source_gpu: int | None
    target_node: str | None
    target_gpu: int | None
    target_slot: int | None
    acknowledged_ms: int | None
    transferring_ms: int | None
    finished_ms: int | None
    step: int | None
    pause_s: float | None
    transfer_s: float | None
    bytes_moved: int | None
    error: str | None
    detail: str | None


audit = Table(
    "audit",
    metadata,
    Column("seq", _ID, primary_key=True, autoincrement=True),
    Column("ts_ms", BigInteger, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("action", String(16), nullable=False),
    Column("reason", Text, nullable=False),
    Column("node", String(253)),
    Column("gpu", SmallInteger),
    Column("job_id", String(253)),
    Column("migration_id", String(64)),
    Column("data", Text, nullable=False, default="{}"),
    Index("ix_audit_ts", "ts_ms"),
    Index("ix_audit_migration", "migration_id"),
)
"""Every decision of the control loop, taken or declined, and every operator action."""

node_drain = Table(
    "node_drain",
    metadata,
    Column("node", String(253), primary_key=True),
    Column("drained", Boolean, nullable=False),
    Column("changed_ms", BigInteger, nullable=False),
    Column("reason", Text),
)

policy = Table(
    "policy",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("data", Text, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
)
"""One row (id 1): the policy operators set through ``PUT /v1/policy``; settings are defaults."""

control_state = Table(
    "control_state",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)
"""Small persisted facts of the loop (the breaker's trip time)."""

score_shards = Table(
    "score_shards",
    metadata,
    Column("member", String(160), primary_key=True),
    Column("seen_ms", BigInteger, nullable=False),
    Column("tick_ms", BigInteger),
    Column("gpus", Integer, nullable=False, default=0),
    Column("payload", LargeBinary),
    Column("status", Text),
)
"""Partitioned scoring (:mod:`control.partition`): one row per control process that scores a
share of the fleet. ``seen_ms`` is its heartbeat (the live members share the fleet's buckets);
a follower's ``payload`` holds the scores of its share at ``tick_ms``, which the leader merges."""


def _upsert(connection: Connection) -> Any:
    return sqlite_insert if connection.dialect.name == "sqlite" else pg_insert


def dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()


# -- arrival cursor ---------------------------------------------------------------------------


def arrival_column(connection: Connection) -> str:
    return "rowid" if connection.dialect.name == "sqlite" else "arrival_seq"


def samples_after(
    connection: Connection, cursor: int, *, limit: int = 200_000
) -> tuple[pd.DataFrame, list[int]]:
    """Samples the store received after ``cursor`` (arrival order), and their sequence numbers.

    Returns:
        (frame in :data:`store.reads.FRAME_COLUMNS`, sorted by ts_ms; the rows' arrival seqs).
    """
    seq = arrival_column(connection)
    mark = _mark(connection)
    _by_arrival_index(connection)
    sql = (
        f"SELECT {seq}, {', '.join(FRAME_COLUMNS)} FROM samples "
        f"WHERE {seq} > {mark} ORDER BY {seq} LIMIT {mark}"
    )
    rows = _fetch(connection, sql, (cursor, limit))
    seqs = [int(r[0]) for r in rows]
    frame = _frame([r[1:] for r in rows], list(FRAME_COLUMNS))
    # Sorted by time; the index keeps each row's position in arrival order (``seqs``).
    return frame.sort_values(["ts_ms", "node", "gpu"], kind="stable"), seqs


class SampleArrays(NamedTuple):
    """Samples as arrays, in arrival order: what the control loop's scorer folds in."""

    seq: np.ndarray  # int64, each row's arrival sequence number
    ts_ms: np.ndarray  # int64
    node: np.ndarray  # object (str)
    gpu: np.ndarray  # int64
    values: np.ndarray  # float64, rows x the columns asked for; NaN where null


def sample_arrays_after(
    connection: Connection,
    cursor: int,
    columns: Sequence[str],
    *,
    limit: int,
    buckets: Sequence[int] | None = None,
    until: int | None = None,
) -> SampleArrays:
    """The samples received after ``cursor`` (arrival order), only ``columns`` besides the key,
    as arrays: no frame, no per-row objects beyond the driver's own. At 100,000 GPUs a 5-s tick
    reads 500,000 rows; building a pandas frame from them cost more than the query.

    ``buckets``: only the nodes of these buckets (:func:`bucket_sql`; PostgreSQL), filtered in
    the database, so a share of the fleet costs its share of the read. ``until``: only rows
    numbered up to it.
    """
    seq = arrival_column(connection)
    where = _where(connection, (f"{seq} >", cursor), (f"{seq} <=", until), buckets=buckets)
    order = f" ORDER BY {seq} LIMIT {_mark(connection)}"
    _by_arrival_index(connection)
    return _sample_arrays(connection, seq, columns, where, order, (*where.params, limit))


def _by_arrival_index(connection: Connection) -> None:
    """Have PostgreSQL read the newest rows by arrival through each partition's arrival index,
    for the rest of ``connection``'s transaction, whatever the partitions' statistics say, and
    without compiling the query (JIT).

    Once autovacuum has analysed the hour's partition its statistics lag its rows, and the
    planner took the tick's read of the newest rows (a few percent of the hour) for a tenth of
    it: it scanned the whole partition, sorted it, and compiled the 25 value expressions for
    that. At 16,384 GPUs, 2.5 million rows into the hour: 614 ms for the read of 82,000 rows,
    427 of them compiling, against 58 ms through the indexes; the tick went from 0.5-0.7 s to
    0.9-1.0 s a minute and a half into a run (``benchmarks/control.py --part t --ticks 30``), and at
    100,000 GPUs the hour grows to 360 million rows."""
    if connection.dialect.name == "postgresql":
        connection.execute(
            text(
                "SELECT set_config('enable_seqscan', 'off', true), "
                "set_config('enable_bitmapscan', 'off', true), "
                "set_config('enable_sort', 'off', true), set_config('jit', 'off', true)"
            )
        )


def sample_arrays_in(
    connection: Connection,
    columns: Sequence[str],
    *,
    since_ms: int,
    until_ms: int | None,
    buckets: Sequence[int] | None = None,
) -> SampleArrays:
    """The samples with ``since_ms <= ts_ms < until_ms`` (None: no end), as
    :func:`sample_arrays_after` gives them, in time order (``seq`` is empty); ``buckets`` as
    there."""
    where = _where(connection, ("ts_ms >=", since_ms), ("ts_ms <", until_ms), buckets=buckets)
    return _sample_arrays(connection, None, columns, where, " ORDER BY ts_ms", where.params)


def _sample_arrays(
    connection: Connection,
    seq: str | None,
    columns: Sequence[str],
    where: _Where,
    order: str,
    params: tuple[Any, ...],
) -> SampleArrays:
    """``SELECT [seq,] ts_ms, node, gpu, columns FROM samples`` with ``where`` and ``order``:
    on PostgreSQL through :func:`_pg_arrays`, else (or where it declines) the driver's rows."""
    tail = f"{where.sql}{order}"
    if connection.dialect.name == "postgresql":
        fast = _pg_arrays(connection, seq, columns, tail, params, where)
        if fast is not None:
            return fast
    head = f"{seq}, " if seq is not None else ""
    sql = f"SELECT {head}ts_ms, node, gpu, {_value_list(columns)} FROM samples{tail}"
    return _arrays(_fetch(connection, sql, params), len(columns), with_seq=seq is not None)


class _Where(NamedTuple):
    sql: str
    params: tuple[Any, ...]


def _mark(connection: Connection) -> str:
    return "?" if connection.dialect.name == "sqlite" else "%s"


def _where(
    connection: Connection, *bounds: tuple[str, int | None], buckets: Sequence[int] | None
) -> _Where:
    """`` WHERE`` with each ``(column and operator, value)`` whose value is not None, and
    with ``buckets`` only the nodes of those (:func:`bucket_sql`)."""
    mark = _mark(connection)
    terms: list[tuple[str, Any]] = [(f"{test} {mark}", v) for test, v in bounds if v is not None]
    if buckets is not None:
        terms.append((f"{bucket_sql(connection)} = ANY({mark}::int[])", list(buckets)))
    if not terms:
        return _Where("", ())
    return _Where(" WHERE " + " AND ".join(t for t, _ in terms), tuple(v for _, v in terms))


def arrival_seqs_after(connection: Connection, cursor: int, *, limit: int) -> np.ndarray:
    """The arrival numbers of every sample received after ``cursor`` (at most ``limit``, in
    order): what a share of the fleet's scorer moves its cursor over, its own rows among them.
    One query for the count and the top first: without holes the numbers are a range."""
    seq = arrival_column(connection)
    mark = _mark(connection)
    _by_arrival_index(connection)
    top_sql = (
        f"SELECT count(*), max(s) FROM (SELECT {seq} AS s FROM samples WHERE {seq} > {mark} "
        f"ORDER BY {seq} LIMIT {mark}) AS t"
    )
    count, top = _fetch(connection, top_sql, (cursor, limit))[0]
    if not count:
        return np.zeros(0, dtype=np.int64)
    if int(top) - cursor == int(count):
        return np.arange(cursor + 1, int(top) + 1, dtype=np.int64)
    rows = _fetch(
        connection,
        f"SELECT {seq} FROM samples WHERE {seq} > {mark} ORDER BY {seq} LIMIT {mark}",
        (cursor, limit),
    )
    return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))


BUCKETS = 1024
"""The fleet's nodes fall into this many buckets by a hash of their name (:func:`bucket_sql`);
partitioned scoring shares the buckets among the control processes."""


def bucket_sql(connection: Connection, column: str = "node") -> str:
    """The SQL of a node's bucket, ``0 <= b < BUCKETS``: PostgreSQL's own hash of the name, the
    same for every replica of one database. Partitioned scoring needs PostgreSQL (replicas on
    SQLite cannot share one database anyway)."""
    if connection.dialect.name != "postgresql":
        raise ValueError("partitioned scoring needs PostgreSQL")
    return f"(hashtext({column}) & {BUCKETS - 1})"


def node_buckets(connection: Connection, nodes: Sequence[str]) -> dict[str, int]:
    """Each of ``nodes``' bucket, as :func:`bucket_sql` computes it."""
    if not nodes:
        return {}
    sql = f"SELECT n, {bucket_sql(connection, 'n')} FROM unnest(%s::text[]) AS n"
    return {str(n): int(b) for n, b in _fetch(connection, sql, (list(nodes),))}


def _fetch(connection: Connection, sql: str, params: tuple[Any, ...]) -> list[Any]:
    """Rows from the driver's own cursor: at 500,000 rows the SQLAlchemy row layer costs more
    than the query. PostgreSQL sends them in binary (parsing text numbers took as long again:
    2.6-2.7 s against 1.5 s for half a million rows of 29 columns)."""
    driver: Any = connection.connection.driver_connection
    cursor = driver.cursor() if connection.dialect.name == "sqlite" else driver.cursor(binary=True)
    try:
        cursor.execute(sql, params)
        return list(cursor.fetchall())
    finally:
        cursor.close()


_NODE_NAMES: dict[int, str] = {}
"""Node names by ``hashtextextended(node, 0)``, as the binary reads met them (a name's hash
never changes, so entries stay true across databases; cleared past a million)."""
_NODE_HASH = "hashtextextended(node, 0)"
_BOOLEAN_COLUMNS = frozenset(BOOL_COLUMNS)


def _pg_arrays(
    connection: Connection,
    seq: str | None,
    columns: Sequence[str],
    tail: str,
    params: tuple[Any, ...],
    where: _Where,
) -> SampleArrays | None:
    """The samples of ``FROM samples{tail}`` as arrays, through a binary ``COPY`` parsed by
    NumPy: every field fixed-width and never null (values as float8, NaN for null; the node as
    its 64-bit hash, named from :data:`_NODE_NAMES`), so each row is one record of a structured
    dtype. Half a million rows of the tick's 25 values (100,000 GPUs, a 5-s tick): the read's
    peak memory 290 MB against 779 MB for the driver's rows and the object array built from
    them, and about 0.3 s less of the read (2-core machine; the tick as a whole within the
    noise: its fold came out slower by about as much, not understood). None where the node
    names cannot be told apart by their hash (two nodes of this read on one hash; never met),
    or the rows came otherwise than asked (a field null or of another width): the caller reads
    rows instead."""
    _value_list(columns)  # refuses unknown columns
    values = ", ".join(
        f"COALESCE({c}{'::int' if c in _BOOLEAN_COLUMNS else ''}::float8, 'NaN')" for c in columns
    )
    head = f"{seq}, " if seq is not None else ""
    sql = f"SELECT {head}ts_ms, {_NODE_HASH}, gpu::int8, {values} FROM samples{tail}"
    fields = (["seq"] if seq is not None else []) + ["ts", "hash", "gpu"]
    names = [*fields, *(f"v{i}" for i in range(len(columns)))]
    layout = [("count", ">i2")]
    for name in names:
        layout += [(f"{name}_len", ">i4"), (name, ">f8" if name.startswith("v") else ">i8")]
    dtype = np.dtype(layout)
    driver: Any = connection.connection.driver_connection
    buffer = bytearray()
    copy_sql = f"COPY ({sql}) TO STDOUT (FORMAT binary)"
    with driver.cursor() as cursor, cursor.copy(copy_sql, params) as copy:
        for chunk in copy:
            buffer += chunk
    start = 11 + 4 + 4 + int.from_bytes(buffer[15:19], "big")  # signature, flags, extension
    rows = max((len(buffer) - start - 2) // dtype.itemsize, 0)
    table = np.frombuffer(buffer, dtype=dtype, count=rows, offset=min(start, len(buffer)))
    # Every field's length word, and every value, as one strided view each: a pass per
    # field took 0.27 s for the values alone at 500,000 rows, a view 0.04 s.
    lengths = _fields(table, f"{names[0]}_len", ">i4", len(names))
    if start + rows * dtype.itemsize + 2 != len(buffer) or not (
        (table["count"] == len(fields) + len(columns)).all() and (lengths == 8).all()
    ):
        log.warning("a binary read of samples was not laid out as asked: read as rows")
        return None
    hashes = table["hash"].astype(np.int64)
    unique, inverse = np.unique(hashes, return_inverse=True)
    missing = [int(h) for h in unique if int(h) not in _NODE_NAMES]
    if missing and not _learn_nodes(connection, missing, where):
        return None
    node_names = np.array([_NODE_NAMES[int(h)] for h in unique], dtype=object)
    out = _fields(table, "v0", ">f8", len(columns)).astype(np.float64)
    return SampleArrays(
        table["seq"].astype(np.int64) if seq is not None else np.zeros(0, dtype=np.int64),
        table["ts"].astype(np.int64),
        node_names[inverse.reshape(-1)] if rows else np.zeros(0, dtype=object),
        table["gpu"].astype(np.int64),
        out,
    )


def _fields(table: np.ndarray, first: str, dtype: str, count: int) -> np.ndarray:
    """``count`` fields of ``table``'s records from field ``first`` on, as one rows x count
    view: in a binary ``COPY`` row every field is a 4-byte length and, here, 8 bytes of value,
    so the lengths (or the values) lie every 12 bytes."""
    if not len(table):
        return np.zeros((0, count), dtype=dtype)
    layout = table.dtype
    assert layout.fields is not None
    at = layout.fields[first][1]
    return np.ndarray(
        (len(table), count), dtype=dtype, buffer=table, offset=at, strides=(layout.itemsize, 12)
    )


def _learn_nodes(connection: Connection, hashes: list[int], where: _Where) -> bool:
    """Name the nodes of ``hashes``: from the GPU registry (every node with a stored sample, in
    the sample's own transaction; a tenth of the time of the samples' range at 100,000 GPUs),
    else from the samples the read covers. False where two names share a hash."""
    mark = _mark(connection)
    found: dict[int, str] = {}
    for table, cond, params in (
        ("gpus", "", ()),
        ("samples", where.sql, where.params),
    ):
        wanted = [h for h in hashes if h not in found]
        if not wanted:
            break
        sql = (
            f"SELECT DISTINCT {_NODE_HASH}, node FROM {table}{cond}"
            + (" AND " if cond else " WHERE ")
            + f"{_NODE_HASH} = ANY({mark}::int8[])"
        )
        for h, node in _fetch(connection, sql, (*params, wanted)):
            if found.setdefault(int(h), str(node)) != str(node):
                log.warning("nodes %s and %s share a hash: read as rows", found[int(h)], node)
                return False
    if len(_NODE_NAMES) + len(found) > 1_000_000:
        _NODE_NAMES.clear()
    _NODE_NAMES.update(found)
    return all(h in _NODE_NAMES for h in hashes)


def _value_list(columns: Sequence[str]) -> str:
    unknown = sorted(set(columns) - set(FRAME_COLUMNS))
    if unknown:
        raise ValueError(f"unknown sample column(s): {', '.join(unknown)}")
    return ", ".join(columns)


def _arrays(rows: list[Any], width: int, *, with_seq: bool) -> SampleArrays:
    first = 1 if with_seq else 0
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return SampleArrays(empty, empty, np.zeros(0, dtype=object), empty, np.zeros((0, width)))
    table = np.array(rows, dtype=object)
    return SampleArrays(
        table[:, 0].astype(np.int64) if with_seq else np.zeros(0, dtype=np.int64),
        table[:, first].astype(np.int64),
        table[:, first + 1],
        table[:, first + 2].astype(np.int64),
        table[:, first + 3 :].astype(np.float64),  # None -> NaN, booleans -> 0/1
    )


def max_sample_seq(connection: Connection) -> int:
    seq = arrival_column(connection)
    return int(
        connection.execute(text(f"SELECT COALESCE(MAX({seq}), 0) FROM samples")).scalar_one()
    )


def events_after(
    connection: Connection, cursor: int, *, limit: int = 50_000
) -> tuple[pd.DataFrame, list[int]]:
    """Events received after ``cursor`` (by ``events.id``), as the predictor's event frame."""
    sql = (
        "SELECT id, node, gpu, ts_ms, kind, xid, message FROM events WHERE id > :c "
        "ORDER BY id LIMIT :n"
    )
    rows = connection.execute(text(sql), {"c": cursor, "n": limit}).mappings().all()
    return event_frame(rows), [int(r["id"]) for r in rows]


def event_frame(rows: Sequence[Any]) -> pd.DataFrame:
    frame = pd.DataFrame(
        [
            {
                "node": r["node"],
                "gpu": None if r["gpu"] == NO_GPU else r["gpu"],
                "ts_ms": int(r["ts_ms"]),
                "kind": r["kind"],
                "xid": None if r["xid"] == NO_XID else r["xid"],
                "message": r["message"],
            }
            for r in rows
        ],
        columns=["node", "gpu", "ts_ms", "kind", "xid", "message"],
    )
    frame["gpu"] = frame["gpu"].astype("Int64")
    frame["xid"] = frame["xid"].astype("Int64")
    return frame.sort_values("ts_ms", kind="stable")  # index: position in arrival order


def events_window(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int | None = None,
    up_to_id: int | None = None,
) -> pd.DataFrame:
    """The events with ``since_ms <= ts_ms < until_ms`` (None: no end), and with ``up_to_id``
    only those received up to it (a later one reaches the control loop by its cursor)."""
    sql = "SELECT id, node, gpu, ts_ms, kind, xid, message FROM events WHERE ts_ms >= :s"
    if until_ms is not None:
        sql += " AND ts_ms < :u"
    if up_to_id is not None:
        sql += " AND id <= :i"
    params = {"s": since_ms, "u": until_ms, "i": up_to_id}
    return event_frame(connection.execute(text(sql), params).mappings().all())


def max_event_seq(connection: Connection) -> int:
    return int(connection.execute(text("SELECT COALESCE(MAX(id), 0) FROM events")).scalar_one())


# -- risk -------------------------------------------------------------------------------------


RISK_VERSION_KEY = "risk_version"
"""``control_state`` key stamped by every :func:`upsert_risk` (each control tick), in the same
transaction as the scores: readers that cache the fleet's scores key them on it."""


def risk_version(connection: Connection) -> str | None:
    """What changes whenever scores land (one primary-key row); None before the first."""
    return get_state(connection, RISK_VERSION_KEY)


def risk_rows(connection: Connection, *, node: str | None = None) -> list[Risk]:
    query = select(risk_latest)
    if node is not None:
        query = query.where(risk_latest.c.node == node)
    out = []
    for row in connection.execute(query.order_by(risk_latest.c.node, risk_latest.c.gpu)).mappings():
        item = dict(row)
        item["reasons"] = orjson.loads(item["reasons"])
        out.append(cast(Risk, item))
    return out


RISK_FLEET_COLUMNS = (
    "node",
    "gpu",
    "risk",
    "alarm",
    "reasons",
    "scored_ms",
    "last_seen_ms",
    "stale",
    "streak",
    "crossed",
    "failed",
    "gpu_last_seen_ms",
)
"""The columns of :func:`risk_fleet`'s tuples: ``risk_latest``'s (``reasons`` as stored JSON
text, booleans as the driver gives them), then the GPU's newest sample time from ``gpus``."""


def risk_fleet(connection: Connection) -> list[tuple[Any, ...]]:
    """Every scored GPU as a tuple of :data:`RISK_FLEET_COLUMNS`, unordered: the fleet-wide
    read (at 65,536 GPUs a mapping per row costs more than the query)."""
    r, g = risk_latest, gpus
    columns = [r.c[name] for name in RISK_FLEET_COLUMNS[:-1]]
    query = select(*columns, g.c.last_seen_ms).select_from(
        r.outerjoin(g, (g.c.node == r.c.node) & (g.c.gpu == r.c.gpu))
    )
    return [tuple(row) for row in connection.execute(query).all()]


def upsert_risk(connection: Connection, rows: Sequence[StoredRisk]) -> None:
    """Replace the latest score of each GPU in ``rows`` (keys: the columns of risk_latest),
    and stamp :data:`RISK_VERSION_KEY` (also with no rows: a tick happened)."""
    set_state(connection, RISK_VERSION_KEY, f"{time.time_ns():x}-{os.getpid():x}")
    if not rows:
        return
    names = [c.name for c in risk_latest.c]
    update = ", ".join(f"{n} = excluded.{n}" for n in names if n not in ("node", "gpu"))
    row = operator.itemgetter(*names)
    values = [row(r) for r in rows]
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        if connection.dialect.name == "sqlite":
            marks = ", ".join("?" * len(names))
            cursor.executemany(
                f"INSERT INTO risk_latest ({', '.join(names)}) VALUES ({marks}) "
                f"ON CONFLICT (node, gpu) DO UPDATE SET {update}",
                values,
            )
        else:
            # Copied into a session's staging table, then one upsert: at 95,000 rows 0.5-1.1 s
            # against 1.6 s for a statement a row.
            cursor.execute(
                "CREATE TEMP TABLE IF NOT EXISTS risk_stage (LIKE risk_latest) "
                "ON COMMIT DELETE ROWS"
            )
            _copy_in(cursor, "risk_stage", names, values)
            cursor.execute(
                f"INSERT INTO risk_latest ({', '.join(names)}) "
                f"SELECT {', '.join(names)} FROM risk_stage "
                f"ON CONFLICT (node, gpu) DO UPDATE SET {update}"
            )
    finally:
        cursor.close()


_HISTORY_COLUMNS = ("node", "gpu", "ts_ms", "risk", "alarm")


def append_history(connection: Connection, rows: Sequence[HistoryRow]) -> None:
    """Append risk history rows (keys: :data:`_HISTORY_COLUMNS`). On PostgreSQL one ``COPY``:
    100,000 rows (every GPU of a fleet that came up together) took 1.5 s as inserts."""
    if not rows:
        return
    names = ", ".join(_HISTORY_COLUMNS)
    row = operator.itemgetter(*_HISTORY_COLUMNS)
    values = [row(r) for r in rows]
    marks = ", ".join("?" * len(_HISTORY_COLUMNS))
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        if connection.dialect.name == "sqlite":
            cursor.executemany(f"INSERT INTO risk_history ({names}) VALUES ({marks})", values)
        else:
            _copy_in(cursor, "risk_history", _HISTORY_COLUMNS, values)
    finally:
        cursor.close()


def _copy_in(cursor: Any, table: str, names: Sequence[str], values: Iterable[Any]) -> None:
    """``values`` (tuples in the order of ``names``) into ``table`` through one text ``COPY``
    (PostgreSQL): a Python call a row, where an insert a row was a round trip."""
    with cursor.copy(f"COPY {table} ({', '.join(names)}) FROM STDIN") as copy:
        for v in values:
            copy.write_row(v)


def history(
    connection: Connection, *, node: str, gpu: int, since_ms: int, until_ms: int, limit: int
) -> list[RiskPoint]:
    query = (
        select(risk_history.c.ts_ms, risk_history.c.risk, risk_history.c.alarm)
        .where(
            risk_history.c.node == node,
            risk_history.c.gpu == gpu,
            risk_history.c.ts_ms >= since_ms,
            risk_history.c.ts_ms < until_ms,
        )
        .order_by(risk_history.c.ts_ms)
        .limit(limit)
    )
    return [cast(RiskPoint, dict(r)) for r in connection.execute(query).mappings()]


def prune_history(connection: Connection, *, before_ms: int) -> int:
    return int(
        connection.execute(delete(risk_history).where(risk_history.c.ts_ms < before_ms)).rowcount
    )


# -- jobs -------------------------------------------------------------------------------------


def upsert_job(
    connection: Connection, *, job: dict[str, Any], ranks: Iterable[dict[str, Any]]
) -> None:
    """Create or replace a job and its whole placement (a registration is the full picture)."""
    statement = _upsert(connection)(jobs).values(job)
    keep = {k: statement.excluded[k] for k in job if k not in ("job_id", "registered_ms")}
    connection.execute(statement.on_conflict_do_update(index_elements=["job_id"], set_=keep))
    connection.execute(delete(job_ranks).where(job_ranks.c.job_id == job["job_id"]))
    rows = [{"job_id": job["job_id"], **r} for r in ranks]
    if rows:
        connection.execute(insert(job_ranks), rows)


def heartbeat_job(connection: Connection, *, job_id: str, values: dict[str, Any]) -> bool:
    result = connection.execute(update(jobs).where(jobs.c.job_id == job_id).values(values))
    return bool(result.rowcount)


def get_jobs(connection: Connection, *, job_id: str | None = None) -> list[Job]:
    query = select(jobs).order_by(jobs.c.job_id)
    if job_id is not None:
        query = query.where(jobs.c.job_id == job_id)
    found = [dict(r) for r in connection.execute(query).mappings()]
    if not found:
        return []
    rq = select(job_ranks).order_by(job_ranks.c.job_id, job_ranks.c.slot)
    if job_id is not None:
        rq = rq.where(job_ranks.c.job_id == job_id)
    by_job: dict[str, list[dict[str, Any]]] = {}
    for r in connection.execute(rq).mappings():
        by_job.setdefault(r["job_id"], []).append({k: v for k, v in r.items() if k != "job_id"})
    tq = select(rank_timings)
    if job_id is not None:
        tq = tq.where(rank_timings.c.job_id == job_id)
    timed: dict[str, dict[int, dict[str, Any]]] = {}
    for t in connection.execute(tq).mappings():
        timed.setdefault(t["job_id"], {})[t["rank"]] = dict(t)
    for j in found:
        j["ranks"] = by_job.get(j["job_id"], [])
        mine = timed.get(j["job_id"], {})
        for r in j["ranks"]:
            r["timing"] = mine.get(r["rank"]) if r["role"] == "active" else None
        j["timings"] = list(mine.values())
    return cast(list[Job], found)


def store_timings(
    connection: Connection, *, job_id: str, timings: dict[str, Any], received_ms: int
) -> None:
    """Replace the step timing of every rank of ``job_id`` in ``timings`` (the columns of
    :class:`forewarn.wire.RankTimings`), keeping each rank's straggler state; ranks the
    heartbeat no longer lists are dropped, except a straggler's: its episode is ended by the
    control loop (moved, stale or its job ended), which a heartbeat that left the rank out
    for a moment (during its move) must not lose."""
    ranks = list(timings["rank"])
    names = ("job_id", "rank", *_TIMING_COLUMNS, "straggling")
    mark = _mark(connection)
    sql = (
        f"INSERT INTO rank_timings ({', '.join(_quoted(n) for n in names)}) "
        f"VALUES ({', '.join([mark] * len(names))}) "
        "ON CONFLICT (job_id, rank) DO UPDATE SET "
        + ", ".join(f"{_quoted(n)} = excluded.{_quoted(n)}" for n in _TIMING_COLUMNS)
    )
    window, step, total = timings["window"], timings["step"], timings.get("total_steps")
    # In rank order, the order the control loop writes a job's straggler states in: two
    # transactions that lock the same rows in one order cannot deadlock.
    rows = sorted(
        (job_id, rank, window, step, total, compute, wait, step_s, received_ms, False)
        for rank, compute, wait, step_s in zip(
            ranks, timings["compute_s"], timings["wait_s"], timings["step_s"], strict=True
        )
    )
    keep = set(ranks)
    listed = connection.execute(
        select(rank_timings.c.rank).where(
            rank_timings.c.job_id == job_id, rank_timings.c.straggling.is_(False)
        )
    ).scalars()
    gone = [r for r in listed if r not in keep]
    if gone:
        connection.execute(
            delete(rank_timings).where(
                rank_timings.c.job_id == job_id, rank_timings.c.rank.in_(gone)
            )
        )
    if not rows:
        return
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.executemany(sql, rows)
    finally:
        cursor.close()


def timing_rows(connection: Connection, *, job_id: str | None = None) -> list[RankTiming]:
    """Every stored rank timing with its straggler state, by job and rank."""
    query = select(rank_timings).order_by(rank_timings.c.job_id, rank_timings.c.rank)
    if job_id is not None:
        query = query.where(rank_timings.c.job_id == job_id)
    return [cast(RankTiming, dict(r)) for r in connection.execute(query).mappings()]


def set_straggler_state(
    connection: Connection, *, job_id: str, rank: int, values: dict[str, Any]
) -> None:
    """Write a rank's straggler state (keys of :data:`STRAGGLER_COLUMNS`)."""
    connection.execute(
        update(rank_timings)
        .where(rank_timings.c.job_id == job_id, rank_timings.c.rank == rank)
        .values(values)
    )


def _quoted(name: str) -> str:
    # "window" is a reserved word in both SQLite and PostgreSQL.
    return f'"{name}"'


def placements(connection: Connection) -> list[RankPlacement]:
    """Ranks and spares of every unfinished job: job_id, slot, rank, node, gpu, role."""
    query = (
        select(job_ranks)
        .join(jobs, jobs.c.job_id == job_ranks.c.job_id)
        .where(jobs.c.status.in_(("starting", "running", "paused")))
    )
    return [cast(RankPlacement, dict(r)) for r in connection.execute(query).mappings()]


def set_rank(connection: Connection, *, job_id: str, slot: int, values: dict[str, Any]) -> None:
    connection.execute(
        update(job_ranks)
        .where(job_ranks.c.job_id == job_id, job_ranks.c.slot == slot)
        .values(values)
    )


# -- migrations -------------------------------------------------------------------------------


def insert_migration(connection: Connection, row: NewMigration) -> bool:
    """Insert a migration; False (nothing written) when ``row`` is active and its (job, rank)
    already has an active migration (``ux_migrations_active_rank``)."""
    if row.get("state") not in ACTIVE_STATES:
        connection.execute(insert(migrations).values(row))
        return True
    statement = _upsert(connection)(migrations).values(row).on_conflict_do_nothing()
    return connection.execute(statement.returning(migrations.c.id)).first() is not None


def get_migration(
    connection: Connection, migration_id: str, *, for_update: bool = False
) -> Migration | None:
    query = select(migrations).where(migrations.c.id == migration_id)
    if for_update and connection.dialect.name == "postgresql":
        query = query.with_for_update()
    row = connection.execute(query).mappings().first()
    return _migration(row) if row is not None else None


def list_migrations(
    connection: Connection,
    *,
    job_id: str | None = None,
    states: Sequence[str] | None = None,
    limit: int = 1000,
) -> list[Migration]:
    query = select(migrations).order_by(migrations.c.requested_ms.desc()).limit(limit)
    if job_id is not None:
        query = query.where(migrations.c.job_id == job_id)
    if states:
        query = query.where(migrations.c.state.in_(list(states)))
    return [_migration(r) for r in connection.execute(query).mappings()]


def update_migration(
    connection: Connection, migration_id: str, *, expect: Sequence[str], values: dict[str, Any]
) -> bool:
    """Change a migration only if it is in one of ``expect`` (compare-and-set); True if it did."""
    result = connection.execute(
        update(migrations)
        .where(migrations.c.id == migration_id, migrations.c.state.in_(list(expect)))
        .values(values)
    )
    return bool(result.rowcount)


def _migration(row: Any) -> Migration:
    item = dict(row)
    item["reasons"] = orjson.loads(item["reasons"] or "[]")
    return cast(Migration, item)


# -- audit ------------------------------------------------------------------------------------


def write_audit(
    connection: Connection,
    *,
    ts_ms: int,
    kind: str,
    action: str,
    reason: str,
    node: str | None = None,
    gpu: int | None = None,
    job_id: str | None = None,
    migration_id: str | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    connection.execute(
        insert(audit).values(
            ts_ms=ts_ms,
            kind=kind,
            action=action,
            reason=reason,
            node=node,
            gpu=gpu,
            job_id=job_id,
            migration_id=migration_id,
            data=dumps(data or {}),
        )
    )


def read_audit(
    connection: Connection,
    *,
    since_ms: int | None = None,
    kind: str | None = None,
    migration_id: str | None = None,
    limit: int = 1000,
) -> list[dict[str, Any]]:
    query = select(audit).order_by(audit.c.seq).limit(limit)
    if since_ms is not None:
        query = query.where(audit.c.ts_ms >= since_ms)
    if kind is not None:
        query = query.where(audit.c.kind == kind)
    if migration_id is not None:
        query = query.where(audit.c.migration_id == migration_id)
    out = []
    for r in connection.execute(query).mappings():
        item = dict(r)
        item["data"] = orjson.loads(item["data"])
        out.append(item)
    return out


# -- drain, policy, state ---------------------------------------------------------------------


def set_drain(
    connection: Connection, *, node: str, drained: bool, ts_ms: int, reason: str | None
) -> None:
    statement = _upsert(connection)(node_drain).values(
        node=node, drained=drained, changed_ms=ts_ms, reason=reason
    )
    connection.execute(
        statement.on_conflict_do_update(
            index_elements=["node"],
            set_={"drained": drained, "changed_ms": ts_ms, "reason": reason},
        )
    )


def drained_nodes(connection: Connection) -> set[str]:
    query = select(node_drain.c.node).where(node_drain.c.drained.is_(True))
    return {r[0] for r in connection.execute(query)}


def read_policy(connection: Connection) -> dict[str, Any] | None:
    row = connection.execute(select(policy.c.data).where(policy.c.id == 1)).first()
    return orjson.loads(row[0]) if row is not None else None


def write_policy(connection: Connection, *, data: dict[str, Any], ts_ms: int) -> None:
    statement = _upsert(connection)(policy).values(id=1, data=dumps(data), updated_ms=ts_ms)
    connection.execute(
        statement.on_conflict_do_update(
            index_elements=["id"], set_={"data": dumps(data), "updated_ms": ts_ms}
        )
    )


def get_state(connection: Connection, key: str) -> str | None:
    row = connection.execute(
        select(control_state.c.value).where(control_state.c.key == key)
    ).first()
    return None if row is None else str(row[0])


def set_state(connection: Connection, key: str, value: str) -> None:
    statement = _upsert(connection)(control_state).values(key=key, value=value)
    connection.execute(
        statement.on_conflict_do_update(index_elements=["key"], set_={"value": value})
    )


# -- leadership fencing and the breaker's window ----------------------------------------------

LEADER_EPOCH_KEY = "leader_epoch"
"""``control_state`` key of the leadership epoch: raised by every take-over, compared by every
tick inside its own transaction (:func:`fence`)."""


def bump_epoch(connection: Connection) -> int:
    """Raise the leadership epoch (a new leader takes over); returns the new epoch.

    Waits for a tick that holds the epoch row (:func:`fence`) to end, so no tick of an
    earlier leader commits after this one."""
    statement = _upsert(connection)(control_state).values(key=LEADER_EPOCH_KEY, value="0")
    connection.execute(statement.on_conflict_do_nothing(index_elements=["key"]))
    query = select(control_state.c.value).where(control_state.c.key == LEADER_EPOCH_KEY)
    if connection.dialect.name == "postgresql":
        query = query.with_for_update()
    epoch = int(connection.execute(query).scalar_one()) + 1
    set_state(connection, LEADER_EPOCH_KEY, str(epoch))
    return epoch


def fence(connection: Connection, epoch: int) -> bool:
    """True if ``epoch`` is still the leadership epoch; run first in a tick's transaction.

    A compare-and-set that writes: it holds the epoch row (PostgreSQL: a row lock; SQLite: the
    database's write lock) until the tick commits, so a take-over waits for the tick to end
    and a deposed leader's tick finds the raised epoch and writes nothing."""
    result = connection.execute(
        update(control_state)
        .where(control_state.c.key == LEADER_EPOCH_KEY, control_state.c.value == str(epoch))
        .values(value=str(epoch))
    )
    return bool(result.rowcount)


# -- what the service shows of the loop ----------------------------------------------------------

STATUS_KEY = "control_status"
"""``control_state`` key of the leading loop's status (JSON), written by each of its ticks."""
BREAKER_RESET_KEY = "breaker_reset_ms"
"""``control_state`` key of the time an operator last reset the breaker."""


def publish_status(connection: Connection, status: dict[str, Any]) -> None:
    """Write the loop's ``status`` (:meth:`control.loop.ControlLoop.status`)."""
    set_state(connection, STATUS_KEY, dumps(status))


def _state_object(connection: Connection, key: str) -> dict[str, Any] | None:
    """The JSON object stored under ``key``; None when absent, or not a JSON object (written
    by hand, or cut short: the next tick rewrites it)."""
    text = get_state(connection, key)
    if not text:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def read_status(connection: Connection) -> dict[str, Any] | None:
    """The status the leading loop published last; None before its first tick."""
    return _state_object(connection, STATUS_KEY)


# -- partitioned scoring ------------------------------------------------------------------------


def beat_member(
    connection: Connection,
    *,
    member: str,
    now_ms: int,
    tick_ms: int | None = None,
    gpus: int = 0,
    payload: bytes | None = None,
    status: dict[str, Any] | None = None,
) -> None:
    """Say that ``member`` (a control process) is alive at ``now_ms``; with ``payload``, the
    scores of its share of the fleet at ``tick_ms`` (``gpus`` of them) replace its last, and
    ``status`` what it says of its ticks (JSON)."""
    values: dict[str, Any] = {"member": member, "seen_ms": now_ms}
    if payload is not None:
        values.update(tick_ms=tick_ms, gpus=gpus, payload=payload, status=dumps(status or {}))
    statement = _upsert(connection)(score_shards).values(**values)
    connection.execute(
        statement.on_conflict_do_update(
            index_elements=["member"], set_={k: v for k, v in values.items() if k != "member"}
        )
    )


def live_members(connection: Connection, *, since_ms: int) -> list[str]:
    """The members seen at or after ``since_ms``, by name."""
    query = (
        select(score_shards.c.member)
        .where(score_shards.c.seen_ms >= since_ms)
        .order_by(score_shards.c.member)
    )
    return [str(m) for m in connection.execute(query).scalars()]


class Shard(NamedTuple):
    """A follower's newest scores, as :func:`beat_member` wrote them."""

    member: str
    tick_ms: int
    gpus: int
    payload: bytes
    status: dict[str, Any]


def shards(connection: Connection, *, since_ms: int, besides: str) -> list[Shard]:
    """The newest scores of each live member but ``besides`` that has some."""
    c = score_shards.c
    query = select(c.member, c.tick_ms, c.gpus, c.payload, c.status).where(
        c.seen_ms >= since_ms, c.member != besides, c.payload.is_not(None)
    )
    found = []
    for member, tick_ms, count, payload, status in connection.execute(query):
        try:
            said = orjson.loads(status) if status else {}
        except orjson.JSONDecodeError:
            said = {}
        found.append(
            Shard(
                str(member),
                int(tick_ms),
                int(count),
                bytes(payload),
                said if isinstance(said, dict) else {},
            )
        )
    return found


def leave(connection: Connection, *, member: str) -> None:
    """Remove ``member`` (its process stops): the others share its buckets at their next tick."""
    connection.execute(delete(score_shards).where(score_shards.c.member == member))


def forget_members(connection: Connection, *, before_ms: int) -> int:
    """Remove the members not seen since ``before_ms`` (processes that died); how many.

    A row its member still holds (a process stopped inside its write, SIGSTOP) is skipped,
    not waited for: the leader's tick that calls this must not hang on it."""
    old = select(score_shards.c.member).where(score_shards.c.seen_ms < before_ms)
    if connection.dialect.name == "postgresql":
        old = old.with_for_update(skip_locked=True)
    result = connection.execute(delete(score_shards).where(score_shards.c.member.in_(old)))
    return int(result.rowcount)


WATCH_KEY = "straggler_watch"
"""``control_state`` key of the rank time the straggler watch judged (JSON: ``rank_ms``,
``since_ms``, ``last_ms``): the denominator of the fleet's own straggler rate."""


def add_watched(connection: Connection, *, ranks: int, now_ms: int, cap_ms: int) -> None:
    """Count ``ranks`` judged since the last tick that counted: ``ranks x`` the time since it
    (at most ``cap_ms``, so an outage of the loop counts as no watching). Written in the
    tick's transaction."""
    doc = read_watched(connection)
    if doc is None:
        if not ranks:
            return
        doc = {"rank_ms": 0, "since_ms": now_ms, "last_ms": now_ms}
    else:
        gap = min(max(0, now_ms - doc["last_ms"]), cap_ms)
        doc = {**doc, "rank_ms": doc["rank_ms"] + ranks * gap, "last_ms": now_ms}
    set_state(connection, WATCH_KEY, dumps(doc))


def read_watched(connection: Connection) -> dict[str, int] | None:
    """The rank time judged so far (:func:`add_watched`); None before the first."""
    doc = _state_object(connection, WATCH_KEY)
    try:
        return None if doc is None else {k: int(doc[k]) for k in ("rank_ms", "since_ms", "last_ms")}
    except (KeyError, TypeError, ValueError):
        return None


def straggler_episodes(connection: Connection, *, since_ms: int = 0) -> list[dict[str, Any]]:
    """Every straggler episode announced since ``since_ms``, oldest first: its
    ``rank.straggling`` event's data and, once it ended, its ``rank.recovered`` event's
    (``ended``; None while it lasts). An episode is keyed by job, rank and ``above_since_ms``."""
    rows = connection.execute(
        select(outbox.c.type, outbox.c.data)
        .where(
            outbox.c.type.in_(("rank.straggling", "rank.recovered")),
            outbox.c.ts_ms >= since_ms,
        )
        .order_by(outbox.c.seq)
    )
    episodes: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for kind, raw in rows:
        data = orjson.loads(raw)
        key = (data.get("job_id"), data.get("rank"), data.get("above_since_ms"))
        if kind == "rank.straggling":
            episodes[key] = {"started": data, "ended": None}
        elif key in episodes:
            episodes[key]["ended"] = data
    return list(episodes.values())


def reset_breaker(connection: Connection, *, ts_ms: int) -> None:
    """Reset the breaker: untrip it, and have the loop forget the crossings up to ``ts_ms``."""
    set_state(connection, "breaker_tripped_ms", "")
    set_state(connection, BREAKER_RESET_KEY, str(ts_ms))


def breaker_reset_ms(connection: Connection) -> int:
    """When an operator last reset the breaker (0: never)."""
    text = get_state(connection, BREAKER_RESET_KEY)
    return int(text) if text else 0


def crossings_since(connection: Connection, *, since_ms: int) -> list[int]:
    """When GPUs crossed the threshold (``risk.threshold_crossed`` events) since ``since_ms``
    and since an operator last reset the breaker, oldest first: the breaker's window."""
    reset = connection.execute(
        select(func.max(audit.c.ts_ms)).where(
            audit.c.kind == "policy", audit.c.action == "breaker_reset"
        )
    ).scalar()
    if reset is not None:
        since_ms = max(since_ms, int(reset) + 1)
    query = (
        select(outbox.c.ts_ms)
        .where(outbox.c.type == "risk.threshold_crossed", outbox.c.ts_ms >= since_ms)
        .order_by(outbox.c.ts_ms)
    )
    return [int(t) for t in connection.execute(query).scalars()]


# -- PostgreSQL arrival numbering -------------------------------------------------------------

_PG_ARRIVAL = (
    "CREATE SEQUENCE IF NOT EXISTS samples_arrival_seq",
    "ALTER TABLE samples ADD COLUMN IF NOT EXISTS arrival_seq BIGINT",
    "CREATE OR REPLACE FUNCTION samples_arrival() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN NEW.arrival_seq := nextval('samples_arrival_seq'); RETURN NEW; END $$",
    "CREATE OR REPLACE TRIGGER samples_arrival BEFORE INSERT ON samples "
    "FOR EACH ROW EXECUTE FUNCTION samples_arrival()",
    "CREATE INDEX IF NOT EXISTS ix_samples_arrival ON samples (arrival_seq)",
)


def ensure_arrival(connection: Connection) -> None:
    """Number samples in arrival order on PostgreSQL (idempotent; SQLite has ``rowid``).

    A trigger, not a column default: the ingest path stages rows in a ``LIKE samples`` table,
    which would copy a default and spend numbers twice. Run by revision ``0003_control`` and
    again by ``0007_arrival_after_tiers``, after ``0003_tiers`` rebuilt ``samples`` as a
    partitioned table (a revision that rebuilds ``samples`` again must run it too).
    Serialised by a transaction-scoped advisory lock.
    """
    if connection.dialect.name != "postgresql":
        return
    connection.execute(text("SELECT pg_advisory_xact_lock(4242004)"))
    for statement in _PG_ARRIVAL:
        connection.execute(text(statement))
