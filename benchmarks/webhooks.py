"""Webhook delivery latency: event written (committed to the outbox) -> receiver got it.

A real ``forewarn serve`` (its dispatcher polling every ``FOREWARN_WEBHOOK_POLL_INTERVAL_S``,
default 0.2 s) delivers to a receiver on a real port in this process, which answers 204 and
notes when each ``webhook-id`` first arrived. In one run and on each backend:

(a) trickle: ``--trickle`` events written one at a time, each waited for — the latency of an
    event on an idle service, the baseline;
(b) burst: ``--burst`` events (default 1,000) written as fast as one writer can, each in its
    own transaction (as the control loop writes them), to one subscription.

Prints p50/p99/max latency of each, the burst's delivery rate, and burst p50 / trickle p50.
``--repeat`` runs it again so the spread shows (the machine is shared).

    .venv/bin/python benchmarks/webhooks.py [--backend sqlite|postgres|both] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _common import Service, free_port, postgres_url, ratio, reset_postgres

from store import Store
from store.outbox import emit_event


class Arrivals:
    """A minimal HTTP/1.1 receiver (asyncio, its own thread): notes each id's first arrival.

    Deliberately cheap per request, so that the figure is the service's, not the receiver's.
    """

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.total = 0
        self.lock = threading.Lock()
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    now = time.time()
                    length, msg_id = 0, ""
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        key = name.strip().lower()
                        if key == b"content-length":
                            length = int(value)
                        elif key == b"webhook-id":
                            msg_id = value.strip().decode()
                    await reader.readexactly(length)
                    with self.lock:
                        self.total += 1
                        self.first.setdefault(msg_id, now)
                    writer.write(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            server = self.loop.run_until_complete(
                asyncio.start_server(handle, "127.0.0.1", self.port)
            )
            ready.set()
            self.loop.run_forever()
            server.close()

        threading.Thread(target=serve, daemon=True).start()
        ready.wait()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)

    def wait_for(self, ids: list[str], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if all(i in self.first for i in ids):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("events not delivered in time")
            time.sleep(0.002)


def write(store: Store, n: int) -> dict[str, float]:
    """``n`` events, one transaction each; event id -> commit time."""
    committed = {}
    for i in range(n):
        with store.begin() as connection:
            event_id = emit_event(
                connection,
                "risk.threshold_crossed",
                {"node": f"node-{i % 512}", "gpu": i % 8, "risk": 0.9, "reasons": ["bench"]},
                node=f"node-{i % 512}",
            )
        committed[event_id] = time.time()
    return committed


def latencies(committed: dict[str, float], arrivals: Arrivals) -> list[float]:
    return sorted(arrivals.first[i] - t for i, t in committed.items())


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def run_once(url: str, work: Path, args: argparse.Namespace) -> dict[str, float]:
    arrivals = Arrivals()
    service = Service(url, work / "service.log")
    store = Store.open(url)
    try:
        made = httpx.post(
            f"{service.url}/v1/webhooks",
            json={"url": f"http://127.0.0.1:{arrivals.port}/hook", "event_types": ["*"]},
            headers={"Authorization": f"Bearer {service.token}"},
            timeout=10,
        )
        made.raise_for_status()
        time.sleep(1.0)  # the dispatcher has claimed the subscription
        trickle = []
        for _ in range(args.trickle):
            committed = write(store, 1)
            arrivals.wait_for(list(committed))
            trickle += latencies(committed, arrivals)
        trickle.sort()
        started = time.time()
        committed = write(store, args.burst)
        written_s = time.time() - started
        arrivals.wait_for(list(committed))
        delivered_s = max(arrivals.first[i] for i in committed) - started
        burst = latencies(committed, arrivals)
    finally:
        store.close()
        service.stop()
        arrivals.stop()
    return {
        "trickle_p50": statistics.median(trickle),
        "trickle_p99": pct(trickle, 0.99),
        "burst_p50": statistics.median(burst),
        "burst_p99": pct(burst, 0.99),
        "burst_max": burst[-1],
        "write_rate": args.burst / written_s,
        "delivery_rate": args.burst / delivered_s,
        "duplicates": arrivals.total - len(arrivals.first),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="sqlite")
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--trickle", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("FOREWARN_WEBHOOK_ALLOW", "127.0.0.1")
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    for backend in backends:
        runs = []
        for r in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                if backend == "sqlite":
                    url = f"sqlite:///{Path(tmp) / 'bench.db'}"
                else:
                    pg = postgres_url()
                    if pg is None:
                        print("postgres: not reachable, skipped")
                        break
                    reset_postgres(pg)
                    url = pg
                result = run_once(url, Path(tmp), args)
            runs.append(result)
            print(
                f"{backend} run {r + 1}: trickle p50 {result['trickle_p50'] * 1000:.0f} ms "
                f"p99 {result['trickle_p99'] * 1000:.0f} ms | burst of {args.burst}: "
                f"p50 {result['burst_p50'] * 1000:.0f} ms p99 {result['burst_p99'] * 1000:.0f} ms "
                f"max {result['burst_max'] * 1000:.0f} ms, written {result['write_rate']:.0f}/s, "
                f"delivered {result['delivery_rate']:.0f}/s, duplicates {result['duplicates']:.0f}"
                f" | burst p50 / trickle p50 = "
                f"{ratio(result['burst_p50'], result['trickle_p50'])}",
                flush=True,
            )
        if runs:
            for key in ("trickle_p50", "burst_p50", "burst_p99"):
                values = [run[key] * 1000 for run in runs]
                print(
                    f"{backend} {key}: median {statistics.median(values):.0f} ms, "
                    f"range {min(values):.0f}-{max(values):.0f} ms over {len(values)} runs"
                )


if __name__ == "__main__":
    main()
