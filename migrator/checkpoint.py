"""A consistent checkpoint written when a job stops at a step boundary, and the resume from it.

With ``forewarn launch --checkpoint-dir DIR`` (``FOREWARN_CHECKPOINT_DIR``), a job that stops
at a step boundary — no spare left after the pause timeout, a crash loop, or the launcher
stopped by Ctrl-C or SIGTERM — writes one checkpoint of that boundary ``k`` before its
processes exit:

- the replica state (every registered tensor: parameters, buffers, optimizer state; and the
  optimizer hyper-parameters, schedulers, grad scaler) from one healthy replica, the
  *writer* (the lowest live rank);
- every rank's own state at ``k`` (RNG states, data position): each live rank's snapshot of
  that boundary, and for a rank that was lost its mirror at ``k`` in the key-value store (the very
  state a spare would have taken over);
- the step ``k`` and the DDP bucket plans.

The writer collects the live ranks' snapshots through the key-value store (``ckpt/{id}/rs/{rank}``),
writes ``DIR/step-<k>.pt`` under a temporary name, renames it into place (atomic on one file
system) and then points ``DIR/latest`` at it the same way; it says ``ckpt/{id}/done`` (the
path) or ``ckpt/{id}/failed`` (why) to the agent, which waits for one of them before it ends
the job. A checkpoint is written only if it is consistent: a rank whose state at ``k`` is
nowhere (no mirror at ``k``) means no checkpoint, and the agent says why.

``Job(..., resume_from=DIR)`` (``FOREWARN_RESUME_FROM``, ``forewarn launch --resume DIR``)
loads the replica state and the process's own rank state into what the script registered,
and ``job.steps()`` continues at ``k``. The same reads a sharded checkpoint (one file per
rank, written by a job with peer copies to disk: :mod:`migrator.shards`), each rank its own
file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from forewarn.errors import MigrationError
from migrator import protocol as P
from migrator.handover import mirror_at
from migrator.membership import Membership
from migrator.shards import FORMAT as SHARDED
from migrator.shards import is_sharded, load_shard, replace_atomically
from migrator.state import Registry, peek_step, restore_rank_state

__all__ = ["CheckpointError", "StopCheckpointer", "load", "restore", "write"]

log = logging.getLogger(__name__)

FORMAT = 1


class CheckpointError(MigrationError):
    """No consistent checkpoint could be written or read."""

    code = "checkpoint_error"


def checkpoint_file(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def write(
    directory: Path,
    *,
    step: int,
    registry: Registry,
    rank_states: dict[int, bytes],
    bucket_plans: list[Any],
    info: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of boundary ``step`` atomically; returns its path.

    Args:
        directory: the checkpoint directory (created if missing).
        step: the boundary: the next step to run after a resume.
        registry: the writer's training state (a healthy replica).
        rank_states: every rank's own state at ``step`` (:func:`state.capture_rank_state`).
        bucket_plans: the DDP wrappers' bucket plans.
        info: what else to record (job id, why it stopped, which ranks were lost).
    """
    for rank, blob in rank_states.items():
        if peek_step(blob) != step:
            raise CheckpointError(f"rank {rank}'s state is at step {peek_step(blob)}, not {step}")
    payload = {
        "format": FORMAT,
        "step": step,
        "world_size": len(rank_states),
        "meta": registry.meta(),
        "tensors": [t.detach().cpu() for _, t in registry.tensors()],
        "ranks": [rank_states[r] for r in range(len(rank_states))],
        "bucket_plans": bucket_plans,
        "info": {**(info or {}), "written_at": time.time()},
    }
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_file(directory, step)
    replace_atomically(final, lambda fh: torch.save(payload, fh))
    replace_atomically(directory / "latest", lambda fh: fh.write(f"{final.name}\n".encode()))
    return final


def load(path: Path, rank: int | None = None) -> dict[str, Any]:
    """Read a checkpoint: a file, or a directory (the one ``latest`` names); of a sharded
    checkpoint, rank ``rank``'s file.

    Raises:
        CheckpointError: nothing there, or not a checkpoint of this format.
    """
    if path.is_dir() and is_sharded(path):
        if rank is None:
            raise CheckpointError(f"{path} is a sharded checkpoint: each rank reads its own file")
        try:
            return load_shard(path, rank)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
    if path.is_dir():
        latest = path / "latest"
        if not latest.exists():
            raise CheckpointError(f"{path} holds no checkpoint (no 'latest')")
        path = path / latest.read_text().strip()
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {payload.get('format')!r}")
    return payload


