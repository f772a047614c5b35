"""End to end against a real ``forewarn serve`` (uvicorn) on both database backends."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import orjson

from forewarn.wire import GpuSample, IngestBatch
from tests.conftest import start_service


def test_serve_ingests_a_batch_and_keeps_it_across_a_restart(
    database_url: str, tmp_path: Path
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    samples = [
        GpuSample(
            node="gpu-node-a",
            gpu=g,
            ts=now - timedelta(seconds=125 - t),
            temp_gpu_c=60.0,
            ecc_sbe_volatile=t,
            remap_pending=False,
        )
        for t in range(125)
        for g in range(8)
    ]
    body = IngestBatch(node="gpu-node-a", samples=[s.model_dump(mode="json") for s in samples])
    payload = gzip.compress(orjson.dumps(body.model_dump(mode="json")))

    service = start_service(database_url, tmp_path / "service.log")
    try:
        r = httpx.post(
            f"{service.url}/v1/ingest",
            content=payload,
            headers={
                "Authorization": f"Bearer {service.ingest_token}",
                "Content-Encoding": "gzip",
                "Content-Type": "application/json",
            },
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json()["stored_samples"] == 1000
    finally:
        service.stop()

    service = start_service(database_url, tmp_path / "service.log")
    try:
        read = {"Authorization": f"Bearer {service.read_token}"}
        gpus = httpx.get(f"{service.url}/v1/gpus", headers=read).json()
        assert gpus["count"] == 8
        window = {
            "since": (now - timedelta(hours=1)).isoformat(),
            "until": (now + timedelta(seconds=1)).isoformat(),
        }
        got = httpx.get(
            f"{service.url}/v1/gpus/gpu-node-a/7/samples", headers=read, params=window
        ).json()
        assert got["count"] == 125
        assert [row["ecc_sbe_volatile"] for row in got["data"]] == list(range(125))
        assert httpx.get(f"{service.url}/readyz").status_code == 200
    finally:
        service.stop()
