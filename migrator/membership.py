"""This process's place in the job: its rank, its generation and that generation's group.

A :class:`Membership` is the one owner of what changes when ranks change hands: the rank this
process holds (None for a spare), the process-group generation ``g`` and its group, the
``ElasticDDP`` wrappers rebuilt and the ``ElasticFSDP`` modules rebound on each new group,
the :class:`~migrator.groups.Graveyard` that keeps left groups referenced, and the
:class:`~migrator.commands.CommandWatcher` that looks for the generation's commands. The
job's loop and its handover procedures (:class:`migrator.handover.Handover`) both hold the
same membership; neither owns the other.

A planned or preventive move forms its generation ahead (:meth:`Membership.preform`): as
soon as a rank's watcher sees the command, and a spare its assignment, a thread of that
process builds generation g+1's group (and its HSDP / tensor-parallel sub-groups) under the
migration's own prefix ``g{g+1}/m/{id}/pg`` while the training loop goes on on g. The
switch at S then only takes the formed group (:meth:`Membership.join` with the migration's
id). A move that does not happen (aborted, or turned into an unplanned recovery) abandons
the formation: its group, formed or not, stays referenced in the graveyard (NCCL aborted),
and a later generation never reads its keys (they are under the migration's prefix).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from migrator import protocol as P
from migrator.commands import CommandWatcher
from migrator.ddp import ElasticDDP
from migrator.fsdp import ElasticFSDP
from migrator.groups import Graveyard, new_group, sever

__all__ = ["Formation", "Membership"]

log = logging.getLogger(__name__)


class Formation:
    """Generation ``gen``'s group at ``rank`` being formed ahead for migration ``migration_id``
    by a background thread (see the module docstring).

    ``form_s``: seconds the rendezvous took once every member was known to be up;
    ``formed_at``: wall-clock time it ended (None while forming); ``error``: why it failed.
    """

    def __init__(self, gen: int, rank: int, migration_id: str) -> None:
        self.gen, self.rank, self.migration_id = gen, rank, migration_id
        self.group: dist.ProcessGroup | None = None
        self.mesh: list[list[dist.ProcessGroup]] = []  # per ElasticFSDP, its mesh's groups
        self.subgroups: list[dist.ProcessGroup] = []
        self.form_s: float | None = None
        self.formed_at: float | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.abandoned = False
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        return formation_prefix(self.gen, self.migration_id)

    def record(self) -> dict[str, Any]:
        """What a report says of it: the rank, whether it was formed, how long it took."""
        return {
            "rank": self.rank,
            "formed": self.group is not None,
            "form_s": self.form_s,
            "formed_at": self.formed_at,
            "error": None if self.error is None else str(self.error)[:300],
        }


def _own_client(kv: P.KVStore, timeout_s: float) -> P.KVStore:
    """Another client of ``kv``'s server (a TCPStore; any other store is shared)."""
    if not isinstance(kv, dist.TCPStore):
        return kv
    return P.as_kv_store(
        dist.TCPStore(
            kv.host,
            kv.port,
            is_master=False,
            timeout=timedelta(seconds=max(timeout_s, 30.0)),
            wait_for_workers=False,
        )
    )


def formation_prefix(gen: int, migration_id: str) -> str:
    """See :func:`protocol.formation_prefix`."""
    return P.formation_prefix(gen, migration_id)


