"""A straggler on the job's page, in a real browser, from what the service stored.

A job registers and heartbeats its ranks' step timings through the API, as a job agent does;
its ranks sit on GPUs of the simulated fleet, one of which the simulator downtrains to a
narrower, slower PCIe link (``sim.slowdowns``). The service's own control loop judges the
timings (the policy's straggler window set to 0 for the test, then put back) and the job's
page names the straggler, its compute time against its peers' and the reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.conftest import LiveService
from tests.dashboard.conftest import OPERATE_TOKEN, SimFeed

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

JOB, NODE, SLOW_GPU = "job-slow", "sim-node-0003", 5
TIMINGS = {
    "window": 20,
    "step": 40,
    "total_steps": 1000,
    "rank": [0, 1, 2],
    "compute_s": [0.5, 0.9, 0.52],
    "wait_s": [0.4, 0.0, 0.38],
    "step_s": [1.0, 1.0, 1.0],
}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_for_narrow_link(service: LiveService, timeout_s: float = 60.0) -> None:
    since = (datetime.now(UTC) - timedelta(seconds=30)).isoformat()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = httpx.get(
            f"{service.url}/v1/gpus/{NODE}/{SLOW_GPU}/samples",
            params={"since": since, "fields": "pcie_link_width"},
            headers=auth(service.read_token),
        ).json()["data"]
        if rows and rows[-1]["pcie_link_width"] == 8:
            return
        time.sleep(0.5)
    raise AssertionError(f"the simulator did not narrow {NODE}/{SLOW_GPU}'s link in {timeout_s} s")


@pytest.fixture(scope="module")
def straggling(service: LiveService, feed: SimFeed) -> Iterator[str]:
    url = service.url
    before = httpx.get(f"{url}/v1/policy", headers=auth(service.read_token)).json()["policy"]
    fast = {**before, "straggler_window_s": 0}
    assert httpx.put(f"{url}/v1/policy", json=fast, headers=auth(service.admin_token)).is_success
    try:
        feed.slow(NODE, SLOW_GPU, "pcie", duration_s=600)
        wait_for_narrow_link(service)  # the reason is named when the rank turns straggler
        placement = [{"rank": r, "node": NODE, "gpu": SLOW_GPU - 1 + r} for r in range(3)]
        job = {"job_id": JOB, "world_size": 3, "spares": 0, "placement": placement}
        assert httpx.post(f"{url}/v1/jobs", json=job, headers=auth(OPERATE_TOKEN)).is_success
        deadline = time.monotonic() + 60
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:  # heartbeats every second until the loop judged
            beat = {"status": "running", "timings": TIMINGS}
            response = httpx.post(
                f"{url}/v1/jobs/{JOB}/heartbeat", json=beat, headers=auth(OPERATE_TOKEN)
            )
            assert response.status_code == 200, response.text
            body = response.json()
            ranks = {r["rank"]: r for r in body["ranks"]}
            if body["stragglers"] == [1] and "PCIe" in (ranks[1]["straggler_reason"] or ""):
                break
            time.sleep(1.0)
        assert body["stragglers"] == [1], f"not judged in 60 s:\n{service.log()[-3000:]}"
        yield JOB
    finally:
        httpx.put(f"{url}/v1/policy", json=before, headers=auth(service.admin_token))


def test_the_job_page_names_the_straggler_and_why(
    make_page: Any, service: LiveService, straggling: str
) -> None:
    p = make_page(service.read_token)
    p.go("/jobs")
    assert "rank 1" in p.page.locator(f"[data-stragglers='{straggling}']").inner_text()
    p.go(f"/jobs/{straggling}")
    note = p.page.locator("[data-straggler='1']")
    note.wait_for()
    text = note.inner_text()
    assert "Rank 1 is a straggler" in text and "900 ms" in text and "510 ms" in text
    reason = note.locator("[data-reason]").inner_text()
    assert "PCIe link at x8 of x16" in reason, reason
    assert "straggler" in p.page.locator("[data-compute='1']").inner_text()
    assert p.page.locator("[data-compute='0']").inner_text() == "500 ms"
    assert p.page.locator("[data-straggler]").count() == 1
    p.shot("job-straggler")
    assert p.errors == []
