"""Fast checks of the parts around the protocol: error classification, job files, imports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forewarn.errors import Conflict, NotFound
from migrator import endpoint
from migrator.job import CollectiveFailed, is_peer_failure, spare_may_help

ROOT = Path(__file__).resolve().parents[2]


def test_a_failed_collective_is_told_from_the_scripts_own_error() -> None:
    """By type and origin, never by words (the gloo failures of real processes are in
    test_handover and test_defects)."""
    port = _unused_port()
    with pytest.raises(dist.DistError) as lost_store:  # a real DistNetworkError
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=0.5))
    assert is_peer_failure(lost_store.value)
    assert is_peer_failure(CollectiveFailed("all_reduce on generation 0: Connection reset"))
    for words in ("Operation timed out!", "gloo: connection reset by peer", "c10d timeout"):
        try:
            raise RuntimeError(words)  # the script's own, whatever it says
        except RuntimeError as exc:
            assert not is_peer_failure(exc)
    assert not is_peer_failure(torch.OutOfMemoryError("CUDA out of memory (timeout)"))
    assert not is_peer_failure(ValueError("gloo"))
    assert not is_peer_failure(NotImplementedError("nccl"))


def test_a_spare_is_tried_only_where_it_could_help() -> None:
    assert spare_may_help(RuntimeError("CUDA error: an illegal memory access"))
    for exc in (
        torch.OutOfMemoryError("CUDA out of memory"),
        ValueError("a typo"),
        KeyError("x"),
        NotImplementedError(),
    ):
        assert not spare_may_help(exc)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_two_jobs_with_one_name_keep_their_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FOREWARN_RUN_DIR", str(tmp_path))
    with pytest.raises(NotFound):
        endpoint.read_job_file("job")
    endpoint.write_job_file("job", {"agent_url": "http://a"})
    assert endpoint.read_job_file("job")["agent_url"] == "http://a"
    # A job file left by a launcher that is gone is ignored and removed.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = endpoint.job_file("job", dead.pid)
    stale.write_text('{"agent_url": "http://stale"}')
    assert endpoint.read_job_file("job")["agent_url"] == "http://a" and not stale.exists()
    # A second live launcher of the same name: both files stay, and the reader asks which.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        endpoint.job_file("job", other.pid).write_text('{"agent_url": "http://b"}')
        assert endpoint.job_file("job").exists()
        with pytest.raises(Conflict, match="2 running jobs"):
            endpoint.read_job_file("job")
        endpoint.job_file("job.x", os.getpid()).write_text("{}")  # another job's name
        with pytest.raises(Conflict, match="2 running jobs"):
            endpoint.read_job_file("job")
    finally:
        other.kill()
        other.wait()


def test_cli_and_wire_parts_import_without_torch() -> None:
    """The parts the service and the command-line clients use: torch is blocked (an import
    of it fails), so any path to it shows up, not only one taken at module level."""
    modules = (
        "migrator migrator.protocol migrator.service_link migrator.webhook_listener "
        "migrator.endpoint migrator.migrate_cli migrator.launch_cli migrator.faults "
        "migrator.commands migrator.table migrator.recovery migrator.peerplan forewarn.wire"
    )
    code = (
        "import importlib, sys; sys.modules['torch'] = None\n"
        f"for name in {modules.split()!r}: importlib.import_module(name)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_agent_and_its_endpoint_import_in_one_direction() -> None:
    """The agent imports its endpoint; the endpoint names what it needs of the agent as a
    protocol (EndpointAgent) and imports nothing of the agent's, not even for types."""
    import ast

    def imported(module: str) -> set[str]:
        tree = ast.parse((ROOT / "migrator" / f"{module}.py").read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    assert "migrator.endpoint" in imported("agent")
    assert not {"migrator.agent", "migrator"} & imported("endpoint")


class _FakeStore:
    """The few TCPStore calls the launchers' monitor makes, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value


def test_a_silent_node_is_lost_with_every_process_on_it() -> None:
    from migrator.nodes import NodeMonitor, RemoteProc

    store, now = _FakeStore(), [0.0]
    monitor = NodeMonitor(store, node_timeout_s=5.0, clock=lambda: now[0])
    monitor.watch(1)
    done, alive = RemoteProc(monitor, 1, 3), RemoteProc(monitor, 1, 4)
    store.set("node/1/exits", '{"3": 0}')
    store.add("node/1/beat", 1)
    now[0] = 1.0
    assert done.poll() == 0 and alive.poll() is None
    now[0] = 4.0  # silent for 3 s: still there
    monitor.refresh(force=True)
    assert alive.poll() is None
    now[0] = 7.0  # silent for 6 s: lost
    assert alive.poll() == -9 and done.poll() == 0


def test_handover_step_is_after_the_last_boundary_any_rank_passed() -> None:
    from migrator.commands import ack_key, handover_step

    store = _FakeStore()
    store.set(ack_key("m1", 0), "7")
    assert handover_step(store, "m1", range(2)) is None  # rank 1 has not acknowledged
    store.set(ack_key("m1", 1), "8")
    assert handover_step(store, "m1", range(2)) == 9


def test_the_key_value_store_keeps_its_former_flag_and_variable() -> None:
    """``--kv-port`` and ``FOREWARN_KV``; ``--store-port`` and ``FOREWARN_STORE`` still work
    (the old flag hidden from the help)."""
    import argparse

    from migrator.job import kv_address
    from migrator.launch_cli import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    assert parser.parse_args(["--kv-port", "7", "--", "x"]).kv_port == 7
    assert parser.parse_args(["--store-port", "8", "--", "x"]).kv_port == 8
    assert parser.parse_args(["--", "x"]).kv_port == 0
    assert "--store-port" not in parser.format_help()
    assert kv_address({"FOREWARN_KV": "h:1", "FOREWARN_STORE": "old:2"}) == "h:1"
    assert kv_address({"FOREWARN_STORE": "old:2"}) == "old:2"


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11
def test_a_stateful_dataloader_is_a_data_position() -> None:
    """torchdata's StatefulDataLoader moves with the rank state like ShardedIndices."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from migrator.state import capture_rank_state, restore_rank_state

    def loader() -> object:
        data = torch.arange(40).float()
        gen = torch.Generator().manual_seed(3)
        return sdl.StatefulDataLoader(data, batch_size=4, shuffle=True, generator=gen)

    source = loader()
    it = iter(source)
    for _ in range(3):
        next(it)
    blob = capture_rank_state(3, source)
    expected = [next(it) for _ in range(4)]
    spare = loader()
    assert restore_rank_state(blob, spare) == 3
    got = list(iter(spare))[:4]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
