"""End to end against a real ``forewarn serve``: outages of the service, restarts of the agent.

Every sample taken must be stored exactly once (GET /v1/gpus/{node}/{gpu}/samples).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from collector.agent import SamplingLoop
from collector.nvml import NvmlSource
from collector.push import Backoff, BatchingPusher, IngestClient
from collector.spool import DiskSpool
from tests.collector.conftest import stored_samples
from tests.conftest import LiveService, free_port, start_service
from tests.fakes.pynvml import FakeGpu, FakeNvml


def make_agent(url: str, token: str, spool_dir: Path, node: str = "gpu-node-a") -> SamplingLoop:
    source = NvmlSource(node, nvml=FakeNvml([FakeGpu(), FakeGpu()]), events=False)
    pusher = BatchingPusher(
        IngestClient(url, token, timeout_s=2.0),
        spool=DiskSpool(spool_dir),
        max_delay_s=0.1,
        heartbeat_s=1.0,
        backoff=Backoff(initial_s=0.1, max_s=0.4),
    )
    return SamplingLoop([source], pusher, interval_s=0.1, node=node)


def wait_until(what: str, event: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait for ``event`` (a slow machine waits longer; it cannot pass vacuously)."""
    deadline = time.monotonic() + timeout_s
    while not event():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s: {what}"
        time.sleep(0.05)


def assert_each_tick_once(svc: LiveService, ticks: int, node: str = "gpu-node-a") -> None:
    for gpu in (0, 1):
        rows = stored_samples(svc, node, gpu)
        stamps = [r["ts"] for r in rows]
        assert len(stamps) == len(set(stamps)), "a sample was stored twice"
        assert len(rows) == ticks, f"GPU {gpu}: {len(rows)} stored of {ticks} taken"


def test_service_outage_loses_nothing_and_stores_nothing_twice(
    service: LiveService, tmp_path: Path
) -> None:
    agent = make_agent(service.url, service.ingest_token, tmp_path / "spool")
    runner = threading.Thread(target=agent.run)
    runner.start()
    try:
        wait_until("a first batch stored", lambda: agent.pusher.stats.sent_total > 0)
        service.stop()  # the service goes away mid-collection
        wait_until("batches spooled in the outage", lambda: agent.pusher.stats.spooled > 0)
        port = int(service.url.rsplit(":", 1)[1])
        back = start_service(service.database_url, tmp_path / "service.log", port=port)
        try:  # the spool drains once the service answers again (slower on a loaded machine)
            wait_until("the spool drained", lambda: agent.pusher.stats.spooled == 0)
            drained = agent.pusher.stats.sent_total
            # and what is taken from now on goes out live again
            wait_until("a live batch after it", lambda: agent.pusher.stats.sent_total > drained)
        finally:
            agent.stop()
            runner.join(timeout=30)
        stats = agent.pusher.stats
        assert stats.spooled == 0 and stats.dropped_total == 0 and stats.failures > 0
        assert_each_tick_once(back, agent.stats.ticks)
        assert stats.sent_total == 2 * agent.stats.ticks
    finally:
        agent.stop()
        runner.join(timeout=30)
        service.stop()
        if "back" in locals():
            back.stop()


def test_spool_survives_an_agent_restart(tmp_path: Path) -> None:
    port = free_port()
    url, token = f"http://127.0.0.1:{port}", "test-ingest-token"
    first = make_agent(url, token, tmp_path / "spool")
    first.run(max_ticks=5)  # nobody listens: everything lands in the spool on disk
    assert first.pusher.stats.spooled == 10 and first.pusher.stats.sent_total == 0
    svc = start_service(f"sqlite:///{tmp_path}/db", tmp_path / "service.log", port=port)
    try:
        second = make_agent(url, token, tmp_path / "spool")
        assert second.pusher.spool.rows == 10  # reopened from the files
        second.run(max_ticks=3)
        assert second.pusher.stats.spooled == 0
        assert_each_tick_once(svc, 5 + 3)
    finally:
        svc.stop()
