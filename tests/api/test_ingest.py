"""POST /v1/ingest: good batches stored once; every kind of bad input refused clearly,
with the good rows beside it kept and the service still up."""

from __future__ import annotations

import gzip
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from tests.api.conftest import INGEST, READ, make_settings
from tests.factories import sample_dict

NOW = datetime.now(UTC).replace(microsecond=0)


def batch(samples, events=(), node="node-0", **extra):  # type: ignore[no-untyped-def]
    return {
        "schema_version": 1,
        "node": node,
        "samples": list(samples),
        "events": list(events),
        **extra,
    }


def good(n: int, gpu: int = 0, node: str = "node-0") -> list[dict]:
    return [sample_dict(node, gpu, NOW - timedelta(seconds=n - i)) for i in range(n)]


def post(client: TestClient, body, headers=INGEST, **kwargs):  # type: ignore[no-untyped-def]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(
        "/v1/ingest",
        content=content,
        headers={"content-type": "application/json", **headers, **kwargs},
    )


def stored(client: TestClient, gpu: int = 0) -> int:
    since = (NOW - timedelta(hours=1)).isoformat()
    r = client.get(
        f"/v1/gpus/node-0/{gpu}/samples",
        params={"since": since, "until": (NOW + timedelta(minutes=1)).isoformat()},
        headers=READ,
    )
    return r.json()["count"] if r.status_code == 200 else 0


