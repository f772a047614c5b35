"""Storage tiers on both backends: rollups equal a pandas resample, retention drops whole
partitions, the Parquet history is a training dataset, a restart across a tier boundary
serves the same window, and the migration from the flat table keeps its rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import create_engine, text

from store import Store, blocks, partitions, schema, tiers
from store.migrate import upgrade
from store.reads import FRAME_COLUMNS
from store.rollups import COUNTER_COLUMNS, GAUGE_COLUMNS, MINUTE_MS, STAT_COLUMNS
from store.schema import SAMPLE_COLUMNS

HOUR = partitions.HOUR_MS
START = 1_764_504_000_000  # 2025-11-30 12:00 UTC, an hour boundary


def raw_frame(
    *, gpus: int = 2, hours: float = 3, step_s: int = 5, start: int = START, seed: int = 0
) -> pd.DataFrame:
    """Samples of ``gpus`` GPUs on one node: noisy gauges, growing counters with one reset
    and a few nulls, a gap of ten minutes on GPU 1."""
    rng = np.random.default_rng(seed)
    ts = np.arange(start, start + int(hours * HOUR), step_s * 1000)
    frames = []
    for g in range(gpus):
        n = len(ts)
        sbe = np.cumsum(rng.integers(0, 3, n)).astype(float)
        reset = n // 2 + 7 * g
        sbe[reset:] -= sbe[reset] - 1  # a reset to 1, counting on from there
        sbe[rng.random(n) < 0.02] = np.nan
        temp = 60 + rng.normal(0, 2, n)
        temp[rng.random(n) < 0.02] = np.nan
        frame = pd.DataFrame(
            {
                "ts_ms": ts,
                "node": "node-a",
                "gpu": g,
                "uuid": f"GPU-a-{g}",
                "vendor": "nvidia",
                "temp_gpu_c": temp,
                "power_w": 400 + rng.normal(0, 20, n),
                "throttle_reasons": rng.choice([0, 4], n),
                "ecc_sbe_volatile": pd.array(sbe, dtype="Float64").astype("Int64"),
                "nvlink_crc_flit": np.cumsum(rng.integers(0, 2, n)),
                "pcie_link_width": 16,
                "remap_pending": rng.random(n) < 0.1,
            }
        )
        if g == 1:
            gap = (ts >= start + HOUR + 600_000) & (ts < start + HOUR + 1_200_000)
            frame = frame[~gap]
        frames.append(frame)
    out = pd.concat(frames, ignore_index=True)
    return out.sort_values(["ts_ms", "node", "gpu"], ignore_index=True)


def raw_tier_ts(c: Any) -> list[int]:
    """Every sample time the raw tier holds: wide rows and packed ones."""
    wide = c.execute(text("SELECT ts_ms FROM samples")).scalars().all()
    return sorted([*wide, *blocks.read(c)["ts_ms"].tolist()])


def rows_of(frame: pd.DataFrame) -> list[tuple]:
    full = frame.reindex(columns=list(SAMPLE_COLUMNS))
    out = []
    for record in full.astype(object).itertuples(index=False):
        out.append(tuple(None if pd.isna(v) else v for v in record))
    return out


def expected_rollup(raw: pd.DataFrame) -> pd.DataFrame:
    """Per-minute rollups the plain pandas way: resample each GPU's series."""
    out = []
    for (node, gpu), series in raw.groupby(["node", "gpu"]):
        s = series.set_index(pd.to_datetime(series["ts_ms"], unit="ms"))
        bins = s.resample("1min")
        stats = {"n": bins.size()}
        for c in GAUGE_COLUMNS:
            values = s[c].astype("float64") if c in s else pd.Series(np.nan, index=s.index)
            by = values.resample("1min")
            stats.update(
                {
                    f"{c}_min": by.min(),
                    f"{c}_max": by.max(),
                    f"{c}_mean": by.mean(),
                    f"{c}_last": by.last(),
                }
            )
        for c in COUNTER_COLUMNS:
            values = s[c].astype("float64") if c in s else pd.Series(np.nan, index=s.index)
            known = values.dropna()
            step = known.diff()
            step[step < 0] = known[step < 0]  # a reset: counted up from zero again
            step = step.fillna(0.0)
            stats[f"{c}_delta"] = step.resample("1min").sum(min_count=1).reindex(stats["n"].index)
            stats[f"{c}_last"] = values.resample("1min").last()
        frame = pd.DataFrame(stats)
        frame = frame[frame["n"] > 0]
        frame.insert(0, "gpu", gpu)
        frame.insert(0, "node", node)
        frame.insert(0, "ts_ms", frame.index.as_unit("ms").asi8)
        out.append(frame.reset_index(drop=True))
    result = pd.concat(out, ignore_index=True)
    return result.sort_values(["ts_ms", "node", "gpu"], ignore_index=True)


