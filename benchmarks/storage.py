"""Storage tiers: write rate, bytes per sample in each tier, roll-up cost, window read latency.

On each backend, in one run, against a baseline measured in the same run:

- baseline: the flat ``samples`` table of schema revision 0002 (one wide row per sample, a
  B-tree time index, retention by DELETE);
- tiered: the schema at head (hourly partitions on PostgreSQL), the tiering task rolling the
  hours up per minute and writing the Parquet history.

The data is the simulator's (``sim.generate_dataset``: ``--gpus`` GPUs for ``--hours`` hours
at ``--interval-s``), the values a real GPU reports (integer temperatures, clocks in steps,
counters mostly still). Figures:

- write rate (samples/s) of ``Store.write`` in batches of one node's ``--batch-s`` seconds;
- bytes per sample: raw table (data + indexes, from the database's own size accounting),
  rollups (the packed chunks and their row overhead, per raw sample they summarise), Parquet
  history (file bytes per row); the hourly tier per GPU-hour (:func:`hourly_figures`);
- roll-up cost: seconds of the tiering task per million samples (read, roll up, pack, Parquet);
- read latency (median of ``--reads``) of one GPU's 1 h raw window and 7 d window: the 7 d
  window from rollups (chunks replicated back in time from the measured ones), and the last
  7 d over a raw day whose newest hour is not rolled up yet (rolled up on the fly); baseline:
  the same 1 h and 7 d raw from the flat table.

``--repeat`` runs it all again so the spread shows. Then the capacity model of
``docs/storage.md`` is printed from the measured bytes.

    .venv/bin/python benchmarks/storage.py [--backend sqlite|postgres|both] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from _common import postgres_url, ratio, reset_postgres
from sqlalchemy import create_engine, text

from sim.dataset import generate_dataset
from store import Store, blocks, partitions, rollups, tiering, tiers
from store.migrate import upgrade
from store.rollups import STAT_COLUMNS, coarsen_frame
from store.schema import SAMPLE_COLUMNS

HOUR = partitions.HOUR_MS
DAY = partitions.DAY_MS


def sample_rows(frame: pd.DataFrame) -> list[tuple[Any, ...]]:
    full = frame.reindex(columns=list(SAMPLE_COLUMNS)).astype(object)
    full = full.where(full.notna(), None)
    return list(full.itertuples(index=False, name=None))


def batches(frame: pd.DataFrame, batch_s: int) -> list[list[tuple[Any, ...]]]:
    """One node's ``batch_s`` seconds per batch, in time order (what a collector sends)."""
    key = frame["ts_ms"] // (batch_s * 1000)
    out = []
    for _, part in frame.groupby([key, frame["node"]], sort=True):
        out.append(sample_rows(part))
    return out


def shifted(frame: pd.DataFrame, copies: int, span_ms: int, node: str) -> pd.DataFrame:
    """``copies`` back-to-back copies of ``frame`` (one GPU), each ``span_ms`` later."""
    parts = [frame.assign(ts_ms=frame["ts_ms"] + k * span_ms, node=node) for k in range(copies)]
    return pd.concat(parts, ignore_index=True)


def table_bytes(store: Store, table: str) -> int:
    with store.begin() as c:
        if store.dialect == "postgresql":
            c.execute(text(f"ANALYZE {table}"))
            sql = (
                "SELECT COALESCE(SUM(pg_total_relation_size(relid)), 0) "
                f"FROM pg_partition_tree('{table}')"
            )
            tree = int(c.execute(text(sql)).scalar_one())
            flat = f"SELECT pg_total_relation_size('{table}')"
            return tree or int(c.execute(text(flat)).scalar_one())
        sql = (
            "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat "
            "WHERE name IN (SELECT name FROM sqlite_master WHERE tbl_name = :t)"
        )
        try:
            return int(c.execute(text(sql), {"t": table}).scalar_one())
        except Exception:
            pass
    # No dbstat: the table's pages, counted by walking its B-trees is not available; use the
    # file (the store holds little else).
    c2 = store.engine.raw_connection()
    try:
        c2.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # type: ignore[attr-defined]
    finally:
        c2.close()
    return Path(str(store.engine.url.database)).stat().st_size


def write_all(store: Store, groups: list[list[tuple[Any, ...]]]) -> float:
    begin = time.perf_counter()
    for rows in groups:
        store.write(samples=rows)
    return time.perf_counter() - begin


