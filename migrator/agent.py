"""The job agent: starts the ranks and the warm spares, hosts the key-value store, moves ranks.

One :class:`Agent` per job, on one host (``docs/migration.md`` on several nodes). It

- hosts the job's key-value store (a c10d ``TCPStore``) in its own process, so it never dies
  with a rank;
- starts ``nproc`` active processes and ``spares`` warm spares of the same command, each
  with ``FOREWARN_*`` variables saying its slot and role;
- accepts migration commands (:meth:`Agent.submit`, reached through the local HTTP endpoint
  of :mod:`migrator.endpoint` by ``forewarn migrate`` and later by the service), assigns a
  spare and posts the command where the ranks look at their next step boundary;
- watches its processes and the survivors' reports: a rank that dies or wedges is replaced by
  a spare rebuilt from a healthy replica; with no spare left the job is paused and says so,
  and fails after ``pause_timeout_s`` (its :class:`~migrator.recovery.Recovery`
  collaborator decides, on the job's :class:`~migrator.table.JobTable`);
- reports each migration (:class:`forewarn.wire.MigrationReport`) to its log, its report
  file, its endpoint and, if given, the service;
- keeps its ranks' step timing (:meth:`Agent.timings`: medians over each rank's last
  ``timing_window`` steps, :mod:`migrator.timing`), which the service link's heartbeat carries.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from forewarn.errors import Conflict, InvalidInput, NoSpareAvailable
from forewarn.wire import JobRegistration, MigrationReason, MigrationReport, RankTimings
from migrator import protocol as P
from migrator.commands import handover_step
from migrator.endpoint import serve
from migrator.faults import FaultPlan
from migrator.nodes import (
    NodeMonitor,
    RemoteProc,
    SlotSpec,
    layout,
    say_goodbye,
    slot_env,
    spawn,
    wait_for_nodes,
)
from migrator.peerplan import ring_of
from migrator.preload import DEFAULT_PRELOAD, ForkServer, fork_server
from migrator.recovery import Recovery
from migrator.stopping import Stopper, StopRequested
from migrator.table import JobTable, Migration, Slot
from migrator.timing import DEFAULT_WINDOW, summarize, timing_key

__all__ = ["Agent", "AgentConfig", "Slot"]

log = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    """How to run one job. Timeouts in seconds."""

    command: list[str]
    nproc: int
    spares: int = 1
    job_id: str = "job"
    backend: str = "gloo"
    timeout_s: float = 30.0
    """Bound on every collective and transfer: a wedged peer is seen after it."""
    detect_grace_s: float | None = None
    """After the first sign of a failure, how long survivors have to report (None: timeout_s
    and a margin, :func:`migrator.recovery.detect_grace`). A rank that neither reports nor
    exits by then is declared wedged and killed."""
    pause_timeout_s: float = 600.0
    """How long a job waits, paused, for a spare before it fails."""
    refill_spares: bool = False
    """Start a new spare on the slot a planned or preventive migration freed (drills, or a
    cluster that swaps or checks the GPU before it is reused)."""
    host: str = "127.0.0.1"
    kv_port: int = 0
    http_port: int | None = 0
    """Port of the local command endpoint; 0 picks one, None serves none."""
    service_url: str | None = None
    service_timeout_s: float = 5.0
    """Bound on each post to ``service_url`` (sent from a thread, never from the watch loop)."""
    faults: FaultPlan | None = None
    log_dir: Path | None = None
    report_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0] or "localhost")
    nnodes: int = 1
    """Launchers of the job, this one (node rank 0, the coordinator) included: it waits for
    the others (``join_timeout_s``) and hosts the key-value store on ``host:kv_port`` for them."""
    join_timeout_s: float = 300.0
    node_timeout_s: float | None = None
    """A node whose launcher is silent this long is lost with its processes (None: the
    smaller of timeout_s and 10 s; launchers beat every 0.2 s)."""
    checkpoint_dir: Path | None = None
    """Where the ranks write one consistent checkpoint when the job stops at a step boundary
    (no spare came, a crash loop, the launcher stopped); None: none (migrator.checkpoint)."""
    resume_from: Path | None = None
    """A checkpoint (file, or directory: its latest) the active ranks start from."""
    timing_window: int = DEFAULT_WINDOW
    """Steps each rank's timing medians are taken over (:meth:`Agent.timings`)."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """What the job's fork server imports before it forks the processes of a Python command
    (:mod:`migrator.preload`: a spare or a replacement starts with torch imported); empty:
    every process starts on its own."""


class Agent:
    """Run a job; see the module docstring. Use :meth:`run` (blocks until the job ends).

    Built from collaborators: the job's :class:`~migrator.table.JobTable` (slots, roster,
    status), a :class:`~migrator.recovery.Recovery` for unplanned failures (it gets the
    key-value store, the table, the config and this agent as its
    :class:`~migrator.recovery.Supervisor`), a :class:`~migrator.stopping.Stopper` for the stop
    checkpoint, and the service ``link``.
    """

    def __init__(self, config: AgentConfig, link: Any = None) -> None:
        """``link``: the service collaborator (:class:`migrator.service_link.ServiceLink`),
        which registers the job, delivers the service's commands to :meth:`submit` and
        reports each transition; None: only the local endpoint and ``service_url`` posts."""
        self.cfg = config
        self.link = link
        self._transferring: set[str] = set()
        server = dist.TCPStore(
            config.host,
            config.kv_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=config.timeout_s + 30),
        )
        self.kv = P.as_kv_store(server)
        self.kv_address = f"{config.host}:{server.port}"
        self.lock = threading.RLock()
        self.table = JobTable(world_size=config.nproc)  # all nodes' ranks, once they joined
        self.recovery = Recovery(self.kv, self.table, config, self)
        self.stopper = Stopper(self.kv, self.table, self.recovery, config, self.lock)
        self.reports: list[MigrationReport] = []
        self.agent_url: str | None = None
        # Per migration id: how its g+1 was formed ahead (_group_record; None: unplanned).
        self.groups: dict[str, dict[str, Any] | None] = {}
        self._refills: list[tuple[int, float]] = []  # (freed slot, kill it after)
        self._aborted: list[tuple[Migration, float]] = []  # (move, report it by then)
        self._endpoint: Any = None
        self._outbox: Any = None  # migrator.service_link.Outbox, once something is posted
        self._forks: ForkServer | None = None  # started with the first process (preload)
        self.monitor: NodeMonitor | None = None  # the other nodes (several launchers)
        self._slot_config: dict[str, Any] = {}

    # The table's fields, as the endpoint, the service link and the tests read them.

    @property
    def slots(self) -> list[Slot]:
        return self.table.slots

    @property
    def gen(self) -> int:
        return self.table.gen

    @property
    def status(self) -> str:
        return self.table.status

    @property
    def message(self) -> str:
        return self.table.message

    @property
    def inflight(self) -> Migration | None:
        return self.table.inflight

    # -- processes --------------------------------------------------------------------------

    def _start_slots(self) -> None:
        """Lay the job's slots out over its nodes and start this node's processes.

        With several launchers, waits (outside the lock) for the others to say hello, then
        publishes the layout they start their own processes from.
        """
        shapes = [(self.cfg.nproc, self.cfg.spares)]
        names = [self.cfg.node]
        if self.cfg.nnodes > 1:
            hellos = wait_for_nodes(self.kv, self.cfg.nnodes, timeout_s=self.cfg.join_timeout_s)
            shapes += [(int(h["nproc"]), int(h["spares"])) for h in hellos]
            names += [str(h["name"]) for h in hellos]
        specs = layout(shapes)
        with self.lock:
            self.table.world_size = sum(n for n, _ in shapes)
            self._slot_config = {
                "kv": self.kv_address,
                "world_size": self.table.world_size,
                "job_id": self.cfg.job_id,
                "backend": self.cfg.backend,
                "timeout_s": self.cfg.timeout_s,
                "agent_url": self.agent_url or "",
                "faults": self.cfg.faults.to_json() if self.cfg.faults else "",
                "join_timeout_s": self.cfg.join_timeout_s,
                "checkpoint_dir": str(self.cfg.checkpoint_dir or ""),
                "resume_from": str(self.cfg.resume_from or ""),
                "timing_window": self.cfg.timing_window,
            }
            # Every rank's timing key exists from the start: the heartbeat reads them all in
            # one round trip (multi_get waits for a missing key).
            ranks = range(self.table.world_size)
            self.kv.multi_set([timing_key(r) for r in ranks], [b""] * len(ranks))
            # Peer copies' ring: every buddy on another node when there are several.
            placed = [(r, s.node_rank, s.local) for s in specs if (r := s.rank) is not None]
            P.put_json(self.kv, P.RING_KEY, ring_of(placed))
            if self.cfg.nnodes > 1:
                grace = self.cfg.node_timeout_s or min(self.cfg.timeout_s, 10.0)
                self.monitor = NodeMonitor(self.kv, node_timeout_s=grace)
                for n in range(1, self.cfg.nnodes):
                    self.monitor.watch(n)
                slots = [asdict(spec) for spec in specs]
                P.put_json(self.kv, P.JOB_CONFIG_KEY, {**self._slot_config, "slots": slots})
            for spec in specs:
                if spec.node_rank == 0:
                    self._spawn(spec.index, spec.rank, local=spec.local)
                else:
                    assert self.monitor is not None
                    proc = RemoteProc(self.monitor, spec.node_rank, spec.index)
                    role = "active" if spec.rank is not None else "spare"
                    node = names[spec.node_rank]
                    self.table.slots.append(
                        Slot(spec.index, role, proc, spec.rank, node, spec.local)
                    )
            self.table.roster = {s.rank: s.index for s in specs if s.rank is not None}

    def _spawn(self, index: int, rank: int | None, *, local: int | None = None) -> Slot:
        """Start slot ``index`` on this node (``local``: its index here; default: the next)."""
        if local is None:
            local = sum(1 for s in self.table.slots if s.node is None)
        spec = SlotSpec(index, 0, local, rank)
        common = {**os.environ, **self.cfg.env}
        local_world = self.cfg.nproc + self.cfg.spares
        env = {**common, **slot_env(spec, self._slot_config, local_world=local_world, node_rank=0)}
        if self._forks is None:
            self._forks = fork_server(self.cfg.command, common, self.cfg.preload)
        proc = spawn(
            self.cfg.command, env, log_dir=self.cfg.log_dir, index=index, forks=self._forks
        )
        slot = Slot(index, "active" if rank is not None else "spare", proc, rank, None, local)
        self.table.slots.append(slot)
        return slot

    def kill(self, slot: Slot) -> None:
        if slot.proc is not None and slot.proc.poll() is None:
            slot.proc.send_signal(signal.SIGKILL)
            slot.proc.wait(timeout=30)

    def registration(self) -> JobRegistration:
        with self.lock:
            live = [s for s in self.table.slots if s.role in ("active", "spare", "assigned")]
            return JobRegistration(
                job_id=self.cfg.job_id,
                world_size=self.table.world_size,
                spares=sum(1 for s in live if s.role == "spare"),
                placement=[s.placement(self.cfg.node, self.cfg.backend) for s in live],
                agent_url=self.agent_url,
            )

    def timings(self) -> RankTimings | None:
        """The ranks' step timing: medians over each one's last ``timing_window`` steps, in
        rank order; a rank moved to a spare counts from the spare's first step. None before
        any rank finished a timed step (or with no timed collective: FSDP)."""
        with self.lock:
            roster = dict(self.table.roster)
            if not roster:
                return None
            ranks = sorted(roster)
            blobs = self.kv.multi_get([timing_key(r) for r in ranks])
        return summarize(
            dict(zip(ranks, blobs, strict=True)), roster, window=self.cfg.timing_window
        )

    # -- commands ---------------------------------------------------------------------------

    def submit(
        self,
        *,
        rank: int,
        reason: str = "planned",
        migration_id: str | None = None,
        job_id: str | None = None,
        detail: str | None = None,
        spare_slot: int | None = None,
    ) -> str:
        """Move ``rank`` to a spare at the next step boundary; returns the migration id.

        Raises:
            InvalidInput: unknown job or rank, or an unplanned reason.
            Conflict: the job is not running, or another migration is in flight (retry).
            NoSpareAvailable: every spare is taken.
        """
        why = MigrationReason(reason)
        if why is MigrationReason.UNPLANNED:
            raise InvalidInput(
                "unplanned migrations are the agent's own; ask planned or preventive"
            )
        if job_id is not None and job_id != self.cfg.job_id:
            raise InvalidInput(f"this agent runs job {self.cfg.job_id!r}, not {job_id!r}")
        if not 0 <= rank < self.table.world_size:
            raise InvalidInput(f"rank {rank} is not in 0..{self.table.world_size - 1}")
        with self.lock:
            if self.table.status is not P.JobStatus.RUNNING:
                raise Conflict(
                    f"the job is {self.table.status}", details={"status": self.table.status}
                )
            if self.table.inflight is not None or self.recovery.current is not None:
                raise Conflict("another migration is in progress; retry when it ends")
            spare = self.recovery.free_spare()
            if spare_slot is not None:  # the service chose the spare (e.g. not on a drained node)
                spare = next(
                    (
                        s
                        for s in self.table.slots
                        if s.index == spare_slot
                        and s.role == "spare"
                        and s.proc
                        and s.proc.poll() is None
                    ),
                    None,
                )
            if spare is None:
                raise NoSpareAvailable(f"job {self.cfg.job_id} has no free spare")
            mid = migration_id or uuid.uuid4().hex[:12]
            replica = self.recovery.replica_for({rank})
            spare.role, spare.rank = "assigned", rank
            assignment: P.Assignment = {
                "mode": "peer",
                "gen": self.table.gen + 1,
                "rank": rank,
                "migration_id": mid,
            }
            P.put_json(self.kv, P.assign_key(spare.index), assignment)
            command: P.Command = {
                "migration_id": mid,
                "rank": rank,
                "replica": replica,
                "reason": reason,
                "spare": spare.index,
            }
            P.put_json(self.kv, P.cmd_key(self.table.gen), command)
            self.table.inflight = Migration(
                mid,
                why,
                [rank],
                {rank: self.table.roster[rank]},
                {rank: spare.index},
                self.table.gen,
                time.monotonic(),
                detail,
            )
            log.info(
                "migration %s: rank %d (slot %d) -> slot %d, %s",
                mid,
                rank,
                self.table.roster[rank],
                spare.index,
                reason,
            )
            return mid

    # -- the watch loop ---------------------------------------------------------------------

    def run(self) -> int:
        """Start the processes and supervise the job; returns the exit code (0: completed)."""
        if self.cfg.http_port is not None:
            self._endpoint = serve(self, self.cfg.host, self.cfg.http_port)
            self.agent_url = f"http://{self.cfg.host}:{self._endpoint.server_port}"
        self._start_slots()
        with self.lock:
            P.put_json(self.kv, P.roster_key(0), self.table.roster)
            self.table.status = P.JobStatus.RUNNING
        self._register()
        if self.link is not None:
            self.link.start(self)
        try:
            code = self._watch()
            if code != 0 and self.recovery.checkpoint is not None:
                said = self.stopper.await_checkpoint(self.recovery.checkpoint)
                with self.lock:
                    self.table.message += said
        except KeyboardInterrupt:  # SIGINT, or SIGTERM (forewarn launch makes it one)
            code = 130
            said = ""
            try:
                said = self.stopper.stop()
            except KeyboardInterrupt:  # a second one: stop now
                said = "; no checkpoint: interrupted again while it was being written"
            with self.lock:
                self.table.status = P.JobStatus.STOPPED
                self.table.message = "stopped by a signal" + said
        finally:
            if self.link is not None:
                self.link.stop(self)
            self._shutdown()
        return code

    def _watch(self) -> int:
        while True:
            with self.lock:
                code = self._tick()
            if code is not None:
                return code
            time.sleep(0.01)

    def _tick(self) -> int | None:
        now = time.monotonic()
        exited = {
            s.index: s.proc.returncode
            for s in self.table.slots
            if s.proc is not None and s.proc.poll() is not None and s.role != "dead"
        }
        for slot in self.table.slots:
            if slot.index not in exited:
                continue
            if slot.role == "retired" or (
                slot.role == "active"
                and exited[slot.index] == 0
                and slot.rank is not None
                and self.kv.check([P.done_key(slot.rank)])
            ):
                slot.role = "done" if slot.role == "active" else "retired"
                continue
            if slot.role in ("active", "assigned", "spare") and exited[slot.index] != 0:
                log.warning(
                    "slot %d (%s, rank %s) exited with %s",
                    slot.index,
                    slot.role,
                    slot.rank,
                    exited[slot.index],
                )
                was = slot.role
                slot.role = "dead"
                if was == "assigned":
                    self._spare_died(slot)
            elif slot.role == "active" and exited[slot.index] == 0:
                # The source of a handover exits 0 once the spare has its state.
                slot.role = "retired"
        if self.monitor is not None and self.kv.check([P.JOB_STOP_KEY]):
            raise StopRequested("another node's launcher was stopped")
        self._progress_migration()
        self._report_aborted(now)
        self._do_refills()
        self.recovery.progress(now)
        if self.table.status is P.JobStatus.FAILED:
            return 1
        active = [s for s in self.table.slots if s.role == "active"]
        ended = all(s.role in ("done", "retired", "dead", "spare") for s in self.table.slots)
        finished = any(s.role == "done" for s in self.table.slots) and self.table.inflight is None
        if not active and ended and finished:
            self.table.status = P.JobStatus.COMPLETED
            return 0
        return None

    def _spare_died(self, slot: Slot) -> None:
        m = self.table.inflight
        if m is None or slot.index not in m.targets.values():
            return
        if m.reason is MigrationReason.UNPLANNED:
            self.recovery.retarget(m, slot)  # another idle spare takes over, or the job fails
            return
        # The source trains on: the command goes first (no rank reads it again), then the
        # abort that every rank waiting at the handover step is looking for.
        self.kv.delete_key(P.cmd_key(m.gen))
        self.kv.set(P.MigrationKeys(m.migration_id).aborted, "spare died")
        self.table.inflight = None
        # Reported once the ranks standing at S say how long they stood there.
        self._aborted.append((m, time.monotonic() + self.cfg.timeout_s))

    def _report_aborted(self, now: float) -> None:
        """Report each aborted move once every rank wrote its pause at the handover step S
        (or ``timeout_s`` after the abort: a rank lost meanwhile says nothing)."""
        for item in list(self._aborted):
            m, deadline = item
            ranks = range(self.table.world_size) if m.stop is not None else range(0)
            keys = [P.MigrationKeys(m.migration_id).pause(r) for r in ranks]
            have = [k for k in keys if self.kv.check([k])]
            if len(have) < len(keys) and now < deadline:
                continue
            self._aborted.remove(item)
            self.finish(
                m,
                P.Outcome.FAILED,
                group=self._group_record(m),
                step=m.stop,
                pause_s=max((float(self.kv.get(k)) for k in have), default=0.0),
                error="the spare died during the handover; the source kept training",
            )

    def _progress_migration(self) -> None:
        m = self.table.inflight
        if m is None:
            return
        keys = P.MigrationKeys(m.migration_id)
        if (
            self.link is not None
            and m.migration_id not in self._transferring
            and self.kv.check([P.stop_key(m.gen, m.migration_id)])
        ):  # the ranks agreed on the handover step: state moves at that boundary
            self._transferring.add(m.migration_id)
            stop = int(self.kv.get(P.stop_key(m.gen, m.migration_id)))
            self.link.progress(m.migration_id, "transferring", step=stop)
        if m.reason is not MigrationReason.UNPLANNED and m.stop is None:
            # Every rank acknowledged the command: S is after the last boundary any passed.
            m.stop = handover_step(self.kv, m.migration_id, range(self.table.world_size))
            if m.stop is not None:
                self.kv.set(P.stop_key(m.gen, m.migration_id), str(m.stop))
        for rank, src in m.sources.items():
            if self.kv.check([keys.fallback(rank)]) and src is not None:
                self.kill(self.table.slots[src])  # the spare gave up on it: it must not come back
        if not all(self.kv.check([keys.received(r)]) for r in m.ranks):
            return
        others = [r for r in range(self.table.world_size) if r not in m.ranks]
        if not all(self.kv.check([keys.pause(r)]) for r in others):
            return
        reports = [
            json.loads(self.kv.get(keys.report(r)))
            for r in m.ranks
            if self.kv.check([keys.report(r)])
        ]
        if len(reports) < len(m.ranks):
            return
        pauses = [float(self.kv.get(keys.pause(r))) for r in others]
        pause = max(pauses) if pauses else max(r["joined_s"] for r in reports)
        if self.kv.check([keys.source_at]) and all("joined_at" in r for r in reports):
            # The stall the job sees: from the source's last completed step (it stood at S)
            # to the new rank's first (it joined g+1); the other ranks' pauses run within it
            # unless one of them reached S later than the source.
            source_at = float(self.kv.get(keys.source_at))
            pause = max(pause, max(r["joined_at"] for r in reports) - source_at)
        for rank in m.ranks:
            target = self.table.slots[m.targets[rank]]
            target.role = "active"
            source = m.sources.get(rank)
            if source is not None and self.table.slots[source].role == "active":
                self.table.slots[source].role = "retired"
            self.table.roster[rank] = target.index
        self.table.gen += 1
        P.put_json(self.kv, P.roster_key(self.table.gen), self.table.roster)
        self.finish(
            m,
            P.Outcome.COMPLETED,
            group=self._group_record(m),
            step=reports[0]["step"],
            pause_s=pause,
            transfer_s=max(r["transfer_s"] for r in reports),
            bytes_moved=sum(r["bytes"] for r in reports),
            steps_lost=1 if m.reason is MigrationReason.UNPLANNED else 0,
            error=None
            if all(r["source"] == "peer" for r in reports) or m.reason is MigrationReason.UNPLANNED
            else "the source failed mid-transfer; rebuilt from a replica",
        )
        self.table.inflight = None
        self.recovery.clear()
        self.table.status = P.JobStatus.RUNNING
        if self.cfg.refill_spares and m.reason is not MigrationReason.UNPLANNED:
            for src in m.sources.values():
                self._refill(src)

    def _refill(self, freed: int) -> None:
        """Start a new spare for slot ``freed``: at once on CPU; with NCCL once the process
        there has left its GPU (or was killed after ``timeout_s``; see _do_refills)."""
        self._refills.append((freed, time.monotonic() + self.cfg.timeout_s))
        if self.cfg.backend != "nccl":
            self._do_refills(wait=False)

    def _do_refills(self, *, wait: bool = True) -> None:
        # Never wait for a leaving source under the lock: the ranks need the watch loop.
        for item in list(self._refills):
            freed, deadline = item
            slot = self.table.slots[freed]
            if wait and slot.proc is not None and slot.proc.poll() is None:
                if time.monotonic() < deadline:
                    continue
                self.kill(slot)
            self._refills.remove(item)
            self._spawn(len(self.table.slots), None)
            self._register()

    # -- reporting --------------------------------------------------------------------------

    def _group_record(self, m: Migration) -> dict[str, Any] | None:
        """How generation g+1 of a planned or preventive move was formed ahead, from each
        rank's record (:meth:`Formation.record`): ``preformed`` (every rank switched to the
        group formed ahead), ``ready_at_switch`` (it was formed before any rank switched),
        ``form_s`` (the longest rendezvous), ``waited_s`` (the longest wait at the switch),
        ``abandoned`` (the move was aborted). None for an unplanned recovery."""
        if m.reason is MigrationReason.UNPLANNED:
            return None
        keys = P.MigrationKeys(m.migration_id)
        ranks = {}
        for r in range(self.table.world_size):
            if self.kv.check([keys.group(r)]):
                ranks[r] = P.get_json(self.kv, keys.group(r))
        if not ranks:
            return None
        forms = [x["form_s"] for x in ranks.values() if x.get("form_s") is not None]
        return {
            "preformed": len(ranks) == self.table.world_size
            and all(x["formed"] and not x.get("abandoned") for x in ranks.values()),
            "ready_at_switch": all(x.get("ready_at_switch", False) for x in ranks.values()),
            "abandoned": any(x.get("abandoned") for x in ranks.values()),
            "form_s": max(forms) if forms else None,
            "waited_s": max((x.get("waited_s", 0.0) for x in ranks.values()), default=0.0),
            "ranks": ranks,
        }

    def finish(
        self, m: Migration, outcome: P.Outcome, group: dict[str, Any] | None = None, **fields: Any
    ) -> None:
        rank = m.ranks[0]
        src = m.sources.get(rank)
        tgt = m.targets.get(rank)
        report = MigrationReport(
            migration_id=m.migration_id,
            job_id=self.cfg.job_id,
            rank=rank,
            outcome=outcome.value,  # type: ignore[arg-type]
            source=self.table.slots[src].placement(self.cfg.node, self.cfg.backend)
            if src is not None
            else None,
            target=self.table.slots[tgt].placement(self.cfg.node, self.cfg.backend)
            if tgt is not None
            else None,
            finished_at=datetime.now(UTC),
            **fields,
        )
        self.reports.append(report)
        mb = (report.bytes_moved or 0) / 1e6
        print(
            f"forewarn launch: migration {m.migration_id} ({m.reason.value}) rank {rank} "
            f"{outcome} at step {report.step}: pause {report.pause_s or 0:.3f} s, transfer "
            f"{report.transfer_s or 0:.3f} s, {mb:.1f} MB{_said(group)}",
            file=sys.stderr,
            flush=True,
        )
        self.groups[m.migration_id] = group
        if self.cfg.report_path is not None:
            line = report.model_dump(mode="json")
            if group is not None:
                line["group"] = group
            with open(self.cfg.report_path, "a") as fh:
                fh.write(json.dumps(line) + "\n")
        if self.link is not None:
            self.link.report(report)
        else:
            self._post("/v1/migrations/reports", report.model_dump(mode="json"))

    def _register(self) -> None:
        if self.link is not None:
            self.link.register(self.registration())
        else:
            self._post("/v1/jobs", self.registration().model_dump(mode="json"))

    def _post(self, path: str, body: dict[str, Any]) -> None:
        """Queue a post to ``service_url`` (sent by the outbox's thread, never under the
        lock: a silent service must not stall the watch loop)."""
        if not self.cfg.service_url:
            return
        if self._outbox is None:
            from migrator.service_link import Outbox

            self._outbox = Outbox(self.cfg.service_url, timeout_s=self.cfg.service_timeout_s)
        self._outbox.post(path, body)

    def _shutdown(self) -> None:
        for slot in self.table.slots:
            if slot.role == "spare" and slot.proc and slot.proc.poll() is None:
                leave: P.Assignment = {"mode": "exit"}
                P.put_json(self.kv, P.assign_key(slot.index), leave)
            elif (
                self.table.status is P.JobStatus.STOPPED and slot.proc and slot.proc.poll() is None
            ):
                slot.proc.send_signal(signal.SIGTERM)  # the ranks ignore SIGINT (nodes.spawn)
        deadline = time.monotonic() + 10
        for slot in self.table.slots:
            if slot.proc is None:
                continue
            try:
                slot.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(slot)
        if self.monitor is not None:  # the other launchers leave with the job
            self.monitor.refresh(force=True)
            live = [n for n, st in self.monitor.nodes.items() if not st["lost"]]
            say_goodbye(self.kv, live, 0 if self.table.status is P.JobStatus.COMPLETED else 1)
        if self._endpoint is not None:
            self._endpoint.shutdown()
            self._endpoint.server_close()
        if self._outbox is not None:
            self._outbox.close()
        if self._forks is not None:
            self._forks.close()


def _said(group: dict[str, Any] | None) -> str:
    """The launcher's words on a move's group formed ahead."""
    if group is None:
        return ""
    if group["abandoned"]:
        return "; its g+1 group, formed ahead, abandoned"
    if not group["preformed"]:
        return "; g+1 formed at the switch"
    when = "before the switch" if group["ready_at_switch"] else "during the transfer"
    return f"; g+1 formed ahead {when} in {group['form_s'] or 0:.3f} s"
