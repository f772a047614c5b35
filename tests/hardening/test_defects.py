"""Defects found by probing the service as an outsider would, each pinned by a test."""

from __future__ import annotations

import gzip
import json
import resource
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from api.app import create_app
from api.state import app_state
from forewarn.wire import GpuSample, sample_columns
from store import Store
from store.engine import make_engine
from store.writes import sample_row
from tests.api.conftest import INGEST, READ, make_settings
from tests.factories import sample_dict

NOW = datetime.now(UTC).replace(microsecond=0)


def rows(n: int, node: str = "node-0", gpu: int = 0) -> list[dict]:
    return [sample_dict(node, gpu, NOW - timedelta(seconds=n - i)) for i in range(n)]


def post(client: TestClient, body: object, **headers: str):  # type: ignore[no-untyped-def]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(
        "/v1/ingest",
        content=content,
        headers={"content-type": "application/json", **INGEST, **headers},
    )


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'api.db'}", tmp_path))
    with TestClient(app) as test_client:
        yield test_client


# Counters ---------------------------------------------------------------------------------


def test_a_counter_near_2_63_is_refused_at_ingest(client: TestClient) -> None:
    bad = rows(3)
    bad[1]["throttle_reasons"] = 2**63 - 1
    r = post(client, {"node": "node-0", "samples": bad})
    assert r.status_code == 422
    (rejected,) = r.json()["result"]["rejected"]
    assert rejected["index"] == 1 and "throttle_reasons" in rejected["reason"]


def test_a_stored_counter_near_2_63_reads_back_exactly(client: TestClient) -> None:
    store: Store = app_state(client.app).store
    first = sample_row(GpuSample.model_validate(sample_dict("node-0", 0, NOW)))
    at = 5 + list(GpuSample.model_fields)[5:].index("throttle_reasons")
    huge = (*first[:at], 2**63 - 1, *first[at + 1 :])
    other = sample_row(
        GpuSample.model_validate(sample_dict("node-0", 1, NOW, throttle_reasons=None))
    )
    store.write(samples=[huge, other])  # as if stored before ingest bounded it
    r = client.get("/v1/gpus", headers=READ)
    assert r.status_code == 200
    by_gpu = {g["gpu"]: g for g in r.json()["data"]}
    assert by_gpu[0]["throttle_reasons"] == 2**63 - 1
    assert by_gpu[1]["throttle_reasons"] is None


# Query parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"until": "0001-01-01T00:30:00Z"},
        {"since": "2026-01-01T00:00:00"},  # naive: ingest refuses these too
        {"until": "2026-01-01T00:00:00"},
        {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
    ],
)
def test_bad_sample_windows_are_422(client: TestClient, params: dict) -> None:
    assert post(client, {"node": "node-0", "samples": rows(2)}).status_code == 200
    r = client.get("/v1/gpus/node-0/0/samples", params=params, headers=READ)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_input"


