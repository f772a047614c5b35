"""FSDP2 (``fully_shard``) through ``job.fsdp``: the layout's guarantees, stated at
registration; a preventive move carries the rank's shards, bit for bit; a rank lost without
warning is refused (its shards are in no replica).

The real-process tests launch ``train_tiny.py --mode fsdp --width 33``: the first layer is
its own FSDP unit, and 33 rows split unevenly (17 on rank 0, 16 on rank 1), so a spare must
shard as the rank it takes, not as any rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from forewarn.errors import MigrationError
from migrator.faults import FaultPlan
from migrator.job import Job
from tests.migrator.harness import Run, assert_same, launch

FSDP_ARGS = ("--width", "33")


def _job() -> Job:
    return Job(kv=dist.HashStore(), slot=0, world_size=1, initial_rank=0, mirror=False)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def test_fsdp_layout_is_stated_at_registration_and_trains_on_the_jobs_group() -> None:
    """``job.fsdp`` shards before the job has a group (on a placeholder), ``job.register``
    says what the layout allows and marks the state rank-unique (the flag the agent reads to
    refuse an unplanned loss), and the module trains once bound to generation 0's group."""
    from torch.distributed.tensor import DTensor

    job = _job()
    model = _model()
    first: Any = model[0]
    assert job.fsdp(model, layers=[first]) is model
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    layout = job.register(model=model, optimizer=opt)
    assert layout.kind == "fsdp2"
    assert "bitwise equal" in layout.planned
    assert "refused (state_not_replicated)" in layout.unplanned and "shards" in layout.unplanned
    assert "layout fsdp2" in str(layout)
    assert job.registry.rank_unique
    assert job.events[-1]["event"] == "registered" and job.events[-1]["layout"] == "fsdp2"
    # The manifest lists this rank's local shards (a view of the parameter's storage).
    names = [n for n, _, _ in job.registry.manifest()]
    assert names[:2] == ["model0.0.weight", "model0.0.bias"]
    (_, weight), *_ = job.registry.tensors()
    assert weight.data_ptr() == first.weight.to_local().data_ptr()
    before = weight.clone()
    losses = []
    for step in job.steps(2):
        with step:
            loss = model(torch.ones(3, 4)).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    assert job.kv.get("slot0/unique") == b"1"
    assert losses[1] != losses[0] and not torch.equal(before, first.weight.to_local())
    # Optimizer state is sharded like its parameter; the transfer sends its local part.
    assert isinstance(opt.state[first.weight]["exp_avg"], DTensor)
    assert len(job.registry.tensors()) == len(job.registry.manifest()) == 4 + 4 * 3


def test_plain_registration_states_the_replicated_and_rank_unique_layouts() -> None:
    model = _model()
    layout = _job().register(model=model)
    assert layout.kind == "replicated" and "1 step lost" in layout.unplanned
    layout = _job().register(model=model, rank_unique=True)
    assert layout.kind == "rank_unique" and "refused (state_not_replicated)" in layout.unplanned


def test_fsdp_without_the_torch_internals_it_needs_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed import distributed_c10d

    monkeypatch.delattr(distributed_c10d, "_register_process_group")
    with pytest.raises(MigrationError, match="_register_process_group") as err:
        _job().fsdp(_model())
    assert "checked on torch 2.13" in str(err.value)


def test_fsdp_refuses_a_module_with_dtensor_parameters_and_a_late_call() -> None:
    job = _job()
    job.register(model=_model())
    with pytest.raises(RuntimeError, match=r"before job\.register"):
        job.fsdp(_model())
    job = _job()
    model = job.fsdp(_model())
    with pytest.raises(MigrationError, match="already holds DTensor parameters"):
        _job().fsdp(model)


@pytest.fixture(scope="module")
def base_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("base_fsdp")
    run = launch(out, spares=0, steps=12, mode="fsdp", script_args=FSDP_ARGS)
    assert run.code == 0 and run.reports == [], run.agent.message
    return run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_preventive_then_planned_move_carry_the_shards_bitwise(
    base_fsdp: Run, tmp_path: Path
) -> None:
    """2 active FSDP2 ranks + 2 spares; rank 1 (the smaller, uneven shard) moves
    preventively at step 4, rank 0 (the larger one) planned at step 8: final parameters and
    optimizer state (each rank's shards) torch.equal to the run without a move, every step's
    loss and samples equal, no step lost."""
    plan = FaultPlan().migrate_at(1, 4, reason="preventive").migrate_at(0, 8)
    run = launch(tmp_path, spares=2, plan=plan, steps=12, mode="fsdp", script_args=FSDP_ARGS)
    assert_same(base_fsdp, run)
    assert [(r.rank, r.outcome, r.step, r.steps_lost) for r in run.reports] == [
        (1, "completed", 5, 0),
        (0, "completed", 9, 0),
    ]
    assert all(r.bytes_moved and r.bytes_moved > 0 for r in run.reports)
    # The steps after each handover ran in a spare, which sharded as the rank it took.
    pids = {(row["rank"], row["step"]): row["pid"] for row in run.steps().values()}
    assert pids[(1, 4)] != pids[(1, 5)] == pids[(1, 11)]
    assert pids[(0, 8)] != pids[(0, 9)] == pids[(0, 11)]
    assert run.final(1)["model"]["0.weight"].shape == (16, 8)
    assert run.final(0)["model"]["0.weight"].shape == (17, 8)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_rank_lost_without_warning_is_refused(tmp_path: Path) -> None:
    """Rank 1 dies mid-step: no other rank holds its shards, so the agent refuses to rebuild
    it from a replica (``state_not_replicated``) and the job fails, saying why."""
    plan = FaultPlan().fail_at(1, 3, where="forward")
    run = launch(tmp_path, spares=1, plan=plan, steps=12, mode="fsdp", script_args=FSDP_ARGS)
    assert run.code == 1
    assert run.agent.status == "failed"
    assert "rank-unique" in run.agent.message and "restart from a checkpoint" in run.agent.message
    # The survivor raises the error of that code (and exits with it); no spare took rank 1.
    assert "StateNotReplicated" in run.log(0)
    assert run.reports == []


def test_a_spare_sharded_as_one_rank_refuses_another() -> None:
    """A spare shards when it is given a rank (uneven shards differ by rank); asked later for
    another rank (an earlier handover of it aborted), it refuses instead of receiving a
    shard of the wrong rows."""
    from migrator.fsdp import ElasticFSDP

    sharded = ElasticFSDP(_model())
    sharded.shard(1, 2, None)
    sharded.shard(1, 2, None)  # the same rank again: nothing to do
    with pytest.raises(MigrationError, match="sharded as rank 1"):
        sharded.shard(0, 2, None)
