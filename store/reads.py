"""Window reads: pandas frames of samples for one GPU or the whole fleet, events, nodes.

Sample frames have the columns of the dataset format (``docs/datasets.md``): ``ts_ms`` then
every field of :class:`forewarn.wire.GpuSample` except ``ts``, with nullable dtypes (``Int64``
counters, ``boolean`` flags), sorted by (ts_ms, node, gpu). The predictor reads live windows
and training datasets through the same columns, so one feature path serves both.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd
from sqlalchemy import Connection, select, text

from store import blocks
from store.schema import (
    BOOL_COLUMNS,
    FLOAT_COLUMNS,
    FRAME_COLUMNS,
    INT_COLUMNS,
    NO_GPU,
    NO_XID,
    gpus,
)

__all__ = [
    "FRAME_COLUMNS",
    "fleet_window",
    "gpu_count",
    "gpu_window",
    "has_gpu",
    "latest_samples",
    "nodes",
    "read_events",
    "stored_gpus",
]


_KEY = ("ts_ms", "node", "gpu")


def _columns(fields: Sequence[str] | None) -> list[str]:
    if not fields:
        return list(FRAME_COLUMNS)
    unknown = sorted(set(fields) - set(FRAME_COLUMNS))
    if unknown:
        raise ValueError(f"unknown sample field(s): {', '.join(unknown)}")
    return [*_KEY, *(c for c in FRAME_COLUMNS if c in fields and c not in _KEY)]


def _frame(rows: Sequence[Any], columns: list[str]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(rows, columns=columns)
    dtypes: dict[str, str] = {"ts_ms": "int64", "gpu": "int64"}
    for c in columns:
        if c in INT_COLUMNS:
            dtypes[c] = "Int64"
        elif c in BOOL_COLUMNS:
            dtypes[c] = "boolean"
        elif c in FLOAT_COLUMNS:
            dtypes[c] = "float64"
    try:
        with warnings.catch_warnings():  # a lossy cast warns: make it fail instead
            warnings.simplefilter("error", RuntimeWarning)
            return frame.astype(dtypes)
    except (TypeError, ValueError, OverflowError, RuntimeWarning):
        pass
    # An integer column with NULLs arrives as float64, and a value near 2**63 (stored before
    # ingest bounded it) has no exact float: rebuild such columns from the rows themselves.
    for c, dtype in dtypes.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                frame[c] = frame[c].astype(dtype)  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError, RuntimeWarning):
            if dtype != "Int64":
                raise
            at = columns.index(c)
            frame[c] = pd.array([_int_or_none(row[at]) for row in rows], dtype="Int64")
    return frame


def _int_or_none(value: Any) -> int | None:
    """An int64 value, or None for NULL or what no int64 holds."""
    if value is None:
        return None
    number = int(value)
    return number if -(2**63) <= number < 2**63 else None


def gpu_window(
    connection: Connection,
    *,
    node: str,
    gpu: int,
    since_ms: int | None = None,
    until_ms: int | None = None,
    fields: Sequence[str] | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """Samples of one GPU with ``since_ms <= ts_ms < until_ms``, oldest first."""
    columns = _columns(fields)
    sql = f"SELECT {', '.join(columns)} FROM samples WHERE node = :node AND gpu = :gpu"
    params: dict[str, Any] = {"node": node, "gpu": gpu}
    sql += _time_filter(params, since_ms, until_ms)
    sql += " ORDER BY ts_ms"
    if limit is not None:
        sql += " LIMIT :limit"
        params["limit"] = limit
    wide = _frame(connection.execute(text(sql), params).all(), columns)
    frame = blocks.with_packed(
        connection, wide, since_ms=since_ms, until_ms=until_ms, node=node, gpu=gpu
    )
    return frame if limit is None or len(frame) <= limit else frame.head(limit)


def fleet_window(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int | None = None,
    fields: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Samples of every GPU in the window, sorted by (ts_ms, node, gpu)."""
    columns = _columns(fields)
    params: dict[str, Any] = {}
    sql = f"SELECT {', '.join(columns)} FROM samples WHERE 1=1"
    sql += _time_filter(params, since_ms, until_ms)
    sql += " ORDER BY ts_ms, node, gpu"
    wide = _frame(connection.execute(text(sql), params).all(), columns)
    return blocks.with_packed(connection, wide, since_ms=since_ms, until_ms=until_ms)


