"""Operator actions in a real browser: drain and undrain, manual migrations, the timeline.

Jobs are registered through the API as a job agent would (``POST /v1/jobs``); nothing acts on
the migration commands, so a requested migration stays ``requested``: what is tested is that
it reaches the operator's timeline within seconds, and that actions need the ``operate`` scope.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.conftest import LiveService
from tests.dashboard.conftest import OPERATE_TOKEN, SimFeed
from tests.dashboard.test_pages import wait_cells, wait_js

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

DRAIN_NODE = "sim-node-0000"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def register(service: LiveService, job: str, node: str) -> None:
    placement = [
        {"rank": 0, "node": node, "gpu": 0, "role": "active"},
        {"rank": 1, "node": node, "gpu": 1, "role": "active"},
        {"rank": 2, "node": node, "gpu": 2, "role": "spare"},
    ]
    body = {"job_id": job, "world_size": 2, "spares": 1, "placement": placement}
    response = httpx.post(f"{service.url}/v1/jobs", json=body, headers=auth(OPERATE_TOKEN))
    assert response.status_code == 201, response.text


@pytest.fixture(scope="module")
def jobs(service: LiveService, feed: SimFeed) -> Iterator[list[str]]:
    register(service, "job-api", "sim-node-0002")
    register(service, "job-ui", "sim-node-0003")
    yield ["job-api", "job-ui"]


def test_drain_needs_the_operate_scope(make_page: Any, service: LiveService, feed: SimFeed) -> None:
    p = make_page(service.read_token)
    p.go(f"/node/{DRAIN_NODE}")
    p.page.click("#drain")
    p.page.click("#confirm-ok")
    refused = p.page.locator("[data-result='refused']")
    refused.wait_for()
    assert "operate" in refused.inner_text()
    assert p.page.inner_text("#node-state") == "in service"
    drains = httpx.get(f"{service.url}/v1/drains", headers=auth(service.read_token)).json()
    assert DRAIN_NODE not in {d["node"] for d in drains["data"] if d["drained"]}
    # the refusal is the browser's log of the 403 answer, nothing else
    assert [e for e in p.errors if "403" not in e] == []
    p.shot("drain-refused")


def test_drain_and_undrain_with_the_operate_scope(
    make_page: Any, service: LiveService, feed: SimFeed
) -> None:
    p = make_page(OPERATE_TOKEN)
    p.go(f"/node/{DRAIN_NODE}")
    p.page.click("#drain")
    assert p.page.is_visible("#confirm-dialog")
    p.page.click("#confirm-cancel")  # cancelling does nothing
    assert p.page.inner_text("#node-state") == "in service"
    p.page.click("#drain")
    p.page.click("#confirm-ok")
    p.page.locator("[data-result='drain']").wait_for()
    wait_js(p.page, "document.getElementById('node-state').textContent === 'drained'")
    p.shot("node-drained")
    p.go("/?state=drained")
    wait_cells(p.page, 8)
    assert "drained nodes 1" in " ".join(p.page.inner_text("#fleet-summary").split())
    p.go(f"/node/{DRAIN_NODE}")
    p.page.click("#undrain")
    p.page.click("#confirm-ok")
    p.page.locator("[data-result='undrain']").wait_for()
    wait_js(p.page, "document.getElementById('node-state').textContent === 'in service'")
    assert p.errors == []


def test_a_requested_migration_reaches_the_timeline(
    make_page: Any, service: LiveService, jobs: list[str]
) -> None:
    p = make_page(service.read_token)
    p.go("/migrations")
    wait_js(p.page, "document.getElementById('live').textContent.startsWith('live')")
    response = httpx.post(
        f"{service.url}/v1/migrations",
        json={"job_id": "job-api", "rank": 1},
        headers=auth(OPERATE_TOKEN),
    )
    assert response.status_code in (200, 201), response.text
    migration = response.json()["id"]
    lane = p.page.locator(f"[data-migration='{migration}']")
    lane.wait_for(timeout=10_000)  # within a few polls of the open page, no reload
    assert "job-api/1" in lane.inner_text()
    row = p.page.locator(f"[data-migration-row='{migration}']")
    assert "manual" in row.inner_text()
    row.get_by_role("link", name="audit").click()
    p.page.wait_for_url(f"**/#/audit?migration={migration}")
    p.page.locator("[data-audit]").first.wait_for()
    p.shot("migrations")
    assert p.errors == []


def test_manual_migration_from_the_job_page(
    make_page: Any, service: LiveService, jobs: list[str]
) -> None:
    refused = make_page(service.read_token)
    refused.go("/jobs/job-ui")
    refused.page.click("[data-migrate='0']")
    refused.page.click("#confirm-ok")
    assert "operate" in refused.page.locator("[data-result='refused']").inner_text()

    p = make_page(OPERATE_TOKEN)
    p.go("/jobs")
    p.page.get_by_role("link", name="job-ui").click()
    p.page.locator("[data-migrate='0']").wait_for()
    assert "spare" in p.page.inner_text("#job-ranks")
    p.page.click("[data-migrate='0']")
    p.page.click("#confirm-ok")
    done = p.page.locator("[data-result='migration']")
    done.wait_for()
    done.get_by_role("link").click()
    p.page.locator(".lane", has_text="job-ui/0").wait_for(timeout=10_000)
    p.shot("jobs")
    assert p.errors == []


class _Accept(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Accept)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_webhooks_show_subscriptions_and_deliveries(
    make_page: Any, service: LiveService, feed: SimFeed, receiver: str
) -> None:
    admin = auth(service.admin_token)
    body = {"url": receiver, "event_types": ["*"], "description": "pager"}
    created = httpx.post(f"{service.url}/v1/webhooks", json=body, headers=admin)
    assert created.status_code in (200, 201), created.text
    hook = created.json()["id"]
    queued = httpx.post(f"{service.url}/v1/webhooks/{hook}/test", headers=admin)
    assert queued.status_code in (200, 201, 202), queued.text

    p = make_page(service.admin_token)
    p.go("/webhooks")
    p.page.locator(f"[data-sub='{hook}']").wait_for()
    assert receiver in p.page.inner_text("#wh-list")
    delivered = p.page.locator("[data-delivery]", has_text="succeeded")
    delivered.first.wait_for(timeout=20_000)
    assert "204" in delivered.first.inner_text()
    p.shot("webhooks")
    assert p.errors == []

    refused = make_page(service.read_token)
    refused.go("/webhooks")
    refused.page.locator(".note.refused").wait_for()
    assert "admin" in refused.page.inner_text(".note.refused")
