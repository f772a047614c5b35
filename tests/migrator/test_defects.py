"""Failures around the handover itself and errors that are the script's own.

- a spare killed while it receives state: a planned move is aborted with the source still
  training (and a later move works); an unplanned recovery hands the rank to another spare;
- a script that fails on every rank at once is reported with its own error;
- a RuntimeError raised by the script is not a lost peer, and the same error again on the
  spare that took the rank over is a crash loop: the job stops and names the error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from migrator import checkpoint
from migrator.faults import FaultPlan
from tests.migrator.harness import Run, assert_same, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = launch(tmp_path_factory.mktemp("base"), spares=0, steps=16, mode="plain")
    assert run.code == 0
    return run


def test_spare_killed_mid_receive_planned_then_unplanned(base: Run, tmp_path: Path) -> None:
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
