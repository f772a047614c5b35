"""The dashboard tells the truth after failures, in a real browser (issue 32).

After the demo's story the map called the GPU that died "27.2 %, alarm, stale", the one that
came back "failed", the finished job offered Move buttons that answer 409, scope hints showed
to tokens that hold the scope, and the audit log was raw JSON. Here a service of its own gets
the same states by its API, as collectors and job agents would post them: a GPU that died of
a double-bit error (Xid 48, nothing since), one lost that reports again, a job that finished
and one that runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveService, start_service
from tests.dashboard.conftest import open_page
from tests.factories import sample_dict

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

NODE = "lab-node-0"
DEAD, BACK, LIVE, DONE = 1, 2, 0, 3  # GPU indexes on NODE


def _post(client: httpx.Client, token: str, path: str, body: dict[str, Any]) -> None:
    r = client.post(path, json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code in (200, 201), (path, r.status_code, r.text)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    tmp: Path = tmp_path_factory.mktemp("after-failures")
    live = start_service(f"sqlite:///{tmp / 'lab.db'}", tmp / "service.log", timeout_s=120)
    now = datetime.now(UTC).replace(microsecond=0)
    with httpx.Client(base_url=live.url, timeout=30) as client:
        samples = [
            sample_dict(NODE, gpu, now - timedelta(seconds=s))
            for s in range(600, -1, -10)
            for gpu in range(4)
            if not (gpu == DEAD and s < 100)  # it died 100 s ago: nothing since
        ]
        events = [
            {"node": NODE, "gpu": DEAD, "ts": (now - timedelta(seconds=100)).isoformat(),
             "kind": "xid", "xid": 48, "message": "double-bit ECC error"},
            {"node": NODE, "gpu": BACK, "ts": (now - timedelta(seconds=400)).isoformat(),
             "kind": "gpu_lost"},
        ]  # fmt: skip
        _post(client, live.ingest_token, "/v1/ingest",
              {"node": NODE, "samples": samples, "events": events})  # fmt: skip
        for job, gpu, status in (("lab-done", DONE, "completed"), ("lab-live", LIVE, "running")):
            placement = [{"rank": 0, "node": NODE, "gpu": gpu}]
            body = {"job_id": job, "world_size": 1, "spares": 0, "placement": placement}
            _post(client, live.admin_token, "/v1/jobs", body)
            _post(client, live.admin_token, f"/v1/jobs/{job}/heartbeat", {"status": status})
        _post(client, live.admin_token, "/v1/nodes/lab-node-9/drain", {"reason": "cabling"})
    yield live
    live.stop()


@pytest.fixture
def page_for(browser: Any, lab: LiveService) -> Iterator[Any]:
    contexts: list[Any] = []

    def make(token: str) -> Any:
        context, page = open_page(browser, lab, token)
        contexts.append(context)
        return page

    yield make
    for context in contexts:
        context.close()


def _wait(page: Any, condition: str) -> None:
    page.wait_for_function(f"() => {condition}", timeout=30_000)


def test_the_map_says_failed_and_recovered_not_risk(page_for: Any, lab: LiveService) -> None:
    p = page_for(lab.read_token)
    p.go("/")
    _wait(p.page, f"window.__forewarnDescribe?.('{NODE}', {DEAD})?.includes('FAILED')")
    dead = p.page.evaluate(f"window.__forewarnDescribe('{NODE}', {DEAD})")
    assert "risk" not in dead and "ALARM" not in dead and "stale" not in dead, dead
    assert "Xid 48" in dead
    back = p.page.evaluate(f"window.__forewarnDescribe('{NODE}', {BACK})")
    assert "recovered" in back and "FAILED" not in back, back
    live = p.page.evaluate(f"window.__forewarnDescribe('{NODE}', {LIVE})")
    assert "FAILED" not in live and "recovered" not in live, live
    legend = p.page.locator("#fleet-legend").inner_text()
    assert "failed" in legend and "recovered" in legend and "drained" in legend
    assert p.page.locator("[data-stat=failed] strong").inner_text() == "1"
    assert not p.errors, p.errors


def test_the_gpu_page_says_failed_and_fits_its_window(page_for: Any, lab: LiveService) -> None:
    p = page_for(lab.read_token)
    p.go(f"/gpu/{NODE}/{DEAD}")
    p.page.locator("[data-state=failed]").wait_for()
    now = p.page.locator("#gpu-now").inner_text()
    assert "failed" in now and "Xid 48" in now and "alarm" not in now and "%" not in now
    # ten minutes of samples: the 15-minute window, not the hour that crowded them
    assert p.page.locator("[data-window][aria-pressed=true]").inner_text() == "15m"
    p.go(f"/gpu/{NODE}/{BACK}")
    p.page.locator("[data-state=recovered]").wait_for()
    assert "failed" not in p.page.locator("#gpu-now").inner_text().lower()
    assert not p.errors, p.errors


def test_a_finished_job_offers_no_move(page_for: Any, lab: LiveService) -> None:
    p = page_for(lab.admin_token)
    p.go("/jobs/lab-done")
    p.page.locator("[data-next=finished]").wait_for()
    assert p.page.locator("[data-migrate]").count() == 0
    p.go("/jobs/lab-live")
    p.page.locator("[data-migrate]").first.wait_for()
    assert p.page.locator("[data-scope-hint]").count() == 0  # admin holds operate
    assert not p.errors, p.errors


def test_scope_hints_only_where_the_token_lacks_the_scope(page_for: Any, lab: LiveService) -> None:
    reader = page_for(lab.read_token)
    reader.go(f"/node/{NODE}")
    reader.page.locator("[data-scope-hint=operate]").wait_for()
    reader.go("/jobs/lab-live")
    reader.page.locator("[data-scope-hint=operate]").wait_for()
    admin = page_for(lab.admin_token)
    admin.go(f"/node/{NODE}")
    admin.page.locator("#drain").wait_for()
    assert admin.page.locator("[data-scope-hint]").count() == 0
    admin.go("/webhooks")
    admin.page.locator("#wh-list").wait_for()
    assert admin.page.locator("[data-scope-hint]").count() == 0


def test_audit_data_reads_as_words(page_for: Any, lab: LiveService) -> None:
    p = page_for(lab.read_token)
    p.go("/audit")
    p.page.locator("[data-audit-data]").first.wait_for()
    text = p.page.locator("#audit-list").inner_text()
    assert "{" not in text and '"' not in text, text[:500]
    assert not p.errors, p.errors
