"""Load: a fleet's collectors and some readers against one service (or two replicas) at once.

Every node (8 GPUs) posts one batch a second of its GPUs' samples (the ``sample_columns``
shape ``IngestClient(columns=True)`` sends); ``--readers`` clients meanwhile read what the
dashboard and API users read (a page of ``/v1/gpus``, one GPU's samples). After
``--duration`` seconds it prints the samples/s sustained, p50/p99 latency of ingest and of
reads, the errors, and a count check: every acknowledged sample must be in the store.

    .venv/bin/python benchmarks/load.py [--backend sqlite|postgres] [--replicas 2] \\
        [--gpus 16384] [--duration 60] [--readers 4]

Two replicas need PostgreSQL (they share it); nodes are spread over them. Collectors and
readers run in this process: on a small machine they take their share of its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson
from _common import Service, postgres_url, reset_postgres

from store import Store


def _columns(node: int, gpus: int, ts_ms: int) -> bytes:
    body = {
        "node": f"load-{node:05d}",
        "sample_columns": {
            "gpu": list(range(gpus)),
            "ts_ms": [ts_ms] * gpus,
            "temp_gpu_c": [60.0 + g for g in range(gpus)],
            "power_w": [650.0] * gpus,
            "util_gpu_pct": [98.0] * gpus,
            "ecc_sbe_volatile": [node % 3] * gpus,
            "remap_pending": [False] * gpus,
        },
    }
    return gzip.compress(orjson.dumps(body), 1)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _collector(
    http: httpx.AsyncClient, url: str, node: int, gpus: int, until: float, out: dict
) -> None:
    headers = {"Authorization": "Bearer bench-token", "Content-Encoding": "gzip"}
    tick = time.time()
    while tick < until:
        ts_ms = int(tick * 1000)
        start = time.perf_counter()
        try:
            r = await http.post(
                f"{url}/v1/ingest", content=_columns(node, gpus, ts_ms), headers=headers
            )
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        out["ingest_s"].append(time.perf_counter() - start)
        if ok:
            out["acked"] += gpus
        else:
            out["ingest_errors"] += 1
        tick += 1.0
        await asyncio.sleep(max(0.0, tick - time.time()))


async def _reader(http: httpx.AsyncClient, urls: list[str], until: float, out: dict) -> None:
    headers = {"Authorization": "Bearer bench-token"}
    i = 0
    while time.time() < until:
        url = urls[i % len(urls)]
        path = "/v1/gpus?limit=1000" if i % 2 == 0 else f"/v1/gpus/load-{i % 97:05d}/0/samples"
        start = time.perf_counter()
        try:
            r = await http.get(url + path, headers=headers)
            ok = r.status_code in (200, 404)
        except httpx.HTTPError:
            ok = False
        out["read_s"].append(time.perf_counter() - start)
        out["read_errors"] += 0 if ok else 1
        i += 1


async def _run(urls: list[str], nodes: int, gpus: int, duration_s: float, readers: int) -> dict:
    out: dict = {"ingest_s": [], "read_s": [], "acked": 0, "ingest_errors": 0, "read_errors": 0}
    until = time.time() + duration_s
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        tasks = [_collector(http, urls[n % len(urls)], n, gpus, until, out) for n in range(nodes)]
        tasks += [_reader(http, urls, until, out) for _ in range(readers)]
        await asyncio.gather(*tasks)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=16384)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--readers", type=int, default=4)
    args = parser.parse_args()
    nodes = args.gpus // 8
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.backend == "postgres":
            url = postgres_url()
            if url is None:
                raise SystemExit("PostgreSQL not reachable")
            reset_postgres(url)
        else:
            if args.replicas > 1:
                raise SystemExit("several replicas share PostgreSQL; use --backend postgres")
            url = f"sqlite:///{work / 'load.db'}"
        Store.open(url).close()  # migrate once, before the replicas start
        services = [Service(url, work / f"service{i}.log") for i in range(args.replicas)]
        try:
            started = time.time()
            out = asyncio.run(
                _run([s.url for s in services], nodes, 8, args.duration, args.readers)
            )
            elapsed = time.time() - started
        finally:
            for service in services:
                service.stop()
        store = Store.open(url, migrate=False)
        try:
            frame = store.fleet_window(since_ms=0, fields=["gpu"])
        finally:
            store.close()
    stored = len(frame)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    print(
        f"{when} {args.backend} x{args.replicas}: {args.gpus} GPUs at 1 Hz, {args.readers} "
        f"readers, {args.duration:.0f} s"
    )
    print(f"  samples/s sustained  {out['acked'] / elapsed:,.0f} (offered {args.gpus:,})")
    ingest, reads = out["ingest_s"], out["read_s"]
    print(
        f"  ingest latency       p50 {_pct(ingest, 0.5) * 1000:.0f} ms, "
        f"p99 {_pct(ingest, 0.99) * 1000:.0f} ms ({len(ingest)} batches)"
    )
    print(
        f"  read latency         p50 {_pct(reads, 0.5) * 1000:.0f} ms, "
        f"p99 {_pct(reads, 0.99) * 1000:.0f} ms ({len(reads)} reads, "
        f"mean {statistics.fmean(reads) * 1000 if reads else 0:.0f} ms)"
    )
    print(f"  errors               ingest {out['ingest_errors']}, reads {out['read_errors']}")
    lost = out["acked"] - stored
    print(
        f"  count check          acknowledged {out['acked']:,}, stored {stored:,}, "
        f"lost {max(lost, 0)}"
    )
    if lost > 0:
        raise SystemExit("acknowledged samples are missing from the store")


if __name__ == "__main__":
    main()
