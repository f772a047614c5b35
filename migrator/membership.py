"""This process's place in the job: its rank, its generation and that generation's group.

A :class:`Membership` is the one owner of what changes when ranks change hands: the rank this
process holds (None for a spare), the process-group generation ``g`` and its group, the
``ElasticDDP`` wrappers rebuilt and the ``ElasticFSDP`` modules rebound on each new group,
the :class:`~migrator.groups.Graveyard` that keeps left groups referenced, and the
:class:`~migrator.commands.CommandWatcher` that looks for the generation's commands. The
job's loop and its handover procedures (:class:`migrator.handover.Handover`) both hold the
same membership; neither owns the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from migrator.commands import CommandWatcher
from migrator.ddp import ElasticDDP
from migrator.fsdp import ElasticFSDP
from migrator.groups import Graveyard, new_group

__all__ = ["Membership"]


class Membership:
    """The rank, generation and process group of one process of the job.

    Args:
        store: a client of the job's store (generations rendezvous under ``g{g}/pg``).
        world_size: active ranks of the job (unchanged by migrations).
        rank: the rank this process starts with; None for a spare.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: bound on joining a group and on every collective on it, in seconds.
        device: this rank's CUDA device, for NCCL.
        graveyard: where left groups go (default: a new one).
        commands: the watcher of this process's commands (default: one on ``store``).
    """

    def __init__(
        self,
        store: Any,
        *,
        world_size: int,
        rank: int | None,
        backend: str = "gloo",
        timeout_s: float = 30.0,
        device: torch.device | None = None,
        graveyard: Graveyard | None = None,
        commands: CommandWatcher | None = None,
    ) -> None:
        self.store = store
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device
        self.rank: int | None = rank
        self.gen = 0
        self.group: dist.ProcessGroup | None = None
        self.ddps: list[ElasticDDP] = []
        self.fsdps: list[ElasticFSDP] = []
        self.subgroups: list[dist.ProcessGroup] = []  # the generation's HSDP sub-groups
        self.graveyard = graveyard or Graveyard()
        self.commands = commands or CommandWatcher(store, lambda: (self.gen, self.rank))

    def join(
        self, gen: int, rank: int, layouts: list[Any] | None, *, initial: bool = False
    ) -> None:
        """Build generation ``gen``'s group at ``rank`` (blocks until every rank joined),
        rebuild DDP on it with ``layouts`` (the bucket layouts to keep; None: DDP's own),
        rebind the FSDP modules to it, and watch for the new generation's commands."""
        group = new_group(
            self.store,
            f"g{gen}/pg",
            rank=rank,
            size=self.world_size,
            backend=self.backend,
            timeout_s=self.timeout_s,
            device=self.device,
        )
        for sub in self.subgroups:  # the last generation's, left unbroken
            self.graveyard.bury(sub, broken=False)
        self.subgroups = []
        for i, wrapped in enumerate(self.ddps):
            wrapped.rebuild(group, layouts[i] if layouts else None, initial=initial)
        for sharded in self.fsdps:
            sharded.bind(sharded.mesh_groups(group, self._sub_group(gen)))
        self.group, self.gen, self.rank = group, gen, rank
        self.commands.clear()
        self.commands.start()

    def _sub_group(self, gen: int) -> Any:
        """Builds a sub-group of generation ``gen`` (an HSDP mesh dimension's) under
        ``g{gen}/pg/{tag}``; left with the generation's group."""

        def build(tag: str, rank: int, size: int) -> dist.ProcessGroup:
            sub = new_group(
                self.store,
                f"g{gen}/pg/{tag}",
                rank=rank,
                size=size,
                backend=self.backend,
                timeout_s=self.timeout_s,
                device=self.device,
            )
            self.subgroups.append(sub)
            return sub

        return build

    def leave(self, *, broken: bool) -> None:
        """Leave the current group (kept referenced; NCCL aborted when ``broken``). A
        broken group cut a step short: the FSDP modules forget it (:meth:`ElasticFSDP.reset`)."""
        if broken:
            for sharded in self.fsdps:
                sharded.reset()
        self.graveyard.bury(self.group, broken=broken)
        for sub in self.subgroups:
            self.graveyard.bury(sub, broken=broken)
        self.group, self.subgroups = None, []

    def settle(self) -> None:
        """Keep each DDP wrapper's bucket layout once DDP settled it (at step boundaries;
        see :meth:`ElasticDDP.settle`)."""
        for wrapped in self.ddps:
            wrapped.settle()

    def layouts(self) -> list[Any]:
        """Each DDP wrapper's bucket layout (a spare receives them; survivors keep them)."""
        return [d.layout() for d in self.ddps]
