"""``GET /v1/risk`` a page at a time, and the fleet's risk read once per control tick.

Two replicas of the service (two apps on one database, as two processes would be) read the
scores a tick writes; between ticks their readers are served from memory (no statement on
``risk_latest`` or ``events``), and the next tick's scores are seen at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, event

from api.app import create_app
from api.state import app_state
from api.tickcache import TickCache
from store import control as control_db
from tests.api.conftest import INGEST, READ, make_settings

pytestmark = pytest.mark.timeout(60)


def replica(database_url: str, tmp_path: Path) -> TestClient:
    settings = make_settings(
        database_url,
        tmp_path,
        control_enabled=False,  # the test writes each tick's scores itself
        control_tick_s=3600.0,  # no expiry by age here: only a new tick moves the cache
        webhook_dispatch=False,
    )
    return TestClient(create_app(settings))


@pytest.fixture
def replicas(database_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, TestClient]]:
    with replica(database_url, tmp_path / "a") as a, replica(database_url, tmp_path / "b") as b:
        yield a, b


def tick(client: TestClient, risks: dict[tuple[str, int], float], crossed: set[Any]) -> None:
    """What a control tick writes: the scores, in one transaction."""
    now = int(time.time() * 1000)
    rows = [
        {
            "node": node,
            "gpu": gpu,
            "risk": risk,
            "alarm": risk >= 0.5,
            "reasons": '["ECC rising"]' if risk >= 0.5 else "[]",
            "scored_ms": now,
            "last_seen_ms": now,
            "stale": False,
            "streak": 3 if (node, gpu) in crossed else 0,
            "crossed": (node, gpu) in crossed,
            "crossed_ms": now if (node, gpu) in crossed else None,
            "failed": False,
        }
        for (node, gpu), risk in risks.items()
    ]
    with app_state(client.app).store.begin() as connection:  # type: ignore[union-attr]
        control_db.upsert_risk(connection, rows)


def fleet(client: TestClient, nodes: int = 3, gpus: int = 3) -> list[tuple[str, int]]:
    now = time.time()
    for n in range(nodes):
        node = f"node-{n}"
        samples = [{"node": node, "gpu": g, "ts": now, "temp_gpu_c": 60.0} for g in range(gpus)]
        r = client.post("/v1/ingest", json={"node": node, "samples": samples}, headers=INGEST)
        assert r.status_code == 200, r.text
    return [(f"node-{n}", g) for n in range(nodes) for g in range(gpus)]


def fleet_reads(client: TestClient) -> list[str]:
    """Every statement this replica sends that reads the scores or the events."""
    seen: list[str] = []
    engine = app_state(client.app).store.engine  # type: ignore[union-attr]

    @event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "risk_latest" in statement or "FROM events" in statement:
            seen.append(statement)

    return seen


def pages(client: TestClient, query: str) -> list[list[dict[str, Any]]]:
    out, cursor = [], None
    while True:
        url = f"/v1/risk?{query}" + (f"&cursor={cursor}" if cursor else "")
        body = client.get(url, headers=READ).json()
        assert body["count"] == len(body["data"])
        out.append(body["data"])
        cursor = body["next"]
        if cursor is None:
            return out


def test_risk_pages_with_a_cursor_and_filters(
    replicas: tuple[TestClient, TestClient],
) -> None:
    a, _ = replicas
    keys = fleet(a)
    risks = {k: 0.9 if k[1] == 1 else 0.1 for k in keys}  # GPU 1 of each node in alarm
    tick(a, risks, crossed={("node-2", 1)})
    got = pages(a, "limit=4")
    assert [len(p) for p in got] == [4, 4, 1]
    assert [(r["node"], r["gpu"]) for p in got for r in p] == sorted(keys)
    assert a.get("/v1/risk", headers=READ).json()["count"] == 9  # one default page
    alarmed = [(r["node"], r["gpu"]) for p in pages(a, "alarm=true&limit=2") for r in p]
    assert alarmed == [("node-0", 1), ("node-1", 1), ("node-2", 1)]
    crossed = a.get("/v1/risk?crossed=true", headers=READ).json()
    assert [(r["node"], r["gpu"], r["reasons"]) for r in crossed["data"]] == [
        ("node-2", 1, ["ECC rising"])
    ]
    quiet = pages(a, "node=node-1&alarm=false&limit=1")
    assert [(r["node"], r["gpu"]) for p in quiet for r in p] == [("node-1", 0), ("node-1", 2)]
    for bad in ("limit=0", "limit=10001", "cursor=nope", "cursor=WyJhIiwiYiJd", "alarm=maybe"):
        r = a.get(f"/v1/risk?{bad}", headers=READ)
        assert 400 <= r.status_code < 500, (bad, r.status_code)


def test_readers_between_ticks_read_from_memory_and_see_the_next_tick(
    replicas: tuple[TestClient, TestClient],
) -> None:
    a, b = replicas
    keys = fleet(a)
    tick(a, dict.fromkeys(keys, 0.1), crossed=set())
    reads = [fleet_reads(a), fleet_reads(b)]
    for client in (a, b):  # the first reader of each replica reads the fleet once
        assert client.get("/v1/risk", headers=READ).json()["data"][0]["risk"] == 0.1
        assert client.get("/v1/dashboard/cells", headers=READ).status_code == 200
    first = [len(r) for r in reads]
    assert all(first)
    for _ in range(3):  # every other reader until the next tick: served from memory
        for client in (a, b):
            assert client.get("/v1/risk?limit=2", headers=READ).json()["next"] is not None
            assert client.get("/v1/risk?alarm=true", headers=READ).json()["count"] == 0
            assert client.get("/v1/dashboard/cells", headers=READ).json()["count"] == 9
            gpus = client.get("/v1/gpus", headers=READ).json()["data"]
            assert {g["risk"] for g in gpus} == {0.1}
            history = client.get("/v1/gpus/node-0/1/risk", headers=READ).json()
            assert history["latest"]["risk"] == 0.1
    assert [len(r) for r in reads] == first
    tick(a, {("node-0", 1): 0.9}, crossed={("node-0", 1)})  # the next tick lands
    for client in (b, a):
        latest = client.get("/v1/risk?crossed=true", headers=READ).json()["data"]
        assert [(r["node"], r["gpu"], r["risk"]) for r in latest] == [("node-0", 1, 0.9)]
        cells = client.get("/v1/dashboard/cells", headers=READ).json()
        assert max(r for r in cells["risk"] if r is not None) == 0.9
        gpu = client.get("/v1/gpus?node=node-0", headers=READ).json()["data"][1]
        assert (gpu["risk"], gpu["alarm"]) == (0.9, True)
    assert all(len(r) > n for r, n in zip(reads, first, strict=True))


def test_a_product_is_read_again_when_older_than_its_age(tmp_path: Path) -> None:
    """With no tick (no control loop), a product lasts ``max_age_s``, then is read again."""
    engine = create_engine(f"sqlite:///{tmp_path / 'c.db'}")
    control_db.control_state.create(engine)
    now = [0.0]
    cache = TickCache(clock=lambda: now[0])
    made: list[int] = []

    def read(connection: Any) -> int:
        made.append(1)
        return len(made)

    assert cache.get(engine, "x", read, max_age_s=5.0) == 1
    now[0] = 4.9
    assert cache.get(engine, "x", read, max_age_s=5.0) == 1
    now[0] = 5.0
    assert cache.get(engine, "x", read, max_age_s=5.0) == 2
    with engine.begin() as connection:  # a tick: the version moves
        control_db.upsert_risk(connection, [])
    assert cache.get(engine, "x", read, max_age_s=5.0) == 3
    assert cache.reads == 3
    engine.dispose()