def restore(payload: dict[str, Any], registry: Registry, rank: int) -> int:
    """Put the checkpoint's replica state and rank ``rank``'s own state in place; returns the
    step to run next.

    Raises:
        CheckpointError: the checkpoint is of another world size.
        MigrationError: the registered model does not match the checkpoint's.
    """
    if payload.get("format") == SHARDED:  # this rank's own file: its tensors and state
        if payload["rank"] != rank:
            raise CheckpointError(f"the file read is rank {payload['rank']}'s, not rank {rank}'s")
        own = payload["rank_state"]
    else:  # one replica's tensors, every rank's own state
        ranks = payload["ranks"]
        if not 0 <= rank < len(ranks):
            raise CheckpointError(f"the checkpoint has {len(ranks)} ranks; this is rank {rank}")
        own = ranks[rank]
    meta = payload["meta"]
    with torch.no_grad():
        for dst, src in zip(registry.prepare(meta["manifest"]), payload["tensors"], strict=True):
            dst.copy_(src)
    registry.apply_meta(meta)
    step = restore_rank_state(own, registry.data)
    if step != payload["step"]:
        raise CheckpointError(f"rank {rank}'s state is at step {step}, not {payload['step']}")
    return step


class StopCheckpointer:
    """Writes the stop checkpoint from inside the ranks of a job; see the module docstring.

    Args:
        kv: a client of the job's key-value store.
        directory: where checkpoints go.
        registry: the training state.
        member: this process's rank and DDP wrappers (for the bucket plans).
        timeout_s: how long the writer waits for each live rank's snapshot, in seconds.
        job_id: recorded in the checkpoint.
    """

    def __init__(
        self,
        kv: P.KVStore,
        directory: Path,
        *,
        registry: Registry,
        member: Membership,
        timeout_s: float,
        job_id: str = "job",
    ) -> None:
        self.kv = kv
        self.directory = directory
        self.registry = registry
        self.member = member
        self.timeout_s = timeout_s
        self.job_id = job_id

    def at_stop(self, plan: P.CheckpointPlan, *, step: int, snapshot: bytes | None) -> str | None:
        """Take part in the stop checkpoint ``plan`` at boundary ``step``.

        ``plan``: the agent's :class:`~migrator.protocol.CheckpointPlan`; ``snapshot``:
        this rank's state at ``step``. Every live rank hands its snapshot over; the writer
        writes the file. Returns the path written (writer) or None. Never raises: a
        checkpoint that cannot be written is said to the agent and logged.
        """
        rank = self.member.rank
        keys = P.CheckpointKeys(plan["id"])
        if rank is None or snapshot is None:
            return None
        try:
            self.kv.set(keys.rank_state(rank), snapshot)
        except (RuntimeError, OSError) as exc:
            log.error("rank %d could not hand its state to the checkpoint: %s", rank, exc)
            return None
        if rank != plan["writer"]:
            return None
        try:
            if self.registry.rank_unique:
                # One replica's tensors would stand for every rank's own shard.
                raise CheckpointError("the job registered rank-unique state (not built)")
            states: dict[int, bytes] = {}
            for r in plan["live"]:
                key = keys.rank_state(r)
                P.first_present(self.kv, [key], timeout_s=self.timeout_s, what=f"rank {r}'s state")
                states[r] = self.kv.get(key)
            for r in plan["lost"]:
                try:
                    states[r] = mirror_at(self.kv, r, step)
                except MigrationError as exc:
                    raise CheckpointError(
                        f"lost rank {r}'s state at step {step} is not mirrored ({exc})"
                    ) from exc
            info = {"job_id": self.job_id, "reason": plan.get("reason"), "lost": plan["lost"]}
            path = write(
                self.directory,
                step=step,
                registry=self.registry,
                rank_states=states,
                bucket_plans=self.member.bucket_plans(),
                info=info,
            )
        except (MigrationError, OSError, RuntimeError) as exc:
            log.error("no checkpoint at step %d: %s", step, exc)
            self.kv.set(keys.failed, str(exc)[:2000])
            return None
        P.put_json(self.kv, keys.done, {"path": str(path), "step": step})
        log.warning("rank %d wrote the checkpoint of step %d to %s", rank, step, path)
        return str(path)
