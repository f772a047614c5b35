"""Failures around the handover itself and errors that are the script's own.

- a spare killed while it receives state: a planned move is aborted with the source still
  training (and a later move works); an unplanned recovery hands the rank to another spare;
- a script that fails on every rank at once is reported with its own error;
- a RuntimeError raised by the script is not a lost peer, and the same error again on the
  spare that took the rank over is a crash loop: the job stops and names the error;
- a rank wedged past the timeout, whether it comes back before the bound or not, is
  replaced and the job ends; a RuntimeError whose words sound like a timeout is still the
  script's; an out-of-memory error stops the job without using a spare; two ranks killed
  together are not reported as the script's error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from migrator import checkpoint
from migrator.agent import Agent
from migrator.faults import FaultPlan
from tests.migrator.harness import Outcome, Run, assert_same, launch, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return reference(tmp_path_factory, steps=16, mode="plain")


def test_spare_killed_mid_receive_planned_then_unplanned(base: Outcome, tmp_path: Path) -> None:
    """Planned move at 3: its spare dies mid-receive, the move is aborted and rank 0 trains
    on; a second move at 6 goes to another spare. Rank 1 is killed at 10: the spare taking
    it over dies mid-receive and the last spare takes it. Bitwise equal, one step lost."""
    plan = (
        FaultPlan()
        .migrate_at(0, 3)
        .fail_at(0, 4, where="receive")
        .migrate_at(0, 6)
        .fail_at(1, 10)
        .fail_at(1, 10, where="receive")
    )
    run = launch(tmp_path, spares=4, plan=plan, steps=16, mode="plain", timeout_s=5.0)
    assert_same(base, run)
    got = [(r.rank, r.outcome, r.step, r.steps_lost) for r in run.reports]
    assert got[0][:2] == (0, "failed")
    assert run.reports[0].error and "source kept training" in run.reports[0].error
    # The aborted move says where the ranks stood and how long: at S, a pause > 0.
    assert run.reports[0].step == 4 and (run.reports[0].pause_s or 0) > 0
    assert got[1:] == [(0, "completed", 7, 0), (1, "completed", 10, 1)]
    dead = [s.index for s in run.agent.slots if s.role == "dead"]
    assert len(dead) == 3  # two spares killed mid-receive, rank 1 killed


def test_script_failing_on_every_rank_reports_its_own_error(tmp_path: Path) -> None:
    run = launch(tmp_path, spares=1, steps=8, script_args=("--crash-all-at", "2"))
    assert run.code == 1
    assert "ValueError" in run.agent.message and "a typo on every rank" in run.agent.message
    assert "min()" not in run.agent.message


def test_user_runtime_error_is_not_a_lost_peer_and_a_crash_loop_stops(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = launch(
        tmp_path, spares=2, steps=12, script_args=("--raise-at", "1:4"), checkpoint_dir=ckpt
    )
    assert run.code == 1
    msg = run.agent.message
    assert "crash loop" in msg and "RuntimeError" in msg and "user bug on rank 1" in msg
    # The job stopped at the boundary of step 4 with a checkpoint of it (rank 1's own state
    # from its mirror there), to restart from once the script is fixed.
    assert f"checkpoint of step 4 in {ckpt}" in msg
    payload = checkpoint.load(ckpt)
    assert (payload["step"], payload["info"]["lost"]) == (4, [1])
    assert "did not answer" not in msg  # the healthy rank 0 was never declared wedged
    # One spare tried the rank once; the other was not burnt.
    assert [s.role for s in run.agent.slots].count("spare") == 1
    assert "RuntimeError: user bug on rank 1" in run.log(1)


def _thaw_after(agent_run: Callable[[], Run], seconds: float) -> tuple[Run, list[int]]:
    """Run the job; once a process of it is stopped (SIGSTOP, a ``wedge`` fault), send it
    SIGCONT ``seconds`` later. Returns the run and the thawed slots."""
    thawed: list[int] = []
    started = threading.Event()
    box: dict[str, Any] = {}

    def spy(self: Agent) -> int:
        box["agent"] = self
        started.set()
        return original(self)

    def thaw() -> None:
        started.wait()
        agent = box["agent"]
        while agent.status not in ("completed", "failed", "stopped"):
            for slot in list(agent.slots):
                if slot.proc is None or slot.proc.poll() is not None:
                    continue
                try:
                    stat = Path(f"/proc/{slot.proc.pid}/stat").read_text()
                except OSError:
                    continue
                if stat.rsplit(")", 1)[1].split()[0] == "T":
                    time.sleep(seconds)  # the wedge itself
                    with contextlib.suppress(ProcessLookupError):  # declared lost: killed
                        os.kill(slot.proc.pid, signal.SIGCONT)
                    thawed.append(slot.index)
                    return
            time.sleep(0.02)

    original = Agent.run
    Agent.run = spy  # type: ignore[method-assign]
    watcher = threading.Thread(target=thaw, daemon=True)
    watcher.start()
    try:
        run = agent_run()
    finally:
        Agent.run = original  # type: ignore[method-assign]
    watcher.join(timeout=5)
    return run, thawed


@pytest.mark.parametrize("factor", [1.5, 2.5])
def test_a_rank_wedged_past_the_timeout_is_replaced_and_the_job_ends(
    base: Outcome, tmp_path: Path, factor: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 SIGSTOPped at step 3 for 1.5x / 2.5x --timeout-s, then let go: whether it
    comes back before the bound or not, it is replaced by the spare, the launcher does not
    spin on the reports of ranks that exited, and the run is bitwise the base run."""
    timeout_s = 5.0
    plan = FaultPlan().wedge_at(1, 3)
    run, thawed = _thaw_after(
        lambda: launch(tmp_path, spares=1, plan=plan, steps=16, mode="plain", timeout_s=timeout_s),
        factor * timeout_s,
    )
    assert_same(base, run)
    assert thawed == [1]
    assert [(r.rank, r.outcome, r.step) for r in run.reports] == [(1, "completed", 3)]
    suspected = [r for r in caplog.records if "failure suspected" in r.getMessage()]
    assert len(suspected) == 1


