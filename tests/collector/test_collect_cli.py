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


@pytest.mark.parametrize("rows", [False, True])
def test_collect_sends_ten_seconds_of_columns_by_default_and_rows_when_asked(
    tmp_path: Path, rows: bool
) -> None:
    """The default shape is the one a service holds a 16,384-GPU fleet with (docs/telemetry.md):
    ``sample_columns``, every reading of the run in one batch when it is shorter than the
    10 s the batch may wait; ``--rows`` sends one object a sample."""
    import gzip
    import json

    bodies: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            bodies.append(json.loads(raw))
            answer = b'{"stored_samples": 0, "duplicate_samples": 0, "stored_events": 0, '
            answer += b'"duplicate_events": 0, "rejected": []}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cmd = [sys.executable, "-m", "forewarn", "collect", "--source", "simulated"]
        cmd += ["--service", f"http://127.0.0.1:{server.server_address[1]}", "--token", "t"]
        cmd += ["--interval-s", "0.5", "--duration-s", "3", "--sim-gpus", "8"]
        cmd += ["--spool-dir", str(tmp_path / "spool")] + (["--rows"] if rows else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    with_samples = [b for b in bodies if b.get("samples") or b.get("sample_columns")]
    if rows:
        assert with_samples and all("sample_columns" not in b for b in with_samples)
        assert sum(len(b["samples"]) for b in with_samples) >= 8 * 5
    else:
        # The run is shorter than the batch's wait: its readings leave together at the end.
        assert len(with_samples) == 1 and "samples" not in with_samples[0]
        columns = with_samples[0]["sample_columns"]
        assert len(columns["gpu"]) >= 8 * 5 and "temp_gpu_c" in columns