class Membership:
    """The rank, generation and process group of one process of the job.

    Args:
        kv: a client of the job's key-value store (generations rendezvous under ``g{g}/pg``).
        world_size: active ranks of the job (unchanged by migrations).
        rank: the rank this process starts with; None for a spare.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: bound on joining a group and on every collective on it, in seconds.
        device: this rank's CUDA device, for NCCL.
        graveyard: where left groups go (default: a new one).
        commands: the watcher of this process's commands (default: one on ``kv``).
    """

    def __init__(
        self,
        kv: P.KVStore,
        *,
        world_size: int,
        rank: int | None,
        backend: str = "gloo",
        timeout_s: float = 30.0,
        device: torch.device | None = None,
        graveyard: Graveyard | None = None,
        commands: CommandWatcher | None = None,
    ) -> None:
        self.kv = kv
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
        self.commands = commands or CommandWatcher(kv, lambda: (self.gen, self.rank))
        self.commands.on_command = self._on_command
        self.commands.formed = self._formed_by_all
        self.commands.on_abort = lambda mid: self.abandon()
        self.formation: Formation | None = None  # the next generation's, formed ahead
        self.used: Formation | None = None  # the formation the last switch took
        self.ready: Callable[[P.Command], bool] = lambda cmd: True
        self.on_source: Callable[[P.Command], Any] = lambda cmd: None  # a fault point
        # False: a move's g+1 is formed at the switch, after the transfer (the way it was
        # before; benchmarks/migration.py measures both).
        self.form_ahead = True

    # -- formed ahead -------------------------------------------------------------------------

    def _on_command(self, cmd: P.Command) -> bool:
        """The watcher saw ``cmd``: a move to a spare forms g+1 ahead, here unless this rank
        is the source (it leaves); True: the command waits until every member formed it.
        That is when the spare is up; a spare still starting (importing torch) is waited
        for at S as before, the formation going on meanwhile and the switch waiting for it
        if it has to. A stop command has no next generation."""
        rank = self.rank
        if not self.form_ahead or rank is None or "spare" not in cmd or cmd.get("kind") == "stop":
            return False
        if cmd["rank"] != rank:
            ready = self.ready
            self.preform(cmd["gen"] + 1, rank, cmd["migration_id"], before=lambda: ready(cmd))
        else:
            self.on_source(cmd)
        return bool(self.kv.check([P.ready_key(cmd["spare"])]))

    def _formed_keys(self, migration_id: str) -> list[str]:
        return [P.MigrationKeys(migration_id).formed(r) for r in range(self.world_size)]

    def _formed_by_all(self, cmd: P.Command) -> bool:
        """Every member of the move's g+1 (the spare at the source's rank) is done forming
        it, formed or failed."""
        keys = self._formed_keys(cmd["migration_id"])
        return all(self.kv.check([k]) for k in keys)

    def preform(
        self,
        gen: int,
        rank: int,
        migration_id: str,
        *,
        before: Callable[[], bool] = lambda: True,
    ) -> Formation:
        """Start forming generation ``gen``'s group at ``rank`` for ``migration_id`` in a
        thread; ``before`` runs first in it (waits until every member is up; False: give up).
        A formation already running for another move is abandoned."""
        old = self.formation
        if old is not None:
            if old.migration_id == migration_id and old.gen == gen:
                return old
            self.abandon()
        formation = Formation(gen, rank, migration_id)

        # A client of its own: a blocking wait of the main thread (a spare waiting for its
        # state) holds the shared client's lock, which the rendezvous would wait behind.
        kv = _own_client(self.kv, self.timeout_s)

        def run() -> None:
            try:
                if not before():
                    raise RuntimeError("the move ended before its group was formed")
                t = time.perf_counter()
                group = new_group(
                    kv,
                    formation.prefix,
                    rank=rank,
                    size=self.world_size,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                    device=self.device,
                    severable=True,
                )
                mesh = [
                    sharded.mesh_groups(group, self._sub_group(formation.prefix, formation, kv))
                    for sharded in self.fsdps
                ]
                formation.form_s = time.perf_counter() - t
                formation.formed_at = time.time()
                with formation._lock:
                    formation.group, formation.mesh = group, mesh
                    if formation.abandoned:  # abandoned while it formed
                        self._bury(formation)
            except Exception as exc:  # every member learns it: g+1 is then built at the switch
                formation.error = exc
                log.warning("forming generation %d ahead failed: %s", gen, exc)
            finally:
                formation.done.set()
                ok = "1" if formation.group is not None else "0"
                try:
                    kv.set(P.MigrationKeys(migration_id).formed(rank), ok)
                except (RuntimeError, OSError) as exc:  # the key-value store is gone
                    log.warning("could not say that generation %d was formed: %s", gen, exc)

        formation.thread = threading.Thread(target=run, name="forewarn-preform", daemon=True)
        self.formation = formation
        formation.thread.start()
        return formation

    def abandon(self) -> Formation | None:
        """The move that formed the next generation ahead will not happen: its group (formed
        or still forming) is left referenced in the graveyard. Returns it, if there was one."""
        formation, self.formation = self.formation, None
        if formation is None:
            return None
        with formation._lock:
            formation.abandoned = True
            if formation.group is not None:
                self._bury(formation)
        self.graveyard.keep(formation)
        return formation

    def _bury(self, formation: Formation) -> None:
        self.graveyard.bury(formation.group, broken=True)
        for sub in formation.subgroups:
            self.graveyard.bury(sub, broken=True)

    def _take(self, gen: int, migration_id: str | None) -> Formation | None:
        """The formation of ``migration_id`` for ``gen`` once formed (waits for it); None
        when there is none (a formation for anything else is abandoned)."""
        formation = self.formation
        if formation is None:
            return None
        if migration_id is None or formation.migration_id != migration_id or formation.gen != gen:
            self.abandon()
            return None
        deadline = time.monotonic() + 2 * self.timeout_s + 30
        formation.done.wait(timeout=max(0.0, deadline - time.monotonic()))
        keys = self._formed_keys(migration_id)
        # Every member decides alike from the same keys, once all are written (a spare that
        # was still starting at S: the others may be finishing their rendezvous): the formed
        # group if every member formed it, else one built now under the generation's prefix.
        while not all(self.kv.check([k]) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.005)
        if not (
            formation.done.is_set()
            and all(self.kv.check([k]) and self.kv.get(k) == b"1" for k in keys)
        ):
            self.abandon()
            return None
        self.formation = None
        return formation

    def join(
        self,
        gen: int,
        rank: int,
        plans: list[Any] | None,
        *,
        initial: bool = False,
        migration_id: str | None = None,
    ) -> None:
        """Take generation ``gen``'s group at ``rank``: the one formed ahead for
        ``migration_id`` (waited for if still forming), else one built now (blocks until
        every rank joined); rebuild DDP on it with ``plans`` (the bucket plans to keep;
        None: DDP's own), rebind the FSDP modules to it, and watch for the new generation's
        commands."""
        formation = self._take(gen, migration_id)
        self.used = formation
        for sub in self.subgroups:  # the last generation's, left unbroken
            self.graveyard.bury(sub, broken=False)
        self.subgroups = []
        if formation is not None:
            assert formation.group is not None
            group = formation.group
            self.subgroups = list(formation.subgroups)
            mesh = formation.mesh
        else:
            group = new_group(
                self.kv,
                P.pg_prefix(gen),
                rank=rank,
                size=self.world_size,
                backend=self.backend,
                timeout_s=self.timeout_s,
                device=self.device,
                severable=True,
            )
            into: list[dist.ProcessGroup] = []
            mesh = [
                s.mesh_groups(group, self._sub_group(P.pg_prefix(gen), into)) for s in self.fsdps
            ]
            self.subgroups = into
        for i, wrapped in enumerate(self.ddps):
            wrapped.rebuild(group, plans[i] if plans else None, initial=initial)
        for sharded, groups in zip(self.fsdps, mesh, strict=True):
            sharded.bind(groups)
        self.group, self.gen, self.rank = group, gen, rank
        self.commands.clear()
        self.commands.start()

    def _sub_group(self, prefix: str, into: Any, kv: P.KVStore | None = None) -> Any:
        """Builds a sub-group (an HSDP or tensor-parallel mesh dimension's) under
        ``{prefix}/{tag}``, kept in ``into.subgroups`` (or the list ``into``); left with
        the generation's group."""

        def build(tag: str, rank: int, size: int) -> dist.ProcessGroup:
            sub = new_group(
                kv or self.kv,
                f"{prefix}/{tag}",
                rank=rank,
                size=size,
                backend=self.backend,
                timeout_s=self.timeout_s,
                device=self.device,
                severable=True,
            )
            (into if isinstance(into, list) else into.subgroups).append(sub)
            return sub

        return build

    def sever(self) -> None:
        """The current generation failed on this rank: shut down its groups' connections, so
        that the peers still waiting in one of its collectives fail now, not at the timeout
        (:func:`migrator.groups.sever`)."""
        cut = sum(sever(g) for g in [self.group, *self.subgroups])
        log.info("generation %d: shut down %d connection(s) to its peers", self.gen, cut)

    def leave(self, *, broken: bool) -> None:
        """Leave the current group (kept referenced; NCCL aborted when ``broken``). A
        broken group cut a step short: the FSDP modules forget it (:meth:`ElasticFSDP.reset`)."""
        if broken:
            for sharded in self.fsdps:
                sharded.reset()
        self.abandon()  # a next generation formed ahead for a move that will not happen
        self.graveyard.bury(self.group, broken=broken)
        for sub in self.subgroups:
            self.graveyard.bury(sub, broken=broken)
        self.group, self.subgroups = None, []

    def settle(self) -> None:
        """Keep each DDP wrapper's bucket plan once DDP settled it (at step boundaries;
        see :meth:`ElasticDDP.settle`)."""
        for wrapped in self.ddps:
            wrapped.settle()

    def bucket_plans(self) -> list[Any]:
        """Each DDP wrapper's bucket plan (a spare receives them; survivors keep them)."""
        return [d.bucket_plan() for d in self.ddps]
