"""Samples handed to the writer as columns (``SampleColumns``) are stored exactly as the same
rows would be, through the writer thread and the writer process, on both backends; and many
concurrent writes group-commit without mixing up whose rows were new."""

from __future__ import annotations

from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pytest

from store import Store
from store.schema import SAMPLE_COLUMNS
from store.writes import SampleColumns, sample_row
from tests.factories import T0, sample


def _rows(node: str, ticks: int = 5, gpus: int = 4) -> list[tuple[Any, ...]]:
    return [
        sample_row(sample(node=node, gpu=g, ts=T0 + timedelta(seconds=t)))
        for t in range(ticks)
        for g in range(gpus)
    ]


def _as_columns(
    rows: list[tuple[Any, ...]], constant: frozenset[str] = frozenset()
) -> SampleColumns:
    """``rows`` as columns; the columns named in ``constant`` sent as their one value."""
    columns: list[list[Any]] = []
    flags = []
    for i, name in enumerate(SAMPLE_COLUMNS[1:], start=1):
        values = [r[i] for r in rows]
        if name in constant:
            assert len(set(values)) == 1, name
            values = values[:1]
        columns.append(values)
        flags.append(name in constant)
    return SampleColumns(rows[0][0], columns, len(rows), flags)


def test_columns_iterate_as_the_rows_they_hold() -> None:
    rows = _rows("n1")
    columns = _as_columns(rows, frozenset({"vendor", "mem_total_mib"}))
    assert len(columns) == len(rows)
    assert list(columns) == rows
    assert list(columns) == rows  # iterable more than once
    again = SampleColumns.from_wire(columns.to_wire())
    assert list(again) == rows


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_columns_and_rows_store_the_same(database_url: str, process: bool) -> None:
    store = Store.open(database_url, writer_process=process)
    try:
        rows = _rows("n1")
        assert store.write(samples=_as_columns(rows, frozenset({"vendor"}))) == (len(rows), 0)
        assert store.write(samples=rows) == (0, 0)  # the same rows: duplicates
        assert store.write(samples=_as_columns(rows)) == (0, 0)
        more = _rows("n2")
        assert store.write(samples=more) == (len(more), 0)
        frame = store.fleet_window(since_ms=0)
        stored = set(
            zip(frame["node"], frame["gpu"], frame["ts_ms"], frame["power_w"], strict=True)
        )
        power = SAMPLE_COLUMNS.index("power_w")
        assert stored == {(r[0], r[1], r[2], r[power]) for r in rows + more}
        assert store.gpu_count() == 8
    finally:
        store.close()


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_concurrent_writes_group_commit_and_count_their_own_rows(
    database_url: str, process: bool
) -> None:
    store = Store.open(database_url, writer_process=process)
    try:
        batches: list[Any] = []
        for i in range(40):
            rows = _rows(f"n{i % 10}", ticks=3)
            batches.append(_as_columns(rows) if i % 2 else rows)
        futures: list[Future[tuple[int, int]]] = [store.submit(samples=b) for b in batches]
        results = [f.result(60) for f in futures]
        # Each node's first batch is new (12 rows), the three after it are duplicates.
        assert [r[0] for r in results] == [12] * 10 + [0] * 30
        assert len(store.fleet_window(since_ms=0, fields=["gpu"])) == 10 * 12
    finally:
        store.close()