def median_s(fn: Any, reads: int) -> float:
    fn()  # warm the caches once, as a dashboard's second look would
    times = []
    for _ in range(reads):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def open_store(url: str, revision: str | None) -> Store:
    if revision is None:
        return Store.open(url)
    engine = create_engine(url)
    upgrade(engine, revision)
    # Today's writer notes rows that reach rolled hours (revisions 0003-0004) and its reads
    # look for packed ones (0009): those tables, empty, beside the old schema.
    for table in (tiers.tier_marks, tiers.late_hours, blocks.sample_blocks):
        table.create(engine, checkfirst=True)
    engine.dispose()
    return Store.open(url, migrate=False)


def run_backend(
    name: str, url: str, reset: Any, frame: pd.DataFrame, args: Any
) -> dict[str, float]:
    groups = batches(frame, args.batch_s)
    n = len(frame)
    start = int(frame["ts_ms"].min())
    end = partitions.floor(int(frame["ts_ms"].max()), HOUR) + HOUR
    one = frame[(frame["node"] == frame["node"].iloc[0]) & (frame["gpu"] == 0)]
    span = end - start
    out: dict[str, float] = {}

    # Baseline: the flat table of revision 0002.
    reset()
    flat = open_store(url, "0002")
    try:
        out["flat_write_per_s"] = n / write_all(flat, groups)
        out["flat_bytes"] = table_bytes(flat, "samples") / n
        week = shifted(one, (7 * DAY) // span, span, "week-node")
        for rows in batches(week, 3600):
            flat.write(samples=rows)
        week_start = int(week["ts_ms"].min())
        out["flat_read_1h_s"] = median_s(
            lambda: flat.gpu_window(
                node="week-node", gpu=0, since_ms=week_start, until_ms=week_start + HOUR
            ),
            args.reads,
        )
        out["flat_read_7d_s"] = median_s(
            lambda: flat.gpu_window(
                node="week-node", gpu=0, since_ms=week_start, until_ms=week_start + 7 * DAY
            ),
            args.reads,
        )
    finally:
        flat.close()

    # Tiered: the schema at head, then the tiering task.
    reset()
    store = open_store(url, None)
    history = Path(tempfile.mkdtemp(prefix="forewarn-history-"))
    try:
        with store.begin() as c:
            partitions.ensure(c, "samples", start_ms=start, end_ms=end + 26 * HOUR)
        out["tier_write_per_s"] = n / write_all(store, groups)
        out["tier_raw_bytes"] = table_bytes(store, "samples") / n
        node0 = str(frame["node"].iloc[0])
        out["tier_read_1h_s"] = median_s(
            lambda: store.gpu_series(
                node=node0, gpu=0, since_ms=start, until_ms=start + HOUR, resolution="raw"
            ),
            args.reads,
        )
        # Every closed hour rolled up and packed, none archived: the raw tier as it stands
        # beyond its newest hours.
        keep = tiers.TierPolicy(
            raw_window_s=30 * 86400.0, history_url=None, max_hours_per_run=10_000
        )
        begin = time.perf_counter()
        report = store.maintain_tiers(keep, now_ms=end + HOUR)
        out["pack_s_per_million"] = (time.perf_counter() - begin) / n * 1e6
        hours = (end - partitions.floor(start, HOUR)) // HOUR
        assert report.hours_packed == hours, report
        packed = table_bytes(store, "sample_blocks")
        out["packed_bytes"] = packed / n
        out["wide_left_bytes"] = table_bytes(store, "samples") / n  # empty tables, indexes
        out["raw_window_bytes"] = (
            WIDE_HOURS * out["tier_raw_bytes"]
            + (RAW_WINDOW_H + 1 - WIDE_HOURS) * out["packed_bytes"]
        ) / RAW_WINDOW_H
        out["packed_read_1h_s"] = median_s(
            lambda: store.gpu_series(
                node=node0, gpu=0, since_ms=start, until_ms=start + HOUR, resolution="raw"
            ),
            args.reads,
        )
        policy = tiers.TierPolicy(
            raw_window_s=3600.0,
            history_url=str(history),
            history_window_s=None,
            max_hours_per_run=10_000,
        )
        begin = time.perf_counter()
        report = store.maintain_tiers(policy, now_ms=end + HOUR)
        elapsed = time.perf_counter() - begin
        assert report.samples_rolled == n, report
        out["rollup_s_per_million"] = elapsed / n * 1e6
        out["rollup_bytes"] = table_bytes(store, "sample_rollups") / n
        parquet = sum(p.stat().st_size for p in (history / "samples").glob("*.parquet"))
        out["parquet_bytes"] = parquet / n
        out["rollup_bytes_per_gpu_minute"] = (
            out["rollup_bytes"] * n / (frame.groupby(["node", "gpu"]).ngroups * (span / 60_000))
        )
        # A week of rollups for every GPU: the measured chunks, replicated back in time.
        with store.begin() as c:
            chunks = (
                c.execute(
                    text("SELECT node, gpu, start_ms, end_ms, minutes, data FROM sample_rollups")
                )
                .mappings()
                .all()
            )
            mark = tiers.rolled_until(c)
            assert mark is not None
            partitions.ensure(c, "sample_rollups", start_ms=mark - 8 * DAY, end_ms=mark)
            copies = []
            for k in range(1, (7 * DAY) // span + 1):
                for row in chunks:
                    copies.append(
                        {
                            **row,
                            "start_ms": row["start_ms"] - k * span,
                            "end_ms": row["end_ms"] - k * span,
                        }
                    )
            c.execute(
                text(
                    "INSERT INTO sample_rollups (node, gpu, start_ms, end_ms, minutes, data) "
                    "VALUES (:node, :gpu, :start_ms, :end_ms, :minutes, :data)"
                ),
                copies,
            )
        # Per GPU-minute over the week: the tables' fixed costs (partitions, their TOAST
        # tables and indexes) spread as they are at scale.
        gpu_minutes = frame.groupby(["node", "gpu"]).ngroups * (span // 60_000)
        copies_made = (7 * DAY) // span + 1
        out["rollup_week_bytes_per_gpu_minute"] = table_bytes(store, "sample_rollups") / (
            gpu_minutes * copies_made
        )
        out["tier_read_7d_rollups_s"] = median_s(
            lambda: store.gpu_series(node=node0, gpu=0, since_ms=mark - 7 * DAY, until_ms=mark),
            args.reads,
        )
        # The last 7 days with a raw day on top (the raw part rolled up on the fly).
        day = shifted(one, DAY // span, span, node0).assign(
            ts_ms=lambda f: f["ts_ms"] - start + mark
        )
        with store.begin() as c:
            partitions.ensure(c, "samples", start_ms=mark, end_ms=mark + DAY)
        for rows in batches(day, 3600):
            store.write(samples=rows)
        # The tiering task has rolled the day's closed hours; the last hour is still raw.
        day_policy = tiers.TierPolicy(raw_window_s=86400.0, history_url=None)
        store.maintain_tiers(day_policy, now_ms=mark + DAY - 50 * 60_000)
        out["tier_read_7d_with_raw_day_s"] = median_s(
            lambda: store.gpu_series(
                node=node0, gpu=0, since_ms=mark + DAY - 7 * DAY, until_ms=mark + DAY
            ),
            args.reads,
        )
        out.update(hourly_figures(store, node0, args.reads))
    finally:
        store.close()
    return out


HOURLY_DAYS = 28
"""Days of hourly chunks the benchmark writes per GPU (four weekly partitions)."""


def hourly_figures(store: Store, node0: str, reads: int) -> dict[str, float]:
    """Bytes per GPU-hour of the hourly tier and a 28-day read of one GPU from it.

    The run holds two hours of each GPU, and one GPU's day of copies of them would compress
    better than a real day. So each GPU's day chunk is 24 distinct hours drawn from every
    GPU's hours of the run (hours of other GPUs differ more than one GPU's consecutive hours:
    the figure errs high), written by the task's own insert into its weekly partitions.
    """
    with store.begin() as c:
        minutes = tiers._chunks(c, since_ms=0, until_ms=2**62, node=None, gpu=None)
        keys = c.execute(text("SELECT DISTINCT node, gpu FROM sample_rollups")).all()
    # The task's cost: one day of the week's minute chunks combined (then put back as it was).
    day = partitions.floor(int(minutes["ts_ms"].min()), DAY) + 2 * DAY
    with store.begin() as c:
        gpus_that_day = c.execute(
            text(
                "SELECT COUNT(DISTINCT node || '/' || gpu) FROM sample_rollups "
                "WHERE start_ms >= :a AND start_ms < :b"
            ),
            {"a": day, "b": day + DAY},
        ).scalar_one()
    begin = time.perf_counter()
    tiering._coarsen_day(store.engine, day)
    took = time.perf_counter() - begin
    with store.begin() as c:
        c.execute(text("DELETE FROM hourly_rollups"))
    hours = coarsen_frame(minutes, HOUR)[list(STAT_COLUMNS)].to_numpy()
    rng = np.random.default_rng(0)
    last_day = partitions.floor(int(minutes["ts_ms"].min()), DAY) - DAY
    first_day = last_day - (HOURLY_DAYS - 1) * DAY
    rows = []
    for node, gpu in keys:
        for day in range(first_day, last_day + DAY, DAY):
            drawn = rng.choice(len(hours), size=24, replace=len(hours) < 24)
            rows.append(
                {
                    "node": node,
                    "gpu": int(gpu),
                    "start_ms": day,
                    "end_ms": day + DAY,
                    "hours": 24,
                    "data": rollups.pack(np.arange(24), hours[drawn]),
                }
            )
    with store.begin() as c:
        partitions.ensure(c, "hourly_rollups", start_ms=first_day, end_ms=last_day + DAY)
        c.execute(text(tiering._INSERT_HOURLY), rows)
        tiers.set_mark(c, tiers.HOURLY_MARK, last_day + DAY)
    out = {
        "hourly_bytes_per_gpu_hour": table_bytes(store, "hourly_rollups") / (len(rows) * 24),
        "coarsen_ms_per_gpu_day": took / gpus_that_day * 1000,
    }
    out["tier_read_28d_hourly_s"] = median_s(
        lambda: store.gpu_series(
            node=node0,
            gpu=0,
            since_ms=first_day,
            until_ms=last_day + DAY,
            resolution="1h",
        ),
        reads,
    )
    return out


RAW_WINDOW_H = 24
"""The raw window the capacity model sizes (``FOREWARN_RAW_WINDOW_H``'s default)."""
WIDE_HOURS = 2
"""Hours of a raw window held as wide rows: the open hour and the closed one until its roll-up
(``rollup_lag_s``, 10 min, plus up to one tiering interval, 10 min), rounded up; the rest is
packed, one hour more than the window (the predecessors' hour)."""

FIGURES = [
    ("flat_write_per_s", "baseline write rate (samples/s)"),
    ("tier_write_per_s", "tiered write rate (samples/s)"),
    ("flat_bytes", "baseline bytes/sample (flat table + indexes)"),
    ("tier_raw_bytes", "wide raw rows bytes/sample (newest hours)"),
    ("packed_bytes", "packed raw bytes/sample (closed hours)"),
    ("wide_left_bytes", "wide table after packing, per sample packed"),
    ("raw_window_bytes", f"raw tier bytes/sample over {RAW_WINDOW_H} h"),
    ("rollup_bytes", "rollup tier bytes/sample"),
    ("rollup_bytes_per_gpu_minute", "rollup tier bytes per GPU-minute"),
    ("rollup_week_bytes_per_gpu_minute", "rollup tier bytes per GPU-minute, a week"),
    ("hourly_bytes_per_gpu_hour", "hourly tier bytes per GPU-hour"),
    ("coarsen_ms_per_gpu_day", "combining a day into hours, ms per GPU"),
    ("parquet_bytes", "Parquet history bytes/sample"),
    ("pack_s_per_million", "roll-up and packing s per million samples"),
    ("rollup_s_per_million", "archiving (Parquet, roll-up again) s per million"),
    ("flat_read_1h_s", "baseline 1 h read of one GPU (s)"),
    ("tier_read_1h_s", "tiered 1 h raw read of one GPU, wide (s)"),
    ("packed_read_1h_s", "tiered 1 h raw read of one GPU, packed (s)"),
    ("flat_read_7d_s", "baseline 7 d raw read of one GPU (s)"),
    ("tier_read_7d_rollups_s", "tiered 7 d read from rollups (s)"),
    ("tier_read_7d_with_raw_day_s", "tiered last 7 d, newest hour raw (s)"),
    ("tier_read_28d_hourly_s", f"tiered {HOURLY_DAYS} d read per hour (s)"),
]


def capacity(
    fig: dict[str, float],
    raw_h: float = 24,
    rollup_d: float = 30,
    hourly_d: float = 365,
    history_d: float = 30,
) -> None:
    print(
        f"\ncapacity (raw {raw_h:g} h + rollups {rollup_d:g} d + hourly {hourly_d:g} d "
        f"+ Parquet {history_d:g} d: the defaults), from the medians above"
    )
    print(
        f"{'GPUs':>8} {'every':>6} {'samples/s':>11} {'raw MB/s':>9} {'raw GB':>8} "
        f"{'rollup GB':>10} {'hourly GB':>10} {'database GB':>12} {'Parquet GB':>11} "
        f"{'total GB':>9}"
    )
    for gpus in (1024, 16_384, 100_000):
        for interval in (1, 10):
            rate = gpus / interval
            raw = rate * raw_h * 3600 * fig["raw_window_bytes"] / 1e9
            rollup = gpus * rollup_d * 1440 * fig["rollup_week_bytes_per_gpu_minute"] / 1e9
            hourly = gpus * hourly_d * 24 * fig["hourly_bytes_per_gpu_hour"] / 1e9
            parquet = rate * history_d * 86400 * fig["parquet_bytes"] / 1e9
            database = raw + rollup + hourly
            print(
                f"{gpus:>8,} {interval:>5}s {rate:>11,.0f} "
                f"{rate * fig['raw_window_bytes'] / 1e6:>9.1f} {raw:>8,.0f} {rollup:>10,.0f} "
                f"{hourly:>10,.0f} {database:>12,.0f} {parquet:>11,.0f} "
                f"{database + parquet:>9,.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--batch-s", type=int, default=10)
    parser.add_argument("--reads", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="forewarn-storage-"))
    generate_dataset(
        work / "ds",
        gpus=args.gpus,
        days=args.hours / 24,
        interval_s=args.interval_s,
        seed=args.seed,
    )
    frame = pd.read_parquet(work / "ds" / "samples")
    print(f"{len(frame):,} samples: {args.gpus} GPUs, {args.hours:g} h every {args.interval_s:g} s")

    backends: list[tuple[str, str, Any]] = []
    if args.backend in ("sqlite", "both"):
        db = work / "bench.db"

        def reset_sqlite() -> None:
            for suffix in ("", "-wal", "-shm", ".write-lock"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)

        backends.append(("sqlite", f"sqlite:///{db}", reset_sqlite))
    if args.backend in ("postgres", "both"):
        url = postgres_url()
        if url is None:
            print("PostgreSQL: not reachable, skipped")
        else:
            backends.append(("postgres", url, lambda: reset_postgres(url)))

    for name, url, reset in backends:
        runs = [run_backend(name, url, reset, frame, args) for _ in range(args.repeat)]
        print(f"\n{name} ({args.repeat} run(s): median [min-max])")
        med = {}
        for key, label in FIGURES:
            values = [r[key] for r in runs]
            med[key] = statistics.median(values)
            print(f"  {label:<46} {med[key]:>12.4g}  [{min(values):.4g}-{max(values):.4g}]")
        pairs = [
            ("write rate tiered/baseline", "tier_write_per_s", "flat_write_per_s"),
            ("raw bytes tiered/baseline", "tier_raw_bytes", "flat_bytes"),
            ("packed raw bytes/baseline", "packed_bytes", "flat_bytes"),
            ("raw tier over 24 h/baseline", "raw_window_bytes", "flat_bytes"),
            ("7 d read rollups/baseline 7 d raw", "tier_read_7d_rollups_s", "flat_read_7d_s"),
            ("7 d read incl. raw day/baseline", "tier_read_7d_with_raw_day_s", "flat_read_7d_s"),
            ("1 h raw read tiered/baseline", "tier_read_1h_s", "flat_read_1h_s"),
            ("1 h raw read packed/baseline", "packed_read_1h_s", "flat_read_1h_s"),
        ]
        for label, a, b in pairs:
            print(f"  {label:<46} {ratio(med[a], med[b]):>12}")
        beyond = med["rollup_bytes"] + med["parquet_bytes"]
        print(
            f"  {'(rollups + Parquet)/baseline bytes':<46} {ratio(beyond, med['flat_bytes']):>12}"
        )
        capacity(med)


if __name__ == "__main__":
    main()
