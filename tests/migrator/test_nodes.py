"""A job across several launchers, each its own process tree on loopback with its own node
name: cross-node moves, a spare lost mid-receive, a whole node lost (two ranks at once).
Every run is compared bit for bit with the same job run without failures on one host."""

from __future__ import annotations

from pathlib import Path

import pytest

from migrator import checkpoint
from migrator.faults import FaultPlan
from migrator.nodes import layout
from tests.migrator.harness import assert_same, reference
from tests.migrator.nodes_harness import launch_nodes


def test_layout_numbers_ranks_node_by_node_and_spares_after() -> None:
    specs = layout([(1, 1), (2, 0), (0, 1)])
    assert [(s.index, s.node_rank, s.local, s.rank) for s in specs] == [
        (0, 0, 0, 0),
        (1, 1, 0, 1),
        (2, 1, 1, 2),
        (3, 0, 1, None),
        (4, 2, 0, None),
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cross_node_preventive_move_and_spare_killed_mid_receive(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Node 0 runs rank 0, node 1 rank 1 and two spares. Rank 0 is moved to node 1; the
    first spare dies mid-receive (the move is aborted, rank 0 trains on), the second move
    lands on node 1. Bitwise equal to a one-host run without moves; no step lost."""
    base = reference(tmp_path_factory, steps=16, mode="plain")
    plan = (
        FaultPlan()
        .migrate_at(0, 3, reason="preventive")
        .fail_at(0, 4, where="receive")
        .migrate_at(0, 6, reason="preventive")
    )
    run, errs = launch_nodes(tmp_path / "run", [(1, 0), (1, 2)], plan=plan)
    assert run.agent.codes == [0, 0], errs
    assert_same(base, run)
    failed, moved = run.reports
    assert failed.outcome == "failed" and failed.error and "kept training" in failed.error
    assert (moved.rank, moved.outcome, moved.step, moved.steps_lost) == (0, "completed", 7, 0)
    assert moved.source and moved.target
    assert (moved.source.node, moved.target.node) == ("node0", "node1")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_whole_node_lost_two_ranks_at_once_spares_on_other_nodes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Three launchers: node 1 runs ranks 1 and 2, nodes 0 and 2 one spare each. Node 1's
    launcher and all its processes are SIGKILLed at once in step 5: both spares, on two
    other nodes, take over from rank 0's replica; one step is lost, the result is equal."""
    base = reference(tmp_path_factory, nproc=3, steps=12, mode="plain")
    plan = FaultPlan().kill_node_at(1, 5)
    run, errs = launch_nodes(tmp_path / "run", [(1, 1), (2, 0), (0, 1)], plan=plan, steps=12)
    assert run.agent.codes[0] == 0 and run.agent.codes[2] == 0, errs
    # Rank 2, on the node lost in rank 1's step 5, may die before logging its step 4 (it had
    # finished it: its state at boundary 5 comes from the mirror written inside step 4).
    assert_same(base, run, nproc=3, unlogged={(2, 4)})
    (report,) = run.reports
    assert (report.outcome, report.step, report.steps_lost) == ("completed", 5, 1)
    assert "node 1: no heartbeat" in errs[0] or "lost" in errs[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_whole_node_lost_without_spares_stops_cleanly(tmp_path: Path) -> None:
    """No spare left for the lost node's rank: the job fails at the boundary of step 4 and
    rank 0, on the surviving node, writes the checkpoint of it (rank 1's own state from its
    mirror; test_checkpoint.py resumes such a checkpoint bitwise equal)."""
    plan = FaultPlan().kill_node_at(1, 4)
    ckpt = tmp_path / "ckpt"
    extra = ("--pause-timeout-s", "2", "--checkpoint-dir", str(ckpt))
    run, errs = launch_nodes(tmp_path, [(1, 0), (1, 0)], plan=plan, steps=12, extra=extra)
    assert run.code == 1
    assert "paused at step 4" in errs[0] and "no spare came" in errs[0]
    assert f"checkpoint of step 4 in {ckpt}" in errs[0], errs[0]
    payload = checkpoint.load(ckpt)
    assert (payload["step"], payload["info"]["lost"]) == (4, [1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_whose_fork_server_imports_slowly_is_not_taken_for_lost(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1's launcher beats while its fork server imports (8 s, on node 1 alone: past the
    5 s the coordinator waits for a silent node), so the job runs, bitwise, nothing lost."""
    base = reference(tmp_path_factory, steps=16, mode="plain")
    monkeypatch.setenv("FOREWARN_TEST_SLOW_IMPORT_S", "8")
    preload = ("--preload", "torch,torch.distributed,migrator,tests.migrator.slow_import")
    run, errs = launch_nodes(tmp_path / "run", [(1, 0), (1, 1)], extra=preload)
    assert run.agent.codes == [0, 0], errs
    assert "no heartbeat" not in "".join(errs) and run.reports == []
    assert_same(base, run)