def latest_samples(
    connection: Connection,
    *,
    node: str | None = None,
    after: tuple[str, int] | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """The newest sample of every GPU (or of one node's GPUs), sorted by (node, gpu).

    Args:
        after: only GPUs after this (node, gpu) in that order (the page cursor).
        limit: at most this many GPUs.
    """
    columns = list(FRAME_COLUMNS)
    keys = {"node": "g.node", "gpu": "g.gpu"}
    select = ", ".join(keys.get(c, f"s.{c}") for c in columns) + ", g.last_seen_ms"
    if connection.dialect.name == "postgresql":
        # Driven by the registry in key order, one primary-key probe a GPU, whatever the
        # planner believes of the hour's partition: joined plainly, a partition whose
        # statistics lag its rows (every new hour's) was read whole, in parallel, for one
        # page (the whole hour at 16,384 GPUs: 59 million rows). A LATERAL with a LIMIT
        # cannot be flattened into that join.
        sql = (
            f"SELECT {select} FROM gpus g LEFT JOIN LATERAL (SELECT * FROM samples "
            "WHERE node = g.node AND gpu = g.gpu AND ts_ms = g.last_seen_ms LIMIT 1) s "
            "ON true WHERE 1=1"
        )
    else:
        sql = (
            f"SELECT {select} FROM gpus g LEFT JOIN samples s "
            "ON s.node = g.node AND s.gpu = g.gpu AND s.ts_ms = g.last_seen_ms WHERE 1=1"
        )
    params: dict[str, Any] = {}
    if node is not None:
        sql += " AND g.node = :node"
        params["node"] = node
    if after is not None:  # a row comparison: where the page starts in the key's index
        sql += " AND (g.node, g.gpu) > (:after_node, :after_gpu)"
        params["after_node"], params["after_gpu"] = after
    sql += " ORDER BY g.node, g.gpu"
    if limit is not None:
        sql += " LIMIT :limit"
        params["limit"] = limit
    rows = connection.execute(text(sql), params).all()
    wide = _frame([r[:-1] for r in rows if r[0] is not None], columns)
    # A GPU silent since an hour that was packed has its newest sample in a block; one that
    # left the raw tier altogether has none, and is left out as before.
    silent = [(r[1], int(r[2]), int(r[-1])) for r in rows if r[0] is None]
    packed = blocks.samples_at(connection, silent)
    if not len(packed):
        return wide
    frame = blocks.merge(wide, packed)
    return frame.sort_values(["node", "gpu"], kind="stable", ignore_index=True)


def read_events(
    connection: Connection,
    *,
    node: str | None = None,
    gpu: int | None = None,
    kind: str | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
    limit: int = 1000,
) -> list[dict[str, Any]]:
    """Events, newest first; node-level events have ``gpu`` None."""
    params: dict[str, Any] = {"limit": limit}
    sql = "SELECT id, node, gpu, ts_ms, kind, xid, message, source FROM events WHERE 1=1"
    for name, value in (("node", node), ("gpu", gpu), ("kind", kind)):
        if value is not None:
            sql += f" AND {name} = :{name}"
            params[name] = value
    sql += _time_filter(params, since_ms, until_ms)
    sql += " ORDER BY ts_ms DESC, id DESC LIMIT :limit"
    out = []
    for row in connection.execute(text(sql), params).mappings():
        item = dict(row)
        item["gpu"] = None if item["gpu"] == NO_GPU else item["gpu"]
        item["xid"] = None if item["xid"] == NO_XID else item["xid"]
        out.append(item)
    return out


def nodes(connection: Connection) -> list[dict[str, Any]]:
    """Every node: GPU count, newest sample time and its collectors' heartbeats."""
    sql = (
        "SELECT node, COUNT(*) AS gpus, MIN(first_seen_ms) AS first_seen_ms, "
        "MAX(last_seen_ms) AS last_seen_ms FROM gpus GROUP BY node ORDER BY node"
    )
    result = {r["node"]: {**r, "agents": []} for r in connection.execute(text(sql)).mappings()}
    agent_sql = "SELECT * FROM agents ORDER BY node, agent_id"
    for row in connection.execute(text(agent_sql)).mappings():
        entry = result.setdefault(
            row["node"],
            {
                "node": row["node"],
                "gpus": 0,
                "first_seen_ms": None,
                "last_seen_ms": None,
                "agents": [],
            },
        )
        entry["agents"].append({k: v for k, v in row.items() if k != "node"})
    return [dict(v) for _, v in sorted(result.items())]


def _time_filter(params: dict[str, Any], since_ms: int | None, until_ms: int | None) -> str:
    sql = ""
    if since_ms is not None:
        sql += " AND ts_ms >= :since_ms"
        params["since_ms"] = since_ms
    if until_ms is not None:
        sql += " AND ts_ms < :until_ms"
        params["until_ms"] = until_ms
    return sql


def gpu_count(connection: Connection) -> int:
    """GPUs with at least one stored sample (a key count of the registry)."""
    return int(connection.execute(text("SELECT COUNT(*) FROM gpus")).scalar_one())


def stored_gpus(
    connection: Connection, *, nodes: Iterable[str] | None = None
) -> set[tuple[str, int]]:
    """(node, gpu) of every GPU with a stored sample, or of those on ``nodes``."""
    query = select(gpus.c.node, gpus.c.gpu)
    if nodes is not None:
        query = query.where(gpus.c.node.in_(sorted(set(nodes))))
    return {(row[0], row[1]) for row in connection.execute(query)}


def has_gpu(connection: Connection, *, node: str, gpu: int) -> bool:
    sql = "SELECT 1 FROM gpus WHERE node = :node AND gpu = :gpu"
    return connection.execute(text(sql), {"node": node, "gpu": gpu}).first() is not None
