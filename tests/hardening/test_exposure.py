"""What the service gives away without a token, and to whom the development token answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.core import GaugeMetricFamily

from api.app import create_app
from api.settings import DEV_TOKEN
from api.state import app_state
from tests.api.conftest import INGEST, READ, make_settings
from tests.conftest import free_port


class _GpuRisks:
    """Per-GPU series as the control loop exports them (``forewarn_gpu_risk{node,gpu}``)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("forewarn_gpu_risk", "risk", labels=["node", "gpu"])
        for i in range(5):
            family.add_metric([f"secret-node-{i}", "0"], i / 10)
        yield family


def _client(tmp_path: Path, **overrides: Any) -> TestClient:
    app = create_app(
        make_settings(f"sqlite:///{tmp_path / 'api.db'}", tmp_path, control_enabled=False,
                      metrics_max_gpu_series=2, **overrides)
    )  # fmt: skip
    app_state(app).metrics.registry.register(_GpuRisks())
    return TestClient(app)


def test_metrics_without_a_token_name_no_node_and_no_risk(tmp_path: Path) -> None:
    with _client(tmp_path) as client:
        open_answer = client.get("/metrics")
        assert open_answer.status_code == 200
        assert "forewarn_http_request_duration_seconds" in open_answer.text
        assert "secret-node" not in open_answer.text and "forewarn_gpu_risk" not in open_answer.text
        read = client.get("/metrics", headers=READ)
        assert read.status_code == 200
        shown = [line for line in read.text.splitlines() if line.startswith("forewarn_gpu_risk{")]
        assert len(shown) == 2  # bounded: the two highest risks
        assert all("secret-node-4" in s or "secret-node-3" in s for s in shown)
        assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_metrics_can_require_a_token(tmp_path: Path) -> None:
    with _client(tmp_path, metrics_require_token=True) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=INGEST).status_code == 403
        assert "secret-node-4" in client.get("/metrics", headers=READ).text


@pytest.fixture
def public_service(tmp_path: Path) -> Iterator[str]:
    """``forewarn serve --host 0.0.0.0`` on a database that holds one stored token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOREWARN_")}
    env["FOREWARN_DATA_DIR"] = str(tmp_path)
    created = subprocess.run(
        [sys.executable, "-m", "forewarn", "token", "create", "--name", "ops", "--scope", "read"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    secret = created.stdout.strip().splitlines()[-1]
    port = free_port()
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "forewarn", "serve", "--host", "0.0.0.0", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the service did not become ready"
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield f"{url}|{secret}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_public_service_never_accepts_the_development_token(public_service: str) -> None:
    url, secret = public_service.split("|")
    dev = {"Authorization": f"Bearer {DEV_TOKEN}"}
    assert httpx.get(f"{url}/v1/jobs", headers=dev).status_code == 401
    spoofed = {**dev, "X-Forwarded-For": "127.0.0.1", "Forwarded": "for=127.0.0.1"}
    assert httpx.get(f"{url}/v1/jobs", headers=spoofed).status_code == 401
    assert httpx.put(f"{url}/v1/policy", headers=spoofed, json={}).status_code == 401
    stored = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{url}/v1/jobs", headers=stored).status_code == 200