@pytest.mark.parametrize(
    "params",
    [
        {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
        {"since": "2026-01-01T00:00:00"},
    ],
)
def test_bad_event_windows_are_422(client: TestClient, params: dict) -> None:
    r = client.get("/v1/events", params=params, headers=READ)
    assert r.status_code == 422, r.text


# The database refusing or locked ------------------------------------------------------------


def test_a_database_that_refuses_connections_gives_503_and_readyz_tells_nothing(
    tmp_path: Path,
) -> None:
    down = Store(make_engine("postgresql+psycopg://forewarn@127.0.0.1:1/forewarn"))
    settings = make_settings("postgresql+psycopg://forewarn@127.0.0.1:1/forewarn", tmp_path)
    app = create_app(settings.model_copy(update={"webhook_dispatch": False}), store=down)
    try:
        with TestClient(app) as client:
            for r in (
                client.get("/v1/gpus", headers=READ),
                client.get("/v1/nodes", headers=READ),
                post(client, {"node": "node-0", "samples": rows(2)}),
            ):
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "store_unavailable"
                assert r.json()["error"]["retryable"] is True
                assert int(r.headers["retry-after"]) > 0
                assert "127.0.0.1" not in r.text
            ready = client.get("/readyz")
            assert ready.status_code == 503
            for secret in ("127.0.0.1", "5432", ":1", "psycopg", "forewarn@", "refused"):
                assert secret not in ready.text
    finally:
        down.close()


def test_a_locked_sqlite_database_gives_503(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    Store.open(url).close()
    engine = make_engine(url)
    # A short busy timeout keeps the test short; the service's own is 10 s.
    event.listen(engine, "connect", lambda c, _: c.execute("PRAGMA busy_timeout=200"))
    store = Store(engine)
    holder = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)
    try:
        app = create_app(make_settings(url, tmp_path), store=store)
        with TestClient(app) as client:
            holder.execute("BEGIN IMMEDIATE")  # another process writing, and not finishing
            r = post(client, {"node": "node-0", "samples": rows(2)})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable"
            assert "retry-after" in r.headers
            holder.execute("ROLLBACK")
            assert post(client, {"node": "node-0", "samples": rows(2)}).status_code == 200
    finally:
        holder.close()
        store.close()


# Content-Encoding -------------------------------------------------------------------------


def test_content_encodings(client: TestClient) -> None:
    body = json.dumps({"node": "node-0", "samples": rows(4)}).encode()
    assert post(client, body, **{"content-encoding": "br"}).status_code == 415
    assert post(client, body, **{"content-encoding": "gzip, br"}).status_code == 415
    half = len(body) // 2
    members = gzip.compress(body[:half]) + gzip.compress(body[half:])
    r = post(client, members, **{"content-encoding": "gzip"})
    assert r.status_code == 200, r.text
    junk = post(client, gzip.compress(body) + b"junk", **{"content-encoding": "gzip"})
    assert junk.status_code == 422
    assert junk.json()["error"]["code"] == "bad_encoding"
    truncated = post(client, gzip.compress(body)[:-12], **{"content-encoding": "gzip"})
    assert truncated.status_code == 422


# Memory and the event loop ------------------------------------------------------------------


def test_a_body_of_millions_of_tiny_objects_is_refused_before_parsing(client: TestClient) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    body = b'{"node": "node-0", "samples": [' + b"{}," * 9_000_000 + b"{}]}"
    r = post(client, body)
    assert r.status_code == 413
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 400  # the body itself is 27 MB; parsing it would take gigabytes


# Fleet size, pagination, names ----------------------------------------------------------------


def test_a_token_cannot_grow_the_fleet_without_bound(tmp_path: Path) -> None:
    settings = make_settings(f"sqlite:///{tmp_path / 'cap.db'}", tmp_path, max_fleet_gpus=3)
    with TestClient(create_app(settings)) as client:
        for n in range(3):
            assert post(client, {"node": f"n{n}", "samples": rows(1, f"n{n}")}).status_code == 200
        r = post(client, {"node": "n3", "samples": rows(1, "n3")})
        assert r.status_code == 422 and r.json()["error"]["code"] == "fleet_limit"
        assert post(client, {"node": "n0", "samples": rows(2, "n0")}).status_code == 200
        assert client.get("/v1/gpus", headers=READ).json()["count"] == 3


def test_a_batch_refused_with_503_and_sent_again_is_charged_to_its_token_once(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'charged.db'}"
    Store.open(url).close()
    engine = make_engine(url)
    event.listen(engine, "connect", lambda c, _: c.execute("PRAGMA busy_timeout=200"))
    store = Store(engine)
    holder = sqlite3.connect(tmp_path / "charged.db", isolation_level=None)
    two_gpus = {"node": "n0", "samples": rows(1, "n0", 0) + rows(1, "n0", 1)}
    try:
        app = create_app(make_settings(url, tmp_path, max_gpus_per_token=3), store=store)
        with TestClient(app) as client:
            assert post(client, {"node": "n9", "samples": rows(1, "n9")}).status_code == 200
            holder.execute("BEGIN IMMEDIATE")
            assert post(client, two_gpus).status_code == 503
            holder.execute("ROLLBACK")
            r = post(client, two_gpus)  # the collector sends the batch again
            assert r.status_code == 200, r.text
            third = post(client, {"node": "n0", "samples": rows(1, "n0", 2)})
            assert third.status_code == 422 and third.json()["error"]["code"] == "fleet_limit"
    finally:
        holder.close()
        store.close()


def test_a_fleet_coming_up_is_not_counted_in_the_database_for_every_batch(
    database_url: str, tmp_path: Path
) -> None:
    """Every batch of a fleet that starts reporting brings new GPUs; away from the caps they
    are decided on counts at most a second old (fleetcaps.CapCounts), not two table counts a
    batch (quadratic in the fleet: 6-7 s of ingest p99 at 16,384 GPUs on PostgreSQL)."""
    import time

    from api.fleetcaps import CAP_COUNTS_FRESH_S

    store = Store.open(database_url)
    counts: list[str] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "count(" in statement.lower():
            counts.append(statement)

    try:
        with TestClient(create_app(make_settings(database_url, tmp_path), store=store)) as client:
            started = time.monotonic()
            for n in range(40):
                assert (
                    post(client, {"node": f"n{n}", "samples": rows(1, f"n{n}")}).status_code == 200
                )
            elapsed = time.monotonic() - started
            assert client.get("/v1/gpus", headers=READ).json()["count"] == 40
        rounds = 1 + int(elapsed / CAP_COUNTS_FRESH_S) + 1
        assert len(counts) <= 2 * rounds, f"{len(counts)} counts for 40 batches in {elapsed:.1f} s"
    finally:
        store.close()


def test_a_token_sprayed_over_two_replicas_passes_the_cap_by_at_most_a_margin(
    database_url: str, tmp_path: Path
) -> None:
    """Each replica admits at most a margin's worth of GPUs on counts the other has not seen
    (fleetcaps.CapCounts), so a token sending new GPUs through both, as fast as it can, ends
    within one margin of the cap."""
    from api.fleetcaps import margin

    cap = 1000
    settings = make_settings(database_url, tmp_path, max_gpus_per_token=cap)
    with (
        TestClient(create_app(settings)) as first,
        TestClient(create_app(settings)) as second,
    ):
        refused = 0
        for n in range(80):  # 32 new GPUs a batch, 2,560 offered
            client = first if n % 2 else second
            body = {"node": f"n{n}", "samples": [r for g in range(32) for r in rows(1, f"n{n}", g)]}
            r = post(client, body)
            assert r.status_code in (200, 422), r.text
            refused += r.status_code == 422
        stored = first.get("/v1/gpus", headers=READ).json()["count"]
    assert refused and cap - 32 < stored <= cap + margin(cap), stored


def test_the_per_token_gpu_cap_holds_across_replicas(database_url: str, tmp_path: Path) -> None:
    other = {"Authorization": "Bearer other-ingest-token-0123"}
    settings = make_settings(
        database_url,
        tmp_path,
        max_gpus_per_token=2,
        max_fleet_gpus=3,
        tokens={other["Authorization"].split()[1]: ["ingest"]},
    )
    with (
        TestClient(create_app(settings)) as first,
        TestClient(create_app(settings)) as second,
    ):
        two_gpus = {"node": "n0", "samples": rows(1, "n0", 0) + rows(1, "n0", 1)}
        assert post(first, two_gpus).status_code == 200
        assert post(second, two_gpus).status_code == 200  # known GPUs cost nothing
        r = post(second, {"node": "n1", "samples": rows(1, "n1")})
        assert r.status_code == 422 and "this token has added 2 GPUs" in r.text
        assert post(first, {"node": "n1", "samples": rows(1, "n1")}, **other).status_code == 200
        r = post(second, {"node": "n2", "samples": rows(1, "n2")}, **other)
        assert r.status_code == 422 and "the fleet holds 3 GPUs" in r.text


def test_gpus_and_nodes_come_a_page_at_a_time(client: TestClient) -> None:
    for n in range(3):
        for g in range(2):
            assert (
                post(client, {"node": f"n{n}", "samples": rows(1, f"n{n}", g)}).status_code == 200
            )
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 4, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/gpus", params=params, headers=READ).json()
        seen += [(g["node"], g["gpu"]) for g in page["data"]]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert pages == 2 and seen == [(f"n{n}", g) for n in range(3) for g in range(2)]
    whole = client.get("/v1/gpus", headers=READ).json()
    assert whole["count"] == 6 and whole["next"] is None  # one page: the old shape, plus next
    first = client.get("/v1/nodes", params={"limit": 2}, headers=READ).json()
    assert [n["node"] for n in first["data"]] == ["n0", "n1"]
    rest = client.get("/v1/nodes", params={"cursor": first["next"]}, headers=READ).json()
    assert [n["node"] for n in rest["data"]] == ["n2"] and rest["next"] is None
    bad = client.get("/v1/gpus", params={"cursor": "not-a-cursor"}, headers=READ)
    assert bad.status_code == 422


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_node_names_are_refused(client: TestClient, name: str) -> None:
    assert post(client, {"node": name, "samples": []}).status_code == 422
    r = post(client, {"node": "node-0", "samples": [sample_dict(name, 0, NOW)]})
    assert r.status_code == 422
    assert r.json()["result"]["rejected"][0]["index"] == 0


# Strict JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ecc_sbe_volatile", True),
        ("ecc_sbe_volatile", "7"),
        ("gpu", "0"),
        ("remap_pending", 1),
        ("temp_gpu_c", "55.0"),
        ("pcie_link_width", 16.0),
    ],
)
def test_no_coercion_into_numbers_or_flags(client: TestClient, field: str, value: object) -> None:
    good = rows(3)
    good[1][field] = value
    r = post(client, {"node": "node-0", "samples": good})
    assert r.status_code == 422, r.text
    (rejected,) = r.json()["result"]["rejected"]
    assert rejected["index"] == 1 and field in rejected["reason"]
    assert r.json()["result"]["stored_samples"] == 2
    # The same in the columns shape.
    columns = sample_columns(rows(3), "node-0")
    assert columns is not None
    columns[field][1] = value
    r = post(client, {"node": "node-0", "sample_columns": columns})
    assert r.status_code == 422, r.text
    assert [e["index"] for e in r.json()["result"]["rejected"]] == [1]


