"""What the coordinator knows of the job's processes: the slots, the roster, the status.

One :class:`JobTable` per job, owned by the :class:`migrator.agent.Agent` and shared with its
collaborators (:class:`migrator.recovery.Recovery`), always read and changed under the
agent's lock. A :class:`Slot` is one process of the job; a :class:`Migration` is the one
move in flight (planned, preventive or a recovery).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from forewarn.wire import MigrationReason, Placement
from migrator.protocol import JobStatus

__all__ = ["JobTable", "Migration", "Slot"]

_PLACEMENT_ROLE: dict[str, Literal["active", "spare", "retired"]] = {
    "active": "active",
    "assigned": "active",
    "spare": "spare",
}


@dataclass
class Slot:
    """One process of the job."""

    index: int
    role: str  # active | spare | assigned | retired | done | dead
    proc: Any = None  # a subprocess.Popen, or a migrator.nodes.RemoteProc on another node
    rank: int | None = None
    node: str | None = None  # None: the coordinator's own node
    local: int | None = None  # index on its node (its GPU with NCCL)

    def placement(self, node: str, backend: str) -> Placement:
        # A retired, done or dead slot no longer serves the job: a migration's source ends so.
        role = _PLACEMENT_ROLE.get(self.role, "retired")
        gpu = (self.index if self.local is None else self.local) if backend == "nccl" else None
        pid = self.proc.pid if self.proc else None
        return Placement(
            rank=self.rank if self.rank is not None else self.index,
            node=self.node or node,
            gpu=gpu,
            pid=pid,
            role=role,
            slot=self.index,
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Migration:
    """The one migration in flight: planned, preventive or a recovery (slot indices)."""

    migration_id: str
    reason: MigrationReason
    ranks: list[int]
    sources: dict[int, int]
    targets: dict[int, int]
    gen: int
    started: float
    detail: str | None = None
    stop: int | None = None  # the handover step S, once the agent fixed it (planned)


@dataclass
class JobTable:
    """The job's processes and where it stands (read and changed under the agent's lock)."""

    world_size: int
    slots: list[Slot] = field(default_factory=list)
    roster: dict[int, int] = field(default_factory=dict)
    """rank -> slot of the current generation"""
    gen: int = 0
    status: JobStatus = JobStatus.STARTING
    message: str = ""
    inflight: Migration | None = None

    def live_spares(self) -> list[Slot]:
        """Spares whose process is running."""
        return [s for s in self.slots if s.role == "spare" and s.running()]
