"""The three ways a rank changes hands, as run inside each process of the job.

:class:`Handover` is a collaborator of :class:`migrator.job.Job`, built from what it needs —
the key-value store client, the job's :class:`~migrator.membership.Membership` (rank, generation,
group), the :class:`~migrator.state.Registry` of the training state, the
:class:`~migrator.channels.Channels` that open a transport per transfer, and the fault hooks —
and called by the job's loop at its step boundaries and when a collective fails:

- :meth:`Handover.hand_over` — planned or preventive, at the agreed boundary S: the source
  sends its whole state to the spare point-to-point; the other ranks wait for the spare to
  confirm, then everyone switches to generation g+1 with the spare at the source's rank, a
  group the spare and the other ranks formed while training went on on g
  (:meth:`Membership.preform`; the switch waits for it only if it is still forming). If the
  source dies mid-transfer, the spare says so and the lowest other rank (a healthy replica)
  sends its replica state instead; the source's own state comes from its mirror at S.
- :meth:`Handover.recover` — unplanned: a collective failed inside a step. The survivor
  reports to the agent and waits for its decision: a spare for each lost rank (the replica
  sends), a pause (no spare left), a refusal (rank-unique state), or "no peer was lost" (the
  error is the script's own and propagates).
- :meth:`Handover.serve_as_spare` — a spare waits for its assignment, receives the state in
  place, restores the rank state and joins the new generation.

Store keys of a migration ``id``: ``m/{id}/received/{rank}``, ``m/{id}/fallback/{rank}``,
``m/{id}/aborted``, ``m/{id}/failed``, ``m/{id}/pause/{rank}``, ``m/{id}/report/{rank}``,
``m/{id}/source_at`` (wall-clock time the source stood at S, the start of the stall) and
``m/{id}/group/{rank}`` (how this rank's g+1 was formed ahead, :meth:`Formation.record`).
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from forewarn.errors import MigrationError, NoSpareAvailable, StateNotReplicated
from migrator import protocol as P
from migrator.channels import Channels
from migrator.faults import FaultPlan, Point
from migrator.membership import Membership
from migrator.peercopy import PeerCopies
from migrator.state import Registry, peek_step, restore_rank_state
from migrator.transport import TransferStats

__all__ = ["Checkpointer", "FaultHooks", "Handover", "PlanHooks", "mirror_at"]

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[MigrationError]] = {
    StateNotReplicated.code: StateNotReplicated,
    NoSpareAvailable.code: NoSpareAvailable,
}


def _raise_failed(kv: P.KVStore, key: str) -> None:
    info = P.get_json(kv, key)
    cls = _ERRORS.get(info.get("code", ""), MigrationError)
    raise cls(info.get("message", "migration failed"), details=info)


class FaultHooks(Protocol):
    """The fault-injection points a handover fires (tests and demos)."""

    def due(self, where: Point, rank: int, step: int) -> bool:
        """Whether a fault is planned at this point."""
        ...

    def watches(self, where: Point) -> bool:
        """Whether any fault is planned at this kind of point."""
        ...

    def fire(self, where: Point, rank: int, step: int) -> None:
        """Fire what is planned here (each fault once per job)."""
        ...


class PlanHooks:
    """:class:`FaultHooks` from a :class:`~migrator.faults.FaultPlan`, its firings counted in
    ``kv``; ``target`` is what a ``migrate`` fault asks (the job: ``request_migration``)."""

    def __init__(self, plan: FaultPlan, kv: P.KVStore, target: Any) -> None:
        self.plan = plan
        self.kv = kv
        self.target = target

    def due(self, where: Point, rank: int, step: int) -> bool:
        return bool(self.plan.due(where, rank, step))

    def watches(self, where: Point) -> bool:
        return any(f.where == where for f in self.plan.faults)

    def fire(self, where: Point, rank: int, step: int) -> None:
        self.plan.fire(where, rank, step, kv=self.kv, job=self.target)


class Checkpointer(Protocol):
    """Writes the stop checkpoint (see :mod:`migrator.checkpoint`)."""

    def at_stop(self, plan: P.CheckpointPlan, *, step: int, snapshot: bytes | None) -> str | None:
        """Take part in checkpoint ``plan`` at boundary ``step`` with this rank's state
        ``snapshot``; returns the path if this rank wrote it. Never raises."""
        ...


class Handover:
    """Planned, preventive and unplanned handovers of one process; see the module docstring.

    Args:
        kv: a client of the agent's key-value store.
        member: this process's rank, generation and group (shared with the job).
        registry: the training state (the job fills it when the script registers).
        channels: opens the transport of each transfer.
        faults: fault-injection hooks.
        slot: this process's slot, its identity for the agent.
        timeout_s: bound on every transfer and wait, in seconds.
        join_timeout_s: how long a source waits for a spare still starting.
        note: records an event of this process (``note("retired", rank=..., ...)``).
        checkpointer: writes the stop checkpoint (None: the job writes none).
    """

    def __init__(
        self,
        *,
        kv: P.KVStore,
        member: Membership,
        registry: Registry,
        channels: Channels,
        faults: FaultHooks,
        slot: int,
        timeout_s: float,
        join_timeout_s: float = 300.0,
        note: Callable[..., None] = lambda event, **fields: None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self.kv = kv
        self.member = member
        self.registry = registry
        self.channels = channels
        self.faults = faults
        self.slot = slot
        self.timeout_s = timeout_s
        self.join_timeout_s = join_timeout_s
        self.note = note
        self.checkpointer = checkpointer
        self.stop: int | None = None  # the step S of the command this rank agreed on
        self.ahead_bytes = 0  # optimizer state a spare allocated before its assignment
        self.cmd: P.Command | None = None
        self.peers: PeerCopies | None = None  # the job's peer copies, if it keeps them
        self.rewind: int | None = None  # the step a recovery went back to (peer copies)
        member.ready = self._spare_up
        member.on_source = self._forming_fault

    def _forming_fault(self, cmd: P.Command) -> None:
        """A ``forming`` fault: the source of ``cmd`` fails while g+1 forms without it."""
        rank, step = self.member.rank, self.member.commands.passed
        if rank is not None and self.faults.due("forming", rank, step):
            self.faults.fire("forming", rank, step)

    def _spare_up(self, cmd: P.Command) -> bool:
        """In the thread forming g+1 ahead: wait until the move's spare is up (it may still
        be importing torch, longer than the rendezvous timeout); False: the move was aborted."""
        mid = cmd["migration_id"]
        keys = [P.ready_key(cmd["spare"]), P.MigrationKeys(mid).aborted]
        got = P.first_present(self.kv, keys, timeout_s=self.join_timeout_s, what="spare")
        return got == keys[0]

    @property
    def _bound(self) -> float:
        return 4 * self.timeout_s + 30

    def _join(
        self, gen: int, rank: int, plans: list[Any] | None, migration_id: str | None = None
    ) -> float:
        """Switch to generation ``gen`` (formed ahead for ``migration_id``, if given);
        returns the seconds the switch waited for a formation still under way."""
        t = time.perf_counter()
        formation = self.member.formation
        pending = formation is not None and not formation.done.is_set()
        self.member.join(gen, rank, plans, migration_id=migration_id)
        self.stop, self.cmd = None, None
        used = self.member.used
        waited = time.perf_counter() - t if pending and used is not None else 0.0
        if used is not None:
            record = used.record()
            record.update(waited_s=waited, ready_at_switch=not pending)
            P.put_json(self.kv, P.MigrationKeys(used.migration_id).group(rank), record)
        return waited

    def _turned_unplanned(self, gen: int, mid: str) -> bool:
        """Whether the agent took move ``mid`` of generation ``gen`` over as an unplanned
        recovery (its source was lost before S)."""
        key = P.recovery_key(gen)
        if not self.kv.check([key]):
            return False
        decision: P.RecoveryDecision = P.get_json(self.kv, key)
        return bool(
            decision.get("status") == P.Decision.PLAN and decision.get("migration_id") == mid
        )

    def _abandon(self, mid: str) -> None:
        """The move ``mid`` will not happen: its g+1 formed ahead is left (kept referenced),
        and the report of the aborted move says how far it got."""
        formation = self.member.abandon()
        if formation is not None and self.member.rank is not None:
            record = formation.record()
            record.update(abandoned=True)
            P.put_json(self.kv, P.MigrationKeys(mid).group(self.member.rank), record)

    # -- sending ----------------------------------------------------------------------------

    def _send(self, prefix: str, *, step: int, rank_state: bytes | None) -> TransferStats:
        rank = self.member.rank or 0
        fire = None
        if self.faults.due("transfer", rank, step):

            def fire(i: int) -> None:
                if i == 0:
                    self.faults.fire("transfer", rank, step)

        meta = self.registry.meta()
        meta.update(step=step, rank_state=rank_state, bucket_plans=self.member.bucket_plans())
        tensors = [t for _, t in self.registry.tensors()]
        with self.channels.open(prefix, sender=True, on_tensor=fire) as transport:
            return transport.send(meta, tensors, timeout_s=self.timeout_s)

    def _receive(self, prefix: str, rank: int) -> tuple[dict[str, Any], TransferStats]:
        at: dict[str, int] = {}

        def prepare(meta: dict[str, Any]) -> Any:
            at["step"] = meta["step"]
            return self.registry.prepare(meta["manifest"])

        def fire(i: int) -> None:  # a "receive" fault: this spare dies mid-transfer
            if i == 0:
                self.faults.fire("receive", rank, at["step"])

        hook = fire if self.faults.watches("receive") else None
        with self.channels.open(prefix, sender=False, on_tensor=hook) as transport:
            return transport.recv(prepare, timeout_s=self.timeout_s)

    # -- planned / preventive ---------------------------------------------------------------

    def await_stop(self, cmd: P.Command, k: int, *, snapshot: bytes) -> bool:
        """Learn S for ``cmd`` at boundary ``k``; False: no handover (aborted, or a peer was
        lost meanwhile and this rank took part in the recovery; step ``k`` runs next)."""
        mid = cmd["migration_id"]
        commands = self.member.commands
        while True:
            got = commands.await_stop(cmd, world_size=self.member.world_size, timeout_s=self._bound)
            if isinstance(got, int):
                self.cmd, self.stop = cmd, got
                return True
            keys = P.MigrationKeys(mid)
            if got == keys.aborted:
                commands.abort(mid)
                self._abandon(mid)
                return False
            if got == keys.failed:
                info = P.get_json(self.kv, got)
                raise MigrationError(info.get("message", "migration failed"), details=info)
            if got == P.suspect_key(cmd["gen"]):
                # Standing at a boundary, this rank is in no collective that could fail:
                # it reports to the agent like a rank whose collective failed.
                lost = RuntimeError("a peer was lost while the ranks waited for the handover")
                if self.recover(lost, k, stepped=False, snapshot=snapshot):
                    return False
                continue

    def hand_over(self, step: int, *, snapshot: bytes | None, t0: float) -> None:
        """Run the handover of the agreed command at its step S (this boundary).

        ``snapshot``: this rank's state at S; ``t0``: when this rank reached S (the pause as
        the ranks see it runs from there to the new generation joined). The source leaves
        with ``SystemExit(0)`` once the spare has its state.
        """
        cmd, member = self.cmd, self.member
        assert cmd is not None and member.rank is not None
        if cmd.get("kind") == "stop":
            self._stop_here(cmd, step, snapshot)
        mid, src, replica = cmd["migration_id"], cmd["rank"], cmd["replica"]
        keys = P.MigrationKeys(mid)
        outcomes = [keys.received(src), keys.fallback(src), keys.aborted, keys.failed]
        if member.rank == src:
            # The stall the job sees starts here: this rank's last step before S is done.
            self.kv.set(keys.source_at, repr(time.time() - (time.perf_counter() - t0)))
            try:
                if "spare" in cmd:  # a spare still starting (importing torch) is waited for
                    ready = [P.ready_key(cmd["spare"]), keys.aborted]
                    P.first_present(self.kv, ready, timeout_s=self.join_timeout_s, what="spare")
                self._send(keys.peer_prefix, step=step, rank_state=snapshot)
            except (RuntimeError, MigrationError) as exc:
                log.warning("sending rank %d to the spare failed: %s", src, exc)
            got = P.first_present(self.kv, outcomes, timeout_s=self._bound, what="the spare")
            if got == keys.aborted:  # the spare died: this rank trains on
                self.kv.set(keys.pause(member.rank), repr(time.perf_counter() - t0))
                member.commands.abort(mid)
                self.stop, self.cmd = None, None
                return
            member.commands.close()
            if self.peers is not None:  # this boundary's copies, sent and received
                self.peers.wait()
            self.note("retired", rank=src, step=step, migration=mid)
            member.leave(broken=False)
            raise SystemExit(0)
        got = P.first_present(self.kv, outcomes, timeout_s=self._bound, what="the spare")
        if got == keys.aborted:  # the pause this rank stood at S, for the report
            self._abandon(mid)
            self.kv.set(keys.pause(member.rank), repr(time.perf_counter() - t0))
            member.commands.abort(mid)
            self.stop, self.cmd = None, None
            return
        if got == keys.failed:
            _raise_failed(self.kv, got)
        if got == keys.fallback(src):
            if member.rank == replica:
                self._send(keys.replica_prefix(src), step=step, rank_state=None)
            got = P.first_present(
                self.kv, [outcomes[0], outcomes[3]], timeout_s=self._bound, what="the spare"
            )
            if got == keys.failed:
                _raise_failed(self.kv, got)
        plans = member.bucket_plans()
        member.graveyard.bury(member.group, broken=False)
        self._join(member.gen + 1, member.rank, plans, migration_id=mid)
        self.kv.set(keys.pause(member.rank), repr(time.perf_counter() - t0))

    def _stop_here(self, cmd: P.Command, step: int, snapshot: bytes | None) -> NoReturn:
        """The job stops at this boundary (the launcher was stopped): hand this rank's state
        to the stop checkpoint and leave."""
        plan = cmd["checkpoint"]
        if self.checkpointer is not None:
            self.checkpointer.at_stop(plan, step=step, snapshot=snapshot)
        elif self.member.rank == plan["writer"]:
            self.kv.set(P.CheckpointKeys(plan["id"]).failed, "no checkpoint directory")
        self.member.commands.close()
        self.note("stopped", rank=self.member.rank, step=step)
        raise SystemExit(0)

    # -- unplanned --------------------------------------------------------------------------

    def recover(
        self, exc: BaseException, step: int, *, stepped: bool, snapshot: bytes | None
    ) -> bool:
        """Handle a failed collective at ``step``; True: the step is to be run again.

        ``stepped``: this rank's optimizer stepped in the failed step (the agent refuses to
        rebuild then); ``snapshot``: this rank's state at the step's boundary, put back
        before the step runs again.
        """
        member = self.member
        if member.group is None or member.rank is None:
            return False
        t0 = time.perf_counter()
        gen, rank = member.gen, member.rank
        member.sever()  # the peers still waiting on this rank learn of the failure now
        report: P.SurvivorReport = {
            "step": step,
            "stepped": stepped,
            "slot": self.slot,
            "error": str(exc),
        }
        P.put_json(self.kv, P.alive_key(gen, rank), report)
        self.kv.add(P.alive_count_key(gen), 1)
        log.warning("rank %d: a collective failed at step %d (%s)", rank, step, exc)
        key = P.recovery_key(gen)
        P.first_present(self.kv, [key], timeout_s=self._bound, what="the agent")
        decision: P.RecoveryDecision = P.get_json(self.kv, key)
        paused_said = False
        while decision["status"] == P.Decision.PAUSED:
            if not paused_said:
                log.error("rank %d waits: %s", rank, decision.get("message"))
                paused_said = True
            time.sleep(0.1)
            decision = P.get_json(self.kv, key)
        if decision["status"] == P.Decision.NONE:
            return False
        if decision["status"] == P.Decision.FAILED:
            plan = decision.get("checkpoint")
            if plan is not None and self.checkpointer is not None:
                # Every survivor stands at the boundary of the failed step, whose optimizer
                # step never ran: its replica state and its snapshot are that boundary's.
                self.checkpointer.at_stop(plan, step=step, snapshot=snapshot)
            cls = _ERRORS.get(decision.get("code", ""), MigrationError)
            raise cls(decision.get("message", "recovery failed"), details=decision) from exc
        # A spare takes each lost rank; this rank redoes the step from its boundary state.
        plans = member.bucket_plans()
        member.leave(broken=True)
        rewind = decision.get("rewind")
        if rewind is not None:  # every rank goes back to its own copy of that boundary
            assert self.peers is not None
            self.peers.restore(rewind)
            self.peers.forget_after(rewind)
        else:
            assert snapshot is not None
            restore_rank_state(snapshot, self.registry.data)
        self.registry.zero_grad()
        mid = decision["migration_id"]
        for lost in decision["replacements"]:
            sender = decision.get("senders", {}).get(str(lost), decision["replica"])
            self._await_spare(
                mid,
                lost,
                step,
                sender=rank == sender,
                copy_of=rewind,
                from_move=bool(decision.get("from_move")),
            )
        self._join(decision["gen"], rank, plans)
        self.rewind = rewind
        self.kv.set(P.MigrationKeys(mid).pause(rank), repr(time.perf_counter() - t0))
        self.note("recovered", rank=rank, step=step, migration=mid)
        return True

    def _await_spare(
        self,
        mid: str,
        lost: int,
        step: int,
        *,
        sender: bool,
        copy_of: int | None = None,
        from_move: bool = False,
    ) -> None:
        """Wait until a spare holds rank ``lost``; the replica (``sender``) sends it the state
        (``copy_of``: the buddy sends its copy of that boundary instead, peer copies).

        A spare that dies while it receives is replaced by the agent with another one (a new
        attempt, announced under :meth:`protocol.MigrationKeys.attempt`); the replica sends again.
        ``from_move``: the spare is a move's, which may still wait on the lost source for up
        to the timeout; the replica sends once it has fallen back (``fallback``), so that its
        own wait for the spare does not run out first.
        """
        m = P.MigrationKeys(mid)
        attempt = 0
        if sender and from_move:
            keys = [m.fallback(lost), m.received(lost), m.failed, m.attempt(lost, 1)]
            got = P.first_present(
                self.kv, keys, timeout_s=self._bound, what=f"the spare for {lost} to fall back"
            )
            if got == m.received(lost):
                return
            if got == m.failed:
                _raise_failed(self.kv, got)
            if got == m.attempt(lost, 1):  # that spare died: the next one
                attempt = 1
        while True:
            if sender:
                try:
                    prefix = m.replica_prefix(lost, attempt)
                    if copy_of is not None and self.peers is not None:
                        self.peers.send_held(prefix, copy_of)
                    else:
                        self._send(prefix, step=step, rank_state=None)
                except (RuntimeError, MigrationError, KeyError) as exc:
                    log.warning("sending rank %d (attempt %d) failed: %s", lost, attempt, exc)
            keys = [m.received(lost), m.failed, m.attempt(lost, attempt + 1)]
            got = P.first_present(
                self.kv, keys, timeout_s=self._bound, what=f"the spare for {lost}"
            )
            if got == keys[0]:
                return
            if got == keys[1]:
                _raise_failed(self.kv, got)
            attempt += 1

    # -- spare ------------------------------------------------------------------------------

    def _allocate_ahead(self) -> None:
        """Allocate the optimizer state of the manifest rank 0 published, so that the
        transfer lands in memory this spare has already touched (Registry.preallocate)."""
        t = time.perf_counter()
        try:
            nbytes = self.registry.preallocate(pickle.loads(self.kv.get(P.MANIFEST_KEY)))
        except (MigrationError, RuntimeError) as exc:  # another model, or out of memory
            self.registry.ahead.clear()
            log.warning("spare: no optimizer state allocated ahead: %s", exc)
            return
        self.ahead_bytes = nbytes
        log.info(
            "spare: %.1f MB of optimizer state allocated ahead in %.2f s",
            nbytes / 1e6,
            time.perf_counter() - t,
        )

    def mirror_at(self, rank: int, step: int) -> bytes:
        """Rank ``rank``'s mirrored state at boundary ``step``: written at that boundary or
        inside the step before it (the rank may have died after that step's last collective,
        before it reached the boundary)."""
        return mirror_at(self.kv, rank, step)

    def serve_as_spare(self) -> int:
        """Wait for an assignment, take the rank over; returns the step to run next.

        Raises:
            SystemExit: the agent told this spare to leave (the job ended).
            StateNotReplicated: the rank's state is rank-unique and its source is gone.
        """
        key = P.assign_key(self.slot)
        self.kv.set(P.ready_key(self.slot), "1")
        ahead = bool(self.member.fsdps)  # shards depend on the rank: nothing to allocate yet
        while not self.kv.check([key]):
            # Each check is bounded by the key-value store's timeout: if the agent is gone,
            # it raises.
            if not ahead and self.kv.check([P.MANIFEST_KEY]):
                ahead = True
                self._allocate_ahead()
            time.sleep(0.02)
        a: P.Assignment = P.get_json(self.kv, key)
        if a["mode"] == "exit":
            raise SystemExit(0)
        t0 = time.perf_counter()
        mid, rank = a["migration_id"], a["rank"]
        keys = P.MigrationKeys(mid)
        source = "peer"
        if a["mode"] == "peer" and self.member.form_ahead:  # g+1 formed while the state comes
            self.member.preform(a["gen"], rank, mid)
        for sharded in self.member.fsdps:  # a rank's shards depend on its rank
            sharded.shard(rank, self.member.world_size, None, self.registry.optimizers)
        try:
            if a["mode"] != "peer":
                raise MigrationError("rebuilding from a replica")
            meta, stats = self._receive(keys.peer_prefix, rank)
            rank_state = meta["rank_state"]
        except (RuntimeError, MigrationError) as exc:
            if a["mode"] == "peer":
                log.warning("spare: the source of rank %d failed mid-transfer: %s", rank, exc)
            holders = self.registry.holders
            copied = a["mode"] == "replica" and self.registry.peer_copies  # a buddy's copy
            if (
                self.registry.rank_unique
                and not copied
                and (holders is None or len(holders(rank)) < 2)
            ):
                msg = f"rank {rank} holds rank-unique state and its source is gone"
                failure = {"code": StateNotReplicated.code, "message": msg}
                P.put_json(self.kv, keys.failed, failure)
                raise StateNotReplicated(msg) from exc
            source = "replica"
            if a["mode"] == "peer":
                self.kv.set(keys.fallback(rank), str(exc)[:500])
            meta, stats = self._receive(keys.replica_prefix(rank, a.get("attempt", 0)), rank)
            # A buddy's copy carries the rank's own state; a replica's comes from the mirror.
            rank_state = meta.get("rank_state") or self.mirror_at(rank, meta["step"])
        self.registry.apply_meta(meta)
        step = restore_rank_state(rank_state, self.registry.data)
        if step != meta["step"]:
            raise MigrationError(f"rank {rank}'s state is at step {step}, not {meta['step']}")
        if self.peers is not None:  # its own copy of this step; the ward's are lost
            self.peers.took_over(rank, step, rank_state, planned=a["mode"] == "peer")
        self.kv.set(keys.received(rank), str(self.slot))
        # The group formed ahead is the move's only if the move went on as planned: a source
        # lost before S turned it into an unplanned recovery, whose ranks build g+1 anew.
        planned = a["mode"] == "peer" and not self._turned_unplanned(a["gen"] - 1, mid)
        waited = self._join(a["gen"], rank, meta["bucket_plans"], mid if planned else None)
        joined_at = time.time()
        # From the first byte received to the new generation joined: the agent uses it as
        # the pause only when there is no other rank to measure it (a one-rank job).
        joined_s = time.perf_counter() - t0 - stats.wait_s
        report: dict[str, Any] = {"step": step, "bytes": stats.bytes}
        report.update(transfer_s=stats.seconds)
        report.update(joined_s=joined_s)
        report.update(source=source, slot=self.slot, ahead_bytes=self.ahead_bytes)
        used = self.member.used
        report.update(joined_at=joined_at, preformed=used is not None, group_waited_s=waited)
        self.kv.set(keys.report(rank), json.dumps(report))
        self.note("took over", rank=rank, migration=mid, **report)
        return step


def mirror_at(kv: P.KVStore, rank: int, step: int) -> bytes:
    """Rank ``rank``'s mirrored state at boundary ``step`` (see :meth:`Handover.mirror_at`).

    Raises:
        MigrationError: the mirror is not at ``step`` (or none was written).
    """
    key = P.mirror_key(rank, step)
    if not kv.check([key]):
        raise MigrationError(f"rank {rank} mirrored no state for step {step}")
    blob: bytes = kv.get(key)
    at = peek_step(blob)
    if at != step:
        raise MigrationError(f"rank {rank}'s mirror for step {step} is at step {at}")
    return blob
