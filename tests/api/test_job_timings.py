"""Step timings through the routes: a heartbeat stores them, the control loop judges what was
stored, ``GET /v1/jobs/{id}`` and ``GET /v1/jobs`` show each rank's times and the straggler."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from control.loop import ControlLoop
from control.policy import Policy
from store import Store
from tests.api.conftest import INGEST, READ, make_settings

OPERATE = {"Authorization": "Bearer operate-token-0123456789abcdef"}
TIMINGS = {
    "window": 20,
    "step": 40,
    "total_steps": 1000,
    "rank": [0, 1, 2],
    "compute_s": [0.5, 0.9, 0.52],
    "wait_s": [0.4, 0.0, 0.38],
    "step_s": [1.0, 1.0, 1.0],
}


def test_a_heartbeat_stores_timings_and_the_job_shows_its_straggler(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    settings = make_settings(
        url,
        tmp_path,
        tokens={OPERATE["Authorization"].split()[1]: ["read", "operate"]},
        control_enabled=False,
    )
    placement = [{"rank": r, "node": "a", "gpu": r} for r in range(3)]
    with TestClient(create_app(settings)) as client:
        job = {"job_id": "j", "world_size": 3, "spares": 0, "placement": placement}
        assert client.post("/v1/jobs", json=job, headers=OPERATE).status_code == 201
        bad = {**TIMINGS, "wait_s": [0.4]}
        refused = client.post(
            "/v1/jobs/j/heartbeat", json={"status": "running", "timings": bad}, headers=OPERATE
        )
        assert refused.status_code == 422 and "same length" in refused.text
        ts = datetime.now(UTC).isoformat()
        sample = {"node": "a", "gpu": 1, "ts": ts, "throttle_reasons": 0x20, "temp_gpu_c": 70.0}
        assert (
            client.post(
                "/v1/ingest", json={"node": "a", "samples": [sample]}, headers=INGEST
            ).status_code
            == 200
        )
        beat = client.post(
            "/v1/jobs/j/heartbeat", json={"status": "running", "timings": TIMINGS}, headers=OPERATE
        )
        assert beat.status_code == 200, beat.text
        body = beat.json()
        assert body["timings"]["step"] == 40 and body["timings"]["total_steps"] == 1000
        slow = body["ranks"][1]
        assert (slow["compute_s"], slow["wait_s"], slow["step_s"]) == (0.9, 0.0, 1.0)
        assert slow["peers_median_s"] == 0.51 and not slow["straggler"]

        store = Store.open(url)  # the control loop of this service, ticked by the test
        try:
            loop = ControlLoop(store, model=None, defaults=Policy(straggler_window_s=0), tick_s=1)
            assert loop.step(now_ms=int(time.time() * 1000))
            loop.leadership.release()
        finally:
            store.close()

        one = client.get("/v1/jobs/j", headers=READ).json()
        assert one["stragglers"] == [1]
        slow = one["ranks"][1]
        assert slow["straggler"] and slow["straggler_since"] is not None
        assert slow["straggler_reason"] == "clocks held down: SW thermal slowdown (0x20)"
        assert not one["ranks"][0]["straggler"] and one["ranks"][0]["straggler_reason"] is None
        (listed,) = client.get("/v1/jobs", headers=READ).json()["data"]
        assert listed["stragglers"] == [1]

        # a later heartbeat without a rank drops its row; one without timings keeps them
        fewer = {k: v[:2] if isinstance(v, list) else v for k, v in TIMINGS.items()}
        client.post(
            "/v1/jobs/j/heartbeat", json={"status": "running", "timings": fewer}, headers=OPERATE
        )
        kept = client.post("/v1/jobs/j/heartbeat", json={"status": "running"}, headers=OPERATE)
        ranks = kept.json()["ranks"]
        assert [r["compute_s"] for r in ranks] == [0.5, 0.9, None]