def stored_minutes(store: Store, since_ms: int, until_ms: int) -> pd.DataFrame:
    with store.engine.connect() as c:
        frame = tiers._minutes(c, since_ms=since_ms, until_ms=until_ms)
    return frame


def assert_same_rollups(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert len(got) == len(want)
    assert got[["ts_ms", "gpu"]].astype("int64").equals(want[["ts_ms", "gpu"]].astype("int64"))
    for c in STAT_COLUMNS:
        np.testing.assert_allclose(
            got[c].to_numpy(float), want[c].to_numpy(float), rtol=1e-12, equal_nan=True, err_msg=c
        )


POLICY = tiers.TierPolicy(raw_window_s=3600.0, rollup_window_s=30 * 86400.0, history_url=None)


def test_rollups_equal_a_pandas_resample_across_a_counter_reset(store: Store) -> None:
    raw = raw_frame()
    store.write(samples=rows_of(raw))
    report = store.maintain_tiers(POLICY, now_ms=START + 4 * HOUR)
    assert report.hours_archived == 3 and report.samples_rolled == len(raw)
    want = expected_rollup(raw)
    # The resets happened (the test exercises them) and the deltas never went negative.
    assert (raw.groupby("gpu")["ecc_sbe_volatile"].diff() < 0).any()
    assert (want["ecc_sbe_volatile_delta"].dropna() >= 0).all()
    assert_same_rollups(stored_minutes(store, START, START + 3 * HOUR), want)


def test_on_the_fly_rollup_of_raw_rows_equals_the_stored_one(store: Store) -> None:
    raw = raw_frame()
    store.write(samples=rows_of(raw))
    store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR)  # hour 0 rolled, hours 1-2 raw
    with store.begin() as c:
        assert tiers.rolled_until(c) == START + HOUR
    assert_same_rollups(stored_minutes(store, START, START + 3 * HOUR), expected_rollup(raw))


def test_a_restarted_service_serves_the_same_window_across_a_tier_boundary(
    database_url: str,
) -> None:
    raw = raw_frame()
    window = {
        "node": "node-a",
        "gpu": 1,
        "since_ms": START + 30 * MINUTE_MS,
        "until_ms": START + 3 * HOUR,
    }
    first = Store.open(database_url)
    try:
        first.write(samples=rows_of(raw))
        first.maintain_tiers(POLICY, now_ms=START + 2 * HOUR)
        before, resolution = first.gpu_series(**window)
        fleet_before = first.tiered_window(since_ms=START + 2 * HOUR, until_ms=START + 3 * HOUR)
    finally:
        first.close()
    assert resolution == "1m"
    second = Store.open(database_url)  # the service restarts an hour and a half later
    try:
        report = second.maintain_tiers(POLICY, now_ms=START + 4 * HOUR + 1_800_000)
        assert report.hours_rolled == 2
        after, resolution = second.gpu_series(**window)
        fleet_after = second.tiered_window(since_ms=START + 2 * HOUR, until_ms=START + 3 * HOUR)
        with second.begin() as c:
            assert tiers.raw_since(c) == START + 3 * HOUR
            raw_left = len(raw_tier_ts(c))
            wide_left = c.execute(text("SELECT COUNT(*) FROM samples")).scalar_one()
    finally:
        second.close()
    assert resolution == "1m"
    assert raw_left == (raw["ts_ms"] >= START + 2 * HOUR).sum()  # one rolled hour stays raw
    assert wide_left == 0  # every rolled hour is packed
    pd.testing.assert_frame_equal(before, after)
    assert len(before) == 150 - 10  # 2.5 h of minutes, less GPU 1's ten-minute gap
    assert list(before.columns[:3]) == ["ts_ms", "node", "gpu"]
    # The warm-start read: raw rows while raw, one per minute after.
    assert len(fleet_before) == (raw["ts_ms"] >= START + 2 * HOUR).sum()
    assert list(fleet_after.columns) == list(FRAME_COLUMNS)
    assert len(fleet_after) == 2 * 60
    third = Store.open(database_url)
    try:
        _, resolution = third.gpu_series(
            node="node-a", gpu=0, since_ms=START + 3 * HOUR, until_ms=START + 4 * HOUR
        )
    finally:
        third.close()
    assert resolution == "raw"


