"""The launcher's side of stopping a job at a step boundary with a checkpoint.

When the launcher is stopped (Ctrl-C, SIGTERM, or another node's launcher asking through
``job/stop``) and the job has a checkpoint directory, :meth:`Stopper.stop` posts a *stop
command* where the ranks look for migration commands: they agree on its step S exactly as
on a planned move's (:mod:`migrator.commands`), and at S every rank hands its state to the
stop checkpoint and leaves (:mod:`migrator.checkpoint`). A job paused for want of a spare is
failed instead, with a checkpoint of the boundary its survivors stand at. When the job fails
with such a checkpoint (no spare came, a crash loop; :meth:`Recovery.fail
<migrator.recovery.Recovery.fail>`), :meth:`Stopper.await_checkpoint` waits for it. Either
way the launcher learns the outcome from ``ckpt/{id}/done`` or ``ckpt/{id}/failed`` and
says it.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

from migrator import protocol as P
from migrator.recovery import Recovery
from migrator.table import JobTable

__all__ = ["StopRequested", "StopSettings", "Stopper"]


class StopRequested(KeyboardInterrupt):
    """Another node's launcher was stopped: the job stops as if this launcher had been."""


class StopSettings(Protocol):
    """The settings a stop reads (:class:`migrator.agent.AgentConfig` has them)."""

    job_id: str
    timeout_s: float
    checkpoint_dir: Path | None


class Stopper:
    """Stops a job at a step boundary with its checkpoint; see the module docstring.

    Args:
        kv: the job's key-value store.
        table: the job's slots, roster and status (shared with the agent).
        recovery: the agent's recovery (a paused job is failed through it).
        settings: the job id, ``timeout_s`` and the checkpoint directory.
        lock: the agent's lock, taken to read and change the table.
    """

    def __init__(
        self,
        kv: P.KVStore,
        table: JobTable,
        recovery: Recovery,
        settings: StopSettings,
        lock: threading.RLock,
    ) -> None:
        self.kv = kv
        self.table = table
        self.recovery = recovery
        self.settings = settings
        self.lock = lock

    def stop(self) -> str:
        """The launcher was stopped: with a checkpoint directory, the ranks agree on a step
        boundary (a stop command, agreed on like a planned move's S), write the stop
        checkpoint there and exit; a job paused for want of a spare writes it from the
        boundary its survivors stand at. Returns what to add to the job's message."""
        if self.settings.checkpoint_dir is None:
            return ""
        plan: P.CheckpointPlan | None
        with self.lock:
            table = self.table
            if table.status is P.JobStatus.PAUSED and self.recovery.current is not None:
                self.recovery.fail(
                    "stopped by a signal while paused: " + table.message,
                    code="stopped",
                    checkpoint=True,
                )
                plan = self.recovery.checkpoint
            elif table.status is not P.JobStatus.RUNNING or table.inflight or self.recovery.current:
                why = "a migration was in progress" if table.inflight else f"it was {table.status}"
                return f"; no checkpoint: {why}"
            else:
                live = sorted(table.roster)
                mid = f"stop-{uuid.uuid4().hex[:8]}"
                plan = {
                    "id": mid,
                    "writer": live[0],
                    "live": live,
                    "lost": [],
                    "reason": "stopped",
                }
                command: P.Command = {
                    "migration_id": mid,
                    "kind": "stop",
                    "rank": -1,
                    "replica": None,
                    "checkpoint": plan,
                }
                table.status = P.JobStatus.STOPPING  # no new command replaces this one
                P.put_json(self.kv, P.cmd_key(table.gen), command)
        if plan is None:
            return "; no checkpoint: the survivors' state is not consistent"
        print(
            f"forewarn launch: job {self.settings.job_id} stopping: the ranks write a checkpoint "
            f"at their next step boundary (interrupt again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        return self.await_checkpoint(plan)

    def await_checkpoint(self, plan: P.CheckpointPlan) -> str:
        """Wait (bounded) for the stop checkpoint ``plan``; returns what to say about it."""
        keys = P.CheckpointKeys(plan["id"])
        with self.lock:
            ranks = [self.table.slots[self.table.roster[r]] for r in plan["live"]]
        deadline = time.monotonic() + 4 * self.settings.timeout_s + 30
        gone = False
        while True:
            if self.kv.check([keys.done]):
                done = P.get_json(self.kv, keys.done)
                said = (
                    f"; a consistent checkpoint of step {done['step']} in "
                    f"{self.settings.checkpoint_dir} ({Path(done['path']).name}): restart with "
                    f"forewarn launch --resume {self.settings.checkpoint_dir}"
                )
                break
            if self.kv.check([keys.failed]):
                said = f"; no checkpoint: {self.kv.get(keys.failed).decode()}"
                break
            if gone:  # looked once more after the last rank had exited
                said = "; no checkpoint: the ranks exited without writing it"
                break
            if time.monotonic() >= deadline:
                said = "; no checkpoint: it was not written in time"
                break
            gone = not any(slot.running() for slot in ranks)
            time.sleep(0.05)
        print(f"forewarn launch: job {self.settings.job_id}{said}", file=sys.stderr, flush=True)
        return said
