"""Simulator throughput: one day of a 1,024-GPU fleet at 10 s, against plain Parquet writing.

In one run:

(a) generate: ``sim.generate_dataset`` — the fleet model stepped 8,640 times and
    every row written (samples, events, failures, manifest);
(b) baseline: writing the same sample rows, already in memory as an Arrow table, to Parquet
    with the same compression — the floor any generator that writes this format pays;
(c) model only: ``FleetModel.step`` for the same ticks, no output;
(d) live source: ``SimulatedSource.read`` (validated wire objects) for a 1,024-GPU fleet.

Prints samples/s of each and the ratios (goal: (a) under 60 s on the 2-core dev machine).

    .venv/bin/python benchmarks/simulator.py [--gpus 1024] [--days 1] [--interval 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow.dataset as pads  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from sim import FleetModel, generate_dataset, load_params  # noqa: E402
from sim.source import SimulatedSource  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--days", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ds"
        t0 = time.perf_counter()
        info = generate_dataset(
            out, gpus=args.gpus, days=args.days, interval_s=args.interval, seed=args.seed
        )
        gen_s = time.perf_counter() - t0

        table = pads.dataset(out / "samples").to_table()
        t0 = time.perf_counter()
        pq.write_table(
            table, Path(tmp) / "baseline.parquet", compression="zstd", row_group_size=1_000_000
        )
        base_s = time.perf_counter() - t0
        size_mb = sum(p.stat().st_size for p in (out / "samples").glob("*.parquet")) / 2**20

    params = load_params(overrides={"sampling.interval_s": args.interval})
    ticks = round(args.days * 86400 / args.interval)
    model = FleetModel(args.gpus, params, args.seed)
    t0 = time.perf_counter()
    for k in range(ticks):
        model.step(args.interval, k * int(args.interval * 1000))
    model_s = time.perf_counter() - t0

    src = SimulatedSource(args.gpus, seed=args.seed)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    reads, rows = 20, 0
    t0 = time.perf_counter()
    for k in range(reads):
        rows += len(src.read(start + timedelta(seconds=k)))
    live_s = time.perf_counter() - t0

    n = info.samples
    print(f"fleet: {args.gpus} GPUs, {args.days:g} day(s) at {args.interval:g} s = {ticks} ticks")
    print(
        f"(a) generate_dataset : {gen_s:7.2f} s  {n / gen_s:12,.0f} samples/s  "
        f"({n:,} samples, {info.events:,} events, {info.failures} failures, {size_mb:.0f} MiB)"
    )
    print(f"(b) parquet baseline : {base_s:7.2f} s  {n / base_s:12,.0f} samples/s")
    print(
        f"(c) model step only  : {model_s:7.2f} s  {args.gpus * ticks / model_s:12,.0f} GPU-ticks/s"
    )
    print(
        f"(d) live source read : {live_s / reads * 1000:7.1f} ms per 1 s tick of {args.gpus} GPUs "
        f"({rows / live_s:,.0f} wire objects/s)"
    )
    print(f"ratio generate / parquet baseline: {gen_s / base_s:.2f}x")
    print(f"ratio generate / 60 s budget     : {gen_s / 60:.2f}")


if __name__ == "__main__":
    main()