def test_retention_drops_whole_partitions_and_keeps_everything_younger(store: Store) -> None:
    raw = raw_frame(gpus=1, hours=6, step_s=30)
    store.write(samples=rows_of(raw))
    store.write(
        events=[
            ("node-a", 0, START + 10 * MINUTE_MS, "xid", 79, "fell off the bus", "kmsg"),
            ("node-a", 0, START + 5 * HOUR, "xid", 13, "graphics engine", "kmsg"),
        ]
    )
    policy = tiers.TierPolicy(
        raw_window_s=2 * 3600.0, rollup_window_s=3 * 3600.0, hourly_window_s=3 * 3600.0
    )
    now = START + 6 * HOUR
    report = store.maintain_tiers(policy, now_ms=now)
    assert report.hours_archived == 4  # hours 0-3 left the 2 h raw window
    with store.begin() as c:
        left = raw_tier_ts(c)
        after = {p.table for p in partitions.existing(c, "samples")}
        after_blocks = {p.table for p in partitions.existing(c, "sample_blocks")}
        events = c.execute(text("SELECT ts_ms FROM events")).scalars().all()
    # Raw: hours 3.. stay (hour 3 is the predecessor hour); nothing younger is lost.
    younger = raw["ts_ms"][raw["ts_ms"] >= START + 3 * HOUR]
    assert left == younger.tolist()
    assert events == [START + 5 * HOUR]  # the 3 h event window
    if store.dialect == "postgresql":
        # Hours 0-4 were rolled up and packed (their wide partitions dropped then); the
        # packed hours 0-2 left with the raw window, whole partitions again.
        hours = [partitions.partition_name("samples", START + h * HOUR) for h in range(6)]
        packed = [partitions.partition_name("sample_blocks", START + h * HOUR) for h in range(6)]
        assert set(hours[:5]).isdisjoint(after) and hours[5] in after
        assert set(packed[:3]).isdisjoint(after_blocks) and set(packed[3:5]) <= after_blocks
        assert report.raw_dropped == 3
    # Rollups: everything from the rollup cutoff on is still there.
    minutes = stored_minutes(store, START, now)["ts_ms"]
    cutoff = now - 3 * HOUR
    assert minutes.min() <= cutoff and (minutes >= cutoff).sum() == 3 * 60
    policy = tiers.TierPolicy(raw_window_s=2 * 3600.0, rollup_window_s=86400.0)
    report = store.maintain_tiers(policy, now_ms=START + 2 * partitions.DAY_MS + 6 * HOUR)
    with store.begin() as c:
        chunks = c.execute(text("SELECT COUNT(*) FROM sample_rollups")).scalar_one()
    assert chunks == 0 and report.rollups_dropped >= 1


