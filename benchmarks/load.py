"""Load: a fleet's collectors and some readers against one service (or two replicas) at once.

Every node (8 GPUs) posts what a collector sends by default (``forewarn collect``:
``BatchingPusher`` with ``--batch-max-delay-s 10``, ``IngestClient`` with ``sample_columns``,
gzip level 5): one batch of its GPUs' last 10 s every 10 s, on its own keep-alive connection,
waiting for each answer before the next batch (a node that falls behind sends its next batch
at once, as a collector drains its buffer). ``--batch-s N`` sends N seconds of samples every
N seconds instead (a collector with another ``--batch-max-delay-s``); ``--shape rows`` sends
one object a sample (``forewarn collect --rows``).

The collectors are ``--generators`` processes of their own. Each encodes and gzips every
request it will send before the clock starts, and sends them with a thin HTTP/1.1 client, so
that sending costs little and the limit measured is the service's. Meanwhile ``--readers``
clients in this process read what dashboard and API users read, each every
``--read-interval`` seconds: a page of ``/v1/gpus`` and one GPU's samples, alternately.

After ``--duration`` seconds it prints the samples/s sustained (acknowledged samples over
the duration) against those offered, p50/p99 latency of ingest and of reads, the errors, the
CPU used by the service (its writer and control-loop processes included) and by the
collectors' processes, the control loop's ticks (from the status it publishes: proof it ran)
and their mean duration, and a count check: every
acknowledged sample must be in the store (exact when there were no errors; a batch that timed
out may have been stored all the same, and is then counted as stored, not acknowledged).

    .venv/bin/python benchmarks/load.py [--backend sqlite|postgres] [--replicas 2] \\
        [--gpus 16384] [--duration 60] [--readers 4] [--repeat 3]

Two replicas need PostgreSQL (they share it); nodes are spread over them. The service runs
as ``forewarn serve`` does by default (control loop in its own process, webhook dispatcher
on; ``--no-control`` turns the control loop off, to see what scoring the fleet costs).
``--partitioned`` has the replicas' loops share the scoring (``FOREWARN_PARTITIONED_SCORING``):
the line then says how many GPUs the leader scored itself and how old each follower's last
scores were at the leader's last tick.

    .venv/bin/python benchmarks/load.py --backend postgres --replicas 3 --partitioned \
        --gpus 10000

``--workers N`` starts each replica as ``forewarn serve --workers N``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from _common import Service, cpu_seconds, postgres_url, reset_postgres

from forewarn.wire import sample_columns
from store import Store
from store import control as control_db

TOKEN = "bench-token"
GPUS_PER_NODE = 8


def _rows(node: int, gpus: int, start_ms: int, seconds: int) -> list[dict[str, Any]]:
    """``seconds`` ticks of one node's samples, as a collector reads them from NVML."""
    name = f"load-{node:05d}"
    rows = []
    for t in range(seconds):
        ts = datetime.fromtimestamp((start_ms + t * 1000) / 1000, UTC).isoformat()
        for g in range(gpus):
            rows.append(
                {
                    "node": name,
                    "gpu": g,
                    "ts": ts,
                    "uuid": f"GPU-{node:05d}-{g}",
                    "vendor": "nvidia",
                    "temp_gpu_c": 60.0 + g,
                    "temp_mem_c": 71.0,
                    "power_w": 650.0 + t % 7,
                    "sm_clock_mhz": 1980.0,
                    "mem_clock_mhz": 2619.0,
                    "throttle_reasons": 0,
                    "util_gpu_pct": 98.0,
                    "util_mem_pct": 40.0,
                    "mem_used_mib": 71000.0,
                    "mem_total_mib": 81559.0,
                    "ecc_sbe_volatile": node % 3,
                    "ecc_dbe_volatile": 0,
                    "ecc_sbe_aggregate": 12,
                    "ecc_dbe_aggregate": 0,
                    "remap_correctable": 0,
                    "remap_uncorrectable": 0,
                    "remap_pending": False,
                    "remap_failure": False,
                    "nvlink_crc_flit": 0,
                    "nvlink_crc_data": 0,
                    "nvlink_replay": 0,
                    "nvlink_recovery": 0,
                    "pcie_replay": 0,
                    "pcie_link_width": 16,
                    "pcie_link_width_max": 16,
                    "pcie_link_gen": 5,
                }
            )
    return rows


