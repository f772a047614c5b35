"""Stored API tokens: created once, kept hashed, scoped, listed without secrets, revoked."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.app import create_app
from api.settings import Settings
from api.state import app_state
from store import Store

ADMIN = {"Authorization": "Bearer admin-token-0123456789"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'tokens.db'}",
        data_dir=tmp_path,
        admin_token="admin-token-0123456789",
        writer_process=False,
        control_enabled=False,
        webhook_dispatch=False,
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_a_created_token_works_for_its_scope_until_revoked(client: TestClient) -> None:
    r = client.post("/v1/tokens", json={"name": "readers", "scopes": ["read"]}, headers=ADMIN)
    assert r.status_code == 201, r.text
    created = r.json()
    secret = created["token"]
    assert secret.startswith("fw_") and len(secret) > 40 and created["scopes"] == ["read"]
    bearer = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/nodes", headers=bearer).status_code == 200
    assert client.post("/v1/ingest", json={"node": "n"}, headers=bearer).status_code == 403
    assert client.get("/v1/tokens", headers=bearer).status_code == 403

    listed = client.get("/v1/tokens", headers=ADMIN).json()
    assert listed["count"] == 1 and "token" not in listed["data"][0]
    store: Store = app_state(client.app).store
    with store.engine.connect() as connection:
        stored = connection.execute(text("SELECT * FROM api_tokens")).mappings().one()
    assert secret not in str(dict(stored)) and len(stored["secret_sha256"]) == 64

    assert client.delete(f"/v1/tokens/{created['id']}", headers=ADMIN).status_code == 204
    assert client.get("/v1/nodes", headers=bearer).status_code == 401
    assert client.delete("/v1/tokens/tok_nope", headers=ADMIN).status_code == 404
    revoked = client.get("/v1/tokens", headers=ADMIN).json()["data"][0]
    assert revoked["revoked_at"] is not None


def test_admin_implies_every_scope_and_bad_requests_are_refused(client: TestClient) -> None:
    r = client.post("/v1/tokens", json={"name": "ops", "scopes": ["admin"]}, headers=ADMIN)
    bearer = {"Authorization": f"Bearer {r.json()['token']}"}
    assert client.get("/v1/nodes", headers=bearer).status_code == 200
    assert client.get("/v1/tokens", headers=bearer).status_code == 200
    for body in (
        {"name": "x", "scopes": []},
        {"name": "x", "scopes": ["root"]},
        {"scopes": ["read"]},
    ):
        assert client.post("/v1/tokens", json=body, headers=ADMIN).status_code == 422


def test_the_token_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOREWARN_")}

    def token(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "forewarn", "token", "--database-url", url, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    created = token("create", "--name", "collectors", "--scope", "ingest")
    assert created.returncode == 0, created.stderr
    token_id = created.stdout.split()[1]
    secret = created.stdout.strip().splitlines()[-1]
    listed = token("list")
    assert token_id in listed.stdout and "collectors" in listed.stdout
    assert secret not in listed.stdout
    assert token("create", "--name", "x", "--scope", "root").returncode == 2
    assert token("revoke", token_id).returncode == 0
    assert token_id not in token("list").stdout and token_id in token("list", "--all").stdout
    assert token("revoke", "tok_missing").returncode == 1
