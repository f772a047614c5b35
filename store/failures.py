"""Failure records an operator keeps: the GPUs that really failed, as training labels.

Events say what a GPU reported (a fatal Xid, a lost GPU); an operator knows what happened (the
board was replaced, the "failure" was a driver bug, a node died with no event at all). A record
names a GPU, or a whole node (``gpu`` null), the time it failed and the failure kind. The
Parquet history's ``failures.parquet`` (:mod:`store.history`) takes the records as ground
truth: a record replaces a failure derived from events of the same GPU within ten minutes, and
a record with no such event adds one. A retracted record keeps its row and stops labelling.

Example::

    with store.begin() as tx:
        rec = record_failure(tx, node="n7", gpu=3, ts_ms=t, kind="memory", now_ms=now)
    with store.engine.connect() as c:
        frame = failure_records(c, since_ms=0, until_ms=now)
"""

from __future__ import annotations

import secrets
from typing import Any

import pandas as pd
from sqlalchemy import BigInteger, Column, Connection, Index, Integer, String, Table, select

from store.schema import metadata

__all__ = [
    "FAILURE_KINDS",
    "failure_records",
    "list_failures",
    "record_failure",
    "retract_failure",
]

FAILURE_KINDS = ("memory", "pcie", "nvlink", "thermal", "power_loss", "gpu_lost", "other")
"""The failure kinds of the dataset format (``docs/datasets.md``)."""

failure_records_table = Table(
    "failure_records",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("node", String(253), nullable=False),
    Column("gpu", Integer),
    Column("ts_ms", BigInteger, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("note", String(2000)),
    Column("recorded_ms", BigInteger, nullable=False),
    Column("retracted_ms", BigInteger),
    Index("ix_failure_records_ts", "ts_ms"),
)


def record_failure(
    connection: Connection,
    *,
    node: str,
    gpu: int | None,
    ts_ms: int,
    kind: str,
    now_ms: int,
    note: str | None = None,
) -> dict[str, Any]:
    """Keep one record; returns it."""
    if kind not in FAILURE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(FAILURE_KINDS)}")
    row = {
        "id": f"fail_{secrets.token_hex(8)}",
        "node": node,
        "gpu": gpu,
        "ts_ms": ts_ms,
        "kind": kind,
        "note": note,
        "recorded_ms": now_ms,
        "retracted_ms": None,
    }
    connection.execute(failure_records_table.insert().values(**row))
    return row


def list_failures(
    connection: Connection,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    include_retracted: bool = False,
    limit: int = 10_000,
) -> list[dict[str, Any]]:
    """Records by failure time, oldest first."""
    t = failure_records_table
    query = select(t).order_by(t.c.ts_ms, t.c.id).limit(limit)
    if since_ms is not None:
        query = query.where(t.c.ts_ms >= since_ms)
    if until_ms is not None:
        query = query.where(t.c.ts_ms < until_ms)
    if not include_retracted:
        query = query.where(t.c.retracted_ms.is_(None))
    return [dict(r) for r in connection.execute(query).mappings()]


def retract_failure(
    connection: Connection, record_id: str, *, now_ms: int
) -> dict[str, Any] | None:
    """Stop a record from labelling (the row stays); None: no such record."""
    t = failure_records_table
    row = connection.execute(select(t).where(t.c.id == record_id)).mappings().first()
    if row is None:
        return None
    if row["retracted_ms"] is None:
        connection.execute(t.update().where(t.c.id == record_id).values(retracted_ms=now_ms))
    return dict(row) | {"retracted_ms": row["retracted_ms"] or now_ms}


def failure_records(connection: Connection, *, since_ms: int, until_ms: int) -> pd.DataFrame:
    """The live records of a span as a frame (``ts_ms``, ``node``, ``gpu``, ``kind``), for
    :meth:`store.history.History.write_labels`."""
    rows = list_failures(connection, since_ms=since_ms, until_ms=until_ms, limit=10**9)
    frame = pd.DataFrame(rows, columns=["ts_ms", "node", "gpu", "kind"])
    return frame.astype({"ts_ms": "int64", "node": "str", "gpu": "Int64", "kind": "str"})