def test_parquet_history_is_a_dataset_with_failure_labels(store: Store, tmp_path: Path) -> None:
    from predictor.dataset import load_dataset

    raw = raw_frame(gpus=2, hours=3, step_s=10)
    store.write(samples=rows_of(raw))
    store.write(
        events=[
            ("node-a", 1, START + 70 * MINUTE_MS, "xid", 79, "fell off the bus", "kmsg"),
            ("node-a", 1, START + 71 * MINUTE_MS, "gpu_lost", None, "lost", "nvml"),
            ("node-a", 1, START + 100 * MINUTE_MS, "gpu_recovered", None, "back", "agent"),
            ("node-a", 0, START + 20 * MINUTE_MS, "xid", 13, "app", "kmsg"),
        ]
    )
    policy = tiers.TierPolicy(raw_window_s=3600.0, history_url=str(tmp_path / "history"))
    report = store.maintain_tiers(policy, now_ms=START + 4 * HOUR)
    assert report.history_rows == len(raw)
    dataset = load_dataset(tmp_path / "history")
    assert dataset.manifest["counts"]["samples"] == len(raw)
    assert (dataset.start_ms, dataset.end_ms) == (START, START + 3 * HOUR)
    history = pd.read_parquet(tmp_path / "history" / "samples")
    assert list(history.columns) == list(FRAME_COLUMNS)
    expected = raw.reindex(columns=list(FRAME_COLUMNS))
    assert history["ts_ms"].tolist() == expected["ts_ms"].tolist()
    for c in ("temp_gpu_c", "ecc_sbe_volatile", "remap_pending", "throttle_reasons"):
        assert history[c].astype("float64").equals(expected[c].astype("float64")), c
    assert str(history["ecc_sbe_volatile"].dtype) == "Int64"
    failures = dataset.failures
    assert failures[["ts_ms", "node", "gpu", "kind"]].values.tolist() == [
        [START + 70 * MINUTE_MS, "node-a", 1, "pcie"]
    ]
    assert failures["recovered_ts_ms"].tolist() == [START + 100 * MINUTE_MS]
    assert len(dataset.events) == 4


def test_migration_from_the_flat_table_keeps_its_rows(database_url: str) -> None:
    engine = create_engine(database_url)
    upgrade(engine, "0002")
    raw = raw_frame(gpus=2, hours=1, step_s=60)
    with engine.begin() as c:  # rows as a writer of that schema stored them
        c.execute(
            schema.samples.insert(),
            [dict(zip(SAMPLE_COLUMNS, r, strict=True)) for r in rows_of(raw)],
        )
    engine.dispose()
    engine = create_engine(database_url)
    upgrade(engine)
    store = Store(engine)
    try:
        frame = store.fleet_window(since_ms=0)
        assert len(frame) == len(raw)
        assert store.write(samples=rows_of(raw)) == (0, 0)  # the key still de-duplicates
        if store.dialect == "postgresql":
            with store.begin() as c:
                kind = c.execute(
                    text("SELECT relkind FROM pg_class WHERE relname = 'samples'")
                ).scalar_one()
                assert kind == "p"
                assert partitions.partition_name("samples", START) in {
                    p.table for p in partitions.existing(c, "samples")
                }
    finally:
        store.close()


@pytest.mark.parametrize("late_hours", [30])
def test_rows_without_a_partition_land_in_the_default_and_move_on_creation(
    store: Store, late_hours: int
) -> None:
    raw = raw_frame(gpus=1, hours=1, step_s=60, start=START + late_hours * HOUR)
    store.write(samples=rows_of(raw))  # far ahead of every partition created so far
    store.maintain_tiers(POLICY, now_ms=START + late_hours * HOUR)
    assert len(store.fleet_window(since_ms=0)) == len(raw)
    if store.dialect == "postgresql":
        with store.begin() as c:
            stray = c.execute(text("SELECT COUNT(*) FROM samples_default")).scalar_one()
        assert stray == 0


