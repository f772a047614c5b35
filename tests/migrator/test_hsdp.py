"""HSDP through ``job.fsdp(..., replicate=2)``: 4 ranks, 2 replica groups x 2 shards, gloo.

Rank ``r * 2 + s`` holds shard ``s`` of replica group ``r``: ranks 0 and 2 hold the same
shards, and so do 1 and 3. The real-process tests launch ``train_tiny.py --mode fsdp
--replicate 2 --width 33`` (33 rows split 17/16 within a replica group, so a spare must shard
as the rank it takes): a preventive move carries the rank's own shards, and a rank killed
without warning is rebuilt from the rank with its shard index in the other replica group;
both end torch.equal to the run without a failure, every step's loss equal.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from migrator.faults import FaultPlan
from migrator.job import Job
from migrator.layouts import MeshLayout, senders
from tests.migrator.harness import Run, assert_same, launch

HSDP_ARGS = ("--width", "33", "--replicate", "2")


def test_hsdp_layout_holders_and_senders() -> None:
    """The layout read from the mesh says which ranks hold a rank's shards; the sender of a
    lost rank is a healthy one of those, and a shard index lost in every replica group has
    none."""
    layout = MeshLayout.of("hsdp", 4, replicate=2)
    assert layout.coords(3) == (1, 1)
    assert layout.holders(1) == [1, 3] and layout.holders(2) == [0, 2]
    assert senders(layout, [1], [0, 2, 3]) == {1: 3}
    assert senders(layout, [0, 3], [1, 2]) == {0: 2, 3: 1}
    assert senders(layout, [1, 3], [0, 2]) == {}
    assert senders(MeshLayout.of("fsdp2", 4), [1], [0, 2, 3]) == {}
    assert senders(MeshLayout.of("replicated", 4), [1], [2, 3]) == {1: 2}
    assert senders(None, [1], [3, 2]) == {1: 2}
    with pytest.raises(ValueError, match="replicate >= 2 dividing"):
        MeshLayout.of("hsdp", 4, replicate=3)
    assert MeshLayout.from_json(layout.to_json()) == layout


def test_hsdp_registration_states_the_layout() -> None:
    """``job.register`` returns the HSDP statement and keeps the layout read from the mesh.
    (A spare: it shards only once given a rank, so this process keeps no default group.)"""
    import torch

    job = Job(kv=dist.HashStore(), slot=0, world_size=4, initial_rank=None, mirror=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    job.fsdp(model, layers=[model[0]], replicate=2)
    layout = job.register(model=model, optimizer=torch.optim.Adam(model.parameters()))
    assert layout.kind == "hsdp"
    assert "same shard index in another replica group" in layout.unplanned
    assert job.mesh_layout == MeshLayout.of("hsdp", 4, replicate=2)
    assert job.registry.holders is not None and job.registry.holders(1) == [1, 3]
    spare = Job(kv=dist.HashStore(), slot=1, world_size=4, initial_rank=None)
    with pytest.raises(ValueError, match="do not split"):
        spare.fsdp(torch.nn.Linear(2, 2), replicate=3)


@pytest.fixture(scope="module")
def base_hsdp(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("base_hsdp")
    run = launch(out, nproc=4, spares=0, steps=10, mode="fsdp", script_args=HSDP_ARGS)
    assert run.code == 0 and run.reports == [], run.agent.message
    return run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_rank_killed_is_rebuilt_from_its_shard_in_the_other_replica_group(
    base_hsdp: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 (shard 1 of replica group 0) is SIGKILLed mid-forward at step 3: the spare is
    rebuilt from rank 3 (shard 1 of replica group 1) and its mirrored rank state; the job
    redoes step 3 and ends torch.equal to the run without a failure."""
    plan = FaultPlan().fail_at(1, 3, where="forward")
    with caplog.at_level(logging.WARNING, logger="migrator.agent"):
        run = launch(
            tmp_path, nproc=4, spares=1, plan=plan, steps=10, mode="fsdp", script_args=HSDP_ARGS
        )
    assert_same(base_hsdp, run, nproc=4)
    assert [(r.rank, r.outcome, r.step, r.steps_lost) for r in run.reports] == [
        (1, "completed", 3, 1)
    ]
    assert "rank(s) [1] -> slot(s) [4] from replica rank 3" in caplog.text
    assert run.final(1)["model"]["0.weight"].shape == (16, 8)
    pids = {(row["rank"], row["step"]): row["pid"] for row in run.steps().values()}
    assert pids[(1, 2)] != pids[(1, 3)] == pids[(1, 9)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_preventive_move_carries_the_ranks_shards_bitwise(
    base_hsdp: Run, tmp_path: Path
) -> None:
    """Rank 2 (shard 0 of replica group 1, the larger shard) moves preventively at step 4:
    the source sends its own shards, no step is lost, and the run ends torch.equal."""
    plan = FaultPlan().migrate_at(2, 4, reason="preventive")
    run = launch(
        tmp_path, nproc=4, spares=1, plan=plan, steps=10, mode="fsdp", script_args=HSDP_ARGS
    )
    assert_same(base_hsdp, run, nproc=4)
    assert [(r.rank, r.outcome, r.step, r.steps_lost) for r in run.reports] == [
        (2, "completed", 5, 0)
    ]
    assert run.final(2)["model"]["0.weight"].shape == (17, 8)
