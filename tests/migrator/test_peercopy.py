"""In-memory peer copies (``job.register(..., peer_copy_every=k)``): FSDP2 with no replica,
4 ranks, gloo.

The real-process tests launch ``train_tiny.py --mode fsdp --width 33 --peer-copy 2``: every
2 steps each rank's shards, optimizer state, RNG states and data position go to the memory
of rank ``r + 1``. A rank killed without warning at step 5 is rebuilt from its buddy's copy
of step 4 and every rank goes back to step 4: the steps run again give the same losses, and
the run ends torch.equal to the run without a failure. A rank lost together with its buddy
stops the job, naming both.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from migrator import checkpoint, shards
from migrator.channels import PairChannels
from migrator.faults import FaultPlan
from migrator.groups import Graveyard
from migrator.job import Job
from migrator.peercopy import PeerCopies, buddy_of, held_key, rewind_plan, since_key
from migrator.peerplan import RING_KEY, read_ring, ring_of
from migrator.state import Registry
from tests.migrator.harness import Run, assert_same_final, launch
from tests.migrator.nodes_harness import launch_nodes

ARGS = ("--width", "33", "--peer-copy", "2")


def _rows(run: Run) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(rank, step) -> every logged row of it (a step replayed after a rewind twice)."""
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for path in sorted(run.out.glob("log.slot*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault((row["rank"], row["step"]), []).append(row)
    return rows


def test_the_ring_puts_every_buddy_on_another_node_and_a_node_lost_whole_is_rebuilt() -> None:
    """Two nodes of two ranks (torchrun's numbering: node 0 holds ranks 0 and 1): the ring
    takes the nodes in turn, so each rank's copy lives on the other node, and losing node 0
    whole leaves both of its ranks' copies on node 1."""
    placed = [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]  # (rank, node, index on the node)
    ring = ring_of(placed)
    assert ring == [0, 2, 1, 3]
    node = {rank: n for rank, n, _ in placed}
    assert all(node[buddy_of(r, ring)] != node[r] for r in range(4))
    assert ring_of([(r, 0, r) for r in range(4)]) == [0, 1, 2, 3]  # one node: in order
    assert ring_of([(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0)]) == [0, 3, 1, 2]

    store = dist.HashStore()
    store.set(RING_KEY, json.dumps(ring))
    assert read_ring(store, 4) == ring and read_ring(store, 8) == list(range(8))
    for rank, step in ((0, 6), (1, 6), (2, 4), (3, 6)):
        store.set(held_key(rank), str(step))
    assert rewind_plan(store, 4, [0, 1], [2, 3]) == ({0: 2, 1: 3}, 6, "")
    assert rewind_plan(store, 4, [2, 3], [0, 1]) == ({2: 1, 3: 0}, 4, "")
    assert rewind_plan(store, 4, [0, 2], [1, 3])[2] == (
        "rank 0 and its buddy rank 2 were lost together"
    )


def test_rewind_plan_names_the_buddy_the_step_and_a_pair_lost_together() -> None:
    store = dist.HashStore()
    assert read_ring(store, 4) == [0, 1, 2, 3]  # no ring written: the ranks in order
    assert buddy_of(3, [0, 1, 2, 3]) == 0 and buddy_of(1, [0, 1, 2, 3]) == 2
    assert rewind_plan(store, 4, [1], [0, 2, 3]) == (
        {},
        None,
        "rank 1 was lost before its first copy reached rank 2",
    )
    store.set(held_key(1), "6")
    store.set(held_key(3), "4")
    assert rewind_plan(store, 4, [1], [0, 2, 3]) == ({1: 2}, 6, "")
    assert rewind_plan(store, 4, [1, 3], [0, 2]) == ({1: 2, 3: 0}, 4, "")
    assert rewind_plan(store, 4, [1, 2], [0, 3])[2] == (
        "rank 1 and its buddy rank 2 were lost together"
    )
    store.set(since_key(0), "5")  # rank 0's process took the rank at step 5: no copy of 4
    assert rewind_plan(store, 4, [1, 3], [0, 2])[2] == (
        "rank 0 was taken over at step 5, after the copy of 4"
    )
    assert rewind_plan(store, 4, [1], [0, 2, 3]) == ({1: 2}, 6, "")


def test_peer_copy_registration_states_the_layout() -> None:
    job = Job(kv=dist.HashStore(), slot=0, world_size=4, initial_rank=None, mirror=False)
    model = torch.nn.Linear(4, 2)
    layout = job.register(model=model, rank_unique=True, peer_copy_every=3)
    assert layout.kind == "peer_copy" and "at most k steps replayed" in layout.unplanned
    assert job.handover.peers is not None and job.handover.peers.every == 3
    with pytest.raises(ValueError, match="a second rank"):
        Job(kv=dist.HashStore(), slot=0, world_size=1, initial_rank=None).register(
            model=model, peer_copy_every=1
        )


@pytest.fixture(scope="module")
def base_copies(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("base_copies")
    run = launch(out, nproc=4, spares=0, steps=9, mode="fsdp", script_args=ARGS)
    assert run.code == 0 and run.reports == [], run.agent.message
    return run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_killed_is_rebuilt_from_its_buddys_copy_and_the_job_replays_bitwise(
    base_copies: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 is SIGKILLed mid-forward at step 5; its buddy (rank 2) holds its copy of
    step 4: the spare takes that copy, every rank goes back to step 4, and steps 4 and 5 run
    again with the same losses and samples; final shards and optimizer state torch.equal."""
    plan = FaultPlan().fail_at(1, 5, where="forward")
    with caplog.at_level(logging.WARNING, logger="migrator.agent"):
        run = launch(tmp_path, nproc=4, spares=1, plan=plan, steps=9, mode="fsdp", script_args=ARGS)
    assert run.code == 0, run.agent.message
    assert [(r.rank, r.outcome, r.step) for r in run.reports] == [(1, "completed", 4)]
    assert "rank(s) [1] -> slot(s) [4] from replica rank 2" in caplog.text  # its buddy
    base, rows = _rows(base_copies), _rows(run)
    assert set(rows) == set(base)
    for key, seen in rows.items():
        for row in seen:  # the first run of a step and its replay alike
            assert row["loss"] == base[key][0]["loss"], f"loss differs at {key}"
            assert row["samples"] == base[key][0]["samples"], f"samples differ at {key}"
    replayed = sorted(k for k, seen in rows.items() if len(seen) > 1)
    # Step 4 ran twice on every rank (rank 1 had finished it before it was killed).
    assert replayed == [(r, 4) for r in range(4)]
    assert_same_final(base_copies, run, nproc=4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_lost_with_its_buddy_stops_at_the_last_disk_copy_and_resumes_bitwise(
    base_copies: Run, tmp_path: Path
) -> None:
    """Copies every 2 steps, to disk every 4: ranks 1 and 2 (1's buddy) are killed together
    mid-forward at step 7. No memory holds rank 1's state, so the job stops, naming both and
    the sharded checkpoint of step 4 that every rank wrote; launched again with ``--resume``
    it runs steps 4 to 8 with the undisturbed run's losses and ends torch.equal to it."""
    ckpt = tmp_path / "ckpt"
    args = (*ARGS, "--disk-copy", "4")
    plan = FaultPlan().fail_at(1, 7, where="forward").fail_at(2, 7, where="forward")
    stopped = launch(
        tmp_path / "stopped",
        nproc=4,
        spares=2,
        plan=plan,
        steps=9,
        mode="fsdp",
        script_args=args,
        checkpoint_dir=ckpt,
    )
    assert stopped.code == 1 and stopped.agent.status == "failed"
    message = stopped.agent.message
    assert "rank 1 and its buddy rank 2 were lost together" in message, message
    assert f"restart from a checkpoint (the last consistent one: step 4 in {ckpt}" in message
    assert stopped.reports == []
    assert (ckpt / "latest").read_text().strip() == "step-00000004"
    assert sorted(p.name for p in (ckpt / "step-00000004").iterdir()) == [
        "manifest.json",
        *(f"rank-{r:05d}.pt" for r in range(4)),
    ]

    def resume(out: str, nproc: int) -> Run:
        return launch(
            tmp_path / out,
            nproc=nproc,
            spares=0,
            steps=9,
            mode="fsdp",
            script_args=args,
            checkpoint_dir=ckpt,
            resume_from=ckpt,
        )

    wrong = resume("two", 2)
    assert wrong.code != 0 and "holds a job of 4 ranks; this one has 2" in wrong.agent.message
    resumed = resume("resumed", 4)
    assert resumed.code == 0, resumed.agent.message
    base, rows = _rows(base_copies), _rows(resumed)
    assert sorted({step for _, step in rows}) == [4, 5, 6, 7, 8]
    for key, seen in rows.items():
        assert [r["loss"] for r in seen] == [base[key][0]["loss"]], f"loss differs at {key}"
        assert seen[0]["samples"] == base[key][0]["samples"], f"samples differ at {key}"
    assert_same_final(base_copies, resumed, nproc=4)
    # The resumed run went on copying to disk: step 8's checkpoint is the latest now.
    assert (ckpt / "latest").read_text().strip() == "step-00000008"


def write_rank_file(directory: Path, step: int, rank: int) -> None:
    """Rank ``rank``'s file of a two-rank sharded checkpoint at ``step`` (a tensor of ones for
    rank 1, zeros for rank 0)."""
    shards.write_shard(
        directory,
        step=step,
        rank=rank,
        world_size=2,
        meta={"manifest": [], "rank_state": b"x"},
        tensors=[torch.full((2,), float(rank))],
        rank_state=b"state",
    )


def test_disk_copies_go_with_the_round_holding_a_multiple_of_m_and_latest_moves_forward(
    tmp_path: Path,
) -> None:
    def copies(k: int, m: int) -> PeerCopies:
        return PeerCopies(
            dist.HashStore(),
            Registry(),
            PairChannels(dist.HashStore(), backend="gloo", timeout_s=1.0, graveyard=Graveyard()),
            every=k,
            world=2,
            timeout_s=1.0,
            where=lambda: (0, 0),
            disk=tmp_path,
            disk_every=m,
        )

    assert [c for c in range(1, 13) if copies(3, 4).due(c) and copies(3, 4).disk_due(c)] == [
        6,
        9,
        12,
    ]
    assert [c for c in (2, 4, 6, 8) if copies(2, 4).disk_due(c)] == [4, 8]
    with pytest.raises(ValueError, match="needs a checkpoint directory"):
        PeerCopies(
            dist.HashStore(),
            Registry(),
            PairChannels(dist.HashStore(), backend="gloo", timeout_s=1.0, graveyard=Graveyard()),
            every=2,
            world=2,
            timeout_s=1.0,
            where=lambda: (0, 0),
            disk_every=4,
        )

    write_rank_file(tmp_path, 4, 0)
    with pytest.raises(FileNotFoundError, match=r"ranks \[1\]"):
        shards.seal(tmp_path, step=4, world_size=2, info={})
    write_rank_file(tmp_path, 4, 1)
    assert (
        shards.seal(tmp_path, step=4, world_size=2, info={}) and shards.latest_step(tmp_path) == 4
    )
    write_rank_file(tmp_path, 2, 0), write_rank_file(tmp_path, 2, 1)
    assert not shards.seal(tmp_path, step=2, world_size=2, info={})  # an older step: no move
    assert shards.latest_step(tmp_path) == 4
    with pytest.raises(checkpoint.CheckpointError, match="each rank reads its own file"):
        checkpoint.load(tmp_path)
    mine = checkpoint.load(tmp_path, rank=1)
    assert (mine["step"], mine["rank"], mine["rank_state"]) == (4, 1, b"state")
    assert torch.equal(mine["tensors"][0], torch.ones(2)) and "rank_state" not in mine["meta"]
    with pytest.raises(checkpoint.CheckpointError, match="has 2 ranks"):
        checkpoint.load(tmp_path, rank=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_lost_whole_is_rebuilt_from_the_copies_on_the_other_node(
    base_copies: Run, tmp_path: Path
) -> None:
    """Two launchers of two ranks each and a third with two spares: node 1 (ranks 2 and 3)
    is SIGKILLed whole in step 5. The ring put rank 2's copies on rank 1 and rank 3's on
    rank 0, both on node 0, so both ranks are rebuilt on the spares from those copies of
    step 4 and every rank replays from there: the same losses and final state as the run
    nothing disturbed. (With buddies on the same node both copies would have died with it.)"""
    plan = FaultPlan().kill_node_at(2, 5)
    run, errs = launch_nodes(
        tmp_path, [(2, 0), (2, 0), (0, 2)], plan=plan, steps=9, mode="fsdp", script_args=ARGS
    )
    assert run.agent.codes[0] == 0 and run.agent.codes[2] == 0, errs
    # One recovery for both ranks, each from its buddy on node 0.
    assert [(r.rank, r.outcome, r.step) for r in run.reports] == [(2, "completed", 4)], errs[0]
    assert "rank(s) [2, 3] -> slot(s) [4, 5] from replica rank 1, 0" in errs[0]
    base, rows = _rows(base_copies), _rows(run)
    for key, seen in rows.items():
        for row in seen:
            assert row["loss"] == base[key][0]["loss"], f"loss differs at {key}"
    assert_same_final(base_copies, run, nproc=4)


def test_auto_k_is_derived_by_rank_0_and_read_by_every_rank() -> None:
    """``peer_copy_every="auto"``: rank 0 times the first steps and one copy into memory
    and publishes k; another rank reads the same k at the same boundary, a spare joining
    later at once; no copy is due before k is known."""
    from migrator.peercopy import EVERY_KEY, PROBE, PeerCopies
    from migrator.state import Registry

    store = dist.HashStore()
    registry = Registry(models=[torch.nn.Linear(64, 64)])

    def copies(rank: int) -> PeerCopies:
        return PeerCopies(
            store,
            registry,
            channels=None,  # type: ignore[arg-type]
            every="auto",
            world=2,
            timeout_s=5,
            where=lambda: (0, rank),
        )

    first, second = copies(0), copies(1)
    for step in range(PROBE + 1):
        assert not first.due(step) and not second.due(step)
        first._derive(step, 0)
        second._derive(step, 1)
        time.sleep(0.01)  # a step
    assert first.every is not None and first.every >= 1
    assert second.every == first.every == int(store.get(EVERY_KEY))
    at = -(-PROBE // first.every) * first.every  # the first multiple of k from PROBE on
    assert first.due(at) and not first.due(PROBE - 1)
    late = copies(1)
    late._derive(12, 1)
    assert late.every == first.every
    with pytest.raises(ValueError, match="'auto'"):
        PeerCopies(
            store, registry, channels=None, every=0, world=2, timeout_s=1, where=lambda: (0, 0)
        )  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_preventive_move_at_a_copy_step_then_a_kill_replays_bitwise(
    base_copies: Run, tmp_path: Path
) -> None:
    """Rank 1 moves preventively and hands over at step 4, a copy step (the round runs with
    the source; the spare keeps its received state as its copy and skips that round); rank
    3 is then SIGKILLed at step 7 and rebuilt from rank 0's copy of step 6: every loss and
    the final state equal the undisturbed run's."""
    plan = FaultPlan().migrate_at(1, 3, reason="preventive").fail_at(3, 7, where="forward")
    run = launch(tmp_path, nproc=4, spares=2, plan=plan, steps=9, mode="fsdp", script_args=ARGS)
    assert run.code == 0, run.agent.message
    assert [(r.rank, r.outcome, r.step) for r in run.reports] == [
        (1, "completed", 4),
        (3, "completed", 6),
    ]
    base, rows = _rows(base_copies), _rows(run)
    assert set(rows) == set(base)
    for key, seen in rows.items():
        assert all(row["loss"] == base[key][0]["loss"] for row in seen), f"loss differs at {key}"
    assert_same_final(base_copies, run, nproc=4)


def test_a_sealed_checkpoint_removes_the_rounds_before_the_one_it_keeps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The directory keeps the newest two sealed checkpoints: older folders go, with a round a
    killed rank left unfinished (its temporary file) among them; one-file checkpoints and
    other files stay, and so does a round newer than ``latest`` still being written."""

    for step in (4, 8):
        write_rank_file(tmp_path, step, 0), write_rank_file(tmp_path, step, 1)
        assert shards.seal(tmp_path, step=step, world_size=2, info={})
    write_rank_file(tmp_path, 10, 0)  # rank 1 was killed writing step 10
    (shards.shard_dir(tmp_path, 10) / ".rank-00001.pt.4242.tmp").write_bytes(b"half")
    (tmp_path / "step-00000002.pt").write_bytes(b"a one-file checkpoint")
    (tmp_path / "notes.txt").write_text("the operator's")
    write_rank_file(tmp_path, 12, 0), write_rank_file(tmp_path, 12, 1)
    write_rank_file(tmp_path, 16, 0)  # the next round, in progress
    assert shards.seal(tmp_path, step=12, world_size=2, info={})
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "latest",
        "notes.txt",
        "step-00000002.pt",
        "step-00000008",
        "step-00000010",
        "step-00000012",
        "step-00000016",
    ]
    write_rank_file(tmp_path, 16, 1)
    assert shards.seal(tmp_path, step=16, world_size=2, info={})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000002.pt",
        "step-00000012",
        "step-00000016",
    ]
    assert shards.latest_step(tmp_path) == 16
    assert checkpoint.load(tmp_path, rank=1)["step"] == 16
