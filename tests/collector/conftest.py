"""Shared pieces of the collector tests: a real service process and small helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveService, start_service


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LiveService]:
    svc = start_service(f"sqlite:///{tmp_path}/forewarn.db", tmp_path / "service.log")
    yield svc
    svc.stop()


def stored_samples(svc: LiveService, node: str, gpu: int) -> list[dict]:
    """Every stored sample of one GPU, oldest first (GET /v1/gpus/{node}/{gpu}/samples)."""
    r = httpx.get(
        f"{svc.url}/v1/gpus/{node}/{gpu}/samples",
        headers={"Authorization": f"Bearer {svc.read_token}"},
        params={"since": "2000-01-01T00:00:00Z", "limit": 100000},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["data"]
