"""``GET /v1/dashboard/cells``: the fleet map's columns, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from api.state import app_state
from store import control as control_db

pytestmark = pytest.mark.timeout(60)

READ = {"Authorization": "Bearer dash-read-token-0123456789"}
INGEST = {"Authorization": "Bearer dash-ingest-token-0123456789"}


@pytest.fixture
def client(database_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database_url=database_url,
        data_dir=tmp_path,
        read_token=READ["Authorization"].split()[1],
        ingest_token=INGEST["Authorization"].split()[1],
        control_enabled=False,  # the test writes the scores itself
        webhook_dispatch=False,
        writer_process=False,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def ingest(client: TestClient, node: str, gpus: int, ts: float) -> None:
    samples = [{"node": node, "gpu": g, "ts": ts, "temp_gpu_c": 60.0} for g in range(gpus)]
    response = client.post("/v1/ingest", json={"node": node, "samples": samples}, headers=INGEST)
    assert response.status_code == 200, response.text


def score(client: TestClient, rows: list[dict[str, Any]]) -> None:
    store = app_state(client.app).store
    with store.begin() as connection:
        control_db.upsert_risk(connection, rows)


def risk_row(node: str, gpu: int, risk: float, **kw: Any) -> dict[str, Any]:
    now = int(time.time() * 1000)
    row = {
        "node": node,
        "gpu": gpu,
        "risk": risk,
        "alarm": False,
        "reasons": "[]",
        "scored_ms": now,
        "last_seen_ms": now,
        "stale": False,
        "streak": 0,
        "crossed": False,
        "crossed_ms": None,
        "failed": False,
    }
    row.update(kw)
    return row


def test_cells_are_parallel_columns_with_reasons_for_the_few(client: TestClient) -> None:
    now = time.time()
    ingest(client, "node-b", 2, now)
    ingest(client, "node-a", 3, now)
    ingest(client, "node-c", 1, now - 3600)  # an hour quiet: stale
    score(
        client,
        [
            risk_row("node-a", 1, 0.9, crossed=True, reasons='["ECC rising", "remap pending"]'),
            risk_row("node-b", 0, 0.1, reasons='["nothing much"]'),
            risk_row("node-b", 1, 0.02, failed=True),
        ],
    )
    assert client.get("/v1/dashboard/cells").status_code == 401
    body = client.get("/v1/dashboard/cells", headers=READ).json()
    assert body["count"] == 6
    assert body["nodes"] == ["node-a", "node-b", "node-c"]
    cols = ["node", "gpu", "last_seen_ms", "risk", "alarm", "stale", "failed"]
    assert all(len(body[c]) == 6 for c in cols)
    cells = [
        dict(zip(cols, row, strict=True)) for row in zip(*(body[c] for c in cols), strict=True)
    ]
    key = {(body["nodes"][c["node"]], c["gpu"]): c for c in cells}
    assert [(body["nodes"][c["node"]], c["gpu"]) for c in cells] == sorted(key)
    assert key[("node-a", 1)]["alarm"] is True and key[("node-a", 1)]["risk"] == 0.9
    assert key[("node-a", 0)]["risk"] is None  # not scored: unknown, not low
    assert key[("node-b", 1)]["failed"] is True
    assert key[("node-c", 0)]["stale"] is True and key[("node-a", 0)]["stale"] is False
    # reasons travel for the GPUs in alarm and the highest risks only, keyed by position
    reasons = {int(i): r for i, r in body["reasons"].items()}
    index = {k: i for i, k in enumerate(key)}
    assert reasons[index[("node-a", 1)]] == ["ECC rising", "remap pending"]
    assert index[("node-a", 0)] not in reasons


def test_a_dead_gpu_is_failed_and_one_that_came_back_is_recovered(client: TestClient) -> None:
    """After the demo's story the map called the GPU that died of a double-bit error "27 %,
    alarm, stale" and the one that came back "failed" (issue 32)."""
    now = time.time()
    ingest(client, "node-a", 3, now - 120)
    ingest(client, "node-a", 1, now - 10)  # only GPU 0 reports still
    dead = {"node": "node-a", "gpu": 1, "ts": now - 100, "kind": "xid", "xid": 48}
    lost = {"node": "node-a", "gpu": 0, "ts": now - 100, "kind": "gpu_lost"}
    r = client.post("/v1/ingest", json={"node": "node-a", "events": [dead, lost]}, headers=INGEST)
    assert r.status_code == 200, r.text
    score(
        client,
        [
            risk_row("node-a", 1, 0.272, crossed=True, stale=True, reasons='["ECC rising"]'),
            risk_row("node-a", 0, 0.01, failed=True),  # the loop's flag stays set
        ],
    )
    body = client.get("/v1/dashboard/cells", headers=READ).json()
    cols = ["gpu", "alarm", "stale", "failed", "recovered"]
    rows = zip(*(body[c] for c in cols), strict=True)
    by_gpu = {row[0]: dict(zip(cols, row, strict=True)) for row in rows}
    assert by_gpu[1] == {"gpu": 1, "alarm": False, "stale": False, "failed": True,
                         "recovered": False}  # fmt: skip
    assert by_gpu[0]["failed"] is False and by_gpu[0]["recovered"] is True
    assert by_gpu[2]["failed"] is False and by_gpu[2]["recovered"] is False
    reasons = {int(i): r for i, r in body["reasons"].items()}
    assert reasons[1] == ["failed: Xid 48"]
    assert reasons[0] == ["recovered: reporting again after gpu lost"]
    # the GPU page reads the same from /v1/gpus
    gpus = {g["gpu"]: g for g in client.get("/v1/gpus?node=node-a", headers=READ).json()["data"]}
    assert (gpus[1]["failed"], gpus[1]["recovered"]) == (True, False)
    assert gpus[1]["failure"]["cause"] == "Xid 48"
    assert (gpus[0]["failed"], gpus[0]["recovered"]) == (False, True)
    assert gpus[2]["failure"] is None


def test_the_risk_routes_say_failed_and_recovered_as_the_map_does(client: TestClient) -> None:
    """``/v1/risk`` kept the loop's ``failed`` flag for a GPU that came back (issue 32)."""
    now = time.time()
    ingest(client, "node-a", 2, now - 120)
    ingest(client, "node-a", 1, now - 10)  # GPU 0 reports again; GPU 1 went quiet
    lost = {"node": "node-a", "gpu": 0, "ts": now - 100, "kind": "gpu_lost"}
    dead = {"node": "node-a", "gpu": 1, "ts": now - 100, "kind": "xid", "xid": 48}
    r = client.post("/v1/ingest", json={"node": "node-a", "events": [lost, dead]}, headers=INGEST)
    assert r.status_code == 200, r.text
    score(client, [risk_row("node-a", g, 0.01, failed=True) for g in (0, 1)])
    risks = {x["gpu"]: x for x in client.get("/v1/risk", headers=READ).json()["data"]}
    assert (risks[0]["failed"], risks[0]["recovered"]) == (False, True)
    assert (risks[1]["failed"], risks[1]["recovered"]) == (True, False)
    latest = client.get("/v1/gpus/node-a/0/risk", headers=READ).json()["latest"]
    assert (latest["failed"], latest["recovered"]) == (False, True)
    gpus = {g["gpu"]: g for g in client.get("/v1/gpus", headers=READ).json()["data"]}
    assert [gpus[g]["failed"] for g in (0, 1)] == [False, True]
