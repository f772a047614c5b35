"""FSDP2 (and HSDP) + tensor parallelism as TorchTitan composes them:
``examples/llama_tp.py`` (a small llama-like model: ``parallelize_module`` Colwise/Rowwise
plan per block on the ``tp`` sub-mesh, then ``fully_shard`` per block on the ``dp_shard``
sub-mesh, or on ``("dp_replicate", "dp_shard")`` with ``--replicate``) under a real agent,
4 ranks (2 data-parallel x 2 tensor-parallel), gloo.

Preventive and planned moves carry the rank's TP and FSDP shards bit for bit. FSDP2 + TP has
no replica dimension, so a rank lost without warning is rebuilt from its buddy's peer copy;
HSDP + TP rebuilds it from the rank in its place in the other replica group.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from migrator.agent import Agent, AgentConfig
from migrator.faults import FaultPlan
from migrator.job import Job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llama_tp.py"
STEPS = 8


def _run(out: Path, plan: FaultPlan | None, spares: int, *extra: str) -> Agent:
    cmd = [sys.executable, str(EXAMPLE), "--out", str(out), "--steps", str(STEPS), *extra]
    cfg = AgentConfig(
        command=cmd,
        nproc=4,
        spares=spares,
        timeout_s=10,
        faults=plan,
        log_dir=out / "logs",
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    agent = Agent(cfg)
    agent.run()
    return agent


def _losses(out: Path) -> dict[tuple[int, int], set[str]]:
    rows: dict[tuple[int, int], set[str]] = {}
    for path in out.glob("log.slot*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault((row["rank"], row["step"]), set()).add(row["loss"])
    return rows


def _assert_same(base: Path, run: Path, ranks: int = 4) -> None:
    """Every step's loss on every rank (replays included) and every rank's final TP/FSDP
    shards and optimizer state equal to the base run's."""
    b, r = _losses(base), _losses(run)
    assert set(b) == set(r)
    for key, seen in r.items():
        assert seen == b[key], f"loss differs at rank/step {key}"
    for rank in range(ranks):
        fb = torch.load(base / f"final.rank{rank}.pt", weights_only=True)
        fr = torch.load(run / f"final.rank{rank}.pt", weights_only=True)
        for name, t in fb["model"].items():
            assert torch.equal(t, fr["model"][name]), f"rank {rank} {name} differs"
        for pid, state in fb["opt"]["state"].items():
            for k, v in state.items():
                assert torch.equal(v, fr["opt"]["state"][pid][k]), f"rank {rank} opt {pid}.{k}"


