"""A rule that is the fleet's normal is no floor, and the service says so (issue 30, item 6).

A service of its own under an alarm budget of 2 per 1,000 GPU-days, the real scorer and the
shipped model: two nodes whose 16 GPUs run in thermal slowdown (hot nodes) and one GPU with a
row remap pending, as collectors post them. The thermal rule trips on 16 healthy GPUs at once,
far more than the budget explains: `GET /v1/policy` names it among the rules that are not a
floor here, the hot GPUs' reasons say so and they are not alarmed, the GPU with the remap
pending still is, and the dashboard's summary shows the badge in a real browser.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import start_service
from tests.dashboard.conftest import open_page
from tests.factories import sample_dict

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

THERMAL_SLOWDOWN = 0x20  # NVML's clocks-event reason: HW thermal slowdown
HOT = ("hot-node-0", "hot-node-1")


def _post(client: httpx.Client, token: str, path: str, body: dict[str, Any]) -> None:
    r = client.post(path, json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code in (200, 201), (path, r.status_code, r.text)


def test_hot_nodes_thermal_rule_is_no_floor_and_the_dashboard_says_so(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "1")
    live = start_service(f"sqlite:///{tmp_path / 'f.db'}", tmp_path / "service.log", timeout_s=120)
    try:
        auth = {"Authorization": f"Bearer {live.admin_token}"}
        with httpx.Client(base_url=live.url, timeout=30) as client:
            r = client.put("/v1/policy", json={"alarm_budget": 2.0}, headers=auth)
            assert r.status_code == 200, r.text
            now = datetime.now(UTC).replace(microsecond=0)
            for node in (*HOT, "cool-node-0"):
                samples = [
                    sample_dict(
                        node,
                        gpu,
                        now - timedelta(seconds=s),
                        throttle_reasons=THERMAL_SLOWDOWN if node in HOT else 0,
                        remap_pending=node == "cool-node-0" and gpu == 3,
                    )
                    for s in range(360, -1, -10)
                    for gpu in range(8)
                ]
                _post(client, live.ingest_token, "/v1/ingest", {"node": node, "samples": samples})
            deadline = time.monotonic() + 90
            policy: dict[str, Any] = {}
            while time.monotonic() < deadline:
                policy = client.get("/v1/policy", headers=auth).json()
                demoted = [d["rule"] for d in (policy.get("floor_budget") or {}).get("demoted", [])]
                if demoted:
                    break
                time.sleep(0.5)
            assert demoted == ["thermal"], policy
            time.sleep(2.5)  # a tick after the demotion: the hot GPUs scored without the floor
            risk = client.get("/v1/risk", headers=auth).json()["data"]
        by = {(r["node"], r["gpu"]): r for r in risk}
        hot = by[("hot-node-0", 0)]
        assert not hot["alarm"], hot
        assert any("not a floor on this fleet" in x for x in hot["reasons"]), hot
        assert by[("cool-node-0", 3)]["alarm"]
        assert by[("cool-node-0", 3)]["reasons"][0].startswith("rule remap")

        context, p = open_page(browser, live, live.read_token)
        try:
            p.go("/")
            badge = p.page.locator("[data-stat=floor-demoted]")
            badge.wait_for()
            assert "thermal" in badge.inner_text()
            assert not p.errors, p.errors
        finally:
            context.close()
    finally:
        live.stop()
