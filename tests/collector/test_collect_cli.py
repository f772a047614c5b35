"""``forewarn collect`` as an operator runs it, feeding a real ``forewarn serve``."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveService

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def exporter() -> Iterator[str]:
    """A dcgm-exporter stand-in serving a recorded ``/metrics`` page over real HTTP."""
    page = (DATA / "dcgm-exporter-h100.txt").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def collect(service: LiveService, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "forewarn",
            "collect",
            "--service",
            service.url,
            "--token",
            service.ingest_token,
            "--interval-s",
            "0.5",
            "--duration-s",
            "3",
            "--spool-dir",
            str(tmp_path / "spool"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def gpus(service: LiveService) -> list[dict]:
    read = {"Authorization": f"Bearer {service.read_token}"}
    return httpx.get(f"{service.url}/v1/gpus", headers=read).json()["data"]


def test_collect_from_a_dcgm_exporter(
    live_service: LiveService, exporter: str, tmp_path: Path
) -> None:
    done = collect(
        live_service,
        tmp_path,
        "--source",
        "dcgm-exporter",
        "--url",
        exporter,
        "--node",
        "gpu-node-17",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = gpus(live_service)
    assert sorted(g["gpu"] for g in seen) == list(range(8))
    assert all(g["node"] == "gpu-node-17" and g["sm_clock_mhz"] == 1980 for g in seen)


def test_collect_from_the_simulator(live_service: LiveService, tmp_path: Path) -> None:
    done = collect(
        live_service,
        tmp_path,
        "--source",
        "simulated",
        "--sim-gpus",
        "8",
        "--node",
        "sim-node-0000",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(gpus(live_service)) == 8
