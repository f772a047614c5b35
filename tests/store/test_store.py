"""The store on both backends: idempotent bulk writes, window reads, latest, retention."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forewarn.wire import Event, EventKind, GpuSample, to_ms
from store import Store
from store.reads import FRAME_COLUMNS
from store.writes import event_row, sample_row
from tests.factories import T0, sample, sample_dict


def rows(n_gpus: int = 4, ticks: int = 10, node: str = "node-0", start=T0):  # type: ignore[no-untyped-def]
    return [
        sample_row(sample(node=node, gpu=g, ts=start + timedelta(seconds=t), ecc_sbe_volatile=t))
        for t in range(ticks)
        for g in range(n_gpus)
    ]


def test_schema_is_at_head_after_open(store: Store) -> None:
    assert store.schema_is_current()
    store.migrate()  # idempotent
    assert store.schema_is_current()


def test_samples_are_stored_once(store: Store) -> None:
    batch = rows()
    assert store.write(samples=batch) == (40, 0)
    assert store.write(samples=batch) == (0, 0)
    # duplicates inside one batch count once as well
    assert store.write(samples=rows(ticks=11)[-4:] * 3) == (4, 0)
    frame = store.fleet_window(since_ms=0)
    assert len(frame) == 44
    assert not frame.duplicated(["node", "gpu", "ts_ms"]).any()


def test_gpu_window_round_trips_every_field(store: Store) -> None:
    original = sample(gpu=3, ts=T0, retired_pages_pending=True, ecc_deferred=7, util_mem_pct=12.5)
    store.write(samples=[sample_row(original)])
    frame = store.gpu_window(node="node-0", gpu=3, since_ms=0)
    assert list(frame.columns) == list(FRAME_COLUMNS)
    record = frame.iloc[0].to_dict()
    assert record.pop("ts_ms") == to_ms(T0)
    for name, value in original.model_dump(exclude={"ts"}).items():
        got = record[name]
        if value is None:
            assert pd.isna(got), name
        else:
            assert got == (value.value if hasattr(value, "value") else value), name


def test_window_bounds_fields_and_dtypes(store: Store) -> None:
    store.write(samples=rows(n_gpus=2, ticks=60))
    since, until = to_ms(T0 + timedelta(seconds=10)), to_ms(T0 + timedelta(seconds=20))
    frame = store.gpu_window(
        node="node-0", gpu=1, since_ms=since, until_ms=until, fields=["ecc_sbe_volatile"]
    )
    assert list(frame.columns) == ["ts_ms", "node", "gpu", "ecc_sbe_volatile"]
    assert frame["ts_ms"].tolist() == list(range(since, until, 1000))
    assert str(frame["ecc_sbe_volatile"].dtype) == "Int64"
    fleet = store.fleet_window(since_ms=since, until_ms=until)
    assert len(fleet) == 20
    assert fleet[["ts_ms", "node", "gpu"]].equals(
        fleet.sort_values(["ts_ms", "node", "gpu"])[["ts_ms", "node", "gpu"]]
    )
    assert str(fleet["remap_pending"].dtype) == "boolean"
    with pytest.raises(ValueError, match="unknown sample field"):
        store.gpu_window(node="node-0", gpu=1, fields=["temperature"])


def test_latest_sample_per_gpu_survives_late_arrivals(store: Store) -> None:
    store.write(samples=rows(n_gpus=2, ticks=5, start=T0 + timedelta(minutes=5)))
    store.write(samples=rows(n_gpus=2, ticks=5, start=T0))  # an older spool replayed later
    latest = store.latest_samples()
    assert latest["gpu"].tolist() == [0, 1]
    assert (latest["ts_ms"] == to_ms(T0 + timedelta(minutes=5, seconds=4))).all()
    assert store.latest_samples(node="elsewhere").empty


def test_latest_samples_page_through_the_fleet_in_key_order(store: Store) -> None:
    for node in ("node-b", "node-a", "node-c"):
        store.write(samples=rows(n_gpus=3, ticks=2, node=node))
    keys = [(n, g) for n in ("node-a", "node-b", "node-c") for g in range(3)]
    pages, after = [], None
    while True:
        page = store.latest_samples(after=after, limit=4)
        got = list(zip(page["node"], page["gpu"].astype(int), strict=True))
        pages.append(got)
        if len(got) < 4:
            break
        after = got[-1]
    assert [k for p in pages for k in p] == keys
    assert pages[0] == keys[:4] and pages[1] == keys[4:8]  # a page starts after the cursor
    assert (store.latest_samples()["ts_ms"] == to_ms(T0 + timedelta(seconds=1))).all()
    one = store.latest_samples(node="node-b", after=("node-b", 0))
    assert one["gpu"].tolist() == [1, 2]


@pytest.mark.postgres
def test_a_page_of_latest_samples_probes_one_sample_a_gpu_whatever_the_statistics(
    postgres_url: str,
) -> None:
    """A page of ``GET /v1/gpus`` on PostgreSQL reads one sample per GPU it lists: the hour's
    partition, never analysed (as every new hour's is at first), is not read whole."""
    from sqlalchemy import event

    from tests.conftest import reset_postgres

    reset_postgres(postgres_url)
    store = Store.open(postgres_url)
    try:
        for n in range(8):
            store.write(samples=rows(n_gpus=8, ticks=300, node=f"node-{n}"))
        statements: list[tuple[str, Any]] = []

        @event.listens_for(store.engine, "before_cursor_execute")
        def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
            statements.append((statement, parameters))

        page = store.latest_samples(after=("node-2", 7), limit=5)
        event.remove(store.engine, "before_cursor_execute", record)
        assert list(zip(page["node"], page["gpu"].astype(int), strict=True)) == [
            ("node-3", g) for g in range(5)
        ]
        statement, parameters = next(s for s in statements if "FROM gpus" in s[0])
        driver = store.engine.raw_connection()
        try:
            cursor = driver.cursor()
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters)
            explained: Any = cursor.fetchone()
            plan = explained[0][0]["Plan"]
        finally:
            driver.close()

        def sample_rows(node: dict[str, Any]) -> int:  # rows read from samples' partitions
            own = 0
            if node.get("Relation Name", "").startswith("samples"):
                own = (
                    node["Actual Rows"] * node["Actual Loops"]
                    + node.get("Rows Removed by Filter", 0) * node["Actual Loops"]
                )
            return own + sum(sample_rows(p) for p in node.get("Plans", []))

        assert sample_rows(plan) <= 5, f"the page read {sample_rows(plan)} samples of 19,200"
    finally:
        store.close()


