"""``forewarn serve`` runs its control loop in a process of its own: the service shows the loop
from what it publishes in the store, starts it again when it dies or stops ticking while it
leads, and takes it down when the service itself is killed (a real uvicorn and real processes,
SQLite)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from store import Store
from store import control as db
from tests.conftest import start_service
from tests.control.test_leader import leads, wait_for, wait_ticks
from tests.factories import sample_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:  # "pid (comm) state ppid ..."
        return int(f.read().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def status(url: str) -> dict[str, Any]:
    """The loop's published status ({} before its first tick, or before the schema exists)."""
    store = Store.open(url, migrate=False)
    try:
        with store.engine.connect() as c:
            return db.read_status(c) or {}
    except OperationalError:
        return {}
    finally:
        store.close()


def test_the_loop_runs_in_its_own_process_restarts_and_dies_with_the_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'control.db'}"
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "0.5")
    service = start_service(url, tmp_path / "service.log", timeout_s=120)
    child = 0
    try:
        now = datetime.now(UTC)
        rows = [sample_dict("n0", 0, now - timedelta(seconds=s)) for s in (2, 1)]
        httpx.post(
            service.url + "/v1/ingest",
            json={"node": "n0", "samples": rows},
            headers={"Authorization": f"Bearer {service.ingest_token}"},
        ).raise_for_status()
        wait_for("the loop to lead", lambda: leads(service), 90)
        wait_ticks(service, 2)
        first = status(url)
        child = int(first["pid"])
        assert child != service.process.pid and parent_of(child) == service.process.pid
        read = {"Authorization": f"Bearer {service.read_token}"}
        policy = httpx.get(service.url + "/v1/policy", headers=read).json()
        assert policy["model_threshold"] == first["model_threshold"] is not None
        assert policy["threshold_in_force"] is not None
        metrics = httpx.get(service.url + "/metrics", headers=read).text
        assert 'forewarn_gpu_risk{gpu="0",node="n0"}' in metrics

        os.kill(child, signal.SIGKILL)  # the loop's process dies: the service starts another
        restarted = wait_for(
            "a new control process",
            lambda: (s := status(url)).get("pid") not in (None, child) and s,
            60,
        )
        child = int(restarted["pid"])
        assert parent_of(child) == service.process.pid
        wait_ticks(service, 2)

        os.kill(child, signal.SIGSTOP)  # wedged while it leads: killed, and another started
        stopped = child
        unwedged = wait_for(
            "the wedged loop to be replaced",
            lambda: (s := status(url)).get("pid") not in (None, stopped) and s,
            60,
        )
        assert not alive(stopped)
        assert "has not ticked for" in service.log()
        child = int(unwedged["pid"])

        service.process.send_signal(signal.SIGKILL)  # the service dies: its loop goes too
        service.process.wait(timeout=10)
        wait_for("the control process to end", lambda: not alive(child), 30)
        child = 0
    finally:
        service.stop()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_service_given_no_process_for_its_loop_runs_it_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'control.db'}"
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "0.5")
    monkeypatch.setenv("FOREWARN_CONTROL_PROCESS", "false")
    service = start_service(url, tmp_path / "service.log", timeout_s=120)
    try:
        wait_for("the loop to lead", lambda: leads(service), 90)
        wait_ticks(service, 1)
        assert int(status(url)["pid"]) == service.process.pid
    finally:
        service.stop()


def test_forewarn_control_runs_alone_and_stops_on_sigterm(tmp_path: Path) -> None:
    """``forewarn control`` by hand (beside services started with the loop off): it brings the
    database to the schema's head, leads, ticks, and on SIGTERM stops with exit 0."""
    url = f"sqlite:///{tmp_path / 'control.db'}"
    env = {**os.environ, "FOREWARN_CONTROL_TICK_S": "0.5", "FOREWARN_DATA_DIR": str(tmp_path)}
    with (tmp_path / "control.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "forewarn", "control", "--database-url", url],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        first = wait_for("a tick", lambda: (s := status(url)).get("pid") == process.pid and s, 90)
        wait_for(
            "more ticks",
            lambda: status(url).get("ticks", 0) > first["ticks"] + 1,
            30,
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(FileNotFoundError, IndexError):  # gone meanwhile
                parents[int(entry)] = parent_of(int(entry))
    found, todo = [], [pid]
    while todo:
        above = todo.pop()
        below = [p for p, parent in parents.items() if parent == above]
        found += below
        todo += below
    return found


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_workers_make_one_replica_with_one_control_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``forewarn serve --workers 2``: one control process, the serve command's child (not
    one a worker), and every worker shows it as its own replica's loop."""
    url = f"sqlite:///{tmp_path / 'control.db'}"
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "0.5")
    service = start_service(url, tmp_path / "service.log", timeout_s=120, extra=("--workers", "2"))
    child = 0
    try:
        wait_for("the loop to lead", lambda: leads(service), 90)
        wait_ticks(service, 2)
        child = int(status(url)["pid"])
        assert parent_of(child) == service.process.pid
        below = descendants(service.process.pid)
        controls = [p for p in below if " control --replica " in command_line(p)]
        assert controls == [child], [command_line(p) for p in below]
        # each answer comes from either worker: all of them name the loop their replica's
        assert all(leads(service) for _ in range(8))
    finally:
        service.stop()
    wait_for("the control process to end with the service", lambda: not alive(child), 30)
