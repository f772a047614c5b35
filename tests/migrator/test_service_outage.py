"""A service that accepts connections and never answers does not stall the job agent.

The agent posts its registration and its migration reports to ``--service`` (no token's
link); a real TCP server here accepts each request and holds it unanswered until the agent
has noticed a rank killed mid-training. Had the agent posted under its lock or from its
watch loop, it would notice nothing while the request hangs, and give the request up first.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from migrator.agent import Agent, AgentConfig
from migrator.faults import FaultPlan
from tests.migrator.harness import ROOT, SCRIPT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class SilentService:
    """Accepts connections and answers none until :attr:`release` is set (then 200 {}).

    ``abandoned``: requests whose client hung up before the release.
    """

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.release = threading.Event()
        self.requests = 0
        self.abandoned = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            with self._lock:
                self.requests += 1
            deadline = time.monotonic() + 120  # a bound for this helper, not a check
            while not self.release.is_set() and time.monotonic() < deadline:
                try:
                    if conn.recv(65536) == b"":  # the client gave the request up
                        with self._lock:
                            self.abandoned += 1
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return
            body = b"{}"
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n"
            head += "Content-Type: application/json\r\nConnection: close\r\n\r\n"
            conn.sendall(head.encode() + body)

    def close(self) -> None:
        self.release.set()
        self.sock.close()


def test_a_silent_service_does_not_stall_failure_detection(tmp_path: Path) -> None:
    service = SilentService()
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", "8", "--mode", "plain"]
    cfg = AgentConfig(
        command=cmd,
        nproc=2,
        spares=1,
        timeout_s=5.0,
        faults=FaultPlan().fail_at(1, 2),
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        service_url=f"http://127.0.0.1:{service.port}",
        service_timeout_s=120.0,  # a post may hang as long as the ranks take to start
    )
    agent = Agent(cfg)

    def release_on_detection() -> None:
        # The service answers once the agent saw the killed rank: until then every request
        # (the registration first) hangs.
        while not service.release.is_set():
            if agent.recovery.current is not None or agent.inflight is not None:
                service.release.set()
            time.sleep(0.01)

    threading.Thread(target=release_on_detection, daemon=True).start()
    try:
        code = agent.run()
    finally:
        service.close()
    assert code == 0, agent.message
    assert [(r.rank, r.outcome) for r in agent.reports] == [(1, "completed")]
    assert service.requests >= 2  # the registration and the report reached it
    assert service.abandoned == 0