def test_a_repeated_key_is_refused(client: TestClient) -> None:
    first = json.dumps(rows(3))
    body = f'{{"node": "node-0", "samples": {first}, "samples": []}}'.encode()
    r = post(client, body)
    assert r.status_code == 422 and r.json()["error"]["code"] == "repeated_key"
    row = json.dumps(sample_dict("node-0", 0, NOW))[:-1] + ', "gpu": 1}'
    r = post(client, f'{{"node": "node-0", "samples": [{row}]}}'.encode())
    assert r.status_code == 422 and r.json()["error"]["code"] == "repeated_key"
    columns = json.dumps(sample_columns(rows(2), "node-0"))[:-1] + ', "gpu": [3, 4]}'
    r = post(client, f'{{"node": "node-0", "sample_columns": {columns}}}'.encode())
    assert r.status_code == 422 and r.json()["error"]["code"] == "repeated_key"
    assert client.get("/v1/gpus", headers=READ).json()["count"] == 0


# The command line and the docs --------------------------------------------------------------


def _serve(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("FOREWARN_")}
    environ.update({"FOREWARN_DATA_DIR": str(tmp_path), **env})
    return subprocess.run(
        [sys.executable, "-m", "forewarn", "serve", "--port", "1", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_refuses_a_public_address_without_tokens(tmp_path: Path) -> None:
    done = _serve(tmp_path, "--host", "0.0.0.0")
    assert done.returncode == 2
    assert "refusing to listen on 0.0.0.0" in done.stderr and "Traceback" not in done.stderr


def test_production_setting_errors_are_a_message_not_a_traceback(tmp_path: Path) -> None:
    done = _serve(tmp_path, FOREWARN_ENVIRONMENT="production", FOREWARN_ADMIN_TOKEN="short")
    assert done.returncode == 2
    assert "invalid settings" in done.stderr and "16 characters" in done.stderr
    assert "Traceback" not in done.stderr


def test_docs_are_served_from_the_app(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "/docs/assets/swagger-ui-bundle.js" in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        r = client.get(f"/docs/assets/{asset}")
        assert r.status_code == 200 and len(r.content) > 10_000
    assert client.get("/redoc").status_code == 404


def test_a_405_allows_the_methods_of_the_path_s_own_operations(
    client: TestClient,
) -> None:
    # POST /v1/migrations/reports and GET /v1/migrations/{migration_id} both match the path;
    # the resource is the reports' (GET /v1/migrations/reports asks for a migration that
    # cannot exist: 404), so Allow says what the OpenAPI document says of the path.
    r = client.put("/v1/migrations/reports", headers=READ)
    assert r.status_code == 405, r.text
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"POST"}
    assert client.get("/v1/migrations/reports", headers=READ).status_code == 404
    r = client.delete("/v1/migrations/0", headers=READ)  # only a parameter's route matches
    assert r.status_code == 405 and r.headers["allow"] in ("GET", "GET, HEAD"), r.headers
