"""Group commit: many concurrent writers, every caller told exactly what was new."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from store import Store
from store.writes import sample_row
from tests.factories import T0, sample


def node_rows(node: int, ticks: int = 20) -> list[tuple]:
    return [
        sample_row(sample(node=f"node-{node}", gpu=g, ts=T0 + timedelta(seconds=t)))
        for t in range(ticks)
        for g in range(8)
    ]


def test_concurrent_writers_each_get_their_own_counts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db'}"
    first, second = Store.open(url), Store.open(url)  # two processes' worth of writers
    batches = [node_rows(n) for n in range(24)]
    try:
        with ThreadPoolExecutor(8) as pool:
            stores = [first, second] * 12
            results = list(
                pool.map(lambda sb: sb[0].write(samples=sb[1]), zip(stores, batches, strict=True))
            )
            assert results == [(160, 0)] * 24
            again = list(
                pool.map(lambda sb: sb[0].write(samples=sb[1]), zip(stores, batches, strict=True))
            )
            assert again == [(0, 0)] * 24
        assert len(first.fleet_window(since_ms=0)) == 24 * 160
    finally:
        first.close()
        second.close()


def test_a_failed_transaction_fails_its_callers_and_the_writer_goes_on(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'db'}")
    try:
        with store.begin() as tx:
            tx.execute(text("ALTER TABLE samples RENAME TO samples_away"))
        with pytest.raises(Exception, match="samples"):
            store.write(samples=node_rows(0, ticks=1))
        with store.begin() as tx:
            tx.execute(text("ALTER TABLE samples_away RENAME TO samples"))
        assert store.write(samples=node_rows(0, ticks=1)) == (8, 0)
    finally:
        store.close()