@contextmanager
def _three_rolled_hours(store: Store, tmp_path: Path, raw: pd.DataFrame) -> Iterator[Any]:
    """A service (TestClient) over ``raw`` written and rolled up to per-minute rows."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    store.write(samples=rows_of(raw))
    store.maintain_tiers(POLICY, now_ms=START + 4 * HOUR)
    settings = Settings(
        database_url="unused://",
        data_dir=tmp_path,
        read_token="read-token-0123456789",
        history_url="none",
        # The service's own tier task runs at once on the real clock: keep it off this data.
        raw_window_h=24 * 3650,
        rollup_days=3650,
    )
    with TestClient(create_app(settings, store=store)) as client:
        yield client


SAMPLES_HEADERS = {"Authorization": "Bearer read-token-0123456789"}


def test_the_samples_route_says_which_resolution_it_served(store: Store, tmp_path: Path) -> None:
    headers = SAMPLES_HEADERS
    raw = raw_frame(gpus=1, hours=3, step_s=10)
    with _three_rolled_hours(store, tmp_path, raw) as client:
        url = "/v1/gpus/node-a/0/samples"
        window = {"since": START / 1000, "until": (START + 3 * HOUR) / 1000}
        body = client.get(url, params={**window, "fields": "temp_gpu_c"}, headers=headers).json()
        assert body["resolution"] == "1m" and body["count"] == 180
        first = body["data"][0]
        assert set(first) >= {"ts", "temp_gpu_c", "temp_gpu_c_min", "temp_gpu_c_max", "n"}
        assert first["n"] == 6
        raw_body = client.get(
            url, params={**window, "resolution": "raw", "limit": 50}, headers=headers
        ).json()
        assert raw_body["resolution"] == "raw" and raw_body["count"] == 50


def test_the_samples_route_gives_columns_and_leaves_the_statistics_out_when_asked(
    store: Store, tmp_path: Path
) -> None:
    """The GPU page's week: ``shape=columns`` gives each name's values in row order (NaN as
    null, as the rows give it), ``stats=false`` only each field's value and ``n``."""
    import math

    headers = SAMPLES_HEADERS
    raw = raw_frame(gpus=1, hours=3, step_s=10)
    raw.loc[raw.index[:30], "power_w"] = math.nan  # the first five minutes without power
    with _three_rolled_hours(store, tmp_path, raw) as client:
        url = "/v1/gpus/node-a/0/samples"
        window = {"since": START / 1000, "until": (START + 3 * HOUR) / 1000}
        fields = "temp_gpu_c,power_w,ecc_sbe_volatile"
        rows = client.get(url, params={**window, "fields": fields}, headers=headers).json()
        cols = client.get(
            url, params={**window, "fields": fields, "shape": "columns"}, headers=headers
        ).json()
        assert "data" not in cols and cols["count"] == rows["count"] == 180
        assert cols["resolution"] == "1m"
        names = set(rows["data"][0]) - {"node", "gpu"}
        assert set(cols["columns"]) == names
        for name in names:
            assert cols["columns"][name] == [r[name] for r in rows["data"]], name
        assert cols["columns"]["power_w"][0] is None and cols["columns"]["power_w"][5] is not None
        bare = client.get(
            url,
            params={**window, "fields": fields, "shape": "columns", "stats": "false"},
            headers=headers,
        ).json()
        assert set(bare["columns"]) == {"ts", "temp_gpu_c", "power_w", "ecc_sbe_volatile", "n"}
        for name in bare["columns"]:
            assert bare["columns"][name] == cols["columns"][name], name
        lean = client.get(
            url, params={**window, "fields": fields, "stats": "false"}, headers=headers
        )
        assert set(lean.json()["data"][0]) == {"ts", "node", "gpu", *fields.split(","), "n"}
        raw_cols = client.get(
            url,
            params={
                **window,
                "resolution": "raw",
                "limit": 50,
                "shape": "columns",
                "stats": "false",
            },
            headers=headers,
        ).json()
        assert raw_cols["resolution"] == "raw" and len(raw_cols["columns"]["ts"]) == 50


