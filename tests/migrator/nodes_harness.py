"""Start a job as several ``forewarn launch`` process trees on loopback, one per node."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from forewarn.wire import MigrationReport
from migrator.faults import FaultPlan
from tests.migrator.harness import ROOT, SCRIPT, Run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_nodes(
    out: Path,
    nodes: list[tuple[int, int]],
    *,
    plan: FaultPlan | None = None,
    steps: int = 16,
    mode: str = "plain",
    timeout_s: float = 5.0,
    extra: tuple[str, ...] = (),
    script_args: tuple[str, ...] = (),
    during: Callable[[list[subprocess.Popen[str]]], None] | None = None,
) -> tuple[Run, list[str]]:
    """One launcher per (active ranks, spares) in ``nodes``, each in its own session (a
    process group a test or a fault may kill whole). ``during`` is called with the
    launchers once they started (to signal them). Returns the run and each launcher's
    stderr; the run's ``agent.message`` is the coordinator's stderr."""
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        FOREWARN_RUN_DIR=str(out / "run"),
    )
    report = out / "reports.jsonl"
    procs = []
    for rank, (nproc, spares) in enumerate(nodes):
        cmd = [sys.executable, "-m", "forewarn", "launch", "--nnodes", str(len(nodes))]
        cmd += ["--node-rank", str(rank), "--node-name", f"node{rank}"]
        cmd += ["--nproc-per-node", str(nproc), "--spares-per-node", str(spares)]
        cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout-s", str(timeout_s)]
        cmd += ["--join-timeout-s", "120", "--log-dir", str(out / "logs"), *extra]
        if rank == 0:
            cmd += ["--report", str(report)]
            if plan is not None:
                cmd += ["--faults", plan.to_json()]
        cmd += ["--", sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(steps)]
        cmd += ["--mode", mode, *script_args]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    errs = []
    try:
        if during is not None:
            during(procs)
        for proc in procs:
            _, err = proc.communicate(timeout=240)
            errs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    reports = []
    if report.exists():
        # Each line is a MigrationReport plus, for a planned or preventive move, "group" (how
        # its next generation was formed ahead), which the wire model does not carry.
        lines = [json.loads(x) for x in report.read_text().splitlines()]
        reports = [
            MigrationReport.model_validate({k: v for k, v in x.items() if k != "group"})
            for x in lines
        ]
    codes = [p.returncode for p in procs]
    agent = SimpleNamespace(message=errs[0], codes=codes)
    return Run(out, codes[0], reports, agent), errs  # type: ignore[arg-type]
