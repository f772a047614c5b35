"""A straggler found and moved, with real processes: ``forewarn serve`` (uvicorn, SQLite), a
simulated fleet streaming into it (``forewarn simulate``) in which one GPU's PCIe link
trains down to x8 (``--slow``), and a gloo job of 2 ranks + 1 spare launched onto fleet
GPUs, rank 1 on the downtrained one. From step ``SLOW_FROM`` the process of rank 1 computes
``DELAY_S`` longer each step (``FaultPlan.slow_at``: the slowness is the process's, as a slow
GPU's would be, and does not follow the rank to the spare).

Under DDP every rank's step takes the slow rank's time, so nothing tells them apart but the
time each spends before the all-reduce: the job wrapper measures it, the agent sends its
medians with the heartbeat, the control loop judges rank 1 a straggler, names the reason from
its GPU's telemetry, finds the move worth its cost and asks for it; the agent hands the rank
to the spare; the job's steps per second recover; a subscribed receiver gets
``rank.straggling``; ``GET /v1/stragglers/history`` counts the episode, ended by the move;
and the job ends with the parameters of a run that was never slowed, bit for bit.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from demo.receiver import Receiver
from migrator.faults import FaultPlan
from tests.conftest import start_service
from tests.control.scene import PACED, Scene, wait_for
from tests.migrator.harness import Run, assert_same, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 400
"""The job's steps: the move comes ~15 steps after the slowness starts (step 44 of a run on a
loaded machine), and the slowed pace (0.35 s a step) leaves ~130 s of runway for it; the test
needs 40 steps after the move, and what is left runs unpaced once it touches ``fast``."""
SLOW_FROM = 30
DELAY_S = 0.3
PACE_S = 0.05
SLOW_GPU = ("sim-node-0000", 1)
POLICY = {
    "threshold": 1.0,  # no risk-driven move: this test is about the straggler path alone
    "cooldown_s": 0,
    "stale_after_s": 60,
    "straggler_window_s": 2,
}


@pytest.fixture
def scene(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scene]:
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "0.5")
    monkeypatch.setenv("FOREWARN_POLICY", json.dumps(POLICY))
    monkeypatch.setenv("FOREWARN_WEBHOOK_ALLOW", "127.0.0.1")
    monkeypatch.setenv("FOREWARN_WEBHOOK_POLL_INTERVAL_S", "0.2")
    db = f"sqlite:///{tmp_path / 's.db'}"
    service = start_service(db, tmp_path / "service.log", timeout_s=120)
    s = Scene(service, tmp_path)
    s.simulate("--slow", f"{SLOW_GPU[0]}:{SLOW_GPU[1]}:pcie:3600")
    try:
        yield s
    finally:
        s.close()


def _launch(scene: Scene, out: Path) -> subprocess.Popen[bytes]:
    plan = FaultPlan().slow_at(1, SLOW_FROM, DELAY_S)
    return scene.spawn(
        [
            "launch",
            "--nproc", "2",
            "--spares", "1",
            "--job-id", "slow",
            "--service", scene.service.url,
            "--token", scene.service.admin_token,
            "--placement", f"sim-node-0000:0,{SLOW_GPU[0]}:{SLOW_GPU[1]},sim-node-0001:0",
            "--timing-window", "8",
            "--heartbeat-s", "1",
            "--timeout-s", "20",
            "--faults", plan.to_json(),
            "--log-dir", str(out / "logs"),
            "--report", str(out / "reports.jsonl"),
            "--",
            sys.executable, str(PACED), "--out", str(out), "--steps", str(STEPS),
            "--mode", "ddp", "--pace-s", str(PACE_S),
        ],
        "launch.log",
    )  # fmt: skip


def _subscribe(scene: Scene, tmp: Path) -> Receiver:
    receiver = Receiver(tmp / "webhooks.log")
    receiver.start()
    response = httpx.post(
        scene.service.url + "/v1/webhooks",
        headers={"Authorization": f"Bearer {scene.service.admin_token}"},
        json={"url": receiver.url, "event_types": ["rank.straggling", "migration.completed"]},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    receiver.secret = response.json()["secret"]
    return receiver


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in out.glob("log.slot*.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def _rate(times: dict[int, float], first: int, last: int) -> float:
    """Steps per second of rank 0 over steps ``first`` to ``last`` (median step interval)."""
    gaps = [times[k + 1] - times[k] for k in range(first, last) if k in times and k + 1 in times]
    assert len(gaps) >= 5, f"too few steps between {first} and {last}: {len(gaps)}"
    return 1.0 / statistics.median(gaps)


def test_a_straggler_is_named_moved_and_the_job_recovers_its_pace_bitwise(
    scene: Scene, tmp_path: Path
) -> None:
    out = tmp_path / "slowed"
    pool = ThreadPoolExecutor(1)
    baseline = pool.submit(launch, tmp_path / "baseline", steps=STEPS, timeout_s=20.0)
    pool.shutdown(wait=False)
    wait_for("the fleet", lambda: scene.get("/v1/risk")["count"] >= 16, 180)
    receiver = _subscribe(scene, tmp_path)
    try:
        job = _launch(scene, out)
        done = wait_for(
            "a finished straggler migration",
            lambda: [
                m
                for m in scene.get("/v1/migrations", job="slow")["data"]
                if m["state"] in ("completed", "failed")
            ],
            240,
        )
        (m,) = done
        assert m["state"] == "completed", m
        assert (m["trigger"], m["rank"]) == ("straggler", 1), m
        assert m["source"] == {"node": SLOW_GPU[0], "gpu": SLOW_GPU[1]}
        assert (m["target"]["node"], m["target"]["gpu"]) == ("sim-node-0001", 0), m
        assert "PCIe link at x8 of x16" in (m["detail"] or ""), m
        moved_at = int(m["step"])
        # some steps at the recovered pace, then the rest unpaced
        wait_for(
            "steps after the move",
            lambda: (
                max((r["step"] for r in _rows(out) if r["rank"] == 0), default=0) >= moved_at + 40
            ),
            120,
        )
        # The episode ended with the move: the fleet's own history counts it, over the rank
        # time the loop judged.
        history = wait_for(
            "the episode's end in the history",
            lambda: (h := scene.get("/v1/stragglers/history"))["ended"] and h,
            60,
        )
        assert (history["episodes"], history["ended_by"]) == (1, {"moved": 1}), history
        assert history["rank_days"] > 0 and history["episodes_per_gpu_day"] > 0, history
        assert history["slowdown"] > 1.5 and history["duration_mean_s"] > 0, history
        assert any("PCIe link at x8 of x16" in r for r in history["reasons"]), history
        (out / "fast").touch()
        assert job.wait(timeout=300) == 0
        wait_for("rank.straggling delivered", lambda: receiver.counts().get("rank.straggling"), 30)
    finally:
        receiver.close()

    times = {r["step"]: r["t"] for r in _rows(out) if r["rank"] == 0}
    before = _rate(times, 5, SLOW_FROM - 1)
    during = _rate(times, SLOW_FROM + 2, moved_at - 1)
    after = _rate(times, moved_at + 3, moved_at + 38)
    requested = datetime.fromisoformat(m["requested_at"]).timestamp()
    finished = datetime.fromisoformat(m["finished_at"]).timestamp()
    print(
        f"steps/s before {before:.2f}, slowed {during:.2f}, after the move {after:.2f}; "
        f"first slow step to the request {requested - times[SLOW_FROM]:.1f} s, request to "
        f"done {finished - requested:.1f} s, pause {m['pause_s']} s, moved at step {moved_at}"
    )
    assert during < 0.5 * before, (before, during)
    assert after > 2 * during, (during, after)
    base = baseline.result(timeout=300)
    assert_same(base, Run(out, 0, [], base.agent))