def test_rows_a_spool_replays_after_the_roll_up_reach_the_rollups_when_archived(
    store: Store,
) -> None:
    raw = raw_frame(gpus=2, hours=2, step_s=10)
    late = (raw["gpu"] == 0) & (raw["ts_ms"] >= START + 20 * MINUTE_MS)
    late &= raw["ts_ms"] < START + 40 * MINUTE_MS
    store.write(samples=rows_of(raw[~late]))
    store.maintain_tiers(POLICY, now_ms=START + HOUR + 15 * MINUTE_MS)  # hour 0 rolled
    with store.begin() as c:
        assert tiers.rolled_until(c) == START + HOUR and tiers.raw_since(c) is None
    store.write(samples=rows_of(raw[late]))  # the collector's spool, replayed
    early = stored_minutes(store, START, START + HOUR)
    assert len(early) == 120 - 20  # the stored chunk lacks GPU 0's twenty late minutes
    store.maintain_tiers(POLICY, now_ms=START + 2 * HOUR + 15 * MINUTE_MS)  # hour 0 archived
    want = expected_rollup(raw[raw["ts_ms"] < START + HOUR])
    assert_same_rollups(stored_minutes(store, START, START + HOUR), want)


def test_rows_that_reach_a_rolled_hour_roll_it_up_again_at_the_next_pass(store: Store) -> None:
    raw = raw_frame(gpus=2, hours=2, step_s=10)
    late = (raw["gpu"] == 1) & (raw["ts_ms"] >= START + 5 * MINUTE_MS)
    late &= raw["ts_ms"] < START + 25 * MINUTE_MS
    store.write(samples=rows_of(raw[~late]))
    store.maintain_tiers(POLICY, now_ms=START + HOUR + 15 * MINUTE_MS)  # hour 0 rolled
    store.write(samples=rows_of(raw[late]))  # a spool replays GPU 1's twenty minutes
    report = store.maintain_tiers(POLICY, now_ms=START + HOUR + 20 * MINUTE_MS)
    # Rolled up again at once, not a raw window (here an hour) later when archived.
    assert report.hours_rerolled == 1 and report.hours_archived == 0
    want = expected_rollup(raw[raw["ts_ms"] < START + HOUR])
    assert_same_rollups(stored_minutes(store, START, START + HOUR), want)
    # Nothing late since: the next pass rolls nothing again; live rows of the open hour
    # note nothing either.
    store.write(samples=rows_of(raw[raw["ts_ms"] >= START + HOUR].head(10)))
    assert store.maintain_tiers(POLICY, now_ms=START + HOUR + 25 * MINUTE_MS).hours_rerolled == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_forewarn_train_reads_the_history_of_a_simulated_fleet(tmp_path: Path) -> None:
    # SQLite only: the history written is the same on both backends (the tests above).
    store = Store.open(f"sqlite:///{tmp_path / 'train.db'}")
    from forewarn.cli import main
    from predictor.dataset import load_dataset
    from sim import generate_dataset
    from tests.predictor.conftest import INJECTIONS

    source = load_dataset(
        generate_dataset(
            tmp_path / "sim", gpus=32, days=0.5, interval_s=60.0, seed=11, injections=INJECTIONS
        ).path
    )
    samples = pd.read_parquet(tmp_path / "sim" / "samples")
    store.write(samples=rows_of(samples))
    events = source.events
    store.write(
        events=[
            (
                e.node,
                None if pd.isna(e.gpu) else int(e.gpu),
                int(e.ts_ms),
                e.kind,
                None if pd.isna(e.xid) else int(e.xid),
                e.message,
                e.source,
            )
            for e in events.itertuples(index=False)
        ]
    )
    end = int(samples["ts_ms"].max()) + 1
    history = tmp_path / "history"
    policy = tiers.TierPolicy(raw_window_s=60.0, history_url=str(history), max_hours_per_run=100)
    store.maintain_tiers(policy, now_ms=partitions.floor(end, HOUR) + 2 * HOUR)
    archived = pd.read_parquet(history / "samples")
    pd.testing.assert_frame_equal(archived, samples.reset_index(drop=True), check_dtype=True)
    derived = load_dataset(history).failures
    truth = source.failures[source.failures["in_window"]]
    # Every failure the simulator recorded with a job-ending event is labelled at its time.
    assert set(zip(derived["node"], derived["gpu"], strict=True)) >= {
        (n, g)
        for n, g, k in zip(truth["node"], truth["gpu"], truth["kind"], strict=True)
        if k in ("memory", "nvlink", "pcie", "gpu_lost")
    }
    out = tmp_path / "models"
    args = ["train", "--data", str(history), "--out", str(out), "--rounds", "20", "--no-progress"]
    store.close()
    assert main(args) == 0
    assert list(out.glob("*.lgb.txt"))


