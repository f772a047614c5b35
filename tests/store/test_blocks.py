"""Packed raw hours (store/blocks.py) on both backends: the codec is lossless, a window reads
the same before and after its hours are packed, the hour's wide rows go in the same
transaction, rows that reach a packed hour are read and packed again, and rows that arrive
while an hour is being packed are never lost."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import event, text

from store import Store, blocks, partitions, reads, schema, tiering, tiers
from store.rawread import samples_between
from tests.conftest import reset_postgres
from tests.store.test_tiers import HOUR, START, raw_frame, rows_of

POLICY = tiers.TierPolicy(raw_window_s=24 * 3600.0, rollup_window_s=30 * 86400.0)
MINUTE = 60_000


def frame_of(rows: list[tuple]) -> pd.DataFrame:
    """Rows in ``samples`` column order as the frame the raw reads give."""
    return reads._frame(
        [(r[2], r[0], r[1], *r[3:]) for r in rows], list(reads.FRAME_COLUMNS)
    ).sort_values(["ts_ms", "node", "gpu"], ignore_index=True)


def awkward_rows() -> list[tuple]:
    """One GPU-minute with every kind of value a column can hold: NULLs in each type, the
    int64 limits, NaN-free floats of every size, -0.0, infinities, a UUID that changes
    mid-minute and a vendor that goes missing."""
    n = len(schema.SAMPLE_COLUMNS)
    out = []
    for k in range(12):
        row: list[object] = [None] * n
        row[0], row[1], row[2] = "node-z", 3, START + 5 * k * 1000
        row[3] = "GPU-old" if k < 5 else "GPU-new"
        row[4] = None if k == 7 else "nvidia"
        for i, name in enumerate(schema.SAMPLE_COLUMNS[5:], start=5):
            if (i + k) % 5 == 0:
                continue  # NULL
            if name in schema.FLOAT_COLUMNS:
                row[i] = [0.1, -0.0, 1e308, -5e-324, float("inf"), 65.0, 350.123][(i + k) % 7]
            elif name in schema.BOOL_COLUMNS:
                row[i] = bool((i * k) % 2)
            else:
                row[i] = [2**63 - 1, -(2**63), 0, 7, 1 << 40][(i + k) % 5]
        out.append(tuple(row))
    return out


def plain_rows(gpu: int, minute: int) -> list[tuple]:
    """A GPU-minute of whole and two-place values: the columns a block keeps as decimals."""
    out = []
    for k in range(6):
        row = [0.0 if name in schema.FLOAT_COLUMNS else 0 for name in schema.SAMPLE_COLUMNS]
        row[:5] = ["node-z", gpu, START + minute * MINUTE + 10_000 * k, "GPU-p", "nvidia"]
        for i, name in enumerate(schema.SAMPLE_COLUMNS[5:], start=5):
            if name in schema.FLOAT_COLUMNS:
                row[i] = 300.0 + 0.25 * k + i if name == "power_w" else float(60 + k)
            elif name in schema.BOOL_COLUMNS:
                row[i] = False
        out.append(tuple(row))
    return out


def test_a_block_gives_back_every_value_it_was_given() -> None:
    # Blocks packed together: one of every kind of value beside plain ones, so that each
    # block's columns are encoded by what that block holds, not its neighbours.
    rows = [*plain_rows(2, 0), *awkward_rows(), *plain_rows(3, 1), *plain_rows(4, 0)]
    want = frame_of(rows)
    packed = blocks.block_rows(want)
    assert [(r["node"], r["gpu"], r["start_ms"], r["n"]) for r in packed] == [
        ("node-z", 2, START, 6),
        ("node-z", 3, START, 12),
        ("node-z", 3, START + MINUTE, 6),
        ("node-z", 4, START, 6),
    ]
    got = blocks._sorted(blocks._decoded([(r["node"], r["gpu"], r["data"]) for r in packed]))
    pd.testing.assert_frame_equal(got, want)
    # -0.0 stays negative zero: the floats' bits, not their values, go through.
    signs = np.signbit(got["temp_gpu_c"].to_numpy()) == np.signbit(want["temp_gpu_c"].to_numpy())
    assert signs.all()
    alone = blocks.unpack(packed[1]["data"])[1]  # the awkward block, as one blob
    assert alone["uuid"].tolist() == ["GPU-old"] * 5 + ["GPU-new"] * 7
    with pytest.raises(ValueError, match="known version"):
        blocks.unpack(b"FWB\x09" + packed[0]["data"][4:])


def test_the_blob_layout_is_the_sample_schema_so_a_new_column_needs_a_new_version() -> None:
    ints, floats = blocks.LAYOUTS[blocks.VERSION]
    assert set(ints[1:]) == set(schema.INT_COLUMNS) | set(schema.BOOL_COLUMNS)
    assert set(floats) == set(schema.FLOAT_COLUMNS)


def test_a_minute_of_a_gpu_costs_a_few_bytes_a_sample() -> None:
    raw = raw_frame(gpus=4, hours=1, step_s=1)
    packed = blocks.block_rows(frame_of(rows_of(raw)))
    assert len(packed) == 4 * 60
    per_sample = sum(len(r["data"]) for r in packed) / len(raw)
    assert per_sample < 40  # the wide row: 188 B on SQLite, ~450 B on PostgreSQL


def reads_of(store: Store) -> dict[str, pd.DataFrame]:
    """Every raw read of the store's first three hours."""
    window = {"since_ms": START, "until_ms": START + 3 * HOUR}
    out = {}
    with store.engine.connect() as c:
        out["samples_between"] = samples_between(c, **window)
        out["fleet_window"] = reads.fleet_window(c, **window)
        out["gpu_window"] = reads.gpu_window(c, node="node-a", gpu=1, **window)
        out["gpu_window fields"] = reads.gpu_window(
            c, node="node-a", gpu=0, fields=["ecc_sbe_volatile", "uuid"], limit=500, **window
        )
        out["latest"] = reads.latest_samples(c)
        out["predecessors"] = tiers.predecessors(c, START + 2 * HOUR)
        out["minutes"] = tiers._minutes(c, since_ms=START + 30 * MINUTE, until_ms=START + 3 * HOUR)
    return out


