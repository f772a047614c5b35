"""Simulator throughput: datasets against plain Parquet writing, live ticks old path and new.

In one run (``--part dataset``, one day of a 1,024-GPU fleet at 10 s):

(a) generate: ``sim.generate_dataset`` — the fleet model stepped 8,640 times and
    every row written (samples, events, failures, manifest);
(b) baseline: writing the same sample rows, already in memory as an Arrow table, to Parquet
    with the same compression — the floor any generator that writes this format pays;
(c) model only: ``FleetModel.step`` for the same ticks, no output;
(d) live source: ``SimulatedSource.read`` (validated wire objects) for a 1,024-GPU fleet.

Prints samples/s of each and the ratios (goal: (a) under 60 s on the 2-core dev machine).

And (``--part live``) what one live tick of ``forewarn simulate --service`` costs this process,
in CPU seconds (``time.process_time``: user + system of every thread, so a loaded machine
slows it little), at 1,024, 4,096 and 16,384 GPUs, each tick sent at once (a 1-s batch
period, as ``forewarn collect`` by default):

(e) old path: ``SimulatedSource.read`` (one ``GpuSample`` per sample), ``BatchingPusher.add``,
    then rows bodies (``model_dump`` per row), JSON, gzip and the HTTP client;
(f) new path: ``SimulatedSource.read_batches`` (columns per node from the model's arrays),
    ``BatchingPusher.add_columns``, then ``sample_columns`` bodies, JSON, gzip, the HTTP client;

both sending through ``httpx.MockTransport`` answering 200 (the client's work, no socket);
(g) the new path with 10-s batches; the model's step alone; and each path only up to its
gzipped bodies (no pusher, no client: "to bytes"). Prints CPU s per tick of each, the ratio
old / new, and whether 16,384 GPUs at 1 Hz fit in one core (new path under 1 CPU-s a tick).

    .venv/bin/python benchmarks/simulator.py [--part all|dataset|live] [--gpus 1024] \\
        [--days 1] [--interval 10] [--ticks 5] [--live-gpus 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import pyarrow.dataset as pads  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from collector.push import BatchingPusher, IngestClient, batch_body  # noqa: E402
from forewarn.wire import GpuSample  # noqa: E402
from sim import FleetModel, generate_dataset, load_params  # noqa: E402
from sim.source import SimulatedSource  # noqa: E402

_OK = (
    b'{"stored_samples":0,"duplicate_samples":0,"stored_events":0,"duplicate_events":0,'
    b'"rejected":[]}'
)


def _pusher() -> BatchingPusher:
    def ok(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_OK, headers={"Content-Type": "application/json"})

    client = IngestClient("http://forewarn", "t", transport=httpx.MockTransport(ok))
    return BatchingPusher(client, max_delay_s=3600.0).start()  # sent by flush(), each tick


def _live_tick_cpu(
    gpus: int, ticks: int, seed: int, new: bool, batch_ticks: int = 1
) -> tuple[float, float, int]:
    """CPU s of one tick (median over ``ticks`` rounds of ``batch_ticks`` ticks, each round
    sent at its end), CPU s of the model's step alone, rows sent."""
    src = SimulatedSource(gpus, seed=seed)
    pusher = _pusher()
    start = datetime(2026, 1, 1, tzinfo=UTC)
    src.read(start)  # the first tick sets the clock
    costs, steps, k = [], [], 0
    for _ in range(ticks):
        c0 = time.process_time()
        for _ in range(batch_ticks):
            k += 1
            now = start + timedelta(seconds=k)
            if new:
                for b in src.read_batches(now):
                    pusher.add_columns(b.node, b.columns, b.events)
            else:
                pusher.add(src.read(now))
        pusher.flush(600.0)
        costs.append((time.process_time() - c0) / batch_ticks)
    for _ in range(ticks):
        k += 1
        c0 = time.process_time()
        src.model.step(1.0, int((start + timedelta(seconds=k)).timestamp() * 1000))
        steps.append(time.process_time() - c0)
    sent = pusher.stats.sent_total
    pusher.close()
    return sorted(costs)[ticks // 2], sorted(steps)[ticks // 2], sent


def _to_bytes_cpu(gpus: int, ticks: int, seed: int, new: bool) -> float:
    """CPU s of one tick up to the gzipped bodies (no pusher, no client), median."""
    src = SimulatedSource(gpus, seed=seed)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    src.read(start)
    costs = []
    for k in range(1, ticks + 1):
        now = start + timedelta(seconds=k)
        c0 = time.process_time()
        if new:
            bodies = [
                {"schema_version": 1, "node": b.node, "sample_columns": b.columns, "events": []}
                for b in src.read_batches(now)
            ]
        else:
            by_node: dict[str, list[GpuSample]] = {}
            for r in src.read(now):
                if isinstance(r, GpuSample):
                    by_node.setdefault(r.node, []).append(r)
            bodies = [batch_body(node, rows) for node, rows in by_node.items()]
        for body in bodies:
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
            gzip.compress(data, compresslevel=5)
        costs.append(time.process_time() - c0)
    return sorted(costs)[ticks // 2]


def live(sizes: list[int], ticks: int, seed: int) -> None:
    print(f"live: CPU s per 1-s tick of this process (median of {ticks}), 1-s batches")
    print(
        f"{'GPUs':>7} {'step':>7} {'(e) old':>8} {'(f) new':>8} {'old/new':>8} "
        f"{'new: core':>9} {'(g) new, 10-s':>13} {'old to bytes':>12} {'new to bytes':>12}"
    )
    fits = None
    for gpus in sizes:
        old, step, sent_old = _live_tick_cpu(gpus, ticks, seed, new=False)
        new, _, sent_new = _live_tick_cpu(gpus, ticks, seed, new=True)
        assert sent_old == sent_new, (sent_old, sent_new)  # the same rows either way
        ten, _, _ = _live_tick_cpu(gpus, max(1, ticks // 2), seed, new=True, batch_ticks=10)
        old_b = _to_bytes_cpu(gpus, ticks, seed, new=False)
        new_b = _to_bytes_cpu(gpus, ticks, seed, new=True)
        print(
            f"{gpus:>7,} {step:7.3f} {old:8.3f} {new:8.3f} {old / new:7.1f}x "
            f"{new:9.0%} {ten:13.3f} {old_b:12.3f} {new_b:12.3f}"
        )
        if gpus == 16384:
            fits = new < 1.0
    if fits is not None:
        print(f"16,384 GPUs at 1 Hz in one core (new path < 1 CPU-s a tick): {fits}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["all", "dataset", "live"], default="all")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--days", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ticks", type=int, default=5, help="live ticks timed per path and size")
    ap.add_argument("--live-gpus", default="1024,4096,16384", help="fleet sizes of --part live")
    args = ap.parse_args()
    if args.part in ("all", "dataset"):
        dataset(args)
    if args.part in ("all", "live"):
        live([int(g) for g in args.live_gpus.split(",")], args.ticks, args.seed)


def dataset(args: argparse.Namespace) -> None:
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
