"""End-to-end: real agent, real processes, gloo on CPU; every run compared bit for bit.

Each launch costs process start-up (torch import), so launches are shared: one uninterrupted
baseline per training mode, and scenarios combined where their events do not overlap.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from migrator.faults import FaultPlan
from tests.migrator.harness import Outcome, assert_same, launch, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def base_ddp(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return reference(tmp_path_factory, steps=40)


@pytest.fixture(scope="module")
def base_plain(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return reference(tmp_path_factory, steps=20, mode="plain")


def test_preventive_then_planned_is_bitwise_identical(base_ddp: Outcome, tmp_path: Path) -> None:
    """(a) 2 active + 1 spare, preventive at step 10, planned at 25."""
    plan = FaultPlan().migrate_at(0, 10, reason="preventive").migrate_at(1, 25)
    run = launch(tmp_path, spares=1, plan=plan, refill_spares=True)
    assert_same(base_ddp, run)
    assert [(r.rank, r.outcome, r.step, r.steps_lost) for r in run.reports] == [
        (0, "completed", 11, 0),
        (1, "completed", 26, 0),
    ]
    assert all(r.bytes_moved and r.bytes_moved > 0 and r.pause_s is not None for r in run.reports)
    # The source of a completed move is retired, not offered back as a spare.
    assert [(r.source and r.source.role, r.target and r.target.role) for r in run.reports] == [
        ("retired", "active"),
        ("retired", "active"),
    ]
    # The steps before the handover ran in the sources, the steps after in the spares.
    pids = {(row["rank"], row["step"]): row["pid"] for row in run.steps().values()}
    assert pids[(0, 10)] != pids[(0, 11)] and pids[(1, 25)] != pids[(1, 26)]
    assert pids[(0, 11)] == pids[(0, 39)]


def test_source_killed_mid_transfer_then_rank_killed_mid_step(
    base_ddp: Outcome, tmp_path: Path
) -> None:
    """(c) the source dies mid-transfer: replica fallback; (b) SIGKILL mid-collective."""
    plan = (
        FaultPlan()
        .migrate_at(0, 4)
        .fail_at(0, 5, where="transfer")
        .fail_at(1, 15, where="backward")
    )
    run = launch(tmp_path, spares=2, plan=plan)
    assert_same(base_ddp, run)
    first, second = run.reports
    assert (first.rank, first.outcome, first.step) == (0, "completed", 5)
    assert first.error and "replica" in first.error
    assert (second.rank, second.outcome, second.step, second.steps_lost) == (1, "completed", 15, 1)
    assert second.source and second.source.role == "retired"  # killed, not a spare


def test_rank0_migrated_twice_with_a_reused_spare_plain_loop(
    base_plain: Outcome, tmp_path: Path
) -> None:
    """(d) rank 0 moves twice; the second time onto the spare started in the freed slot."""
    plan = FaultPlan().migrate_at(0, 3).migrate_at(0, 8)
    run = launch(tmp_path, spares=1, plan=plan, steps=20, mode="plain", refill_spares=True)
    assert_same(base_plain, run)
    first, second = run.reports
    assert first.rank == second.rank == 0 and first.outcome == second.outcome == "completed"
    assert first.target and second.source and first.target.pid == second.source.pid
    # Each move freed a slot that got a new spare; the second move used the first refill.
    slots = run.agent.slots
    assert len(slots) == 5 and second.target and slots[3].proc
    assert second.target.pid == slots[3].proc.pid


@pytest.mark.parametrize("mode", ["ddp", "plain"])
def test_rank_killed_after_its_last_collective_is_rebuilt_at_the_next_step(
    base_ddp: Outcome, base_plain: Outcome, mode: str, tmp_path: Path
) -> None:
    """Rank 1 dies leaving ``with step:`` of step 7: its peers finished step 7 with it and
    fail in step 8. The spare takes rank 1's state as boundary 8 would have found it (the
    mirror written inside step 7, before its collectives), not the one of boundary 7."""
    base = base_ddp if mode == "ddp" else base_plain
    plan = FaultPlan().fail_at(1, 7, where="step_end")
    run = launch(tmp_path, spares=1, plan=plan, steps=40 if mode == "ddp" else 20, mode=mode)
    assert_same(base, run, unlogged={(1, 7)})
    assert (1, 7) not in run.steps()
    (report,) = run.reports
    assert (report.rank, report.outcome, report.step) == (1, "completed", 8)


def test_wedged_peer_is_detected_within_the_bound(base_plain: Outcome, tmp_path: Path) -> None:
    """(e) SIGSTOP: alive but silent. Survivors time out, the agent kills it, a spare runs on."""
    timeout_s = 2.0
    plan = FaultPlan().wedge_at(1, 6)
    run = launch(tmp_path, spares=1, plan=plan, steps=20, mode="plain", timeout_s=timeout_s)
    assert_same(base_plain, run)
    (report,) = run.reports
    assert (report.rank, report.step, report.steps_lost) == (1, 6, 1)
    # Detection (collective timeout + grace) plus the rebuild, well under the bound.
    assert report.pause_s is not None and report.pause_s < 2 * timeout_s + 10
    assert "did not answer" in run.agent.message or run.agent.status == "completed"


def test_rank_unique_state_moves_planned_and_is_refused_from_a_replica(tmp_path: Path) -> None:
    plan = FaultPlan().migrate_at(0, 2).fail_at(1, 5)
    run = launch(tmp_path, spares=2, plan=plan, steps=20, script_args=("--unique",))
    assert run.code == 1
    assert run.reports[0].outcome == "completed" and run.reports[0].step == 3
    assert run.agent.status == "failed" and "rank-unique" in run.agent.message
    # The spare the move went to is the first warm one: slot 2, or 3 if 2 was still starting.
    assert "StateNotReplicated" in "".join(run.log(s.index) for s in run.agent.slots)


def test_a_script_drawing_after_its_collectives_is_rebuilt_bitwise_from_the_boundary_mirror(
    tmp_path: Path,
) -> None:
    """The state at boundary k is mirrored inside step k-1, before its collectives; a script
    that draws random numbers after them changes it, and the boundary writes it again. Rank 1
    dies in step 9's backward, its peers fail in step 9: the spare must take the boundary's
    mirror of 9, not the one written ahead in step 8 (which misses step 8's late draws)."""
    args = ("--draw-after",)
    base = launch(tmp_path / "base", spares=0, steps=14, script_args=args)
    assert base.code == 0, base.agent.message
    plan = FaultPlan().fail_at(1, 9, where="backward")
    run = launch(tmp_path / "run", spares=1, plan=plan, steps=14, script_args=args)
    (report,) = run.reports
    assert (report.rank, report.outcome, report.step) == (1, "completed", 9)
    assert_same(base, run)


def test_gradients_kept_in_place_at_three_ranks_stay_bitwise_through_a_move_and_a_kill(
    tmp_path: Path,
) -> None:
    """DDP divides a gradient kept as a view of its bucket and multiplies a fresh one, which
    differ in the last bit at 3 ranks: a script that zeroes its gradients in place must find
    them views of the new buckets after every rebuild, on the survivors and on the spares."""
    args = ("--keep-grads",)
    base = launch(tmp_path / "base", nproc=3, spares=0, steps=14, script_args=args)
    assert base.code == 0, base.agent.message
    plan = FaultPlan().migrate_at(0, 4, reason="preventive").fail_at(2, 9, where="backward")
    run = launch(tmp_path / "run", nproc=3, spares=2, plan=plan, steps=14, script_args=args)
    assert [(r.rank, r.outcome) for r in run.reports] == [(0, "completed"), (2, "completed")]
    assert_same(base, run, nproc=3)
