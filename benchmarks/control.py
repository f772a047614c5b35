"""The control loop's latencies and cost, measured in one run.

Part A (in-process, SQLite): a simulated 16,384-GPU fleet streams one sample per GPU per second
into the store (a writer thread, the ingest path's bulk insert) while the control loop ticks
every ``--tick-s`` with the shipped model. Reported:

- tick cost (read by arrival + score + write risk + decide) at 16,384 GPUs, as a share of the
  default 5 s interval and of the tick used here; beside it, in the same run, the scorer alone
  (update + score) on the same rows, and the store's bulk insert of one fleet tick;
- sample arrival -> risk updated: for every committed batch, the time until the end of the
  first tick whose arrival cursor covers it.

Part T (``--part t``, the tick alone, SQLite or ``--backend postgres``): a fleet of
``--gpus`` GPUs, ``--interval-s`` seconds of its samples at 1 Hz stored before each tick
(what a tick at that interval reads),
``--ticks`` ticks with nothing else running; per tick the phases (read, score, write and
decide) and the tick against its interval. The size question: does one control process hold
a fleet of this size at this interval (``--gpus 100000``)? With ``--members M`` (PostgreSQL),
M loops share the scoring (:mod:`control.partition`), as M replicas would: each tick the
followers score their shares and the leader its own, merges theirs and decides; each loop's
tick is timed alone (they take turns here; replicas run side by side).

Part B (real processes): ``forewarn serve`` (SQLite) with a fleet streaming through
``POST /v1/ingest`` and ``--jobs`` job agents (``migrator.service_link.ServiceLink`` with a stub
agent that accepts at once), each with one rank on a fleet GPU; a policy whose threshold every
GPU crosses makes the loop request one migration per job. Reported: threshold crossing (the
migration's ``requested`` time, the tick that saw the crossing) -> ``acknowledged`` (the
agent's report received), from the service's own timestamps.

    .venv/bin/python benchmarks/control.py [--gpus 16384] [--seconds 30] [--tick-s 1]
    .venv/bin/python benchmarks/control.py --part t --gpus 100000 [--interval-s 5] [--ticks 4] \\
        [--backend postgres] [--members 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
from _common import ROOT, free_port, postgres_url, reset_postgres

from control.loop import ControlLoop
from control.policy import Policy
from forewarn import heap
from forewarn.wire import Event, GpuSample, JobRegistration, Placement
from predictor import registry
from sim.source import SimulatedSource
from store import Store
from store import control as db
from store.writes import event_row, sample_row


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def fleet_rows(source: SimulatedSource, now: datetime) -> tuple[list[Any], list[Any]]:
    samples, events = [], []
    for row in source.read(now):
        if isinstance(row, GpuSample):
            samples.append(sample_row(row))
        elif isinstance(row, Event):
            events.append(event_row(row))
    return samples, events


def part_a(gpus: int, seconds: float, tick_s: float) -> dict[str, Any]:
    model = registry.load_default(ROOT / "models")
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(f"sqlite:///{tmp}/bench.db")
        source = SimulatedSource(gpus, seed=1)
        t = time.time() - 5
        for k in range(5):  # a few seconds of history to warm from
            samples, events = fleet_rows(source, datetime.fromtimestamp(t + k, UTC))
            store.write(samples=samples, events=events)
        loop = ControlLoop(store, model=model, defaults=Policy(), tick_s=tick_s)
        loop.step()
        stop = threading.Event()
        batches: list[tuple[float, int]] = []
        inserts: list[float] = []

        def writer() -> None:
            next_at = time.time()
            while not stop.is_set():
                samples, events = fleet_rows(source, datetime.now(UTC))
                t0 = time.perf_counter()
                store.write(samples=samples, events=events)
                inserts.append(time.perf_counter() - t0)
                with store.engine.connect() as c:
                    top = db.max_sample_seq(c)
                batches.append((time.time(), top))
                next_at += 1.0
                stop.wait(max(0.0, next_at - time.time()))

        ticks: list[tuple[float, int, float]] = []
        phases: list[dict[str, float]] = []
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        deadline = time.time() + seconds
        while time.time() < deadline:
            started = time.time()
            loop.step()
            ticks.append((time.time(), loop.samples.position, loop.last_tick_s))
            phases.append(dict(loop.last_phases))
            time.sleep(max(0.0, tick_s - (time.time() - started)))
        stop.set()
        thread.join(timeout=30)
        # The scorer alone on the same fleet, for the ratio.
        bare = []
        for _ in range(5):
            samples, events = fleet_rows(source, datetime.now(UTC))
            store.write(samples=samples, events=events)
            with store.engine.connect() as c:
                frame, _ = db.samples_after(c, loop.samples.position)
            t0 = time.perf_counter()
            loop.scorer.update(frame, None, now_ms=int(time.time() * 1000) + 1)
            loop.scorer.score()
            bare.append(time.perf_counter() - t0)
        store.close()
    latencies = []
    for committed, top in batches:
        done = next(
            (end for end, position, _ in ticks if position >= top and end >= committed), None
        )
        if done is not None:
            latencies.append(done - committed)
    costs = [c for _, _, c in ticks[1:]]
    return {
        "gpus": gpus,
        "tick_s": tick_s,
        "ticks": len(costs),
        "tick_cost_s": {"p50": pct(costs, 50), "p99": pct(costs, 99), "max": max(costs)},
        "tick_phases_s_p50": {
            k: pct([p[k] for p in phases[1:] if k in p], 50)
            for k in ("read_s", "score_s", "write_decide_s")
        },
        "tick_share_of_5s": pct(costs, 50) / 5.0,
        "tick_share_of_tick": pct(costs, 50) / tick_s,
        "scorer_alone_s_p50": pct(bare, 50),
        "tick_over_scorer_alone": pct(costs, 50) / pct(bare, 50),
        "store_insert_one_fleet_tick_s_p50": pct(inserts, 50),
        "arrival_to_risk_s": {
            "n": len(latencies),
            "p50": pct(latencies, 50),
            "p99": pct(latencies, 99),
            "max": max(latencies) if latencies else float("nan"),
        },
    }


class StubAgent:
    """Accepts every command at once (what the service sees of a healthy job agent)."""

    def __init__(self, job_id: str, node: str, gpu: int) -> None:
        self.job_id, self.node, self.gpu = job_id, node, gpu
        self.status, self.gen, self.message = "running", 0, ""

    def registration(self) -> JobRegistration:
        return JobRegistration(
            job_id=self.job_id,
            world_size=1,
            spares=1,
            placement=[
                Placement(rank=0, node=self.node, gpu=self.gpu, slot=0),
                Placement(rank=1, node="spare-node", gpu=0, slot=1, role="spare"),
            ],
        )

    def submit(self, **_: Any) -> str:
        return "ok"


def part_b(gpus: int, jobs: int, seconds: float, tick_s: float) -> dict[str, Any]:
    from migrator.service_link import ServiceLink

    port = free_port()
    token = "bench-admin-token-0123456789"
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "FOREWARN_ADMIN_TOKEN": token,
            "FOREWARN_CONTROL_TICK_S": str(tick_s),
            "FOREWARN_POLICY": json.dumps(
                {"threshold": 0.0, "hysteresis": 1, "max_inflight_fleet": 100_000,
                 "breaker_min_gpus": 10**9}
            ),
            "FOREWARN_DATA_DIR": tmp,
        }  # fmt: skip
        log = open(Path(tmp) / "serve.log", "wb")  # noqa: SIM115
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "forewarn",
                "serve",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        try:
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            source = SimulatedSource(gpus, seed=2)
            stop = threading.Event()
            sent = {"rows": 0}

            def feeder() -> None:
                client = httpx.Client(base_url=url, headers=headers, timeout=30)
                next_at = time.time()
                while not stop.is_set():
                    by_node: dict[str, list[dict[str, Any]]] = {}
                    for row in source.read(datetime.now(UTC)):
                        if isinstance(row, GpuSample):
                            by_node.setdefault(row.node, []).append(row.model_dump(mode="json"))
                    nodes = sorted(by_node)
                    for i in range(0, len(nodes), 256):  # 256 nodes (2,048 GPUs) a request
                        chunk = nodes[i : i + 256]
                        for node in chunk:
                            body = {"node": node, "samples": by_node[node]}
                            client.post("/v1/ingest", content=orjson.dumps(body))
                            sent["rows"] += len(by_node[node])
                    next_at += 1.0
                    stop.wait(max(0.0, next_at - time.time()))

            feed = threading.Thread(target=feeder, daemon=True)
            feed.start()
            time.sleep(min(10.0, seconds / 3))
            links = []
            for j in range(jobs):
                node, gpu = f"sim-node-{j // 8:04d}", j % 8
                agent = StubAgent(f"bench-{j}", node, gpu)
                link = ServiceLink(url, token=token, job_id=agent.job_id, poll_s=2.0)
                link.preflight()
                link.register(agent.registration())
                link.start(agent)
                links.append((link, agent))
            deadline = time.time() + seconds
            acked: list[dict[str, Any]] = []
            while time.time() < deadline:
                data = httpx.get(url + "/v1/migrations", headers=headers, timeout=30).json()["data"]
                acked = [m for m in data if m["acknowledged_at"]]
                if len(acked) >= jobs:
                    break
                time.sleep(1.0)
            stop.set()
            for link, agent in links:
                link.stop(agent)
            feed.join(timeout=30)
            lat = [
                (
                    datetime.fromisoformat(m["acknowledged_at"])
                    - datetime.fromisoformat(m["requested_at"])
                ).total_seconds()
                for m in acked
            ]
            return {
                "gpus_streaming": gpus,
                "rows_ingested": sent["rows"],
                "jobs": jobs,
                "acknowledged": len(lat),
                "crossing_to_acknowledged_s": {
                    "p50": pct(lat, 50),
                    "p99": pct(lat, 99),
                    "max": max(lat) if lat else float("nan"),
                },
            }
        finally:
            serve.terminate()
            serve.wait(timeout=30)
            log.close()


def part_t(
    gpus: int, interval_s: float, ticks: int, backend: str = "sqlite", members: int = 1
) -> dict[str, Any]:
    import gc

    model = registry.load_default(ROOT / "models")
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        if backend == "postgres":
            pg = postgres_url()
            if pg is None:
                raise SystemExit("no PostgreSQL answers (FOREWARN_BENCH_POSTGRES_URL)")
            reset_postgres(pg)
            url = pg
        store = Store.open(url)
        source = SimulatedSource(gpus, seed=1)
        seconds = int(interval_s)
        t = time.time() - (ticks + 1) * seconds - 5

        def store_seconds(first: float) -> None:
            for k in range(seconds):
                samples, events = fleet_rows(source, datetime.fromtimestamp(first + k, UTC))
                store.write(samples=samples, events=events)

        store_seconds(t)
        loops = [
            ControlLoop(
                store,
                model=model,
                defaults=Policy(),
                tick_s=interval_s,
                replica=f"bench-{i}",
                partitioned=members > 1,
            )
            for i in range(members)
        ]
        loop, followers = loops[0], loops[1:]
        for at in (t + seconds, t + seconds + 1):  # take over, warm, share: not timed
            for one in loops:
                one.step(int(at * 1000))
        gc.collect()
        gc.freeze()  # as the control process does once it has its model
        heap.keep_large_blocks()  # and as it does then
        rows, follower_rows = [], []
        for k in range(1, ticks + 1):
            store_seconds(t + k * seconds)
            at = int((t + (k + 1) * seconds) * 1000)
            for one in followers:  # their shares first: the leader merges them this tick
                one.step(at)
                follower_rows.append({"tick_s": one.last_tick_s, **one.last_phases})
            loop.step(at)
            rows.append({"tick_s": loop.last_tick_s, **loop.last_phases, "read": loop.last_read})
            print(
                f"  tick {k}: "
                + ", ".join(f"{n} {v:.2f}" for n, v in rows[-1].items() if n != "read")
                + f", samples read {loop.last_read:,}"
                + "".join(
                    f"; follower {i + 1}: tick {r['tick_s']:.2f} (read {r['read_s']:.2f}, "
                    f"score {r['score_s']:.2f})"
                    for i, r in enumerate(follower_rows[-len(followers) :] if followers else [])
                )
                + (
                    f"; GPUs scored by the leader {loop.last_partition['gpus']:,}"
                    if loop.last_partition
                    else ""
                )
            )
        for one in loops:
            one.leadership.release()
            if one.share is not None:
                one.leave()
        store.close()
    median = {n: pct([r[n] for r in rows], 50) for n in rows[0]}
    return {
        "gpus": gpus,
        "backend": backend,
        "members": members,
        "followers": follower_rows,
        "interval_s": interval_s,
        "rows_per_tick": gpus * seconds,
        "ticks": rows,
        "median": median,
        "share_of_interval": median["tick_s"] / interval_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=16_384)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--tick-s", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--part", choices=["a", "b", "both", "t"], default="both")
    ap.add_argument("--interval-s", type=float, default=5.0, help="t: the tick's interval")
    ap.add_argument("--ticks", type=int, default=4, help="t: ticks timed")
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite", help="t only")
    ap.add_argument(
        "--members", type=int, default=1, help="t: loops sharing the scoring (PostgreSQL)"
    )
    args = ap.parse_args()
    out: dict[str, Any] = {}
    if args.part == "t":
        print(
            f"(t) the tick alone: {args.gpus:,} GPUs, {args.interval_s:g} s of samples a tick, "
            f"{args.backend}"
            + (f", {args.members} loops share the scoring" if args.members > 1 else ""),
            flush=True,
        )
        if args.members > 1 and args.backend != "postgres":
            raise SystemExit("loops share the scoring on PostgreSQL only: --backend postgres")
        out["tick"] = part_t(args.gpus, args.interval_s, args.ticks, args.backend, args.members)
        print(json.dumps(out["tick"]["median"] | {"share": out["tick"]["share_of_interval"]}))
        return
    if args.part in ("a", "both"):
        out["in_process"] = part_a(args.gpus, args.seconds, args.tick_s)
        print(json.dumps(out["in_process"], indent=1), flush=True)
    if args.part in ("b", "both"):
        out["service"] = part_b(args.gpus, args.jobs, args.seconds, args.tick_s)
        print(json.dumps(out["service"], indent=1), flush=True)
    print("goal: arrival -> risk and crossing -> acknowledged under 2 s at p99")


if __name__ == "__main__":
    main()
