"""Two real ``forewarn serve`` processes on one PostgreSQL: one leads the control loop.

One threshold crossing (every scored GPU alarms under this policy) gives exactly one
migration, not one per replica; killing the leader hands the loop to the other replica
within a few ticks, and the migration is still the only one.
"""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveService, reset_postgres, start_service
from tests.factories import sample_dict

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(240)]

POLICY = '{"threshold": 0.0, "hysteresis": 1, "breaker_min_gpus": 100}'


def leads(service: LiveService) -> bool:
    try:
        text = httpx.get(service.url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    return "forewarn_control_leader 1.0" in text


def ticks(service: LiveService) -> int:
    """Control-loop ticks this replica ran (the tick histogram's count; 0 while it follows)."""
    text = httpx.get(service.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("forewarn_scorer_tick_seconds_count"):
            return int(float(line.split()[-1]))
    return 0


def wait_ticks(service: LiveService, n: int, timeout_s: float = 60) -> None:
    """Wait until ``service`` ran ``n`` more ticks: a count of ticks, not a fixed sleep, so
    that what the test then asserts was decided by that many ticks on a loaded machine too."""
    start = ticks(service)
    wait_for(f"{n} ticks", lambda: ticks(service) >= start + n, timeout_s)


def wait_for(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_one_leader_one_migration_and_a_handover(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reset_postgres(postgres_url)
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "0.5")
    monkeypatch.setenv("FOREWARN_POLICY", POLICY)
    a = start_service(postgres_url, tmp_path / "a.log", timeout_s=120)
    b = start_service(postgres_url, tmp_path / "b.log", timeout_s=120)
    try:
        admin = {"Authorization": f"Bearer {a.admin_token}"}
        leader = wait_for("a leader", lambda: [s for s in (a, b) if leads(s)], 60)
        assert len(leader) == 1
        registration = {
            "job_id": "j",
            "world_size": 2,
            "spares": 1,
            "placement": [
                {"rank": 0, "node": "n0", "gpu": 0, "slot": 0},
                {"rank": 1, "node": "n0", "gpu": 1, "slot": 1},
                {"rank": 2, "node": "n9", "gpu": 0, "slot": 2, "role": "spare"},
            ],
        }
        httpx.post(b.url + "/v1/jobs", json=registration, headers=admin).raise_for_status()
        now = datetime.now(UTC)
        rows = [
            sample_dict("n0", gpu, now - timedelta(seconds=s)) for gpu in (0, 1) for s in (2, 1)
        ]
        ingest = {"Authorization": f"Bearer {a.ingest_token}"}
        httpx.post(
            a.url + "/v1/ingest", json={"node": "n0", "samples": rows}, headers=ingest
        ).raise_for_status()

        def migrations() -> list[dict[str, Any]]:
            alive = next(s for s in (a, b) if s.process.poll() is None)
            r = httpx.get(alive.url + "/v1/migrations", headers=admin, timeout=5)
            return r.json()["data"]  # type: ignore[no-any-return]

        wait_for("a migration", migrations, 60)
        first = leader[0]
        other = b if first is a else a
        wait_ticks(first, 4)  # the leader saw the crossing again and again
        assert ticks(other) == 0, "the follower must not run the loop"
        (m,) = migrations()
        assert m["trigger"] == "preventive" and m["state"] == "requested"

        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)
        wait_for("the other replica to lead", lambda: leads(other), 30)
        wait_ticks(other, 4)
        assert [x["id"] for x in migrations()] == [m["id"]]
    finally:
        a.stop()
        b.stop()
