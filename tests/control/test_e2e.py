"""The loop closed, with real processes: ``forewarn serve`` (uvicorn), a simulated fleet
streaming into it (``forewarn simulate``, the collector's batching pusher), and a gloo job of
2 ranks + 1 spare launched with ``--service --token --placement`` onto fleet GPUs. Memory wear
is injected under rank 1; the risk crosses, the policy requests a preventive migration, the
agent hands the rank over, the migration completes, and the job ends with the parameters of a
run without the migration, bit for bit. It starts in dry-run (one audit entry, nothing moves)
and is armed mid-episode, as an operator turns Forewarn on.

The shipped model scores a short wear episode low until its last stretch (its precursors are
learnt over hours): a three-minute episode (three hours of fleet time at ``--speed 60``) crosses
0.02 about 27 s before the GPU fails, the healthy GPUs stay under 0.005. So the test sets the
policy's threshold there, and gives the dry-run, the arming and the move that margin.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveService, free_port, start_service
from tests.migrator.harness import ROOT, Run, assert_same, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PACED = Path(__file__).with_name("train_paced.py")
STEPS = 3000
WEAR_LEAD_S = 180
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


@pytest.fixture
def scene(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: Any
) -> Iterator[Scene]:
    dry = getattr(request, "param", False)
    policy = POLICY[:-1] + (', "dry_run": true}' if dry else "}")
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "0.5")
    monkeypatch.setenv("FOREWARN_POLICY", policy)
    monkeypatch.setenv("FOREWARN_RISK_HISTORY_INTERVAL_S", "1")
    service = start_service(database_url, tmp_path / "service.log", timeout_s=120)
    s = Scene(service, tmp_path)
    s.spawn(
        [
            "simulate",
            "--gpus", "16",
            "--seed", "0",
            "--speed", "60",
            "--service", service.url,
            "--token", service.ingest_token,
            "--control-port", str(s.control),
        ],
        "simulate.log",
    )  # fmt: skip
    try:
        yield s
    finally:
        s.stop()
        service.stop()
        print(service.log()[-4000:])


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


# On PostgreSQL: the same path on SQLite is what tests/demo/test_demo.py runs (`forewarn demo`).
@pytest.mark.parametrize("scene", [True], indirect=True, ids=["dry-run-first"])
@pytest.mark.parametrize(
    "database_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_dry_run_first_then_the_crossing_migrates_the_rank_and_the_job_ends_bitwise_equal(
    scene: Scene, tmp_path: Path
) -> None:
    """How an operator turns Forewarn on: in dry-run the crossing is one audit entry and
    nothing moves; with dry-run turned off (``PUT /v1/policy``) the same crossing requests
    the preventive move, the rank is handed over, and the job ends bit for bit equal."""
    out = tmp_path / "migrated"
    # The run nothing disturbs, meanwhile (it needs no service): the scene mostly waits.
    pool = ThreadPoolExecutor(1)
    baseline = pool.submit(launch, tmp_path / "baseline", steps=STEPS, timeout_s=20.0)
    pool.shutdown(wait=False)
    job = start_and_inject(scene, out)
    wait_for(
        "a dry-run decision",
        lambda: scene.get("/v1/audit", kind="migration")["data"],
        WEAR_LEAD_S + 60,
    )
    scene.wait_ticks(3)  # three more decisions: still one entry, nothing moved
    entries = scene.get("/v1/audit", kind="migration")["data"]
    assert [(e["action"], e["job_id"], e["data"]["rank"]) for e in entries] == [
        ("dry_run", "e2e", 1)
    ]
    assert scene.get("/v1/migrations")["count"] == 0

    admin = {"Authorization": f"Bearer {scene.service.admin_token}"}
    armed = httpx.put(
        scene.service.url + "/v1/policy", json=json.loads(POLICY), headers=admin, timeout=10
    )
    assert armed.status_code == 200 and armed.json()["policy"]["dry_run"] is False, armed.text
    done = wait_for(
        "a completed migration",
        lambda: [
            m
            for m in scene.get("/v1/migrations", job="e2e")["data"]
            if m["state"] in ("completed", "failed")
        ],
        120,
    )
    (out / "fast").touch()  # the rest of the job need not wait any more
    (m,) = done
    assert m["state"] == "completed", m
    assert (m["trigger"], m["rank"]) == ("preventive", 1)
    assert m["source"] == {"node": "sim-node-0000", "gpu": 1}
    assert m["target"]["node"] == "sim-node-0001" and m["target"]["gpu"] == 0
    assert m["risk"] >= 0.02 and m["acknowledged_at"] and m["bytes_moved"] > 0
    trail = scene.get(f"/v1/migrations/{m['id']}")["audit"]
    actions = [a["action"] for a in trail]
    assert actions[0] == "requested" and actions[-1] == "completed", actions
    print("audit trail:", json.dumps(trail, indent=1))
    ranks = {r["slot"]: r for r in scene.get("/v1/jobs/e2e")["ranks"]}
    assert (ranks[2]["role"], ranks[2]["rank"]) == ("active", 1)
    assert job.wait(timeout=180) == 0
    base = baseline.result(timeout=300)
    assert_same(base, Run(0, out, [], base.agent))


@pytest.fixture
def quiet_service(tmp_path: Path) -> Iterator[LiveService]:
    """A service with no fleet (the default start timeout is short for a loaded machine)."""
    service = start_service(f"sqlite:///{tmp_path / 'q.db'}", tmp_path / "q.log", timeout_s=120)
    yield service
    service.stop()


def test_the_launcher_refuses_a_bad_token_at_start(
    quiet_service: LiveService, tmp_path: Path
) -> None:
    live_service = quiet_service
    result = subprocess.run(
        [
            sys.executable, "-m", "forewarn", "launch", "--nproc", "1", "--spares", "0",
            "--service", live_service.url, "--token", live_service.read_token,
            "--", sys.executable, "-c", "pass",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "needs 'operate'" in result.stderr
    result = subprocess.run(
        [
            sys.executable, "-m", "forewarn", "launch", "--nproc", "1", "--spares", "0",
            "--service", live_service.url, "--token", "wrong-token",
            "--", sys.executable, "-c", "pass",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "refused" in result.stderr and "401" in result.stderr


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_service_killed_mid_migration_reconciles_it_and_moves_the_rank_once(
    scene: Scene, database_url: str, tmp_path: Path
) -> None:
    """SIGKILL ``forewarn serve`` once the agent took a manual migration, restart it on the
    same database: the agent's reports reach the new process, the migration ends completed,
    and nothing asks for the move again."""
    out = tmp_path / "killed"
    wait_for("the fleet", lambda: scene.get("/v1/risk")["count"] >= 16, 180)
    job = run_job(scene, out)
    wait_for("the job", lambda: _job_running(scene), 180)
    wait_for("training", lambda: any(out.glob("log.slot*.jsonl")), 180)
    url = scene.service.url
    operate = {"Authorization": f"Bearer {scene.service.admin_token}"}
    created = httpx.post(
        f"{url}/v1/migrations", json={"job_id": "e2e", "rank": 0}, headers=operate, timeout=10
    )
    assert created.status_code == 201, created.text
    mid = created.json()["id"]
    taken = wait_for(
        "the agent to take the command",
        lambda: scene.get(f"/v1/migrations/{mid}")["state"] != "requested",
        60,
        every_s=0.05,
    )
    assert taken
    killed_in = scene.get(f"/v1/migrations/{mid}")["state"]
    scene.service.process.kill()  # SIGKILL: no shutdown, no flush
    scene.service.process.wait(timeout=10)
    back = start_service(
        database_url, tmp_path / "service2.log", port=int(url.rsplit(":", 1)[1]), timeout_s=120
    )
    scene.procs.append(back.process)
    scene.service = back
    m = wait_for(
        "the migration to end",
        lambda: (
            (got := scene.get(f"/v1/migrations/{mid}"))["state"] in ("completed", "failed") and got
        ),
        120,
    )
    assert m["state"] == "completed", (killed_in, m)
    scene.wait_ticks(3)  # three more control ticks: nothing asks for the move again
    moves = scene.get("/v1/migrations", job="e2e")["data"]
    assert [x["id"] for x in moves] == [mid], (killed_in, moves)
    actions = [a["action"] for a in scene.get(f"/v1/migrations/{mid}")["audit"]]
    assert actions.count("completed") == 1, actions
    ranks = {r["slot"]: r for r in scene.get("/v1/jobs/e2e")["ranks"]}
    assert (ranks[2]["role"], ranks[2]["rank"]) == ("active", 0)
    (out / "fast").touch()
    assert job.wait(timeout=180) == 0
    print(f"killed while {killed_in}; audit: {actions}")
