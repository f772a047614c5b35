"""Ingest throughput: the store's raw bulk insert against the whole path through the API.

For a 16,384-GPU fleet (2,048 nodes x 8 GPUs) whose collectors batch ``--ticks`` seconds of
1 Hz samples per request, in one run and on each backend:

(a) raw: ``Store.write`` of already-validated rows, one transaction per node batch — the
    ceiling set by the database;
(b) end to end: gzip'd JSON batches POSTed to a real ``forewarn serve`` (uvicorn) over
    loopback by ``--concurrency`` concurrent clients, each response waited for.

Prints samples/s for both and the ratio b/a (goal: b/a >= 0.6, b >= 50,000/s on SQLite).

    .venv/bin/python benchmarks/ingest.py [--backend sqlite|postgres|both] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
from _common import Service, post_raw, postgres_url, ratio, reset_postgres

from forewarn.wire import GpuSample
from store import Store
from store.writes import sample_row


def fleet_batches(nodes: int, gpus: int, ticks: int, start: datetime) -> list[list[dict]]:
    """One batch per node: ``ticks`` seconds of samples for each of its GPUs."""
    batches = []
    for n in range(nodes):
        node = f"gpu-node-{n:05d}"
        rows = []
        for t in range(ticks):
            ts = (start + timedelta(seconds=t)).isoformat()
            for g in range(gpus):
                rows.append(
                    {
                        "node": node,
                        "gpu": g,
                        "ts": ts,
                        "uuid": f"GPU-{n:05d}-{g}",
                        "vendor": "nvidia",
                        "temp_gpu_c": 61.0 + g,
                        "temp_mem_c": 70.5,
                        "power_w": 640.0 + t,
                        "sm_clock_mhz": 1980.0,
                        "mem_clock_mhz": 2619.0,
                        "throttle_reasons": 0,
                        "util_gpu_pct": 99.0,
                        "util_mem_pct": 40.0,
                        "mem_used_mib": 71000.0,
                        "mem_total_mib": 81559.0,
                        "ecc_sbe_volatile": t // 4,
                        "ecc_dbe_volatile": 0,
                        "ecc_sbe_aggregate": 12 + t // 4,
                        "ecc_dbe_aggregate": 0,
                        "remap_correctable": 0,
                        "remap_uncorrectable": 0,
                        "remap_pending": False,
                        "remap_failure": False,
                        "nvlink_crc_flit": 3,
                        "nvlink_crc_data": 0,
                        "nvlink_replay": 1,
                        "nvlink_recovery": 0,
                        "pcie_replay": 0,
                        "pcie_link_width": 16,
                        "pcie_link_width_max": 16,
                        "pcie_link_gen": 5,
                    }
                )
        batches.append(rows)
    return batches


def raw_rate(url: str, batches: list[list[dict]]) -> float:
    rows = [[sample_row(GpuSample.model_validate(r)) for r in b] for b in batches]
    store = Store.open(url)
    try:
        start = time.perf_counter()
        for batch in rows:
            store.write(samples=batch)
        elapsed = time.perf_counter() - start
    finally:
        store.close()
    return sum(map(len, rows)) / elapsed


def _post_all(url: str, token: str, bodies: list[bytes], concurrency: int) -> int:
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Encoding": "gzip",
        "Content-Type": "application/json",
    }
    responses = asyncio.run(post_raw(url, "/v1/ingest", headers, bodies, concurrency))
    return sum(orjson.loads(r)["stored_samples"] for r in responses)


def end_to_end_rate(url: str, work: Path, batches: list[list[dict]], concurrency: int) -> float:
    bodies = [gzip.compress(orjson.dumps({"node": b[0]["node"], "samples": b}), 1) for b in batches]
    expected = sum(map(len, batches))
    service = Service(url, work / "service.log")
    try:
        start = time.perf_counter()
        stored = _post_all(service.url, service.token, bodies, concurrency)
        elapsed = time.perf_counter() - start
    finally:
        service.stop()
    if stored != expected:
        raise SystemExit(f"stored {stored} of {expected} samples")
    return expected / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--nodes", type=int, default=2048)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=10, help="seconds of samples per batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

    now = datetime.now(UTC).replace(microsecond=0)
    rounds = [
        fleet_batches(
            args.nodes, args.gpus, args.ticks, now - timedelta(seconds=(r + 1) * args.ticks)
        )
        for r in range(args.rounds)
    ]
    batches = [b for r in rounds for b in r]
    total = sum(map(len, batches))
    print(
        f"fleet: {args.nodes} nodes x {args.gpus} GPUs, {args.ticks} s per batch, "
        f"{len(batches)} batches, {total} samples"
    )
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    print(f"{'backend':<10} {'raw (a) /s':>12} {'e2e (b) /s':>12} {'b/a':>6}")
    for backend in backends:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if backend == "sqlite":
                raw_url = f"sqlite:///{work / 'raw.db'}"
                e2e_url = f"sqlite:///{work / 'e2e.db'}"
            else:
                pg = postgres_url()
                if pg is None:
                    print(f"{backend:<10} skipped: PostgreSQL not reachable")
                    continue
                raw_url = e2e_url = pg
                reset_postgres(pg)
            a = raw_rate(raw_url, batches)
            if backend == "postgres":
                reset_postgres(e2e_url)
            b = end_to_end_rate(e2e_url, work, batches, args.concurrency)
            print(f"{backend:<10} {a:>12,.0f} {b:>12,.0f} {ratio(b, a):>6}")


if __name__ == "__main__":
    main()
