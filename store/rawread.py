"""Bulk sample reads for the tiers: the driver's tuples turned into a frame column by column.

The tiering task reads every raw sample once (a million an hour at 256 GPUs, 59 million at
16,384), and a minute-resolution window reads up to an hour of one GPU's rows. Building a
frame from SQLAlchemy ``Row`` objects costs several times the query itself; these reads take
the DBAPI cursor's plain tuples and convert each column once. The frame has the dataset's
columns and dtypes, as :mod:`store.reads` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Connection, text

from store import blocks
from store.reads import FRAME_COLUMNS
from store.schema import BOOL_COLUMNS, FLOAT_COLUMNS, INT_COLUMNS

__all__ = ["fetch_samples", "samples_between"]


def _column(name: str, values: Sequence[Any]) -> Any:
    if name in ("ts_ms", "gpu"):
        return np.fromiter(values, dtype=np.int64, count=len(values))
    if name in FLOAT_COLUMNS:
        return np.array(values, dtype=np.float64)  # None becomes NaN
    if name in INT_COLUMNS:
        return pd.array(values, dtype="Int64")
    if name in BOOL_COLUMNS:
        return pd.array(values, dtype="boolean")
    return np.array(values, dtype=object)


def fetch_samples(
    connection: Connection, sql: str, params: dict[str, Any], columns: Sequence[str]
) -> pd.DataFrame:
    """Run ``sql`` (selecting ``columns`` in order) and return the rows as a sample frame."""
    result = connection.execute(text(sql), params)
    cursor = result.cursor
    rows = cursor.fetchall() if cursor is not None else []
    result.close()
    if not rows:
        return pd.DataFrame(
            {c: pd.Series(_column(c, []), dtype=None) for c in columns}, columns=list(columns)
        )
    transposed = list(zip(*rows, strict=True))
    return pd.DataFrame({c: _column(c, transposed[i]) for i, c in enumerate(columns)})


def samples_between(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int,
    node: str | None = None,
    gpu: int | None = None,
    counted: list[int] | None = None,
) -> pd.DataFrame:
    """Raw samples with ``since_ms <= ts_ms < until_ms`` (of one node or GPU), sorted by
    (ts_ms, node, gpu): the wide rows and the packed ones (:mod:`store.blocks`).

    Args:
        counted: the number of wide rows read is appended here (what the tiering task checks
            before it drops an hour's wide rows)."""
    columns = list(FRAME_COLUMNS)
    sql = f"SELECT {', '.join(columns)} FROM samples WHERE ts_ms >= :a AND ts_ms < :b"
    params: dict[str, Any] = {"a": since_ms, "b": until_ms}
    if node is not None:
        sql += " AND node = :node"
        params["node"] = node
    if gpu is not None:
        sql += " AND gpu = :gpu"
        params["gpu"] = gpu
    sql += " ORDER BY ts_ms" if gpu is not None else " ORDER BY ts_ms, node, gpu"
    wide = fetch_samples(connection, sql, params, columns)
    if counted is not None:
        counted.append(len(wide))
    return blocks.with_packed(
        connection, wide, since_ms=since_ms, until_ms=until_ms, node=node, gpu=gpu
    )
