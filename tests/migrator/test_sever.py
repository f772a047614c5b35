"""A generation's failure crosses the job at once: a rank that saw its group fail shuts down
the group's connections (``groups.sever``), so peers waiting in a collective on a live but
failed rank fail now instead of at the group's timeout. Real gloo groups in real processes."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from migrator.faults import FaultPlan
from migrator.groups import new_group, sever
from migrator.protocol import as_kv_store
from tests.migrator.harness import Outcome, assert_same, launch, reference

TIMEOUT_S = 60.0  # far beyond what any wait below may take


def _rank(rank: int, port: int, echo_port: int, out: Any) -> None:
    """Rank 2 stays alive and never enters the all-reduce; ranks 1 and 3 (its neighbours in
    gloo's ring) give up on it after 1 s and sever; rank 0 waits only on 1 and 3. No rank
    exits (which would close its sockets) before the test has every answer."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=90))
    kv = as_kv_store(store)
    unrelated = socket.create_connection(("127.0.0.1", echo_port))  # the script's own
    group = new_group(kv, "g0", rank=rank, size=4, timeout_s=TIMEOUT_S, severable=True)
    group.barrier().wait()
    t = torch.ones(1 << 14)
    t0 = time.monotonic()
    result: dict[str, Any] = {"rank": rank}
    if rank == 2:
        kv.get("release")  # waits until the others answered
    else:
        work = group.allreduce([t])
        if rank in (1, 3):
            time.sleep(1.0)
            result["cut"] = sever(group)
            result["cut_again"] = sever(group)
        try:
            work.wait()
            result["failed_after_s"] = None
        except RuntimeError:
            result["failed_after_s"] = time.monotonic() - t0
    unrelated.sendall(b"ping")
    result["unrelated"] = unrelated.recv(4).decode()
    kv.set(f"alive/{rank}", "1")  # the store's connection is the store's, never cut
    result["store"] = kv.get(f"alive/{rank}").decode()
    out.put(result)
    kv.get("done")
    unrelated.close()


@pytest.mark.timeout(240)
def test_a_severed_group_fails_its_waiting_peers_at_once_and_nothing_else() -> None:
    echo = socket.create_server(("127.0.0.1", 0))
    echo.settimeout(150)  # four processes importing torch on a loaded machine
    server = dist.TCPStore(  # the agent's store: it outlives every rank
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    # Not forked from this process: its threads (the store's, the test runner's) may hold a
    # lock at the fork, which the child then waits on for ever (seen once in CI: no rank
    # connected within 30 s). A fork server forks from a process that only imported torch.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, server.port, echo.getsockname()[1], out))
        for r in range(4)
    ]
    for p in procs:
        p.start()
    conns: list[socket.socket] = []
    results: dict[int, dict[str, Any]] = {}

    def collect(want: int, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while len(results) < want and time.monotonic() < deadline:
            for c in conns:  # echo each process's ping on its unrelated connection
                c.settimeout(0.05)
                try:
                    if c.recv(4):
                        c.sendall(b"pong")
                except TimeoutError:
                    pass
            while not out.empty():
                r = out.get()
                results[r["rank"]] = r

    try:  # every process, socket and store is let go below, whatever fails
        conns.extend(echo.accept()[0] for _ in range(4))
        # Without the severing, rank 0 would wait for its group's 60 s timeout.
        collect(3, within_s=TIMEOUT_S / 4)
        server.set("release", "1")
        collect(4, within_s=10)
    finally:
        server.set("release", "1")
        server.set("done", "1")
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for c in conns:
            c.close()
        echo.close()
    assert sorted(results) == [0, 1, 2, 3], f"ranks that answered: {sorted(results)}"
    # Rank 0 never talked to rank 2: it learned of the failure from its severed neighbours.
    assert results[0]["failed_after_s"] is not None
    for r in (1, 3):
        assert results[r]["cut"] > 0 and results[r]["cut_again"] == 0
        assert results[r]["failed_after_s"] is not None
    for r in range(4):
        assert results[r]["unrelated"] == "pong" and results[r]["store"] == "1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rank_four_ranks_apart_recovers_without_waiting_for_the_timeout(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """4 ranks in gloo's ring, rank 2 SIGKILLed mid-backward with a 60 s timeout: rank 0 is
    no neighbour of rank 2, and before its group was severed it waited the whole timeout
    (pause 60.05 s); bitwise equal to the undisturbed run either way."""
    base: Outcome = reference(tmp_path_factory, nproc=4, steps=10)
    plan = FaultPlan().fail_at(2, 5, where="backward")
    run = launch(tmp_path, nproc=4, spares=1, plan=plan, steps=10, timeout_s=TIMEOUT_S)
    assert_same(base, run, nproc=4)
    (report,) = run.reports
    assert report.outcome == "completed" and report.rank == 2
    assert report.pause_s is not None and report.pause_s < TIMEOUT_S / 4