def test_a_user_runtime_error_saying_timed_out_is_the_scripts(tmp_path: Path) -> None:
    """A RuntimeError the script raises is the script's whatever its words: no recovery of
    rank 1 from the replica as if a peer were lost, one spare tries, then a crash loop."""
    args = ("--raise-at", "1:4", "--raise-text", "the data loader timed out (connection reset)")
    run = launch(tmp_path, spares=2, steps=12, mode="plain", timeout_s=5.0, script_args=args)
    assert run.code == 1
    msg = run.agent.message
    assert "crash loop" in msg and "RuntimeError" in msg and "data loader timed out" in msg
    assert "did not answer" not in msg
    assert [s.role for s in run.agent.slots].count("spare") == 1


def test_out_of_memory_on_one_rank_stops_without_using_a_spare(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = launch(
        tmp_path,
        spares=1,
        steps=12,
        mode="plain",
        timeout_s=5.0,
        script_args=("--oom-at", "1:4"),
        checkpoint_dir=ckpt,
    )
    assert run.code == 1
    msg = run.agent.message
    assert "rank 1 raised OutOfMemoryError at step 4" in msg and "no spare was used" in msg
    assert run.reports == []  # no migration, completed or not
    assert [s.role for s in run.agent.slots].count("spare") == 1
    assert checkpoint.load(ckpt)["step"] == 4


def test_two_ranks_killed_together_are_not_the_scripts_error(tmp_path: Path) -> None:
    plan = FaultPlan().fail_at(0, 3, where="step_start").fail_at(1, 3, where="step_start")
    run = launch(tmp_path, spares=1, plan=plan, steps=8, mode="plain", timeout_s=5.0)
    assert run.code == 1
    msg = run.agent.message
    assert "every rank was lost at once" in msg and "killed by SIGKILL" in msg
    assert "own error" not in msg
