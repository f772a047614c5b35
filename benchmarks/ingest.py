"""Ingest throughput: the store's raw bulk insert against the whole path through the API.

For a 16,384-GPU fleet (2,048 nodes x 8 GPUs) whose collectors batch ``--ticks`` seconds of
1 Hz samples per request, in one run and on each backend:

(a) raw: ``Store.submit`` of already-validated rows, one node batch per call, with
    ``--concurrency`` batches awaiting their commit as the service's requests would be (the
    store group-commits what has queued up), in this process (no HTTP, no validation) — the
    ceiling set by the database and the store's writer; also shown one batch at a time
    (``1-by-1``: each commit waited for before the next batch, as earlier figures were);
(b) end to end: gzip'd batches POSTed to a real ``forewarn serve`` (uvicorn, writer process;
    the control loop and webhook dispatcher off, see ``INGEST_ONLY``) over loopback by
    ``--concurrency`` concurrent clients, each response waited for; the batches as
    ``sample_columns`` (what ``IngestClient(columns=True)`` sends) and as rows.

Prints samples/s for each, b/a (a: the higher of the two raw figures; goal: b/a >= 0.6 and
b >= 50,000/s on SQLite; PostgreSQL raw >= 50,000/s), and the service's CPU time per sample
in (b) (``us/sample``, the writer process included): on a shared machine the rates follow
the load, the CPU cost much less.
``--repeat`` runs everything again so the spread shows: the machine is shared, and a figure
alone says little.

    .venv/bin/python benchmarks/ingest.py [--backend sqlite|postgres|both] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import tempfile
import time
from collections import deque
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import orjson
from _common import Service, cpu_seconds, post_raw, postgres_url, ratio, reset_postgres

from forewarn.wire import GpuSample, sample_columns
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


def raw_rate(url: str, batches: list[list[dict]], in_flight: int) -> float:
    """Samples/s of ``Store.submit`` with up to ``in_flight`` node batches awaiting commit."""
    rows = [[sample_row(GpuSample.model_validate(r)) for r in b] for b in batches]
    store = Store.open(url)
    try:
        start = time.perf_counter()
        pending: deque[Future[tuple[int, int]]] = deque()
        for batch in rows:
            if len(pending) >= in_flight:
                pending.popleft().result()
            pending.append(store.submit(samples=batch))
        for future in pending:
            future.result()
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


def bodies_of(batches: list[list[dict]], shape: str) -> list[bytes]:
    """gzip'd request bodies, as rows or as ``sample_columns``."""
    out = []
    for rows in batches:
        node = rows[0]["node"]
        if shape == "columns":
            body = {"node": node, "sample_columns": sample_columns(rows, node)}
        else:
            body = {"node": node, "samples": rows}
        out.append(gzip.compress(orjson.dumps(body), 1))
    return out


def end_to_end_rate(
    url: str, work: Path, bodies: list[bytes], expected: int, concurrency: int
) -> tuple[float, float]:
    """(samples/s, the service's CPU microseconds per sample, its writer process included)."""
    service = Service(url, work / "service.log", env=INGEST_ONLY)
    try:
        _warm_up(service)
        cpu = cpu_seconds(service.process.pid)
        start = time.perf_counter()
        stored = _post_all(service.url, service.token, bodies, concurrency)
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds(service.process.pid) - cpu
    finally:
        service.stop()
    if stored != expected:
        raise SystemExit(f"stored {stored} of {expected} samples")
    return expected / elapsed, cpu / expected * 1e6


def _warm_up(service: Service) -> None:
    """One small batch, answered only once the service's writer process has started."""
    now = datetime.now(UTC).isoformat()
    body = {"node": "warm-up", "samples": [{"node": "warm-up", "gpu": 0, "ts": now}]}
    response = httpx.post(
        f"{service.url}/v1/ingest",
        json=body,
        headers={"Authorization": f"Bearer {service.token}"},
        timeout=120,
    )
    response.raise_for_status()


INGEST_ONLY = {"FOREWARN_CONTROL_ENABLED": "false", "FOREWARN_WEBHOOK_DISPATCH": "false"}
"""The service with ingest alone: the control loop scores every GPU that reports (its cost is
``benchmarks/scoring.py``'s to measure) and would share these two cores with ingest here."""


def _fresh(backend: str, work: Path, name: str) -> str | None:
    if backend == "sqlite":
        return f"sqlite:///{work / name}.db"
    url = postgres_url()
    if url is not None:
        reset_postgres(url)
    return url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--nodes", type=int, default=2048)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=10, help="seconds of samples per batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1, help="run everything this many times")
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
    shapes = {s: bodies_of(batches, s) for s in ("columns", "rows")}
    print(
        f"{'backend':<10} {'raw (a) /s':>11} {'1-by-1 /s':>10} {'columns (b) /s':>15} "
        f"{'b/a':>5} {'us/sample':>9} {'rows /s':>9}"
    )
    figures: dict[str, list[tuple[float, ...]]] = {b: [] for b in backends}
    for _ in range(args.repeat):
        for backend in backends:
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                url = _fresh(backend, work, "raw")
                if url is None:
                    print(f"{backend:<10} skipped: PostgreSQL not reachable")
                    continue
                a = raw_rate(url, batches, args.concurrency)
                url = _fresh(backend, work, "raw1")
                assert url is not None
                one = raw_rate(url, batches, 1)
                rates = []
                for shape in ("columns", "rows"):
                    url = _fresh(backend, work, shape)
                    assert url is not None
                    rates.append(end_to_end_rate(url, work, shapes[shape], total, args.concurrency))
                (b, cpu), (rows, _) = rates
                best = max(a, one)  # b/a against the store's better figure, whichever it is
                figures[backend].append((a, one, b, b / best, cpu, rows))
                print(
                    f"{backend:<10} {a:>11,.0f} {one:>10,.0f} {b:>15,.0f} {ratio(b, best):>5} "
                    f"{cpu:>9.1f} {rows:>9,.0f}",
                    flush=True,
                )
    if args.repeat > 1:
        print("spread (min-max):")
        names = ("raw", "1-by-1", "columns", "b/a", "us/sample", "rows")
        for backend, runs in figures.items():
            if runs:
                spans = []
                for name, values in zip(names, zip(*runs, strict=True), strict=True):
                    fmt = ".2f" if name == "b/a" else ".1f" if name == "us/sample" else ",.0f"
                    spans.append(f"{name} {min(values):{fmt}}-{max(values):{fmt}}")
                print(f"{backend:<10} " + "  ".join(spans))


if __name__ == "__main__":
    main()
