"""Crash safety with real processes: SIGKILL the service during heavy ingest, restart it, and
every sample whose batch was acknowledged is in the store (SQLite and PostgreSQL)."""

from __future__ import annotations

import gzip
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import orjson
import pytest

from forewarn.wire import sample_columns
from store import Store
from tests.conftest import reset_postgres, start_service
from tests.factories import sample_dict

pytestmark = pytest.mark.slow

START = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)


def _body(node: str, second: int) -> bytes:
    rows = [
        sample_dict(node, g, START + timedelta(seconds=second + t))
        for t in range(5)
        for g in range(8)
    ]
    return gzip.compress(orjson.dumps({"node": node, "sample_columns": sample_columns(rows, node)}))


def _ingest_until_killed(
    url: str, token: str, node: str, acked: list[tuple[str, int]], killed: threading.Event
) -> None:
    headers = {"Authorization": f"Bearer {token}", "Content-Encoding": "gzip"}
    with httpx.Client(timeout=60) as http:
        for second in range(0, 100_000, 5):
            if killed.is_set():
                return
            try:
                r = http.post(f"{url}/v1/ingest", content=_body(node, second), headers=headers)
            except httpx.HTTPError:
                continue  # slow or gone: the main thread decides when to stop
            if r.status_code == 200:
                acked.append((node, second))


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sigkill_during_ingest_loses_no_acknowledged_sample(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'crash.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
        reset_postgres(url)
    service = start_service(url, tmp_path / "service.log", timeout_s=120)
    acked: list[tuple[str, int]] = []
    killed = threading.Event()
    writers = [
        threading.Thread(
            target=_ingest_until_killed,
            args=(service.url, service.ingest_token, f"n{i}", acked, killed),
        )
        for i in range(3)
    ]
    for w in writers:
        w.start()
    deadline = time.monotonic() + 240
    while len(acked) < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    service.process.kill()  # SIGKILL: no shutdown, no flush, requests in flight
    service.process.wait(10)
    killed.set()
    for w in writers:
        w.join(90)
    assert len(acked) >= 60, service.log()
    acked = list(acked)

    restarted = start_service(url, tmp_path / "service2.log", timeout_s=120)
    try:
        r = httpx.get(f"{restarted.url}/readyz", timeout=10)
        assert r.status_code == 200
        store = Store.open(url, migrate=False)
        try:
            frame = store.fleet_window(since_ms=0, fields=["gpu"])
        finally:
            store.close()
        stored = set(zip(frame["node"], frame["gpu"], frame["ts_ms"], strict=True))
        start_ms = int(START.timestamp() * 1000)
        missing = [
            (node, second)
            for node, second in acked
            if any(
                (node, g, start_ms + (second + t) * 1000) not in stored
                for t in range(5)
                for g in range(8)
            )
        ]
        assert not missing, f"{len(missing)} acknowledged batches lost, e.g. {missing[:3]}"
        # And the restarted service takes the next batch.
        headers = {"Authorization": f"Bearer {restarted.ingest_token}", "Content-Encoding": "gzip"}
        again = httpx.post(
            f"{restarted.url}/v1/ingest", content=_body("n9", 0), headers=headers, timeout=10
        )
        assert again.status_code == 200
    finally:
        restarted.stop()