def test_events_are_deduplicated_and_node_level_has_no_gpu(store: Store) -> None:
    xid = Event(node="node-0", gpu=2, ts=T0, kind=EventKind.XID, xid=79, source="kmsg")
    lost = Event(node="node-0", ts=T0, kind=EventKind.POWER_LOSS, message="PSU 2 lost")
    assert store.write(events=[event_row(xid), event_row(lost)]) == (0, 2)
    assert store.write(events=[event_row(xid), event_row(lost)]) == (0, 0)
    got = store.events(node="node-0")
    assert {(e["gpu"], e["xid"], e["kind"]) for e in got} == {
        (2, 79, "xid"),
        (None, None, "power_loss"),
    }
    assert [e["kind"] for e in store.events(kind="xid")] == ["xid"]


def test_nodes_report_gpus_and_agents(store: Store) -> None:
    store.write(
        samples=rows(n_gpus=8, ticks=1, node="node-7"),
        agent=(
            "node-7",
            {
                "agent_id": "a1",
                "source": "nvml",
                "version": "0.1.0",
                "started_ms": 1,
                "last_seen_ms": 2,
                "sent_total": 8,
                "spooled": 0,
                "dropped_total": 0,
                "interval_s": 1.0,
            },
        ),
    )
    (node,) = store.nodes()
    assert node["node"] == "node-7" and node["gpus"] == 8
    assert node["agents"][0]["agent_id"] == "a1"


def test_retention_drops_old_rows(store: Store) -> None:
    store.write(samples=rows(n_gpus=1, ticks=10))
    store.write(events=[event_row(Event(node="node-0", ts=T0, kind=EventKind.GPU_LOST, gpu=0))])
    removed = store.delete_before(to_ms(T0 + timedelta(seconds=5)))
    assert removed["samples"] == 5 and removed["events"] == 1
    assert len(store.fleet_window(since_ms=0)) == 5
    removed = store.delete_before(to_ms(T0 + timedelta(hours=1)))
    assert removed["gpus"] == 1 and store.latest_samples().empty


counters = st.one_of(st.none(), st.integers(min_value=0, max_value=2**48))
temps = st.one_of(st.none(), st.floats(min_value=-60, max_value=250, allow_nan=False))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sbe=counters, crc=counters, temp=temps, pending=st.one_of(st.none(), st.booleans()))
def test_any_valid_sample_round_trips_on_sqlite(tmp_path_factory, sbe, crc, temp, pending) -> None:  # type: ignore[no-untyped-def]
    store = Store.open(f"sqlite:///{tmp_path_factory.mktemp('h') / 'db'}")
    s = GpuSample.model_validate(
        sample_dict(
            ecc_sbe_aggregate=sbe, nvlink_crc_data=crc, temp_mem_c=temp, remap_pending=pending
        )
    )
    store.write(samples=[sample_row(s)])
    got = store.gpu_window(node="node-0", gpu=0).iloc[0]
    for name, value in (
        ("ecc_sbe_aggregate", sbe),
        ("nvlink_crc_data", crc),
        ("temp_mem_c", temp),
        ("remap_pending", pending),
    ):
        assert pd.isna(got[name]) if value is None else got[name] == value, name
    store.close()