def assert_alive(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"


def test_a_thousand_samples_in_and_back_out(client: TestClient) -> None:
    samples = [
        sample_dict("node-0", g, NOW - timedelta(seconds=125 - t))
        for t in range(125)
        for g in range(8)
    ]
    events = [
        {
            "node": "node-0",
            "gpu": 3,
            "ts": NOW.isoformat(),
            "kind": "xid",
            "xid": 48,
            "message": "DBE",
            "source": "nvml",
        }
    ]
    r = post(client, batch(samples, events))
    assert r.status_code == 200, r.text
    assert r.json() == {
        "stored_samples": 1000,
        "duplicate_samples": 0,
        "stored_events": 1,
        "duplicate_events": 0,
        "rejected": [],
    }
    gpus = client.get("/v1/gpus", headers=READ).json()
    assert gpus["count"] == 8 and {g["gpu"] for g in gpus["data"]} == set(range(8))
    newest = (NOW - timedelta(seconds=1)).isoformat()[:19]
    assert all(g["ts"].startswith(newest) for g in gpus["data"])
    assert sum(stored(client, g) for g in range(8)) == 1000
    one = client.get(
        "/v1/gpus/node-0/5/samples",
        headers=READ,
        params={"fields": "temp_gpu_c,ecc_sbe_volatile", "limit": 3},
    ).json()
    assert one["count"] == 3 and set(one["data"][0]) == {
        "ts",
        "node",
        "gpu",
        "temp_gpu_c",
        "ecc_sbe_volatile",
    }
    (event,) = client.get("/v1/events", headers=READ, params={"kind": "xid"}).json()["data"]
    assert event["xid"] == 48 and event["gpu"] == 3
    nodes = client.get("/v1/nodes", headers=READ).json()["data"]
    assert nodes[0]["node"] == "node-0" and nodes[0]["gpus"] == 8
    metrics = client.get("/metrics").text
    assert 'forewarn_ingest_samples_total{outcome="stored"} 1000.0' in metrics


def test_read_back_rows_are_valid_ingest_rows(client: TestClient) -> None:
    post(client, batch(good(3)))
    rows = client.get("/v1/gpus/node-0/0/samples", headers=READ).json()["data"]
    r = post(client, batch(rows))
    assert r.status_code == 200 and r.json()["duplicate_samples"] == 3


def test_gzip_body_is_accepted(client: TestClient) -> None:
    body = gzip.compress(json.dumps(batch(good(50))).encode())
    r = post(client, body, **{"content-encoding": "gzip"})
    assert r.status_code == 200 and r.json()["stored_samples"] == 50


def test_duplicates_are_stored_once_and_are_not_errors(client: TestClient) -> None:
    rows = good(10)
    assert post(client, batch(rows + rows[:4])).json()["duplicate_samples"] == 4
    again = post(client, batch(rows)).json()
    assert again["stored_samples"] == 0 and again["duplicate_samples"] == 10
    assert stored(client) == 10


@pytest.mark.parametrize(
    ("bad_row", "reason"),
    [
        ({"temp_gpu_c": "hot"}, "temp_gpu_c"),
        ({"gpu": "zero"}, "gpu"),
        ({"ecc_sbe_volatile": -1}, "ecc_sbe_volatile"),
        ({"ecc_dbe_aggregate": 2**60}, "ecc_dbe_aggregate"),
        ({"power_w": 1e9}, "power_w"),
        ({"temp_gpu_c": "NaN"}, "finite"),
        ({"power_w": "inf"}, "finite"),
        ({"fan_speed": 40}, "fan_speed"),
        ({"ts": (NOW + timedelta(days=2)).isoformat()}, "clock skew"),
        ({"ts": (NOW - timedelta(days=400)).isoformat()}, "maximum sample age"),
        # Within the maximum age (14 days), but its hour has left the raw window (24 h):
        # stored, it would be dropped with the hour's raw rows and reach no tier.
        ({"ts": (NOW - timedelta(hours=26)).isoformat()}, "raw window"),
        ({"ts": "yesterday"}, "ts"),
        ({"node": "node-9"}, "node"),
        ({"vendor": "intel"}, "vendor"),
    ],
)
def test_a_bad_row_is_rejected_and_its_neighbours_kept(client, bad_row, reason) -> None:  # type: ignore[no-untyped-def]
    rows = good(5)
    rows[2] = {**rows[2], **bad_row}
    r = post(client, batch(rows))
    assert r.status_code == 422
    body = r.json()
    assert body["error"]["code"] == "rows_rejected"
    (rejected,) = body["result"]["rejected"]
    assert rejected["index"] == 2 and rejected["kind"] == "sample"
    assert reason in rejected["reason"] or reason in rejected["reason"].lower()
    assert body["result"]["stored_samples"] == 4
    assert stored(client) == 4
    assert_alive(client)


def test_nan_and_infinity_tokens_fail_only_their_rows(client: TestClient) -> None:
    rows = good(3)
    text = json.dumps(batch(rows))
    text = text.replace('"temp_gpu_c": 55.0', '"temp_gpu_c": NaN', 1)
    text = text.replace('"power_w": 410.5', '"power_w": Infinity', 1)
    r = post(client, text.encode())
    assert r.status_code == 422
    assert [e["index"] for e in r.json()["result"]["rejected"]] == [0]
    assert stored(client) == 2


def test_bad_events_are_reported_separately(client: TestClient) -> None:
    events = [
        {"node": "node-0", "gpu": 1, "ts": NOW.isoformat(), "kind": "xid", "xid": 79},
        {"node": "node-0", "gpu": 1, "ts": NOW.isoformat(), "kind": "meteor"},
    ]
    r = post(client, batch(good(2), events))
    assert r.status_code == 422
    result = r.json()["result"]
    assert result["stored_events"] == 1 and result["stored_samples"] == 2
    assert result["rejected"][0]["kind"] == "event" and result["rejected"][0]["index"] == 1


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"node": "node-0", "samples": [', 400, "malformed_json"),
        (b"\xff\xfe not json", 400, "malformed_json"),
        (b"[1, 2, 3]", 422, "invalid_input"),
        (json.dumps({"node": "node-0", "samples": {}}).encode(), 422, "invalid_input"),
        (json.dumps({"node": "node-0", "schema_version": 99}).encode(), 422, "invalid_input"),
        (json.dumps({"node": "node-0", "extra": 1}).encode(), 422, "invalid_input"),
        (json.dumps({"samples": []}).encode(), 422, "invalid_input"),
        (json.dumps({"node": "bad node!"}).encode(), 422, "invalid_input"),
    ],
)
def test_a_bad_envelope_is_refused_with_its_reason(client, body, status, code) -> None:  # type: ignore[no-untyped-def]
    r = post(client, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    assert_alive(client)


def test_tokens(client: TestClient) -> None:
    body = batch(good(1))
    missing = post(client, body, headers={})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert post(client, body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert post(client, body, headers={"Authorization": "Basic abc"}).status_code == 401
    wrong_scope = post(client, body, headers=READ)
    assert wrong_scope.status_code == 403 and wrong_scope.json()["error"]["code"] == "forbidden"
    assert client.get("/v1/gpus").status_code == 401
    assert client.get("/v1/gpus", headers=INGEST).status_code == 403
    assert stored(client) == 0


def test_oversized_bodies_get_413(tmp_path: Path) -> None:
    settings = make_settings(f"sqlite:///{tmp_path / 'db'}", tmp_path, max_body_bytes=50_000)
    with TestClient(create_app(settings)) as small:
        big = json.dumps(batch(good(400))).encode()
        assert len(big) > 50_000
        r = post(small, big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        bomb = gzip.compress(b'{"node": "node-0", "samples": [' + b" " * 10_000_000 + b"]}")
        assert len(bomb) < 50_000
        r = post(small, bomb, **{"content-encoding": "gzip"})
        assert r.status_code == 413
        assert post(small, b"not gzip", **{"content-encoding": "gzip"}).status_code == 422
        assert post(small, b"{}", **{"content-encoding": "br"}).status_code == 415
        assert post(small, json.dumps(batch(good(5))).encode()).status_code == 200


def test_read_endpoints_validate_their_parameters(client: TestClient) -> None:
    post(client, batch(good(2)))
    r = client.get("/v1/gpus/node-0/0/samples", headers=READ, params={"fields": "nope"})
    assert r.status_code == 422 and "nope" in r.json()["error"]["message"]
    r = client.get("/v1/gpus/node-0/0/samples", headers=READ, params={"since": "soon"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_input"
    assert client.get("/v1/gpus/node-0/7/samples", headers=READ).status_code == 404
    assert client.get("/v1/events", headers=READ, params={"kind": "meteor"}).status_code == 422


def test_heartbeat_batch_records_the_agent(client: TestClient) -> None:
    agent = {
        "agent_id": "node-0/nvml",
        "source": "nvml",
        "version": "0.1.0",
        "sent_total": 10,
        "spooled": 2,
        "dropped_total": 0,
        "interval_s": 1.0,
    }
    r = post(client, batch([], agent=agent))
    assert r.status_code == 200
    (node,) = client.get("/v1/nodes", headers=READ).json()["data"]
    assert node["agents"][0]["spooled"] == 2 and node["agents"][0]["last_seen"]


def test_ready_and_openapi(client: TestClient) -> None:
    assert client.get("/readyz").json() == {"status": "ready", "database": "sqlite"}
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/ingest", "/v1/gpus", "/v1/nodes", "/v1/events"} <= set(paths)
    assert client.get("/docs").status_code == 200