def wide_rows(store: Store, since_ms: int, until_ms: int) -> int:
    with store.engine.connect() as c:
        sql = "SELECT COUNT(*) FROM samples WHERE ts_ms >= :a AND ts_ms < :b"
        return int(c.execute(text(sql), {"a": since_ms, "b": until_ms}).scalar_one())


def test_a_packed_hour_reads_as_it_did_and_its_wide_rows_are_gone(store: Store) -> None:
    raw = raw_frame(gpus=3, hours=3, step_s=5)
    silent = raw[(raw["gpu"] != 2) | (raw["ts_ms"] < START + 40 * MINUTE)]  # GPU 2 stops
    store.write(samples=rows_of(silent))
    before = reads_of(store)
    report = store.maintain_tiers(POLICY, now_ms=START + 3 * HOUR + 11 * MINUTE)
    assert report.hours_rolled == 3 and report.hours_packed == 3
    assert wide_rows(store, START, START + 3 * HOUR) == 0
    with store.engine.connect() as c:
        stored = c.execute(text("SELECT COUNT(*), SUM(n) FROM sample_blocks")).one()
    assert tuple(stored) == (len(silent.groupby(["gpu", silent["ts_ms"] // MINUTE])), len(silent))
    after = reads_of(store)
    for name, frame in before.items():
        pd.testing.assert_frame_equal(after[name], frame, obj=name)
    latest = after["latest"]
    assert latest[latest["gpu"] == 2]["ts_ms"].tolist() == [START + 40 * MINUTE - 5000]


def test_the_newest_samples_of_gpus_silent_since_packed_hours_are_read_together(
    store: Store,
) -> None:
    """A page of the fleet whose GPUs fell silent in packed hours reads their newest samples
    from the blocks in one query, not one query a GPU, and reads as before the packing."""
    raw = pd.concat(
        [raw_frame(gpus=8, hours=2, step_s=30).assign(node=f"node-{n}") for n in range(5)],
        ignore_index=True,
    )
    stops = {(n, g): START + (5 + 3 * g + n) * MINUTE for n in range(5) for g in range(8)}
    stop = raw.apply(lambda r: stops[(int(r["node"][-1]), r["gpu"])], axis=1)
    store.write(samples=rows_of(raw[raw["ts_ms"] < stop]))
    with store.engine.connect() as c:
        before = reads.latest_samples(c)
    store.maintain_tiers(POLICY, now_ms=START + 3 * HOUR + 11 * MINUTE)
    assert wide_rows(store, START, START + 2 * HOUR) == 0
    statements: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        with store.engine.connect() as c:
            after = reads.latest_samples(c)
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
    assert len(before) == 40
    pd.testing.assert_frame_equal(after, before)
    blocks_read = [s for s in statements if "sample_blocks" in s]
    assert len(blocks_read) == 1, statements


def test_rows_that_reach_a_packed_hour_are_read_at_once_and_packed_at_the_next_pass(
    store: Store,
) -> None:
    raw = raw_frame(gpus=2, hours=2, step_s=10)
    store.write(samples=rows_of(raw))
    store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR + 11 * MINUTE)
    assert wide_rows(store, START, START + 2 * HOUR) == 0
    # A spool replays: a sample the hour lacked (at 5 s) and one it has, with other values.
    late = raw[(raw["gpu"] == 0) & (raw["ts_ms"] == START)].copy()
    late["ts_ms"] = START + 5000
    late["power_w"] = 123.0
    again = raw[(raw["gpu"] == 0) & (raw["ts_ms"] == START + 10_000)].copy()
    again["power_w"] = 999.0
    store.write(samples=rows_of(pd.concat([late, again])))
    want = pd.concat([raw, late]).sort_values(["ts_ms", "node", "gpu"], ignore_index=True)
    with store.engine.connect() as c:
        first = samples_between(c, since_ms=START, until_ms=START + HOUR)
    assert len(first) == (want["ts_ms"] < START + HOUR).sum()
    at = first.set_index(["ts_ms", "gpu"])["power_w"]
    assert at[(START + 5000, 0)] == 123.0
    assert (
        at[(START + 10_000, 0)] == raw.set_index(["ts_ms", "gpu"])["power_w"][(START + 10_000, 0)]
    )  # the first value stored stays, as in a wide row
    report = store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR + 12 * MINUTE)
    assert report.hours_rerolled == 1
    assert wide_rows(store, START, START + 2 * HOUR) == 0
    with store.engine.connect() as c:
        second = samples_between(c, since_ms=START, until_ms=START + HOUR)
        n = c.execute(
            text("SELECT SUM(n) FROM sample_blocks WHERE start_ms < :b"), {"b": START + HOUR}
        )
    pd.testing.assert_frame_equal(second, first)
    assert n.scalar_one() == len(first)


def test_rows_that_arrive_while_an_hour_is_packed_are_never_lost(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = raw_frame(gpus=2, hours=2, step_s=10)
    store.write(samples=rows_of(raw))
    arrivals = [raw[raw["ts_ms"] == START].assign(ts_ms=START + 1000 * k, gpu=1) for k in (1, 2, 3)]
    real = tiering.roll_span
    reads_done = []

    def roll_span_and_a_row_arrives(*args: object, **kwargs: object) -> object:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        reads_done.append(args[1])
        if args[1] == START and arrivals:  # after the read, before the pack commits
            store.write(samples=rows_of(arrivals.pop(0)))
        return out

    monkeypatch.setattr(tiering, "roll_span", roll_span_and_a_row_arrives)
    report = store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR + 11 * MINUTE)
    # Three reads of hour 0 each met a new row: rolled up without packing, wide rows kept.
    assert reads_done.count(START) == tiering.PACK_TRIES + 1 and not arrivals
    assert report.hours_rolled == 2 and report.hours_packed == 1
    assert wide_rows(store, START, START + HOUR) == (raw["ts_ms"] < START + HOUR).sum() + 3
    with store.engine.connect() as c:
        got = samples_between(c, since_ms=START, until_ms=START + 2 * HOUR)
    assert len(got) == len(raw) + 3
    assert {START + 1000, START + 2000, START + 3000} <= set(got[got["gpu"] == 1]["ts_ms"])


def test_a_long_read_makes_the_task_give_up_its_ddl_not_stall_behind_it(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reset_postgres(postgres_url)
    store = Store.open(postgres_url)
    reader = store.engine.connect()
    try:
        raw = raw_frame(gpus=2, hours=2, step_s=10)
        with store.begin() as c:
            partitions.ensure(c, "samples", start_ms=START, end_ms=START + 2 * HOUR)
        store.write(samples=rows_of(raw))
        # A read that has not ended holds its share of ``samples``: creating or dropping a
        # partition cannot lock the parent until it ends.
        reader.execute(text("SELECT count(*) FROM samples WHERE ts_ms < :b"), {"b": START + HOUR})
        monkeypatch.setattr(tiering, "LOCK_TIMEOUT_MS", 200)
        report = store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR + 11 * MINUTE)
        # Rolled up all the same, unpacked, nothing lost; the partitions ahead wait a pass.
        assert report.hours_rolled == 2 and report.hours_packed == 0
        assert report.partitions_created == []
        assert wide_rows(store, START, START + 2 * HOUR) == len(raw)
        with store.engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM sample_blocks")).scalar_one() == 0
            minutes = tiers._minutes(c, since_ms=START, until_ms=START + 2 * HOUR)
        assert len(minutes) == len(raw.groupby(["gpu", raw["ts_ms"] // MINUTE]))
        reader.rollback()
        report = store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR + 12 * MINUTE)
        assert report.partitions_created
    finally:
        reader.close()
        store.close()


def test_a_downgrade_puts_the_packed_samples_back_as_wide_rows(database_url: str) -> None:
    from alembic import command

    from store.migrate import alembic_config

    store = Store.open(database_url)
    try:
        raw = raw_frame(gpus=2, hours=2, step_s=10)
        store.write(samples=rows_of(raw))
        with store.engine.connect() as c:
            before = samples_between(c, since_ms=START, until_ms=START + 2 * HOUR)
        report = store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR + 11 * MINUTE)
        assert report.hours_packed == 2 and wide_rows(store, START, START + 2 * HOUR) == 0
        config = alembic_config()
        with store.engine.begin() as c:
            config.attributes["connection"] = c
            command.downgrade(config, "0008_score_shards")
        with store.engine.connect() as c:
            sql = f"SELECT {', '.join(reads.FRAME_COLUMNS)} FROM samples ORDER BY ts_ms, node, gpu"
            after = reads._frame(c.execute(text(sql)).all(), list(reads.FRAME_COLUMNS))
        pd.testing.assert_frame_equal(after, before)
        with store.engine.begin() as c:
            config.attributes["connection"] = c
            command.upgrade(config, "heads")
    finally:
        store.close()
