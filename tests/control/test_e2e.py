"""The loop closed, with real processes: ``forewarn serve`` (uvicorn), a simulated fleet
streaming into it (``forewarn simulate``, the collector's batching pusher), and a gloo job of
2 ranks + 1 spare launched with ``--service --token --placement`` onto fleet GPUs. Memory wear
is injected under rank 1; the risk crosses, the policy requests a preventive migration, the
agent hands the rank over, the migration completes, and the job ends with the parameters of a
run without the migration, bit for bit. It starts in dry-run (one audit entry, nothing moves)
and is armed mid-episode, as an operator turns Forewarn on.

The shipped model scores a short wear episode low (its precursors are learnt over hours); the
floor's rules (row remap pending, a fatal Xid) raise the worn GPU to the threshold as soon as
the hard evidence shows. The scene's fleet (``tests/control/wear.toml``) shows it within
seconds of the injection, so the dry-run, the arming and the move share nearly the whole
60-s episode, and the test waits for the loop rather than for the wear; the healthy GPUs stay
under 0.005, so the test sets the policy's threshold at 0.02
(``tests/demo/test_wear_margin.py`` replays the episode offline and holds it to 40 s).
The slow climb of the default physics is the demo's story (``tests/demo/test_demo.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveService, start_service
from tests.control.scene import POLICY, STEPS, WEAR_LEAD_S, Scene, start_and_inject, wait_for
from tests.migrator.harness import ROOT, Run, assert_same, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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
    assert_same(base, Run(out, 0, [], base.agent))


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
