"""Collector cost: agent CPU per wall second on an 8-GPU node at 1 Hz, dcgm-exporter parse rate.

1. SamplingLoop: the NVML source over the fake pynvml (8 GPUs), the batching pusher (JSON, gzip,
   an in-process HTTP transport answering 200) and the sampling loop.
   - live: the agent really runs at 5 Hz for a few seconds; process CPU time / wall time,
     scaled to 1 Hz (goal: under 1 % of one core);
   - per tick: CPU per tick in a tight loop (tick + encode + send), against a baseline
     measured in the same run — building the same 8 samples alone (pydantic's floor).
2. dcgm-exporter: parsing the recorded 8-GPU H100 page, against prometheus_client's own text
   parser on the same page in the same run.

Run: ``.venv/bin/python benchmarks/collector.py``
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collector.agent import SamplingLoop  # noqa: E402
from collector.dcgm_exporter import parse_metrics, to_readings  # noqa: E402
from collector.nvml import NvmlSource  # noqa: E402
from collector.push import BatchingPusher, IngestClient  # noqa: E402
from forewarn.wire import GpuSample  # noqa: E402
from tests.fakes.pynvml import FakeNvml  # noqa: E402


def ok(request: httpx.Request) -> httpx.Response:
    n = len(json.loads(gzip.decompress(request.content))["samples"])
    return httpx.Response(
        200,
        json={
            "stored_samples": n,
            "duplicate_samples": 0,
            "stored_events": 0,
            "duplicate_events": 0,
            "rejected": [],
        },
    )


def make_agent(interval_s: float) -> SamplingLoop:
    source = NvmlSource("bench-node", nvml=FakeNvml(), events=True)
    client = IngestClient("http://svc", "t", transport=httpx.MockTransport(ok))
    pusher = BatchingPusher(client, max_delay_s=1.0, heartbeat_s=10.0)
    return SamplingLoop([source], pusher, interval_s=interval_s, node="bench-node")


def live(rate_hz: float = 5.0, seconds: float = 6.0) -> float:
    agent = make_agent(1.0 / rate_hz)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    agent.run(duration_s=seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return cpu / wall / rate_hz  # fraction of a core at 1 Hz


def per_tick(ticks: int = 400) -> float:
    agent = make_agent(1.0)
    agent.pusher.start()
    agent.tick()
    agent.pusher.flush()
    t0 = time.process_time()
    for _ in range(ticks):
        agent.tick()
        agent.pusher.flush()
    cost = (time.process_time() - t0) / ticks
    agent.close()
    return cost


def baseline_tick(ticks: int = 400) -> float:
    now = datetime.now(UTC)
    t0 = time.process_time()
    for _ in range(ticks):
        [
            GpuSample(
                node="bench-node",
                gpu=g,
                ts=now,
                temp_gpu_c=45.0,
                power_w=300.0,
                ecc_sbe_volatile=0,
                remap_pending=False,
                pcie_link_width=16,
            )
            for g in range(8)
        ]
    return (time.process_time() - t0) / ticks


def parse_rate(text: str, seconds: float = 2.0) -> tuple[float, float]:
    n, t0, now = 0, time.perf_counter(), datetime.now(UTC)
    while time.perf_counter() - t0 < seconds:
        to_readings(parse_metrics(text), node="n", now=now, last_xid={})
        n += 1
    return n / (time.perf_counter() - t0), len(parse_metrics(text))


def prometheus_rate(text: str, seconds: float = 2.0) -> float | None:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return None
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for family in text_string_to_metric_families(text):
            list(family.samples)
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    frac = live()
    tick = per_tick()
    base = baseline_tick()
    print("agent, 8 GPUs (fake NVML), NVML source + pusher (JSON, gzip, HTTP)")
    print(
        f"  live run:  {frac * 100:.3f} % of one core at 1 Hz  (goal < 1 %: "
        f"{'met' if frac < 0.01 else 'MISSED'}, {0.01 / frac:.1f}x headroom)"
    )
    print(f"  per tick:  {tick * 1e3:.3f} ms CPU  = {tick * 100:.3f} % of a core at 1 Hz")
    print(
        f"  baseline:  {base * 1e3:.3f} ms CPU to build the 8 samples alone"
        f"  (tick / baseline = {tick / base:.1f}x)"
    )
    text = (ROOT / "tests" / "data" / "dcgm-exporter-h100.txt").read_text()
    pages, series = parse_rate(text)
    print("dcgm-exporter page, 8 H100 GPUs,", f"{series} series, {len(text)} bytes")
    print(
        f"  forewarn:  {pages:,.0f} pages/s = {pages * series:,.0f} series/s"
        f" = {pages * 8:,.0f} GPU samples/s (parse + map + validate)"
    )
    prom = prometheus_rate(text)
    if prom is not None:
        print(
            f"  baseline:  prometheus_client parser {prom:,.0f} pages/s (parse only)"
            f"  (forewarn / baseline = {pages / prom:.2f}x)"
        )


if __name__ == "__main__":
    main()
