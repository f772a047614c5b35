"""Fleet reads through the API: ``GET /v1/risk`` and the fleet map at 16,384 and 65,536 GPUs,
cold and cached, and one GPU's 7-day samples.

A real ``forewarn serve`` (its control loop off: the benchmark writes each "tick" itself, as
a leader on another replica would) over a store that holds one newest sample and one score of
every GPU (8 to a node, 1 in 32 crossed, a few with a fatal event). For each fleet size, in the
same run:

- ``/v1/risk`` first page (default 5,000) and the whole fleet (pages of 10,000 through
  ``next``), cold (the first read after a tick: the scores' version moved, so the fleet is read
  from the database) and cached (the next readers of the same tick);
- ``/v1/dashboard/cells`` (the fleet map's poll), cold and cached;
- baselines measured in the same run: ``/healthz`` over the same loopback (the floor of one
  request), and the previous ``/v1/risk``'s work for the whole fleet in this process (read the
  scores, the GPUs' sample times and their fatal events, then pydantic per row), without HTTP.

Then one GPU's last 7 days through ``GET /v1/gpus/{node}/{gpu}/samples`` as the GPU page asks
(its 18 fields, ``limit=100000``, resolution ``auto``: per minute, from the rollups of the
closed hours and the newest hour rolled up on the fly; ``shape=columns&stats=false``, each
field's value a minute; and the same as rows with every statistic), and one field: the GPU
wrote 1 Hz for 7 days and the tiering task ran, as in a service. Timed until the whole answer
arrived (the client's parse not counted). Goal: under 200 ms.

Every figure is the median of ``--runs`` runs with its min-max spread. The machine this runs
on may be shared: the load average is printed before and after.

    .venv/bin/python benchmarks/reads.py [--sizes 16384,65536] [--runs 3] [--backend postgres]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
from _common import Service, postgres_url, reset_postgres

from store import Store, control, partitions, tiers
from store.schema import SAMPLE_COLUMNS

DAY = 86_400_000
HOUR = 3_600_000
PAGE_FIELDS = (  # what the dashboard's GPU page asks for (api/dashboard/static/js/gpu.js)
    "temp_gpu_c,temp_mem_c,power_w,sm_clock_mhz,mem_clock_mhz,ecc_sbe_volatile,"
    "ecc_dbe_volatile,remap_correctable,remap_uncorrectable,remap_pending,remap_failure,"
    "nvlink_crc_flit,nvlink_crc_data,nvlink_replay,nvlink_recovery,pcie_replay,"
    "pcie_link_width,pcie_link_width_max"
)


def sample(node: str, gpu: int, ts_ms: int, i: int) -> tuple[Any, ...]:
    values: dict[str, Any] = {
        "node": node,
        "gpu": gpu,
        "ts_ms": ts_ms,
        "vendor": "nvidia",
        "temp_gpu_c": 55.0 + (i // 600) % 20,
        "temp_mem_c": 60.0 + (i // 900) % 15,
        "power_w": 300.0 + i % 97,
        "sm_clock_mhz": 1410,
        "mem_clock_mhz": 1593,
        "util_gpu_pct": 90.0,
        "mem_total_mib": 81920,
        "mem_used_mib": 70000,
        "ecc_sbe_volatile": i // 50_000,
        "ecc_dbe_volatile": 0,
        "remap_correctable": 0,
        "remap_uncorrectable": 0,
        "remap_pending": False,
        "remap_failure": False,
        "nvlink_crc_flit": i // 20_000,
        "nvlink_crc_data": 0,
        "nvlink_replay": 0,
        "nvlink_recovery": 0,
        "pcie_replay": 0,
        "pcie_link_width": 16,
        "pcie_link_width_max": 16,
        "pcie_link_gen": 5,
    }
    return tuple(values.get(c) for c in SAMPLE_COLUMNS)


def grow_fleet(store: Store, have: int, gpus: int, now_ms: int) -> None:
    """Nodes ``have // 8`` .. ``gpus // 8``: one fresh sample and one score of each GPU."""
    rows, scores, events = [], [], []
    for n in range(have // 8, gpus // 8):
        node = f"gpu-node-{n:05d}"
        for g in range(8):
            k = n * 8 + g
            rows.append(sample(node, g, now_ms - 1000, k))
            crossed = k % 32 == 5
            scores.append(
                {
                    "node": node,
                    "gpu": g,
                    "risk": 0.9 if crossed else (k % 1000) / 4000,
                    "alarm": crossed,
                    "reasons": '["ECC errors rising (SBE +12 in 10 min)", "remap pending"]'
                    if crossed
                    else "[]",
                    "scored_ms": now_ms,
                    "last_seen_ms": now_ms - 1000,
                    "stale": False,
                    "streak": 3 if crossed else 0,
                    "crossed": crossed,
                    "crossed_ms": now_ms if crossed else None,
                    "failed": False,
                }
            )
            if k % 1024 == 7:
                events.append((node, g, now_ms - 60_000, "xid", 48, "DBE", "nvml"))
        if len(rows) >= 8192:
            store.write(samples=rows, events=events)
            rows, events = [], []
    if rows or events:
        store.write(samples=rows, events=events)
    with store.begin() as c:
        control.upsert_risk(c, scores)


def write_week(store: Store, node: str, now_ms: int) -> None:
    """One GPU at 1 Hz for 7 days, then the tiering task: closed hours rolled up per minute,
    raw kept for the last 24 h (the defaults of a service)."""
    start = now_ms - 7 * DAY - HOUR
    with store.begin() as c:
        partitions.ensure(c, "samples", start_ms=start - DAY, end_ms=now_ms + DAY)
        partitions.ensure(c, "sample_rollups", start_ms=start - DAY, end_ms=now_ms + DAY)
    i = 0
    for hour in range(start, now_ms, HOUR):
        end = min(hour + HOUR, now_ms)
        batch = []
        for ts in range(hour, end, 1000):
            batch.append(sample(node, 0, ts, i))
            i += 1
        store.write(samples=batch)
    policy = tiers.TierPolicy(history_url=None, max_hours_per_run=10_000)
    store.maintain_tiers(policy, now_ms=now_ms)


def timed(fn: Callable[[], Any]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def median_of(fn: Callable[[], Any], n: int) -> float:
    return statistics.median(timed(fn) for _ in range(n))


def whole_fleet(client: httpx.Client) -> int:
    cursor, total = None, 0
    while True:
        params: dict[str, Any] = {"limit": 10_000}
        if cursor:
            params["cursor"] = cursor
        body = orjson.loads(client.get("/v1/risk", params=params).raise_for_status().content)
        total += body["count"]
        cursor = body["next"]
        if cursor is None:
            return total


def previous_route(store: Store) -> int:
    """What ``GET /v1/risk`` did for the whole fleet before it paged and cached (no HTTP)."""
    from sqlalchemy import select

    from api.dashboard.cells import FAILURE_LOOKBACK_MS, failure_state, last_failures
    from api.routes._common import iso
    from api.routes.risk import RisksPublic
    from store.schema import gpus

    with store.engine.connect() as c:
        rows = control.risk_rows(c)
        now = int(time.time() * 1000)
        failures = last_failures(c, since_ms=now - FAILURE_LOOKBACK_MS)
        seen = {
            (r[0], r[1]): r[2]
            for r in c.execute(select(gpus.c.node, gpus.c.gpu, gpus.c.last_seen_ms))
        }
    for row in rows:
        key = (row["node"], row["gpu"])
        row["failed"], row["recovered"] = failure_state(
            bool(row["failed"]), failures.get(key), seen.get(key, row["last_seen_ms"]), 30_000
        )
        row["scored_at"] = iso(row.pop("scored_ms"))
        row["last_seen_at"] = iso(row.pop("last_seen_ms"))
        row.pop("crossed_ms")
    body = RisksPublic.model_validate({"data": rows, "count": len(rows), "next": None})
    return len(body.model_dump_json())


def measure(store: Store, client: httpx.Client, gpus: int) -> dict[str, float]:
    def tick() -> None:  # what a control tick on the leader does to every replica's cache
        with store.begin() as c:
            control.upsert_risk(c, [])

    out: dict[str, float] = {}
    out["healthz"] = median_of(lambda: client.get("/healthz").raise_for_status(), 20)
    out["previous_fleet"] = timed(lambda: previous_route(store))
    tick()
    out["first_cold"] = timed(lambda: client.get("/v1/risk").raise_for_status())
    out["first_cached"] = median_of(lambda: client.get("/v1/risk").raise_for_status(), 5)
    tick()
    counted: list[int] = []
    out["fleet_cold"] = timed(lambda: counted.append(whole_fleet(client)))
    out["fleet_cached"] = median_of(lambda: counted.append(whole_fleet(client)), 3)
    assert set(counted) == {gpus}, counted
    tick()
    out["cells_cold"] = timed(lambda: client.get("/v1/dashboard/cells").raise_for_status())
    out["cells_cached"] = median_of(lambda: client.get("/v1/dashboard/cells").raise_for_status(), 5)
    body = client.get("/v1/risk").content
    out["first_page_mb"] = len(body) / 1e6
    return out


WEEK_READS: dict[tuple[str, str], dict[str, str]] = {
    (PAGE_FIELDS, "rows with statistics"): {},
    (PAGE_FIELDS, "as the page asks (columns, no statistics)"): {
        "shape": "columns",
        "stats": "false",
    },
    ("temp_gpu_c", "rows with statistics"): {},
}
"""The week's reads: (fields, how) -> the query's other parameters."""


def week_read(
    client: httpx.Client, node: str, now_ms: int, fields: str, extra: dict[str, str]
) -> tuple[float, int]:
    """Seconds until the whole answer arrived (the client's parse not counted), and its rows."""
    params: dict[str, Any] = {
        "since": (now_ms - 7 * DAY) / 1000,
        "until": now_ms / 1000,
        "fields": fields,
        "limit": 100_000,
        **extra,
    }
    path = f"/v1/gpus/{node}/0/samples"
    begin = time.perf_counter()
    response = client.get(path, params=params).raise_for_status()
    elapsed = time.perf_counter() - begin
    body = orjson.loads(response.content)
    assert body["resolution"] == "1m", body["resolution"]
    return elapsed, body["count"]


def spread(values: list[float], scale: float = 1000.0) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):9.1f}  [{min(v):.1f}-{max(v):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16384,65536")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backend", choices=["postgres", "sqlite"], default="postgres")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    tmp = Path(tempfile.mkdtemp(prefix="forewarn-reads-"))
    if args.backend == "postgres":
        url = postgres_url()
        if url is None:
            raise SystemExit("no PostgreSQL (FOREWARN_BENCH_POSTGRES_URL); try --backend sqlite")
        reset_postgres(url)
    else:
        url = f"sqlite:///{tmp / 'reads.db'}"
    store = Store.open(url)
    now_ms = int(time.time() * 1000)
    begin = time.perf_counter()
    write_week(store, "week-node", now_ms)
    print(f"wrote and tiered one GPU's week in {time.perf_counter() - begin:.0f} s")
    service = Service(
        url,
        tmp / "service.log",
        env={"FOREWARN_CONTROL_ENABLED": "false", "FOREWARN_CONTROL_TICK_S": "3600"},
    )
    results: dict[int, list[dict[str, float]]] = {}
    weeks: dict[tuple[str, str], list[float]] = {week: [] for week in WEEK_READS}
    week_rows = 0
    have = 0
    headers = {"Authorization": f"Bearer {service.token}"}
    try:
        with httpx.Client(base_url=service.url, headers=headers, timeout=120) as client:
            for gpus in sizes:
                grow_fleet(store, have, gpus, int(time.time() * 1000))
                have = gpus
                results[gpus] = [measure(store, client, gpus) for _ in range(args.runs)]
                if gpus == sizes[0]:
                    for _ in range(args.runs):
                        for (fields, shape), times in weeks.items():
                            elapsed, week_rows = week_read(
                                client, "week-node", now_ms, fields, WEEK_READS[fields, shape]
                            )
                            times.append(elapsed)
    finally:
        service.stop()
        store.close()
    print(f"backend {args.backend}; {args.runs} runs; ms: median [min-max]\n")
    rows = [
        ("healthz", "baseline: GET /healthz"),
        ("previous_fleet", "baseline: previous /v1/risk work, whole fleet, in process"),
        ("first_cold", "/v1/risk first page, cold (first read after a tick)"),
        ("first_cached", "/v1/risk first page, cached"),
        ("fleet_cold", "/v1/risk whole fleet (pages of 10,000), cold"),
        ("fleet_cached", "/v1/risk whole fleet, cached"),
        ("cells_cold", "/v1/dashboard/cells, cold"),
        ("cells_cached", "/v1/dashboard/cells, cached"),
    ]
    for gpus, runs in results.items():
        print(f"{gpus:,} GPUs")
        for key, label in rows:
            print(f"  {label:58s} {spread([r[key] for r in runs])}")
        print(f"  first page size (MB) {statistics.median(r['first_page_mb'] for r in runs):.2f}")
        for a, b, label in (
            ("first_cached", "healthz", "first page cached / healthz"),
            ("first_cached", "first_cold", "first page cached / cold"),
            ("fleet_cached", "fleet_cold", "whole fleet cached / cold"),
            ("fleet_cold", "previous_fleet", "whole fleet cold / previous route's work"),
            ("cells_cached", "cells_cold", "cells cached / cold"),
        ):
            ratios = [r[a] / r[b] for r in runs]
            print(f"  ratio {label:52s} {spread(ratios, 1.0)}")
    healthz = statistics.median(r["healthz"] for r in results[sizes[0]])
    print(f"\n7-day samples of one GPU ({week_rows:,} rows a minute), ms; ratio to /healthz")
    for (fields, shape), times in weeks.items():
        label = "the GPU page's 18 fields" if fields == PAGE_FIELDS else fields
        label = f"{label}, {shape}"
        print(f"  {label:58s} {spread(times)}; {statistics.median(times) / healthz:.0f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
