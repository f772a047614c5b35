"""The collector's side of hardening: no phantom node, columns sent, 503 backed off."""

from __future__ import annotations

import json

import httpx

from collector.agent import SamplingLoop
from collector.push import BatchingPusher, IngestClient
from forewarn.errors import ServiceUnavailable
from tests.factories import sample


def _client(seen: list[dict], status: int = 200) -> IngestClient:
    def handler(request: httpx.Request) -> httpx.Response:
        import gzip

        seen.append(json.loads(gzip.decompress(request.content)))
        if status != 200:
            return httpx.Response(status, headers={"Retry-After": "7"}, json={"error": {}})
        body = {"stored_samples": 0, "duplicate_samples": 0, "stored_events": 0}
        return httpx.Response(200, json={**body, "duplicate_events": 0, "rejected": []})

    return IngestClient("http://forewarn", "t", transport=httpx.MockTransport(handler))


def test_a_simulated_fleet_sends_no_heartbeat_for_the_host() -> None:
    seen: list[dict] = []
    now = [0.0]
    pusher = BatchingPusher(_client(seen), heartbeat_s=1.0, clock=lambda: now[0])
    SamplingLoop([], pusher, node="build-host", heartbeat=False)
    now[0] = 100.0
    pusher._heartbeats()  # what the sender thread does each turn
    assert seen == []
    SamplingLoop([], pusher, node="gpu-host")  # a real node's agent still announces itself
    now[0] = 200.0
    pusher._heartbeats()
    assert [b["node"] for b in seen] == ["gpu-host"]


def test_the_client_sends_columns_and_honours_retry_after() -> None:
    seen: list[dict] = []
    rows = [sample(node="n1", gpu=g).model_dump(mode="json") for g in range(3)]
    client = _client(seen)
    client.columns = True
    client.send({"node": "n1", "samples": rows})
    assert "samples" not in seen[0] and seen[0]["sample_columns"]["gpu"] == [0, 1, 2]
    busy = _client([], status=503)
    try:
        busy.send({"node": "n1", "samples": rows})
    except ServiceUnavailable as exc:
        assert exc.retry_after_s == 7
    else:  # pragma: no cover
        raise AssertionError("503 must raise ServiceUnavailable")
