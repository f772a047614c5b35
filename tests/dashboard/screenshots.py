"""Take the README's dashboard screenshots from a real service fed by the simulator.

    .venv/bin/python -m tests.dashboard.screenshots docs/img

256 simulated GPUs with 20 minutes of history, three of them failing (memory wear, thermal
loss, NVLink degradation, each a few minutes from failure at the end of the history), a job of
6 ranks and 2 spares placed on the fleet, one node drained; once the control loop has scored
the fleet, it saves ``dashboard-fleet.png`` and ``dashboard-gpu.png`` (the GPU most at risk).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.conftest import start_service
from tests.dashboard.conftest import CHROMIUM, HISTORY_S, SimFeed, open_page

FAILING = [
    ("sim-node-0005", 2, "memory"),
    ("sim-node-0017", 6, "thermal"),
    ("sim-node-0026", 1, "nvlink"),
]


def main(out: Path) -> None:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        service = start_service(f"sqlite:///{tmp}/shots.db", Path(tmp) / "log", timeout_s=120)
        feed = SimFeed(service, gpus=256)
        try:
            for node, gpu, kind in FAILING:
                feed.model.inject(
                    feed.model.node_names.index(node), gpu, kind, lead_s=HISTORY_S + 400
                )
            feed.history()
            feed.start()
            admin = {"Authorization": f"Bearer {service.admin_token}"}
            placement = [
                {"rank": r, "node": "sim-node-0005", "gpu": r, "role": "active"} for r in range(6)
            ]
            placement += [
                {"rank": 6 + s, "node": "sim-node-0009", "gpu": s, "role": "spare"}
                for s in range(2)
            ]
            job = {"job_id": "llm-pretrain", "world_size": 6, "spares": 2, "placement": placement}
            httpx.post(f"{service.url}/v1/jobs", json=job, headers=admin).raise_for_status()
            httpx.post(
                f"{service.url}/v1/nodes/sim-node-0012/drain",
                json={"reason": "maintenance"},
                headers=admin,
            ).raise_for_status()
            time.sleep(25)  # a few control-loop ticks: scores, hysteresis
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
                )
                context, page = open_page(
                    browser, service, service.admin_token, viewport={"width": 1440, "height": 860}
                )
                page.go("/")
                page.page.wait_for_function(
                    "() => document.querySelector('#fleet-map')?.dataset.cells === '256'"
                )
                page.page.wait_for_timeout(2500)
                page.page.screenshot(path=str(out / "dashboard-fleet.png"))
                # the GPU most at risk that has reasons in words (not one already failed)
                with_reasons = page.page.locator("#fleet-top tbody tr").filter(
                    has=page.page.locator("td.reason", has_text=" ")
                )
                with_reasons.first.locator("a").click()
                page.page.wait_for_function(
                    "() => Number(document.querySelector('#chart-risk')?.dataset.points) > 0",
                    timeout=60_000,
                )
                page.page.click("[data-window='900']")
                page.page.wait_for_timeout(3000)
                page.page.screenshot(path=str(out / "dashboard-gpu.png"))
                context.close()
                browser.close()
        finally:
            feed.close()
            service.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img"))
