"""The scene of the control loop's end-to-end tests (:mod:`tests.control.test_e2e`,
:mod:`tests.control.test_e2e_restart`): ``forewarn serve``, a simulated fleet streaming into
it, and a gloo job of 2 ranks + 1 spare placed on fleet GPUs (the ``scene`` fixture, in
``conftest.py``, starts the first two)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import LiveService, free_port

ROOT = Path(__file__).resolve().parents[2]
"""The repository (what the processes run from)."""

PACED = Path(__file__).with_name("train_paced.py")
STEPS = 1000
"""The job's steps: 100 s of paced runway (0.1 s a step) against the ~20 s the e2e's move
needs from the injection (60 s on a loaded machine); what is left runs unpaced once the test
touches ``fast``."""
WEAR_PARAMS = Path(__file__).with_name("wear.toml")
"""The scene's fleet parameters: memory wear whose hard evidence shows within seconds."""
WEAR_LEAD_S = 60
"""The wear episode, s: the failure comes this long after the injection, the move's margin."""
POLICY = '{"threshold": 0.02, "hysteresis": 2, "cooldown_s": 0, "stale_after_s": 60}'


def wait_for(what: str, check: Any, timeout_s: float, every_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Scene:
    def __init__(self, service: LiveService, tmp: Path) -> None:
        self.service = service
        self.tmp = tmp
        self.control = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.read = {"Authorization": f"Bearer {service.read_token}"}

    def spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        with (self.tmp / log).open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "forewarn", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            )
        self.procs.append(proc)
        return proc

    def ticks(self) -> int:
        """Control-loop ticks this service has run (``forewarn_scorer_tick_seconds_count``)."""
        text = httpx.get(self.service.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("forewarn_scorer_tick_seconds_count"):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    def wait_ticks(self, n: int, timeout_s: float = 60.0) -> None:
        """Wait until the control loop ran ``n`` more ticks: time in which it could have acted,
        measured in what it did, not in seconds a loaded machine may not give it."""
        target = self.ticks() + n
        wait_for(f"{n} control ticks", lambda: self.ticks() >= target, timeout_s)

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(self.service.url + path, headers=self.read, params=params, timeout=10)
        response.raise_for_status()
        return response.json()

    def simulate(self, *extra: str) -> subprocess.Popen[bytes]:
        """Stream a 16-GPU simulated fleet (seed 0) into the service, with ``extra`` options."""
        return self.spawn(
            [
                "simulate",
                "--gpus", "16",
                "--seed", "0",
                "--service", self.service.url,
                "--token", self.service.ingest_token,
                "--control-port", str(self.control),
                *extra,
            ],
            "simulate.log",
        )  # fmt: skip

    def close(self) -> None:
        """Stop the scene's processes and the service, and print the service's last log."""
        self.stop()
        self.service.stop()
        print(self.service.log()[-4000:])

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def run_job(scene: Scene, out: Path) -> subprocess.Popen[bytes]:
    return scene.spawn(
        [
            "launch",
            "--nproc", "2",
            "--spares", "1",
            "--job-id", "e2e",
            "--service", scene.service.url,
            "--token", scene.service.admin_token,
            "--placement", "sim-node-0000:0,sim-node-0000:1,sim-node-0001:0",
            "--timeout-s", "20",
            "--log-dir", str(out / "logs"),
            "--report", str(out / "reports.jsonl"),
            "--",
            sys.executable, str(PACED), "--out", str(out), "--steps", str(STEPS),
            "--mode", "ddp", "--pace-s", "0.1",
        ],
        "launch.log",
    )  # fmt: skip


def start_and_inject(scene: Scene, out: Path) -> subprocess.Popen[bytes]:
    wait_for("the fleet", lambda: scene.get("/v1/risk")["count"] >= 16, 180)
    job = run_job(scene, out)
    wait_for("the job", lambda: _job_running(scene), 180)
    wait_for("training", lambda: any(out.glob("log.slot*.jsonl")), 180)
    subprocess.run(
        [
            sys.executable, "-m", "forewarn", "simulate", "inject",
            "--control", f"http://127.0.0.1:{scene.control}",
            "--node", "sim-node-0000", "--gpu", "1", "--kind", "memory",
            "--lead-s", str(WEAR_LEAD_S),
        ],
        check=True,
        cwd=ROOT,
        timeout=30,
    )  # fmt: skip
    return job


def _job_running(scene: Scene) -> bool:
    try:
        job = scene.get("/v1/jobs/e2e")
    except httpx.HTTPStatusError:
        return False
    placed = {(r["node"], r["gpu"], r["role"]) for r in job["ranks"]}
    assert ("sim-node-0000", 1, "active") in placed, placed
    return True
