from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings

INGEST = {"Authorization": "Bearer ingest-token-0123456789"}
READ = {"Authorization": "Bearer read-token-0123456789"}


def make_settings(database_url: str, tmp_path: Path, **overrides) -> Settings:  # type: ignore[no-untyped-def]
    overrides.setdefault("writer_process", False)  # a child per test is slow; live tests use it
    return Settings(
        database_url=database_url,
        data_dir=tmp_path,
        ingest_token=INGEST["Authorization"].split()[1],
        read_token=READ["Authorization"].split()[1],
        **overrides,
    )


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'api.db'}", tmp_path))
    with TestClient(app) as test_client:
        yield test_client
