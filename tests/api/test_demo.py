"""``forewarn demo`` (what ``make run`` starts) brings up a service that a fleet feeds."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from api.demo_cli import TOKENS
from tests.conftest import free_port


def test_demo_serves_a_simulated_fleet(tmp_path: Path) -> None:
    port, control = free_port(), free_port()
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "forewarn",
            "demo",
            "--port",
            str(port),
            "--control-port",
            str(control),
            "--gpus",
            "16",
            "--data-dir",
            str(tmp_path),
            "--no-job",
            "--duration",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    read = {"Authorization": f"Bearer {TOKENS['FOREWARN_READ_TOKEN']}"}
    try:
        deadline = time.monotonic() + 45
        gpus = 0
        while time.monotonic() < deadline and gpus < 16:
            time.sleep(0.5)
            try:
                gpus = httpx.get(f"http://127.0.0.1:{port}/v1/gpus", headers=read).json()["count"]
            except (httpx.HTTPError, KeyError):
                continue
        assert gpus == 16, (tmp_path / "demo-fleet.log").read_text(errors="replace")
    finally:
        demo.terminate()
        out, _ = demo.communicate(timeout=30)
    assert b"Forewarn demo is running" in out
    assert demo.returncode == 0
