"""Launch the tiny job under a real agent and compare runs bit for bit."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from forewarn.wire import MigrationReport
from migrator.agent import Agent, AgentConfig
from migrator.faults import FaultPlan

SCRIPT = Path(__file__).with_name("train_tiny.py")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """What a job left in its output directory: per-step logs and every rank's final state."""

    out: Path

    def steps(self) -> dict[tuple[int, int], dict[str, Any]]:
        """(rank, step) -> the logged row of the attempt that finished."""
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        for path in sorted(self.out.glob("log.slot*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                key = (row["rank"], row["step"])
                assert key not in rows, f"step {key} finished twice"
                rows[key] = row
        return rows

    def final(self, rank: int) -> dict[str, Any]:
        return torch.load(self.out / f"final.rank{rank}.pt", weights_only=True)

    def log(self, slot: int) -> str:
        return (self.out / "logs" / f"slot{slot}.log").read_text()


@dataclass
class Run(Outcome):
    """A job this process launched under its own agent."""

    code: int
    reports: list[MigrationReport]
    agent: Agent


def launch(
    out: Path,
    *,
    nproc: int = 2,
    spares: int = 1,
    plan: FaultPlan | None = None,
    steps: int = 40,
    mode: str = "ddp",
    timeout_s: float = 10.0,
    script_args: tuple[str, ...] = (),
    **config: Any,
) -> Run:
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(steps)]
    cmd += ["--mode", mode, *script_args]
    cfg = AgentConfig(
        command=cmd,
        nproc=nproc,
        spares=spares,
        timeout_s=timeout_s,
        faults=plan,
        log_dir=out / "logs",
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        **config,
    )
    agent = Agent(cfg)
    code = agent.run()
    return Run(out, code, list(agent.reports), agent)


def reference(
    factory: pytest.TempPathFactory, *, nproc: int = 2, steps: int, mode: str = "ddp"
) -> Outcome:
    """The run that nothing disturbs, of ``nproc`` ranks for ``steps`` steps in ``mode``:
    launched once in a test session and shared by every test and every xdist worker that
    asks for the same (it is bitwise reproducible, so one copy serves them all). It lives
    beside the workers' temporary directories; a lock lets one worker launch it while the
    others wait for it."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base directories share it
    out = root / f"reference-{mode}-{nproc}x{steps}"
    with (root / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = out / "done"
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            run = launch(out, nproc=nproc, spares=0, steps=steps, mode=mode)
            assert run.code == 0 and run.reports == [], run.agent.message
            done.touch()
    return Outcome(out)


def assert_same(
    base: Outcome, run: Run, *, nproc: int = 2, unlogged: set[tuple[int, int]] = frozenset()
) -> None:
    """Final parameters and optimizer state torch.equal; per-step losses and samples equal.

    ``unlogged``: (rank, step) pairs that may have finished without their log line (the rank
    was killed between the end of the step and the script's logging); every other pair must
    be logged, and no pair the base run lacks.
    """
    assert run.code == 0, f"the job failed: {run.agent.message}"
    b, r = base.steps(), run.steps()
    missing, extra = set(b) - set(r), set(r) - set(b)
    assert not extra and missing <= unlogged, f"missing {sorted(missing)}, extra {sorted(extra)}"
    for key in r:
        assert b[key]["loss"] == r[key]["loss"], f"loss differs at rank/step {key}"
        assert b[key]["samples"] == r[key]["samples"], f"samples differ at {key}"
    assert_same_final(base, run, nproc=nproc)


def assert_same_final(base: Outcome, run: Outcome, *, nproc: int = 2) -> None:
    """Every rank's final parameters and optimizer state torch.equal, hyper-parameters and
    scheduler state equal."""
    for rank in range(nproc):
        fb, fr = base.final(rank), run.final(rank)
        for name, t in fb["model"].items():
            assert torch.equal(t, fr["model"][name]), f"rank {rank} {name} differs"
        for pid, st in fb["opt"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, fr["opt"]["state"][pid][k]), f"opt {pid}.{k} differs"
        assert fb["opt"]["param_groups"] == fr["opt"]["param_groups"]
        assert fb["sched"] == fr["sched"]