def test_fsdp_tp_layout_is_stated_at_registration() -> None:
    """A spare (sharded only once given a rank): ``job.register`` states the fsdp2_tp
    layout, and the hsdp_tp one for a 3-D mesh (HSDP with TP); a tp without its plan and
    a mesh that does not split the ranks are refused."""
    sys.path.insert(0, str(ROOT / "examples"))
    from llama_tp import Llama, apply_tp

    job = Job(kv=dist.HashStore(), slot=0, world_size=4, initial_rank=None, mirror=False)
    model = Llama()
    job.fsdp(model, layers=list(model.layers), tp=2, tp_plan=apply_tp)
    layout = job.register(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert layout.kind == "fsdp2_tp" and "tensor-parallel and FSDP shards" in layout.planned
    assert "refused (state_not_replicated)" in layout.unplanned
    spare = Job(kv=dist.HashStore(), slot=1, world_size=4, initial_rank=None)
    with pytest.raises(ValueError, match="both tp > 1 and tp_plan"):
        spare.fsdp(Llama(), tp=2)
    with pytest.raises(ValueError, match="do not split"):
        spare.fsdp(Llama(), replicate=4, tp=2, tp_plan=apply_tp)
    three = Job(kv=dist.HashStore(), slot=3, world_size=8, initial_rank=None)
    model3 = Llama()
    three.fsdp(model3, layers=list(model3.layers), replicate=2, tp=2, tp_plan=apply_tp)
    layout = three.register(model=model3, optimizer=torch.optim.AdamW(model3.parameters()))
    assert layout.kind == "hsdp_tp" and "tensor-parallel and FSDP shards" in layout.planned
    assert "same shard and tensor-parallel index in another replica group" in layout.unplanned
    assert three.mesh_layout.holders(5) == [1, 5]
    copies = Job(kv=dist.HashStore(), slot=2, world_size=4, initial_rank=None)
    other = Llama()
    copies.fsdp(other, layers=list(other.layers), tp=2, tp_plan=apply_tp)
    assert copies.register(model=other, peer_copy_every=2).kind == "peer_copy"


@pytest.fixture(scope="module")
def base_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base_tp")
    agent = _run(out, None, 0)
    assert agent.status != "failed" and agent.reports == [], agent.message
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_tp_preventive_and_planned_moves_carry_the_shards_bitwise(
    base_tp: Path, tmp_path: Path
) -> None:
    """Rank 1 (tp 1 of dp group 0) moves preventively at step 2, rank 2 (tp 0 of dp group 1)
    planned at step 5: no step lost, every loss and final shard equal."""
    plan = FaultPlan().migrate_at(1, 2, reason="preventive").migrate_at(2, 5)
    agent = _run(tmp_path, plan, 2)
    assert [(r.rank, r.outcome, r.step, r.steps_lost) for r in agent.reports] == [
        (1, "completed", 3, 0),
        (2, "completed", 6, 0),
    ]
    _assert_same(base_tp, tmp_path)
    pids: dict[Any, int] = {}
    for path in tmp_path.glob("log.slot*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            pids[(row["rank"], row["step"])] = row["pid"]
    assert pids[(1, 2)] != pids[(1, 3)] and pids[(2, 5)] != pids[(2, 6)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_tp_rank_killed_is_rebuilt_from_its_peer_copy_bitwise(
    base_tp: Path, tmp_path: Path
) -> None:
    """With peer copies every 2 steps, rank 2 SIGKILLed mid-forward at step 5 is rebuilt from
    rank 3's copy of step 4 and every rank replays from step 4: equal to the base run."""
    plan = FaultPlan().fail_at(2, 5, where="forward")
    agent = _run(tmp_path, plan, 1, "--peer-copy", "2")
    assert [(r.rank, r.outcome, r.step) for r in agent.reports] == [(2, "completed", 4)]
    _assert_same(base_tp, tmp_path)


@pytest.fixture(scope="module")
def base_hsdp_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base_hsdp_tp")
    agent = _run(out, None, 0, "--replicate", "2")
    assert agent.status != "failed" and agent.reports == [], agent.message
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_tp_rank_killed_is_rebuilt_from_the_other_replica_group_and_moves_bitwise(
    base_hsdp_tp: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """HSDP + TP on a (2 replica groups, 1 shard, 2 tensor-parallel) mesh: rank 1 SIGKILLed
    mid-forward at step 5 is rebuilt from rank 3 (same shard and TP index, other replica
    group), one step lost; rank 2 moves preventively at step 2, none lost; every loss and
    final shard equal to the undisturbed run."""
    plan = FaultPlan().migrate_at(2, 2, reason="preventive").fail_at(1, 5, where="forward")
    with caplog.at_level(logging.WARNING, logger="migrator.agent"):
        agent = _run(tmp_path, plan, 2, "--replicate", "2")
    assert [(r.rank, r.outcome, r.step, r.steps_lost) for r in agent.reports] == [
        (2, "completed", 3, 0),
        (1, "completed", 5, 1),
    ]
    assert "rank(s) [1] -> slot(s) [5] from replica rank 3" in caplog.text
    _assert_same(base_hsdp_tp, tmp_path)


@pytest.mark.parametrize(
    ("replicate", "tp", "world"), [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 8), (2, 2, 4)]
)
def test_every_mesh_dimensions_sub_groups_are_named_alike_on_their_members(
    replicate: int, tp: int, world: int
) -> None:
    """For every layout's mesh, each rank's sub-group along each dimension is built under a
    tag its members share and no other sub-group uses, with the rank's index in it, and
    holds exactly the ranks :func:`dim_ranks` says (what the new generation's groups are
    formed from)."""
    from migrator.fsdp import ElasticFSDP, dim_ranks

    sharded = ElasticFSDP(
        torch.nn.Linear(2, 2),
        replicate=replicate,
        tp=tp,
        tp_plan=(lambda *_: None) if tp > 1 else None,
    )
    shape = sharded.shape(world)
    members: dict[str, dict[int, int]] = {}
    for rank in range(world):
        made: list[tuple[str, int, int]] = []

        class _Whole:
            def size(self) -> int:
                return world

            def rank(self) -> int:
                return rank  # noqa: B023

        def new_group(tag: str, index: int, size: int) -> Any:
            made.append((tag, index, size))  # noqa: B023
            return tag

        sharded.mesh_groups(_Whole(), new_group)  # type: ignore[arg-type]
        spans = dim_ranks(rank, shape)
        assert len(made) == (0 if len(shape) == 1 else len(shape))
        for (tag, index, size), ranks in zip(made, spans, strict=False):
            assert size == len(ranks) and ranks[index] == rank
            members.setdefault(tag, {})[index] = rank
    for tag, by_index in members.items():
        assert sorted(by_index) == list(range(len(by_index))), tag
        any_rank = by_index[0]
        assert any(list(by_index.values()) == s for s in dim_ranks(any_rank, shape)), tag
