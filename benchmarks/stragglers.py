"""Stragglers end to end: how long until a slow rank is named and moved, how often a healthy
job's rank is named by mistake, and the job's steps per second before, during and after.

Every run is real processes on this machine: ``forewarn serve`` (SQLite), ``forewarn
simulate`` streaming a 16-GPU fleet into it, and ``forewarn launch`` running ``demo/gpt.py``
(a small GPT under DDP, gloo) with ``--ranks`` ranks and one spare placed on fleet GPUs, its
heartbeats every ``--heartbeat-s``. A subscribed webhook receiver counts ``rank.straggling``.

- **slowed** (``--runs`` times): the simulator downtrains rank 1's GPU to a PCIe x8 link, and
  from step ``--slow-from`` rank 1's process computes ``--delay-s`` longer each step
  (``FaultPlan.slow_at``). Printed: steps per second of rank 0 before, slowed and after the
  move (median step interval), from the first slow step to the ``rank.straggling`` delivery
  and to the migration's request, and from the request to its end.
- **healthy** (once, ``--healthy-min`` minutes): the same job with nothing slowed. Printed:
  ranks named stragglers (false positives) per rank-hour, and the largest ratio of a rank's
  compute time to its peers' median the service reported (how close noise came to the
  policy's margin).

The policy is the default one (``straggler_window_s`` 120 s, margin 20 %, 20 ms) unless
``--policy`` gives JSON; its risk threshold is set to 1 so that only the straggler path acts.

    .venv/bin/python benchmarks/stragglers.py --runs 3 --healthy-min 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from _common import ROOT, Service, free_port

from demo.receiver import Receiver
from migrator.faults import FaultPlan

GPT = ROOT / "demo" / "gpt.py"
SLOW_GPU = ("sim-node-0000", 1)


class Scene:
    """A service, a simulated fleet streaming into it and a receiver subscribed to it."""

    def __init__(self, tmp: Path, policy: dict[str, Any], slow_gpu: bool) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        env = {
            "FOREWARN_POLICY": json.dumps(policy),
            "FOREWARN_CONTROL_TICK_S": "1",
            "FOREWARN_WEBHOOK_ALLOW": "127.0.0.1",
        }
        self.service = Service(f"sqlite:///{tmp / 'bench.db'}", tmp / "service.log", env=env)
        self.auth = {"Authorization": f"Bearer {self.service.token}"}
        sim = ["simulate", "--gpus", "16", "--seed", "0", "--service", self.service.url]
        sim += ["--token", self.service.token, "--control-port", str(free_port())]
        if slow_gpu:
            sim += ["--slow", f"{SLOW_GPU[0]}:{SLOW_GPU[1]}:pcie:36000"]
        self.spawn(sim, "simulate.log")
        self.receiver = Receiver(tmp / "webhooks.log")
        self.receiver.start()
        answer = httpx.post(
            f"{self.service.url}/v1/webhooks",
            headers=self.auth,
            json={"url": self.receiver.url, "event_types": ["rank.straggling"]},
            timeout=10,
        )
        answer.raise_for_status()
        self.receiver.secret = answer.json()["secret"]
        self.straggling_at: list[float] = []

    def spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        with (self.tmp / log).open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "forewarn", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            )
        self.procs.append(proc)
        return proc

    def get(self, path: str, **params: Any) -> Any:
        answer = httpx.get(self.service.url + path, headers=self.auth, params=params, timeout=10)
        answer.raise_for_status()
        return answer.json()

    def launch(self, args: argparse.Namespace, out: Path, plan: FaultPlan | None) -> None:
        slots = [f"sim-node-0000:{i}" for i in range(args.ranks)] + ["sim-node-0001:0"]
        cmd = ["launch", "--nproc", str(args.ranks), "--spares", "1", "--job-id", "bench"]
        cmd += ["--service", self.service.url, "--token", self.service.token]
        cmd += ["--placement", ",".join(slots), "--heartbeat-s", str(args.heartbeat_s)]
        cmd += ["--log-dir", str(out / "logs")]
        if plan is not None:
            cmd += ["--faults", plan.to_json()]
        cmd += ["--", sys.executable, str(GPT), "--steps", "1000000", "--log", str(out)]
        cmd += ["--pace-s", str(args.pace_s)]
        self.spawn(cmd, "launch.log")

    def wait(self, what: str, check: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.receiver.counts().get("rank.straggling", 0) > len(self.straggling_at):
                self.straggling_at.append(time.time())
            got = check()
            if got:
                return got
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout_s} s waiting for {what} (see {self.tmp})")

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.receiver.close()
        self.service.stop()


def steps(out: Path, rank: int = 0) -> dict[int, float]:
    """When each step of ``rank`` ended (the last run of a step counts)."""
    times: dict[int, float] = {}
    for path in out.glob("gpt.slot*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row["rank"] == rank:
                    times[row["step"]] = row["t"]
    return times


def rate(times: dict[int, float], first: int, last: int) -> float:
    gaps = [times[k + 1] - times[k] for k in range(first, last) if k in times and k + 1 in times]
    return 1.0 / statistics.median(gaps) if gaps else float("nan")


def slowed_run(args: argparse.Namespace, policy: dict[str, Any]) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="forewarn-straggler-"))
    scene = Scene(tmp, policy, slow_gpu=True)
    try:
        scene.wait("the fleet", lambda: scene.get("/v1/risk")["count"] >= 16, 180)
        out = tmp / "job"
        scene.launch(args, out, FaultPlan().slow_at(1, args.slow_from, args.delay_s))
        budget = float(policy.get("straggler_window_s", 120)) + 300
        (m,) = scene.wait(
            "the straggler's move",
            lambda: [
                m
                for m in scene.get("/v1/migrations", job="bench")["data"]
                if m["state"] in ("completed", "failed")
            ],
            budget,
        )
        if m["state"] != "completed":
            raise RuntimeError(f"the move failed: {m}")
        moved = int(m["step"])
        scene.wait("steps after the move", lambda: max(steps(out), default=0) >= moved + 45, 300)
        times = steps(out)
        first_slow = times[args.slow_from]
        requested = datetime.fromisoformat(m["requested_at"]).timestamp()
        finished = datetime.fromisoformat(m["finished_at"]).timestamp()
        named = scene.straggling_at[0] if scene.straggling_at else float("nan")
        before = rate(times, 5, args.slow_from - 1)
        slowed = rate(times, args.slow_from + 2, moved - 1)
        after = rate(times, moved + 5, moved + 44)
        return {
            "before": before,
            "slowed": slowed,
            "after": after,
            "slowed/before": slowed / before,
            "after/before": after / before,
            "to_named_s": named - first_slow,
            "to_request_s": requested - first_slow,
            "request_to_done_s": finished - requested,
            "pause_s": float(m["pause_s"] or float("nan")),
            "trigger": 1.0 if m["trigger"] == "straggler" else 0.0,
        }
    finally:
        scene.close()


def healthy_run(args: argparse.Namespace, policy: dict[str, Any]) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="forewarn-healthy-"))
    scene = Scene(tmp, policy, slow_gpu=False)
    try:
        scene.wait("the fleet", lambda: scene.get("/v1/risk")["count"] >= 16, 180)
        out = tmp / "job"
        scene.launch(args, out, None)
        scene.wait("training", lambda: len(steps(out)) > 20, 180)
        start = time.monotonic()
        worst, judged, flagged = 0.0, 0, set()
        while time.monotonic() - start < args.healthy_min * 60:
            job = scene.get("/v1/jobs/bench")
            for r in job["ranks"]:
                if r.get("compute_s") and r.get("peers_median_s"):
                    worst = max(worst, r["compute_s"] / r["peers_median_s"])
                    judged += 1
                if r.get("straggler"):
                    flagged.add(r["rank"])
            time.sleep(2.0)
        hours = (time.monotonic() - start) / 3600
        events = scene.receiver.counts().get("rank.straggling", 0)
        moves = scene.get("/v1/migrations", job="bench")["count"]
        times = steps(out)
        return {
            "rank_hours": hours * args.ranks,
            "straggling_events": events,
            "ranks_flagged": len(flagged),
            "moves": moves,
            "false_per_rank_hour": events / (hours * args.ranks),
            "worst_ratio": worst,
            "readings": judged,
            "steps_per_s": rate(times, 5, max(times) - 1),
        }
    finally:
        scene.close()


def spread(values: list[float]) -> str:
    good = [v for v in values if v == v]
    if not good:
        return "n/a"
    return f"{statistics.median(good):.2f} [{min(good):.2f}-{max(good):.2f}]"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="slowed runs (0: none)")
    ap.add_argument("--healthy-min", type=float, default=10.0, help="healthy run (0: none)")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--slow-from", type=int, default=30)
    ap.add_argument("--delay-s", type=float, default=0.2)
    ap.add_argument("--pace-s", type=float, default=0.05)
    ap.add_argument("--heartbeat-s", type=float, default=5.0)
    ap.add_argument("--policy", default="{}", help="policy JSON over the defaults")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    policy = {"threshold": 1.0, **json.loads(args.policy)}
    print(f"load average at start: {os.getloadavg()}; policy {policy}")
    slowed = []
    for i in range(args.runs):
        result = slowed_run(args, policy)
        print(f"slowed run {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))
        slowed.append(result)
    if slowed:
        print("\nslowed runs (median [min-max]):")
        for key in slowed[0]:
            print(f"  {key:18s} {spread([r[key] for r in slowed])}")
    healthy = healthy_run(args, policy) if args.healthy_min > 0 else None
    if healthy:
        print("\nhealthy run: " + ", ".join(f"{k} {v:.3f}" for k, v in healthy.items()))
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"slowed": slowed, "healthy": healthy}, indent=1))


if __name__ == "__main__":
    main()
