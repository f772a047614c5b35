"""The hourly tier on both backends: hours combined from minutes equal the raw samples rolled
up per hour, the tiering task fills the tier a whole day at a time behind the archived mark,
the minute tier keeps a day until it is there, reads beyond the minute tier are served per
hour and read the same before and after the days move tier."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from store import Store, partitions, tiers
from store.rollups import HOUR_MS, MINUTE_MS, STAT_COLUMNS, coarsen, coarsen_frame, rollup
from tests.store.test_tiers import START, assert_same_rollups, raw_frame, rows_of

DAY = partitions.DAY_MS
HOUR = HOUR_MS
DAY0 = partitions.floor(START, DAY)  # START is noon: day 0 holds its last 12 hours


def without_gauge_nulls(raw: pd.DataFrame) -> pd.DataFrame:
    """``raw`` with every gauge reported in every sample (counters keep their nulls)."""
    return raw.assign(temp_gpu_c=raw["temp_gpu_c"].fillna(61.0))


def hours_of(store: Store, since_ms: int, until_ms: int) -> pd.DataFrame:
    with store.engine.connect() as c:
        return tiers._hours(c, since_ms=since_ms, until_ms=until_ms)


def test_hours_combined_from_minutes_equal_the_samples_rolled_up_per_hour() -> None:
    raw = without_gauge_nulls(raw_frame(gpus=2, hours=3, step_s=5))
    assert raw["ecc_sbe_volatile"].isna().any()  # counters with gaps, and one reset each
    got = coarsen_frame(rollup(raw), HOUR_MS)
    want = rollup(raw, step_ms=HOUR_MS).sort_values(["node", "gpu", "ts_ms"], ignore_index=True)
    assert_same_rollups(got, want)
    assert got["n"].tolist() == [720, 720, 720, 720, 600, 720]  # GPU 1's ten-minute gap


def test_a_gauge_missing_from_some_samples_weighs_its_minute_by_all_of_them() -> None:
    stats = list(STAT_COLUMNS)
    rows = np.full((3, len(stats)), np.nan)
    rows[:, stats.index("n")] = [60, 30, 10]
    rows[:, stats.index("temp_gpu_c_mean")] = [50.0, np.nan, 80.0]  # never reported in minute 1
    rows[:, stats.index("temp_gpu_c_last")] = [51.0, np.nan, np.nan]
    rows[:, stats.index("ecc_sbe_volatile_delta")] = [np.nan, 2.0, 3.0]
    one = coarsen(rows, np.array([0]))[0]
    assert one[stats.index("n")] == 100
    assert one[stats.index("temp_gpu_c_mean")] == pytest.approx((50 * 60 + 80 * 10) / 70)
    assert one[stats.index("temp_gpu_c_last")] == 51.0  # the newest known, not the newest row
    assert one[stats.index("ecc_sbe_volatile_delta")] == 5.0
    assert np.isnan(one[stats.index("power_w_max")])  # never reported: null, not 0


def test_the_task_fills_the_hourly_tier_a_day_at_a_time_and_reads_match(store: Store) -> None:
    raw = without_gauge_nulls(raw_frame(gpus=2, hours=50, step_s=60))
    store.write(samples=rows_of(raw))
    policy = tiers.TierPolicy(raw_window_s=3600.0, rollup_window_s=30 * 86400.0)
    # Day 1 is not behind the archived mark yet: per hour on the fly, from the minutes.
    report = store.maintain_tiers(policy, now_ms=DAY0 + 2 * DAY - HOUR)
    assert report.days_coarsened == 1  # day 0 only
    with store.begin() as c:
        assert tiers.hourly_until(c) == DAY0 + DAY
    window = (START, START + 50 * HOUR)
    before = hours_of(store, *window)
    want = rollup(raw, step_ms=HOUR_MS).sort_values(["ts_ms", "node", "gpu"], ignore_index=True)
    assert_same_rollups(before, want)
    # Later: day 1 is stored too; the same hours read the same.
    report = store.maintain_tiers(policy, now_ms=DAY0 + 3 * DAY)
    assert report.days_coarsened == 1
    with store.begin() as c:
        assert tiers.hourly_until(c) == DAY0 + 2 * DAY
        stored = c.execute(
            text("SELECT start_ms, hours FROM hourly_rollups ORDER BY start_ms, node, gpu")
        ).all()
    assert [tuple(r) for r in stored] == [(DAY0, 12)] * 2 + [(DAY0 + DAY, 24)] * 2
    pd.testing.assert_frame_equal(hours_of(store, *window), before)
    # Combining a day again replaces its chunks: nothing doubles.
    from store.tiering import _coarsen_day

    _coarsen_day(store.engine, DAY0)
    pd.testing.assert_frame_equal(hours_of(store, *window), before)


def test_minutes_stay_until_their_day_is_hourly_and_reads_beyond_them_are_per_hour(
    store: Store,
) -> None:
    raw = raw_frame(gpus=1, hours=50, step_s=60)
    store.write(samples=rows_of(raw))
    store.write(events=[("node-a", 0, START + HOUR, "xid", 48, "double-bit ECC", "kmsg")])
    # A minute window of a day: the minutes of both days are kept, though past it, while the
    # hourly tier has only day 0 (one day combined a pass).
    policy = tiers.TierPolicy(
        raw_window_s=3600.0, rollup_window_s=86400.0, hourly_window_s=10 * 86400.0
    )
    policy = tiers.TierPolicy(**{**policy.__dict__, "max_days_per_run": 1})
    now = DAY0 + 4 * DAY
    report = store.maintain_tiers(policy, now_ms=now)
    assert report.days_coarsened == 1
    with store.begin() as c:
        assert tiers.minutes_since(c) == DAY0 + DAY  # day 0 went, day 1 waits for its hours
    with store.engine.connect() as c:
        kept = tiers._minutes(c, since_ms=DAY0, until_ms=now)
    assert kept["ts_ms"].min() == DAY0 + DAY
    store.maintain_tiers(policy, now_ms=now)  # day 1 into hours, now its minutes go too
    with store.begin() as c:
        assert tiers.hourly_until(c) == DAY0 + 2 * DAY
        assert tiers.minutes_since(c) == DAY0 + 2 * DAY
        events = c.execute(text("SELECT COUNT(*) FROM events")).scalar_one()
    assert events == 1  # kept with the longer rollup tier
    # A read reaching back before the minute tier is served per hour, one resolution whole.
    frame, resolution = store.gpu_series(
        node="node-a", gpu=0, since_ms=START, until_ms=START + 50 * HOUR, fields=["temp_gpu_c"]
    )
    assert resolution == "1h" and len(frame) == 50
    assert frame["n"].tolist() == [60.0] * 50
    assert {"temp_gpu_c", "temp_gpu_c_min", "temp_gpu_c_max"} <= set(frame.columns)
    _, resolution = store.gpu_series(
        node="node-a", gpu=0, since_ms=DAY0 + 2 * DAY, until_ms=now, fields=["temp_gpu_c"]
    )
    assert resolution == "1m"
    # The hourly window passes: the tier's partitions go whole, and the events with it.
    later = tiers.TierPolicy(raw_window_s=3600.0, rollup_window_s=86400.0, hourly_window_s=86400.0)
    report = store.maintain_tiers(later, now_ms=now + 20 * DAY)
    with store.begin() as c:
        left = c.execute(text("SELECT COUNT(*) FROM hourly_rollups")).scalar_one()
        events = c.execute(text("SELECT COUNT(*) FROM events")).scalar_one()
    assert left == 0 and events == 0 and report.hourly_dropped >= 1


def test_the_samples_route_serves_hours_beyond_the_minute_tier(
    store: Store, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    raw = raw_frame(gpus=1, hours=50, step_s=60)
    store.write(samples=rows_of(raw))
    policy = tiers.TierPolicy(raw_window_s=3600.0, rollup_window_s=2 * 86400.0)
    # Every hour rolled before the service starts: its own task (on the real clock) then has
    # none left to roll while the route reads.
    for _ in range(3):
        store.maintain_tiers(policy, now_ms=DAY0 + 4 * DAY)
    settings = Settings(
        database_url="unused://",
        data_dir=tmp_path,
        read_token="read-token-0123456789",
        history_url="none",
        raw_window_h=24 * 3650,  # the service's own task runs on the real clock: keep it off
        rollup_days=3650,
        hourly_days=3650,
    )
    headers = {"Authorization": "Bearer read-token-0123456789"}
    url = "/v1/gpus/node-a/0/samples"
    window = {"since": START / 1000, "until": (START + 50 * HOUR) / 1000, "fields": "power_w"}
    with TestClient(create_app(settings, store=store)) as client:
        body = client.get(url, params=window, headers=headers).json()
        lean = client.get(
            url, params={**window, "stats": "false", "shape": "columns"}, headers=headers
        ).json()
        minute = client.get(url, params={**window, "resolution": "1m"}, headers=headers).json()
    assert body["resolution"] == "1h" and body["count"] == 50
    times = [datetime.fromisoformat(r["ts"]) for r in body["data"]]
    assert {b - a for a, b in itertools.pairwise(times)} == {timedelta(hours=1)}
    assert set(lean["columns"]) == {"ts", "power_w", "n"}
    # Asked per minute: only the minutes the tier still holds (from day 2 on).
    assert minute["resolution"] == "1m"
    first = datetime.fromisoformat(minute["data"][0]["ts"])
    assert first == datetime.fromtimestamp((DAY0 + 2 * DAY) / 1000, UTC)
    assert minute["count"] == (START + 50 * HOUR - DAY0 - 2 * DAY) // MINUTE_MS


def test_a_failure_older_than_the_minute_tier_still_shows_its_precursors(store: Store) -> None:
    """The failure labels' look back (``had_precursors``) reads the hourly tier once the
    failure's minutes are gone, and the raw rows of hours not rolled up yet: a GPU whose ECC
    counter grew before it failed warns at every age, a quiet one never does."""
    raw = raw_frame(gpus=2, hours=50, step_s=60)
    quiet = raw.assign(temp_gpu_c=61.0, ecc_sbe_volatile=0, nvlink_crc_flit=0, remap_pending=False)
    failed_at = START + 20 * HOUR + 30 * MINUTE_MS  # day 1, 08:30
    grew = (quiet["gpu"] == 1) & (quiet["ts_ms"] >= failed_at - 40 * MINUTE_MS)
    quiet.loc[grew, "ecc_sbe_volatile"] = 5

    def warned() -> list[bool]:
        with store.engine.connect() as c:
            return [tiers.had_precursors(c, node="node-a", gpu=g, ts_ms=failed_at) for g in (0, 1)]

    store.write(samples=rows_of(quiet))
    assert warned() == [False, True]  # nothing rolled up yet: raw rows on the fly
    policy = tiers.TierPolicy(
        raw_window_s=3600.0, rollup_window_s=86400.0, hourly_window_s=10 * 86400.0
    )
    for _ in range(2):  # day 1's minutes leave on the pass after its hours are stored
        store.maintain_tiers(policy, now_ms=DAY0 + 4 * DAY)
    with store.begin() as c:
        assert tiers.minutes_since(c) == DAY0 + 2 * DAY  # the failure's minutes are gone
        assert not c.execute(
            text("SELECT COUNT(*) FROM sample_rollups WHERE start_ms < :d"), {"d": DAY0 + 2 * DAY}
        ).scalar_one()
    assert warned() == [False, True]
