"""The loop closed, with real processes, through a restart: ``forewarn serve`` killed while the
job's agent carries out a migration, started again on the same database (the scene:
:mod:`tests.control.scene`). Apart from :mod:`tests.control.test_e2e` so that the suite's
workers run the two side by side."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import start_service
from tests.control.scene import Scene, _job_running, run_job, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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
