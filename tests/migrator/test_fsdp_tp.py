"""FSDP2 + tensor parallelism as TorchTitan composes them: ``examples/llama_tp.py`` (a small
llama-like model: ``parallelize_module`` Colwise/Rowwise plan per block on the ``tp``
sub-mesh, then ``fully_shard`` per block on the ``dp_shard`` sub-mesh) under a real agent,
4 ranks (2 data-parallel x 2 tensor-parallel), gloo.

Preventive and planned moves carry the rank's TP and FSDP shards bit for bit; the layout has
no replica dimension, so a rank lost without warning is rebuilt from its buddy's peer copy.
"""

from __future__ import annotations

import json
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


def _assert_same(base: Path, run: Path) -> None:
    """Every step's loss on every rank (replays included) and every rank's final TP/FSDP
    shards and optimizer state equal to the base run's."""
    b, r = _losses(base), _losses(run)
    assert set(b) == set(r)
    for key, seen in r.items():
        assert seen == b[key], f"loss differs at rank/step {key}"
    for rank in range(4):
        fb = torch.load(base / f"final.rank{rank}.pt", weights_only=True)
        fr = torch.load(run / f"final.rank{rank}.pt", weights_only=True)
        for name, t in fb["model"].items():
            assert torch.equal(t, fr["model"][name]), f"rank {rank} {name} differs"
        for pid, state in fb["opt"]["state"].items():
            for k, v in state.items():
                assert torch.equal(v, fr["opt"]["state"][pid][k]), f"rank {rank} opt {pid}.{k}"


def test_fsdp_tp_layout_is_stated_at_registration() -> None:
    """A spare (sharded only once given a rank): ``job.register`` states the fsdp2_tp
    layout; a 3-D mesh (HSDP with TP) and a tp without its plan are refused."""
    sys.path.insert(0, str(ROOT / "examples"))
    from llama_tp import Llama, apply_tp

    job = Job(kv=dist.HashStore(), slot=0, world_size=4, initial_rank=None, mirror=False)
    model = Llama()
    job.fsdp(model, layers=list(model.layers), tp=2, tp_plan=apply_tp)
    layout = job.register(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert layout.kind == "fsdp2_tp" and "tensor-parallel and FSDP shards" in layout.planned
    assert "refused (state_not_replicated)" in layout.unplanned
    spare = Job(kv=dist.HashStore(), slot=1, world_size=4, initial_rank=None)
    with pytest.raises(ValueError, match="3-D mesh"):
        spare.fsdp(Llama(), replicate=2, tp=2, tp_plan=apply_tp)
    with pytest.raises(ValueError, match="both tp > 1 and tp_plan"):
        spare.fsdp(Llama(), tp=2)
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