def test_a_minute_read_of_a_gpu_that_stopped_reporting_is_empty_not_an_error(
    store: Store,
) -> None:
    raw = raw_frame(gpus=1, hours=1, step_s=10)
    store.write(samples=rows_of(raw))  # the GPU reports for an hour, then falls silent
    # Five minutes later, one minute read past its last sample: its predecessor row (the
    # counters' base) exists, no row of the window does.
    since = START + HOUR + 5 * MINUTE_MS
    series, resolution = store.gpu_series(
        node="node-a", gpu=0, since_ms=since, until_ms=since + MINUTE_MS, resolution="1m"
    )
    assert resolution == "1m" and len(series) == 0
    assert list(series.columns[:3]) == ["ts_ms", "node", "gpu"]


def test_a_minute_read_has_one_column_a_name(store: Store) -> None:
    """pcie_link_width's ``_max`` statistic is named like the field pcie_link_width_max: the
    field is served, the statistic left out (two columns of one name broke the answer)."""
    raw = raw_frame(gpus=1, hours=1, step_s=10)
    store.write(samples=rows_of(raw))
    series, resolution = store.gpu_series(
        node="node-a", gpu=0, since_ms=START, until_ms=START + HOUR, resolution="1m"
    )
    assert resolution == "1m" and len(series) > 0
    assert not series.columns.duplicated().any(), list(series.columns)
    assert "pcie_link_width_max" in series.columns and "temp_gpu_c_max" in series.columns


@pytest.mark.parametrize("rolled_hours", [0, 3])
def test_a_counter_missing_from_an_hours_last_sample_counts_on_from_its_last_value(
    store: Store, rolled_hours: int
) -> None:
    """The sample before an hour boundary lacks a counter (the collector failed to read it):
    the hour after counts on from the value before that, stored or rolled up on the fly."""
    raw = raw_frame(gpus=1, hours=3, step_s=60)
    raw["ecc_sbe_volatile"] = pd.array(np.arange(len(raw)), dtype="Int64")
    for hour in (1, 2):
        raw.loc[raw["ts_ms"] == START + hour * HOUR - MINUTE_MS, "ecc_sbe_volatile"] = pd.NA
    store.write(samples=rows_of(raw))
    store.maintain_tiers(POLICY, now_ms=START + (rolled_hours + 1) * HOUR)
    got = stored_minutes(store, START, START + 3 * HOUR)
    assert_same_rollups(got, expected_rollup(raw))
    at = got.set_index("ts_ms")["ecc_sbe_volatile_delta"]
    assert at[START + HOUR] == at[START + 2 * HOUR] == 2  # from the sample two minutes before


def test_reads_never_miss_rows_moving_out_of_the_default_partition(store: Store) -> None:
    """Rows written for an hour without a partition wait in the default one; creating the
    hour's partition moves them. A read of the hour at that moment must find them (before the
    parent was locked for the move, 2-3 of 20 such moves gave an empty read)."""
    import threading

    if store.dialect != "postgresql":
        pytest.skip("SQLite has no partitions")
    raw = raw_frame(gpus=4, hours=1, step_s=5)
    rows = rows_of(raw)
    short: list[int] = []
    for _ in range(20):
        store.write(samples=rows)  # no partition for the hour yet: into the default one

        def move() -> None:
            with store.begin() as c:
                partitions.ensure(c, "samples", start_ms=START, end_ms=START + HOUR)

        mover = threading.Thread(target=move)
        mover.start()
        counts = []
        while mover.is_alive() or not counts:
            frame = store.fleet_window(since_ms=START, until_ms=START + HOUR)
            counts.append(len(frame))
        mover.join()
        short += [n for n in counts if n != len(rows)]
        with store.begin() as c:
            c.execute(text(f"DROP TABLE {partitions.partition_name('samples', START)}"))
    assert short == []
