"""The writer process (``FOREWARN_WRITER_PROCESS``): same answers as the writer thread, and a
child that dies fails only the writes in flight; the next write starts a new one."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest

from store import Store
from store.writes import sample_row
from tests.factories import T0, sample


def _rows(node: str, ticks: int = 10) -> list[tuple]:
    return [
        sample_row(sample(node=node, gpu=g, ts=T0 + timedelta(seconds=t)))
        for t in range(ticks)
        for g in range(4)
    ]


def test_the_writer_process_stores_once_and_survives_its_child(database_url: str) -> None:
    store = Store.open(database_url, writer_process=True)
    try:
        futures = [store.submit(samples=_rows(f"n{i}")) for i in range(6)]
        assert [f.result(60) for f in futures] == [(40, 0)] * 6
        assert store.write(samples=_rows("n0")) == (0, 0)  # duplicates, not errors
        os.kill(store._writer.pid, signal.SIGKILL)  # type: ignore[union-attr]
        # The write after the child died goes to a new child (or fails retryably at most once).
        try:
            result = store.write(samples=_rows("n9"))
        except Exception as exc:  # the write raced the dying child
            assert getattr(exc, "retryable", False), exc
            result = store.write(samples=_rows("n9"))
        assert result in ((40, 0), (0, 0))
        assert len(store.fleet_window(since_ms=0, fields=["gpu"])) == 7 * 40
    finally:
        store.close()


@pytest.mark.parametrize("rows", [0, 1])
def test_empty_and_tiny_writes(tmp_path, rows: int) -> None:  # type: ignore[no-untyped-def]
    store = Store.open(f"sqlite:///{tmp_path / 'w.db'}", writer_process=True)
    try:
        assert store.write(samples=_rows("n1")[:rows]) == (rows, 0)
    finally:
        store.close()
