"""SIGKILL the collector, restart it: its disk spool is replayed with no gap and no duplicate.

A real ``forewarn collect`` process (simulated GPUs) samples while the service is down, so
every batch lands in its spool; it is killed outright; the service comes up; a second
collector on the same spool replays it and goes on sampling. Per GPU, the stored samples of
the first collector must be a gapless run of its ticks up to the last ``--batch-max-delay-s``
before the kill (what sat in memory is all a SIGKILL may take), and every stored sample was
acknowledged once: the service counted no duplicate.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.collector.conftest import stored_samples
from tests.conftest import LiveService, free_port, start_service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

INTERVAL_S = 0.2
MAX_DELAY_S = 0.3
GPUS = 8  # one simulated node
NODE = "sim-node-0000"  # the simulated fleet names its nodes


def _collector(port: int, spool: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "forewarn", "collect", "--source", "simulated"]
    cmd += ["--service", f"http://127.0.0.1:{port}", "--token", "test-ingest-token"]
    cmd += ["--sim-gpus", str(GPUS), "--interval-s", str(INTERVAL_S)]
    cmd += ["--spool-dir", str(spool), "--batch-max-delay-s", str(MAX_DELAY_S)]
    cmd += ["--heartbeat-s", "1", "--timeout-s", "2"]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())


def _stamps(svc: LiveService, gpu: int) -> list[float]:
    try:
        rows = stored_samples(svc, NODE, gpu)
    except AssertionError:  # 404: nothing of that GPU arrived yet
        return []
    return [datetime.fromisoformat(r["ts"]).timestamp() for r in rows]


def _spooled_rows(spool: Path) -> int:
    # DiskSpool names its files <seq>-<rows>.json.gz
    return sum(int(p.name.split("-")[1].split(".")[0]) for p in spool.glob("*.json.gz"))


def _metric(svc: LiveService, name: str) -> float:
    headers = {"Authorization": f"Bearer {svc.read_token}"}
    text = httpx.get(f"{svc.url}/metrics", headers=headers, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_sigkilled_collector_replays_its_spool_with_no_gap_and_no_duplicate(
    tmp_path: Path,
) -> None:
    port, spool = free_port(), tmp_path / "spool"
    first = _collector(port, spool, tmp_path / "collect1.log")
    try:
        deadline = time.monotonic() + 60
        while _spooled_rows(spool) < 10 * GPUS and time.monotonic() < deadline:
            time.sleep(0.1)  # nobody listens on the port: every batch is spooled
        assert _spooled_rows(spool) >= 10 * GPUS, (tmp_path / "collect1.log").read_text()
        time.sleep(0.7)
    finally:
        killed_at = time.time()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    spooled = _spooled_rows(spool)

    svc = start_service(f"sqlite:///{tmp_path}/forewarn.db", tmp_path / "service.log", port=port)
    try:
        second = _collector(port, spool, tmp_path / "collect2.log")
        try:
            restarted_at = time.time()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                time.sleep(0.5)
                after = [t for t in _stamps(svc, 0) if t > restarted_at]
                if not any(spool.glob("*.json.gz")) and len(after) >= 5:
                    break
            assert not any(spool.glob("*.json.gz")), "the spool was not replayed"
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)
        for gpu in range(GPUS):
            stamps = _stamps(svc, gpu)
            assert len(stamps) == len(set(stamps))
            before = [t for t in stamps if t <= killed_at]
            # Every tick the first collector spooled is stored, in one gapless run ...
            steps = [b - a for a, b in itertools.pairwise(before)]
            assert steps and max(steps) < 2.5 * INTERVAL_S, f"GPU {gpu}: a gap of {max(steps)} s"
            # ... up to what sat in memory when it was killed.
            assert killed_at - before[-1] < MAX_DELAY_S + 2 * INTERVAL_S + 0.5
            assert len(before) * GPUS >= spooled
            # The second collector picked up where it started, ticking on.
            after = [t for t in stamps if t >= restarted_at]
            steps = [b - a for a, b in itertools.pairwise(after)]
            assert len(after) >= 5 and max(steps) < 2.5 * INTERVAL_S
        # Each spooled batch was sent once: the service saw no sample twice.
        assert _metric(svc, 'forewarn_ingest_samples_total{outcome="duplicate"}') == 0
    finally:
        svc.stop()
