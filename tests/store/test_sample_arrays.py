"""The control loop's reads of samples as arrays: on PostgreSQL a binary COPY parsed by NumPy,
which must give exactly what the driver's rows give (nulls, booleans, big counters, several
nodes and hours, the bucket filter, the bounds and the limit)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import pytest

from predictor.state import VALUE_COLUMNS
from store import Store
from store import control as db
from store.writes import sample_row
from tests.factories import T0, sample


@pytest.fixture
def pg_store(postgres_url: str) -> Iterator[Store]:
    from tests.conftest import reset_postgres

    reset_postgres(postgres_url)
    store = Store.open(postgres_url)
    yield store
    store.close()


def _fill(store: Store) -> None:
    rows = []
    for t in range(0, 7200, 600):  # two hours: two partitions
        for n, node in enumerate(("gpu-node-a", "b", "a-much-longer.node-name.example.org")):
            for g in range(3):
                rows.append(
                    sample_row(
                        sample(
                            node=node,
                            gpu=g,
                            ts=T0 + timedelta(seconds=t + n),
                            ecc_sbe_volatile=None if g == 1 else t,
                            ecc_sbe_aggregate=2**48 - t,  # the wire's largest counter
                            remap_pending=bool(t % 1200) if g != 2 else None,
                            power_w=None if (t, g) == (600, 0) else 300.125 + t / 7,
                            throttle_reasons=2**40 + g,
                        )
                    )
                )
    store.write(samples=rows)


def _same(fast: db.SampleArrays, rows: db.SampleArrays) -> None:
    np.testing.assert_array_equal(fast.seq, rows.seq)
    np.testing.assert_array_equal(fast.ts_ms, rows.ts_ms)
    assert fast.node.tolist() == rows.node.tolist()
    np.testing.assert_array_equal(fast.gpu, rows.gpu)
    np.testing.assert_array_equal(fast.values, rows.values)  # NaN where null, equal in place
    assert fast.values.dtype == rows.values.dtype == np.float64


@pytest.mark.postgres
def test_the_binary_read_gives_what_the_rows_give(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(pg_store)
    monkeypatch.setattr(db, "_NODE_NAMES", {})
    with pg_store.engine.connect() as c:
        buckets = sorted(set(db.node_buckets(c, ["b", "gpu-node-a"]).values()))
    reads = [
        lambda c: db.sample_arrays_after(c, 0, VALUE_COLUMNS, limit=1_000),
        lambda c: db.sample_arrays_after(c, 10, VALUE_COLUMNS, limit=25, until=60),
        lambda c: db.sample_arrays_after(c, 0, VALUE_COLUMNS, limit=1_000, buckets=buckets),
        lambda c: db.sample_arrays_after(c, 10_000, VALUE_COLUMNS, limit=1_000),  # none
        lambda c: db.sample_arrays_in(c, VALUE_COLUMNS, since_ms=0, until_ms=None),
        lambda c: db.sample_arrays_in(
            c, ["remap_pending", "power_w"], since_ms=0, until_ms=None, buckets=buckets
        ),
    ]
    with pg_store.engine.connect() as c:
        fast = [read(c) for read in reads]
    assert len(fast[0].seq) == 108 and len(fast[1].seq) == 25 and len(fast[3].seq) == 0
    assert set(fast[2].node.tolist()) == {"b", "gpu-node-a"}
    assert len(db._NODE_NAMES) == 3  # the binary path read them (it alone learns names)
    assert np.isnan(fast[0].values).any()
    assert fast[4].values[:, VALUE_COLUMNS.index("ecc_sbe_aggregate")].max() == 2**48
    monkeypatch.setattr(db, "_pg_arrays", lambda *a, **k: None)  # the driver's rows
    with pg_store.engine.connect() as c:
        for got, read in zip(fast, reads, strict=True):
            _same(got, read(c))


@pytest.mark.postgres
def test_two_nodes_on_one_hash_are_read_as_rows(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(pg_store)
    monkeypatch.setattr(db, "_NODE_NAMES", {})
    monkeypatch.setattr(db, "_NODE_HASH", "0::int8")  # every name on one hash
    with pg_store.engine.connect() as c:
        got = db.sample_arrays_after(c, 0, VALUE_COLUMNS, limit=1_000)
    assert sorted(set(got.node.tolist())) == [
        "a-much-longer.node-name.example.org",
        "b",
        "gpu-node-a",
    ]
    assert db._NODE_NAMES == {}


@pytest.mark.postgres
def test_a_binary_read_not_laid_out_as_asked_is_read_as_rows(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(pg_store)
    with pg_store.engine.connect() as c:
        want = db.sample_arrays_after(c, 0, VALUE_COLUMNS, limit=1_000)
    monkeypatch.setattr(db, "_NODE_HASH", "NULL::int8")  # a field that comes null
    with pg_store.engine.connect() as c:
        _same(db.sample_arrays_after(c, 0, VALUE_COLUMNS, limit=1_000), want)


def test_the_reads_by_arrival_go_through_the_arrival_index_whatever_the_statistics(
    pg_store: Store,
) -> None:
    # Analysed, a partition the read takes whole is cheaper to scan and sort than to walk by
    # its index: the planner's choice whenever its statistics make the newest rows look many
    # (they lag the rows), and then it scanned the whole hour every tick. The reads by arrival
    # walk the index: no sequential scan of any partition, and no JIT.
    _fill(pg_store)
    with pg_store.engine.begin() as c:
        c.exec_driver_sql("ANALYZE samples")
    for read in (
        lambda c: db.sample_arrays_after(c, 0, VALUE_COLUMNS, limit=10_000),
        lambda c: db.arrival_seqs_after(c, 0, limit=10_000),
        lambda c: db.samples_after(c, 0),
    ):
        with pg_store.engine.connect() as c:
            # This backend's counts not yet reported (earlier transactions' included): the
            # read's own are what it adds to them.
            scans = "SELECT relname, seq_scan FROM pg_stat_xact_user_tables WHERE relname LIKE %s"
            before = dict(c.exec_driver_sql(scans, ("samples%",)).all())
            assert len(read(c)) > 0
            after = dict(c.exec_driver_sql(scans, ("samples%",)).all())
            assert {t: n - before.get(t, 0) for t, n in after.items() if n > before.get(t, 0)} == {}
            assert c.exec_driver_sql("SHOW jit").scalar_one() == "off"