def _request(url: str, node: int, rows: list[dict[str, Any]], shape: str) -> bytes:
    name = f"load-{node:05d}"
    if shape == "columns":
        body: dict[str, Any] = {"node": name, "sample_columns": sample_columns(rows, name)}
    else:
        body = {"node": name, "samples": rows}
    data = gzip.compress(orjson.dumps(body), compresslevel=5)
    head = (
        f"POST /v1/ingest HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: gzip\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def _response(reader: asyncio.StreamReader) -> int:
    status = await reader.readline()
    if not status:
        raise ConnectionResetError("the service closed the connection")
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    parts = status.split()
    return int(parts[1]) if len(parts) > 1 else 0


async def _node(
    url: str, requests: list[bytes], rows: int, period_s: float, first_at: float, until: float
) -> dict[str, Any]:
    """One collector: a batch every ``period_s`` from ``first_at``, each answer waited for."""
    out: dict[str, Any] = {"acked": 0, "errors": 0, "latency_s": [], "sent_at": [], "statuses": {}}
    parts = urlsplit(url)
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    due = first_at
    for request in requests:
        delay = due - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.time() >= until:
            break
        due += period_s
        start = time.perf_counter()
        status = 0
        # A keep-alive connection the service closed while idle (uvicorn: after 5 s) is opened
        # again and the batch sent once more at once, as an HTTP client's pool does.
        for attempt in range(2):
            reused = connection is not None
            try:
                if connection is None:
                    connection = await asyncio.open_connection(parts.hostname, parts.port)
                connection[1].write(request)
                status = await asyncio.wait_for(_response(connection[0]), 60)
                break
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                if connection is not None:
                    connection[1].close()
                connection = None
                if not reused or attempt or isinstance(exc, TimeoutError):
                    break
        out["latency_s"].append(time.perf_counter() - start)
        out["sent_at"].append(due - period_s)
        if status == 200:
            out["acked"] += rows
        else:
            out["errors"] += 1
            out["statuses"][status] = out["statuses"].get(status, 0) + 1
    if connection is not None:
        connection[1].close()
    return out


def _generator(
    urls: list[str],
    nodes: list[int],
    args: argparse.Namespace,
    start: Any,
    results: Any,
) -> None:
    """A process of collectors: encode every request first, then send them on the clock."""
    period = args.batch_s
    batches = int(args.duration // period) + 1
    base_ms = int(time.time()) * 1000
    plan = []
    for node in nodes:
        url = urls[node % len(urls)]
        requests = [
            _request(
                url,
                node,
                _rows(node, GPUS_PER_NODE, base_ms + k * period * 1000, period),
                args.shape,
            )
            for k in range(batches)
        ]
        plan.append((node, url, requests))
    results.put(("ready", os.getpid()))
    begin, until = start.get()

    async def run() -> list[dict[str, Any]]:
        # Collectors start spread over the first period, as a real fleet's clocks are.
        return await asyncio.gather(
            *(
                _node(
                    url,
                    requests,
                    GPUS_PER_NODE * period,
                    period,
                    begin + (node * 0.618034 % 1) * period,
                    until,
                )
                for node, url, requests in plan
            )
        )

    cpu = time.process_time()
    outs = asyncio.run(run())
    results.put(
        (
            "done",
            {
                "cpu_s": time.process_time() - cpu,
                "acked": sum(o["acked"] for o in outs),
                "errors": sum(o["errors"] for o in outs),
                "latency_s": [x for o in outs for x in o["latency_s"]],
                "sent_at": [x for o in outs for x in o["sent_at"]],
                "statuses": _merged([o["statuses"] for o in outs]),
            },
        )
    )


def _merged(counts: list[dict[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


async def _reader(
    http: httpx.AsyncClient, urls: list[str], nodes: int, every_s: float, until: float, out: dict
) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    i = 0
    due = time.time()
    while time.time() < until:
        url = urls[i % len(urls)]
        if i % 2 == 0:
            path = "/v1/gpus?limit=1000"
        else:
            path = f"/v1/gpus/load-{(i * 7919) % nodes:05d}/{i % GPUS_PER_NODE}/samples"
        start = time.perf_counter()
        try:
            r = await http.get(url + path, headers=headers)
            ok = r.status_code in (200, 404)  # 404: a GPU whose first batch is not in yet
        except httpx.HTTPError:
            ok = False
        out["read_s"].append(time.perf_counter() - start)
        out["read_errors"] += 0 if ok else 1
        i += 1
        due += every_s
        await asyncio.sleep(max(0.0, due - time.time()))


async def _read(urls: list[str], nodes: int, args: argparse.Namespace, until: float) -> dict:
    out: dict = {"read_s": [], "read_errors": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(
            *(
                _reader(http, urls, nodes, args.read_interval, until, out)
                for _ in range(args.readers)
            )
        )
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _by_period(
    latency: list[float], sent_at: list[float], begin: float, period: float
) -> list[float]:
    """Ingest p99 of the batches due in each period of the run, in order: when the tail was."""
    periods: dict[int, list[float]] = {}
    for lat, at in zip(latency, sent_at, strict=True):
        periods.setdefault(int((at - begin) // period), []).append(lat)
    return [_pct(periods[k], 0.99) for k in sorted(periods)]


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    nodes = args.gpus // GPUS_PER_NODE
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
        env = {"FOREWARN_CONTROL_ENABLED": "false"} if args.no_control else {}
        if args.partitioned:
            env["FOREWARN_PARTITIONED_SCORING"] = "true"
        extra = ("--workers", str(args.workers)) if args.workers > 1 else ()
        services = [
            Service(url, work / f"service{i}.log", env=env, extra=extra)
            for i in range(args.replicas)
        ]
        try:
            urls = [s.url for s in services]
            ctx = mp.get_context("fork")
            start, results = ctx.Queue(), ctx.Queue()
            shares = [list(range(nodes))[i :: args.generators] for i in range(args.generators)]
            procs = [
                ctx.Process(target=_generator, args=(urls, share, args, start, results))
                for share in shares
            ]
            for p in procs:
                p.start()
            for _ in procs:
                kind, _pid = results.get(timeout=600)
                assert kind == "ready"
            cpu = [cpu_seconds(s.process.pid) for s in services]
            begin = time.time() + 0.5
            until = begin + args.duration
            for _ in procs:
                start.put((begin, until))
            reads = asyncio.run(_read(urls, nodes, args, until))
            outs = [results.get(timeout=args.duration + 120)[1] for _ in procs]
            for p in procs:
                p.join(30)
            elapsed = time.time() - begin
            cpu = [cpu_seconds(s.process.pid) - c for s, c in zip(services, cpu, strict=True)]
        finally:
            for service in services:
                service.stop()
        store = Store.open(url, migrate=False)
        try:
            with store.engine.connect() as connection:
                from sqlalchemy import text

                # Wide rows and packed ones (an hour the tiering task packed during the run).
                stored = connection.execute(
                    text(
                        "SELECT (SELECT count(*) FROM samples) "
                        "+ (SELECT COALESCE(SUM(n), 0) FROM sample_blocks)"
                    )
                ).scalar_one()
                loop = control_db.read_status(connection) or {}  # the loop was on, and ticked
        finally:
            store.close()
    acked = sum(o["acked"] for o in outs)
    ingest = [x for o in outs for x in o["latency_s"]]
    sent_at = [x for o in outs for x in o["sent_at"]]
    return {
        "ingest_p99_by_period": _by_period(ingest, sent_at, begin, args.batch_s),
        "rate": acked / args.duration,
        "elapsed": elapsed,
        "ingest_p50": _pct(ingest, 0.5),
        "ingest_p99": _pct(ingest, 0.99),
        "batches": len(ingest),
        "read_p50": _pct(reads["read_s"], 0.5),
        "read_p99": _pct(reads["read_s"], 0.99),
        "reads": len(reads["read_s"]),
        "read_mean": statistics.fmean(reads["read_s"]) if reads["read_s"] else float("nan"),
        "ingest_errors": sum(o["errors"] for o in outs),
        "statuses": _merged([o["statuses"] for o in outs]),
        "read_errors": reads["read_errors"],
        "acked": acked,
        "stored": stored,
        "cpu": sum(cpu) / args.duration,
        "cpu_each": [c / args.duration for c in cpu],
        "partition": loop.get("partition"),
        "generator_cpu": sum(o["cpu_s"] for o in outs) / args.duration,
        "ticks": (loop.get("durations") or {}).get("count", 0),
        "tick_mean_s": (
            loop["durations"]["sum"] / loop["durations"]["count"]
            if (loop.get("durations") or {}).get("count")
            else float("nan")
        ),
    }


def _shares(partition: dict[str, Any] | None) -> str:
    """The leader's last word on the shared scoring: its own GPUs, each follower's."""
    if not partition:
        return ""
    followers = partition.get("followers") or {}
    return f" | scoring shared by {len(partition.get('members') or [])} loops: leader " + (
        f"{partition.get('gpus', 0):,} GPUs; "
        + "; ".join(
            f"a follower {f['gpus']:,} GPUs, its scores {f['age_s']:.1f} s old"
            for f in followers.values()
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--workers", type=int, default=1, help="worker processes of each replica (serve --workers)"
    )
    parser.add_argument("--gpus", type=int, default=16384)
    parser.add_argument("--duration", type=float, default=60.0)
    # The defaults are the collector's (forewarn collect).
    parser.add_argument("--batch-s", type=int, default=10, help="seconds of samples per batch")
    parser.add_argument("--shape", choices=["rows", "columns"], default="columns")
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--read-interval", type=float, default=1.0, help="seconds between reads")
    parser.add_argument("--generators", type=int, default=2, help="collector processes")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--no-control", action="store_true", help="the control loop off (it scores the fleet)"
    )
    parser.add_argument(
        "--partitioned", action="store_true", help="the replicas' loops share the scoring"
    )
    args = parser.parse_args()
    print(
        f"{datetime.now(UTC).isoformat(timespec='seconds')} {args.backend} x{args.replicas}"
        f"{f' ({args.workers} workers each)' if args.workers > 1 else ''}: "
        f"{args.gpus} GPUs at 1 Hz ({args.gpus // GPUS_PER_NODE} nodes, a batch of "
        f"{args.batch_s} s each as {args.shape}), {args.readers} readers every "
        f"{args.read_interval:g} s, {args.duration:.0f} s"
        f"{', control loop off' if args.no_control else ''}",
        flush=True,
    )
    lost_any = False
    for _ in range(args.repeat):
        r = run_once(args)
        lost = r["acked"] - r["stored"]
        lost_any |= lost > 0
        print(
            f"  samples/s {r['rate']:>8,.0f} of {args.gpus:,} offered | ingest p50 "
            f"{r['ingest_p50'] * 1000:.0f} ms p99 {r['ingest_p99'] * 1000:.0f} ms "
            f"({r['batches']} batches) | read p50 {r['read_p50'] * 1000:.0f} ms p99 "
            f"{r['read_p99'] * 1000:.0f} ms ({r['reads']} reads) | errors ingest "
            f"{r['ingest_errors']} {r['statuses'] or ''} (status: count; 0: no answer) reads "
            f"{r['read_errors']} | CPU service {r['cpu']:.2f} cores, "
            f"collectors {r['generator_cpu']:.2f} | control ticks {r['ticks']} "
            f"(mean {r['tick_mean_s']:.2f} s) | "
            f"acknowledged {r['acked']:,} stored {r['stored']:,} lost {max(lost, 0)}",
            flush=True,
        )
        print(
            f"  ingest p99 by {args.batch_s} s of the run (ms): "
            + " ".join(f"{x * 1000:.0f}" for x in r["ingest_p99_by_period"]),
            flush=True,
        )
        if args.replicas > 1:
            print(
                "  CPU per replica "
                + ", ".join(f"{c:.2f}" for c in r["cpu_each"])
                + " cores"
                + _shares(r["partition"]),
                flush=True,
            )
    if lost_any:
        raise SystemExit("acknowledged samples are missing from the store")


if __name__ == "__main__":
    main()
