"""``/v1/webhooks``: subscriptions, secrets, scopes, the guard at the door, deliveries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from store.outbox import EVENT_TYPES

ADMIN = {"Authorization": "Bearer admin-token-0123456789"}
READ = {"Authorization": "Bearer read-token-0123456789"}


def _client(database_url: str, tmp_path: Path, **overrides) -> TestClient:  # type: ignore[no-untyped-def]
    settings = Settings(
        database_url=database_url,
        data_dir=tmp_path,
        admin_token=ADMIN["Authorization"].split()[1],
        read_token=READ["Authorization"].split()[1],
        webhook_dispatch=False,
        **overrides,
    )
    return TestClient(create_app(settings))


@pytest.fixture
def client(database_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with _client(database_url, tmp_path, webhook_allow="127.0.0.1") as test_client:
        yield test_client


def test_subscription_lifecycle(client: TestClient) -> None:
    created = client.post(
        "/v1/webhooks",
        json={"url": "http://127.0.0.1:9/hook", "event_types": ["migration.requested"]},
        headers=ADMIN,
    )
    assert created.status_code == 201, created.text
    hook = created.json()
    assert hook["id"].startswith("wh_") and hook["secret"].startswith("whsec_")
    assert hook["enabled"] and hook["event_types"] == ["migration.requested"]

    listed = client.get("/v1/webhooks", headers=ADMIN).json()
    assert listed["count"] == 1 and "secret" not in listed["data"][0]
    got = client.get(f"/v1/webhooks/{hook['id']}", headers=ADMIN).json()
    assert "secret" not in got and got["url"] == "http://127.0.0.1:9/hook"

    patched = client.patch(
        f"/v1/webhooks/{hook['id']}",
        json={"event_types": ["*"], "enabled": False, "job_id": "job-1"},
        headers=ADMIN,
    ).json()
    assert patched["event_types"] == ["*"] and not patched["enabled"]
    assert patched["job_id"] == "job-1"

    rotated = client.post(f"/v1/webhooks/{hook['id']}/rotate-secret", headers=ADMIN).json()
    assert rotated["secret"] != hook["secret"] and rotated["previous_secret_until"]
    no_grace = client.post(
        f"/v1/webhooks/{hook['id']}/rotate-secret", json={"grace_s": 0}, headers=ADMIN
    ).json()
    assert no_grace["previous_secret_until"] is None

    queued = client.post(f"/v1/webhooks/{hook['id']}/test", headers=ADMIN)
    assert queued.status_code == 202 and queued.json()["event_id"].startswith("msg_")
    deliveries = client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=ADMIN).json()
    assert deliveries == {"data": [], "count": 0}  # the dispatcher is off in this app

    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=ADMIN).status_code == 204
    assert client.get(f"/v1/webhooks/{hook['id']}", headers=ADMIN).status_code == 404
    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=ADMIN).status_code == 404
    for path in ("", "/deliveries"):
        missing = client.get(f"/v1/webhooks/wh_nope{path}", headers=ADMIN)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_scopes_and_validation(client: TestClient) -> None:
    body = {"url": "http://127.0.0.1:9/"}
    assert client.post("/v1/webhooks", json=body).status_code == 401
    assert client.post("/v1/webhooks", json=body, headers=READ).status_code == 403
    assert client.get("/v1/webhooks", headers=READ).status_code == 403
    types = client.get("/v1/webhooks/event-types", headers=READ).json()
    assert {t["type"] for t in types["data"]} == set(EVENT_TYPES)
    bad = client.post(
        "/v1/webhooks",
        json={"url": "http://127.0.0.1:9/", "event_types": ["gpu.on_fire"]},
        headers=ADMIN,
    )
    assert bad.status_code == 422 and "unknown event types" in bad.text
    empty = client.post(
        "/v1/webhooks", json={"url": "http://127.0.0.1:9/", "event_types": []}, headers=ADMIN
    )
    assert empty.status_code == 422


def test_guard_refuses_at_the_door(client: TestClient) -> None:
    for url in ("http://169.254.169.254/latest", "http://10.0.0.1/", "file:///x"):
        refused = client.post("/v1/webhooks", json={"url": url}, headers=ADMIN)
        assert refused.status_code == 422
        assert refused.json()["error"]["code"] == "webhook_target_refused"
    hook = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/"}, headers=ADMIN).json()
    refused = client.patch(
        f"/v1/webhooks/{hook['id']}", json={"url": "http://192.168.1.1/"}, headers=ADMIN
    )
    assert refused.json()["error"]["code"] == "webhook_target_refused"


@pytest.mark.slow  # two apps start per backend
def test_loopback_needs_the_allow_list(database_url: str, tmp_path: Path) -> None:
    with _client(database_url, tmp_path) as strict:
        for url in ("http://127.0.0.1:9/", "http://169.254.169.254/"):
            refused = strict.post("/v1/webhooks", json={"url": url}, headers=ADMIN)
            assert refused.json()["error"]["code"] == "webhook_target_refused"
    with _client(database_url, tmp_path, webhook_allow="127.0.0.1,169.254.169.254") as open_:
        for url in ("http://127.0.0.1:9/", "http://169.254.169.254/"):
            assert open_.post("/v1/webhooks", json={"url": url}, headers=ADMIN).status_code == 201
