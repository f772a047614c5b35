"""Unplanned failures: a lost or wedged rank replaced by a spare rebuilt from a replica.

A collaborator of the job agent: :class:`migrator.agent.Agent` builds one :class:`Recovery`
from its key-value store, the job's :class:`~migrator.table.JobTable` (slots, roster, status), its
settings and a :class:`Supervisor` (what it may ask of the agent: kill a process, report a
migration's end), and calls it on every tick of its watch loop. It handles what nobody
asked for:

- detection: once a rank exits or a survivor reports a failed collective, every rank of the
  generation has ``detect_grace_s`` (default: ``timeout_s`` plus the smaller of 2 s and
  ``timeout_s``) to report its last completed step; one that neither reports nor exits is
  declared wedged and killed. A rank's process
  is looked at before its report (one that reported and exited since is lost); when every
  rank reported and none exited, the last to report (the one the others waited for, back
  from a wedge longer than their timeout) is declared lost too;
- the checks before a rebuild: no rank-unique state (it is in no replica), and survivors
  agreeing on the last completed step;
- choosing the spares (a warm one first) and the healthy replica they are rebuilt from, and
  posting the recovery plan where the survivors wait for it;
- the script's own errors: every rank dead at once is the script's failure (its traceback is
  reported, nothing is rebuilt; ranks killed by a signal are said so), an error a spare
  would raise again (out of memory, any exception but a ``RuntimeError``) stops the job
  without using one, and the same error on the same rank and step after a spare took it
  over is a crash loop (the job stops instead of using up every spare);
- with too few spares, the pause (said on stderr, on the endpoint and in the key-value
  store) and the failure after ``pause_timeout_s``; and :meth:`Recovery.fail`, which ends the job.

Its own state is the recovery in progress (:attr:`Recovery.current`), the pause deadline and
the script errors seen; the rest is the table's. Call it only with the agent's lock held.
"""

from __future__ import annotations

import logging
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from forewarn.errors import NoSpareAvailable, StateNotReplicated
from forewarn.wire import MigrationReason
from migrator import protocol as P
from migrator.layouts import read_layout, senders
from migrator.peerplan import rewind_plan
from migrator.shards import latest_step
from migrator.table import JobTable, Migration, Slot

__all__ = ["Recovery", "RecoverySettings", "RecoveryState", "Supervisor", "detect_grace"]

# The agent's own logger: its records read as one stream, whichever half wrote them.
log = logging.getLogger("migrator.agent")


class RecoverySettings(Protocol):
    """The job settings a recovery reads (:class:`migrator.agent.AgentConfig` has them)."""

    job_id: str
    timeout_s: float
    detect_grace_s: float | None
    pause_timeout_s: float
    log_dir: Path | None
    checkpoint_dir: Path | None


def detect_grace(cfg: RecoverySettings) -> float:
    """How long the survivors of a failure have to report: their own collective's timeout,
    and a margin. A survivor may enter its failing collective a little after the failure
    the agent saw (its previous one, with a healthy peer, completed), and it reports only
    when that collective's timeout runs out; with no margin such a rank would be declared
    wedged the moment it reports."""
    if cfg.detect_grace_s is not None:
        return cfg.detect_grace_s
    return cfg.timeout_s + min(2.0, cfg.timeout_s)


class Supervisor(Protocol):
    """What a recovery asks of the agent that runs the job's processes."""

    def kill(self, slot: Slot) -> None:
        """SIGKILL the slot's process and wait for it."""
        ...

    def finish(self, m: Migration, outcome: P.Outcome, **fields: Any) -> None:
        """Report the end of migration ``m`` (its MigrationReport)."""
        ...


@dataclass
class RecoveryState:
    """The recovery in progress (:attr:`Recovery.current`): a failure suspected in generation
    ``gen``, then the lost ranks named. Updated in place while the ranks report (so not
    frozen); the agent's own, never on the wire (its decision is a
    :class:`~migrator.protocol.RecoveryDecision`)."""

    gen: int
    deadline: float
    """Until when (monotonic seconds) every rank of ``gen`` may report or exit."""
    decided: bool = False
    """The lost ranks were named (placing their spares may still wait: a pause)."""
    seen: dict[int, float] = field(default_factory=dict)
    """When each survivor's report was first seen (the last to report is the wedged one)."""
    dead: list[int] = field(default_factory=list)
    """The lost ranks, once decided, in order."""
    alive: dict[int, P.SurvivorReport] = field(default_factory=dict)
    """The survivors' reports, once decided."""


def _same_error(a: P.ScriptError, b: P.ScriptError) -> bool:
    return (a["rank"], a["step"], a["type"]) == (b["rank"], b["step"], b["type"])


class Recovery:
    """Failure handling of the job agent; call only with the agent's lock held.

    Args:
        kv: the job's key-value store (the agent hosts it).
        table: the job's slots, roster and status, shared with the agent.
        settings: timeouts and names (:class:`RecoverySettings`).
        supervisor: kills processes and reports migrations for the recovery.
    """

    def __init__(
        self, kv: P.KVStore, table: JobTable, settings: RecoverySettings, supervisor: Supervisor
    ) -> None:
        self.kv = kv
        self.table = table
        self.cfg = settings
        self.supervisor = supervisor
        self.current: RecoveryState | None = None
        """The recovery in progress."""
        self.pause_deadline: float | None = None
        self.script_errors: list[P.ScriptError] = []
        self._weighed: dict[int, int] = {}
        """Per generation, the survivors' reports a decision already weighed."""
        self.checkpoint: P.CheckpointPlan | None = None
        """The stop checkpoint the survivors were asked to write (see :meth:`fail`)."""
        self.why_not = ""  # why the lost ranks' state is in no healthy rank (peer copies)

    def clear(self) -> None:
        """The recovery in progress ended (its spares joined the new generation)."""
        self.current = None

    # -- choosing -----------------------------------------------------------------------------

    def free_spare(self) -> Slot | None:
        spares = self.table.live_spares()
        # A warm spare (model and optimizer allocated, waiting) first: one still starting
        # would make the ranks wait for it at the handover step.
        spares.sort(key=lambda s: not self.kv.check([P.ready_key(s.index)]))
        return spares[0] if spares else None

    def replica_for(self, lost: set[int]) -> int | None:
        """The healthy rank that sends the state of the lowest lost rank: one that holds
        the same state by the job's layout (:mod:`migrator.layouts`), else the lowest."""
        healthy = [r for r in range(self.table.world_size) if r not in lost]
        if not lost or not healthy:
            return healthy[0] if healthy else None
        first = min(lost)
        return senders(read_layout(self.kv), [first], healthy).get(first, healthy[0])

    def _unrebuildable(self, dead: list[int]) -> list[int]:
        """The lost ranks whose state no healthy rank holds: by the job's published layout
        (an HSDP rank has holders in the other replica groups; a peer-copy rank a copy in
        its buddy's memory), else every lost rank when a rank registered rank-unique
        state."""
        layout = read_layout(self.kv)
        roster = self.table.roster
        if layout is not None and layout.kind == "peer_copy":
            healthy = [r for r in range(self.table.world_size) if r not in dead]
            _, _, why = rewind_plan(self.kv, self.table.world_size, dead, healthy)
            if why:
                self.why_not = why
            return list(dead) if why else []
        if layout is None or layout.kind == "replicated":
            unique = any(self.kv.check([P.unique_key(roster[r])]) for r in roster)
            return list(dead) if unique else []
        healthy = [r for r in range(self.table.world_size) if r not in dead]
        return [r for r in dead if r not in senders(layout, dead, healthy)]

    # -- unplanned --------------------------------------------------------------------------

    def progress(self, now: float) -> None:
        g = self.table.gen
        if self.current is None:
            if (
                self.table.inflight is not None
                and self.table.inflight.reason is MigrationReason.UNPLANNED
            ):
                return
            lost = [
                s
                for s in self.table.slots
                if s.role == "dead"
                and s.rank is not None
                and self.table.roster.get(s.rank) == s.index
            ]
            reported = int(self.kv.add(P.alive_count_key(g), 0))
            # Reports already weighed by a decision of this generation start nothing new:
            # only a newly lost rank or a new report does.
            if not lost and reported <= self._weighed.get(g, 0):
                return
            self.current = RecoveryState(gen=g, deadline=now + detect_grace(self.cfg))
            self.kv.set(P.suspect_key(g), "1")  # ranks waiting for S join the recovery
            log.warning(
                "generation %d: failure suspected (%d lost, %d reports)", g, len(lost), reported
            )
        rec = self.current
        if rec.decided:
            if self.table.status is P.JobStatus.PAUSED:
                self._retry_paused(now)
            return
        alive: dict[int, P.SurvivorReport] = {}
        dead: list[int] = []
        for rank, index in self.table.roster.items():
            # The process first: a rank that reported and exited since is lost, its report
            # is no survivor's.
            if self.table.slots[index].role in ("dead", "retired", "done"):
                dead.append(rank)
            elif self.kv.check([P.alive_key(g, rank)]):
                alive[rank] = P.get_json(self.kv, P.alive_key(g, rank))
                rec.seen.setdefault(rank, now)
        undecided = [r for r in self.table.roster if r not in alive and r not in dead]
        if undecided and now < rec.deadline:
            return
        for rank in undecided:  # neither reported nor exited within the bound: wedged
            log.warning("rank %d did not answer within the bound: declared lost", rank)
            self._declare_lost(rank, dead)
        if not dead and len(alive) > 1:
            # Every rank reported a failed collective and none exited: one was stalled (a
            # SIGSTOP, a swapping host) past the others' timeout and came back. The last to
            # report is the one the others waited for; it is replaced like a wedged rank.
            late = max(alive, key=lambda r: (rec.seen[r], r))
            log.warning(
                "every rank reported a failed collective and none exited: rank %d, the last "
                "to report, was the one the others waited for: declared lost",
                late,
            )
            del alive[late]
            self._declare_lost(late, dead)
        rec.decided = True
        rec.dead = sorted(dead)
        rec.alive = alive
        self._weighed[g] = int(self.kv.add(P.alive_count_key(g), 0))
        errors = self._script_errors_of(dead)
        if dead and not alive:
            code = "script_error" if errors else "no_replica"
            self.fail(self._nobody_left(sorted(dead), errors), code=code)
            return
        for info in errors:
            if not info.get("retryable", True):
                # An out-of-memory error, a ValueError: the spare would redo the same step on
                # the same data and raise it again. Stop now, no spare used.
                self.fail(
                    f"{self._describe(info)}; the script's own error, which a spare would "
                    "raise again: no spare was used",
                    code="script_error",
                    checkpoint=True,
                )
                return
            if any(_same_error(info, seen) for seen in self.script_errors):
                self.fail(
                    f"crash loop: {self._describe(info)}, again after a spare took the rank "
                    "over; the error is the script's, not the GPU's",
                    code="crash_loop",
                    checkpoint=True,
                )
                return
        self.script_errors.extend(errors)
        if self.table.inflight is not None and set(self.table.inflight.ranks) != set(dead):
            self.fail("a rank failed during a planned migration of another rank")
            return
        if not dead:
            self.kv.delete_key(P.suspect_key(g))
            decision: P.RecoveryDecision = {"status": P.Decision.NONE}
            P.put_json(self.kv, P.recovery_key(g), decision)
            self.current = None
            return
        self.why_not = ""
        if self._unrebuildable(dead):
            self.fail(
                f"rank(s) {dead} lost; the job registered rank-unique state, which no "
                f"replica holds{self.why_not and ' (' + self.why_not + ')'}: restart from a "
                f"checkpoint{self._last_checkpoint()}",
                code=StateNotReplicated.code,
            )
            return
        steps = {a["step"] for a in alive.values()}
        if len(steps) > 1 or any(a["stepped"] for a in alive.values()):
            self.fail(
                f"survivors disagree on the last completed step ({sorted(steps)}): "
                "a collective failed after optimizer.step() on some of them"
            )
            return
        self._place_spares(now)

    def _last_checkpoint(self) -> str:
        """Where the job can go on from, said after "restart from a checkpoint": the newest
        consistent checkpoint in the job's directory (:func:`migrator.shards.latest_step`)."""
        directory = self.cfg.checkpoint_dir
        step = latest_step(directory) if directory is not None else None
        if step is None:
            return ""
        return f" (the last consistent one: step {step} in {directory}; --resume {directory})"

    def _declare_lost(self, rank: int, dead: list[int]) -> None:
        slot = self.table.slots[self.table.roster[rank]]
        self.supervisor.kill(slot)
        slot.role = "dead"
        dead.append(rank)

    def _place_spares(self, now: float) -> None:
        rec = self.current
        assert rec is not None
        g, dead = rec.gen, rec.dead
        planned = self.table.inflight
        spares = self.table.live_spares()
        if planned is not None:  # the source died before its handover: reuse its spare
            spares = [self.table.slots[planned.targets[r]] for r in dead] + spares
        if len(spares) < len(dead):
            at = min(a["step"] for a in rec.alive.values())
            msg = (
                f"job {self.cfg.job_id} paused at step {at}: "
                f"rank(s) {dead} lost and {len(spares)} spare(s) left; it fails in "
                f"{self.cfg.pause_timeout_s:.0f} s unless a spare appears"
            )
            msg += "".join(
                f"; rank {e['rank']} raised {e['type']}: {e['message'][:300]}"
                for e in self.script_errors
                if e["rank"] in dead
            )
            if self.table.status is not P.JobStatus.PAUSED:
                print(f"forewarn launch: {msg}", file=sys.stderr, flush=True)
                self.pause_deadline = now + self.cfg.pause_timeout_s
            self.table.status, self.table.message = P.JobStatus.PAUSED, msg
            paused: P.RecoveryDecision = {"status": P.Decision.PAUSED, "message": msg}
            P.put_json(self.kv, P.recovery_key(g), paused)
            return
        mid = planned.migration_id if planned is not None else uuid.uuid4().hex[:12]
        replica = self.replica_for(set(dead))
        healthy = [r for r in range(self.table.world_size) if r not in dead]
        layout = read_layout(self.kv)
        sources = senders(layout, dead, healthy)
        rewind = None
        if layout is not None and layout.kind == "peer_copy":  # from the buddies' copies
            sources, rewind, _ = rewind_plan(self.kv, self.table.world_size, dead, healthy)
        targets = {}
        for rank, spare in zip(dead, spares, strict=False):
            spare.role, spare.rank = "assigned", rank
            targets[rank] = spare.index
            if planned is None:
                assignment: P.Assignment = {
                    "mode": "replica",
                    "gen": g + 1,
                    "rank": rank,
                    "migration_id": mid,
                }
                P.put_json(self.kv, P.assign_key(spare.index), assignment)
        decision: P.RecoveryDecision = {
            "status": P.Decision.PLAN,
            "gen": g + 1,
            "replacements": dead,
            "replica": replica,
            "senders": {str(r): sources.get(r, replica) for r in dead},
            "rewind": rewind,
            "migration_id": mid,
            "from_move": planned is not None,
        }
        P.put_json(self.kv, P.recovery_key(g), decision)
        self.table.inflight = Migration(
            mid,
            MigrationReason.UNPLANNED,
            dead,
            {r: self.table.roster[r] for r in dead},
            targets,
            g,
            now,
        )
        log.warning(
            "recovery %s: rank(s) %s -> slot(s) %s from replica rank %s",
            mid,
            dead,
            list(targets.values()),
            ", ".join(str(sources.get(r, replica)) for r in dead),
        )

    def retarget(self, m: Migration, dead_spare: Slot) -> None:
        """The spare of an unplanned recovery died: give its rank to another idle spare.

        The replica sends again to the new one (a new attempt under
        :meth:`protocol.MigrationKeys.attempt`); with no spare left the job fails.
        """
        rank = next(r for r, index in m.targets.items() if index == dead_spare.index)
        spare = self.free_spare()
        if spare is None:
            self.fail(
                f"the spare taking over rank {rank} died and no other spare is left",
                code=NoSpareAvailable.code,
            )
            return
        mid = m.migration_id
        attempt = int(self.kv.add(P.MigrationKeys(mid).attempts(rank), 1))
        spare.role, spare.rank = "assigned", rank
        m.targets[rank] = spare.index
        assignment: P.Assignment = {
            "mode": "replica",
            "gen": m.gen + 1,
            "rank": rank,
            "migration_id": mid,
            "attempt": attempt,
        }
        P.put_json(self.kv, P.assign_key(spare.index), assignment)
        self.kv.set(P.MigrationKeys(mid).attempt(rank, attempt), str(spare.index))
        log.warning(
            "recovery %s: the spare in slot %d died; rank %d -> slot %d (attempt %d)",
            mid,
            dead_spare.index,
            rank,
            spare.index,
            attempt,
        )

    def _script_errors_of(self, ranks: list[int]) -> list[P.ScriptError]:
        """The exceptions the scripts of these (dead) ranks reported before they exited."""
        out = []
        for rank in sorted(ranks):
            key = P.error_key(self.table.roster[rank])
            if self.kv.check([key]):
                out.append(P.get_json(self.kv, key))
        return out

    def _describe(self, info: P.ScriptError) -> str:
        """What a rank's script raised, said once: its traceback (which ends with the type
        and message) when the ranks write to log files, else the type and message (the
        rank printed its traceback on the launcher's stderr itself)."""
        head = f"rank {info['rank']} raised {info['type']} at step {info['step']}"
        if self.cfg.log_dir is not None and info.get("traceback"):
            return f"{head}; its traceback:\n{info['traceback'].rstrip()}"
        return f"{head}: {info['message']}"

    def _nobody_left(self, dead: list[int], errors: list[P.ScriptError]) -> str:
        """Why a job whose every rank died at once cannot go on (no replica is left)."""
        if errors:
            return f"every rank exited at once; {self._describe(errors[0])}"
        slots = {r: self.table.slots[self.table.roster[r]] for r in dead}

        def how(s: Slot) -> str:
            if s.role == "done":
                return "finished"
            code = s.proc.returncode if s.proc is not None else None
            if isinstance(code, int) and code < 0:
                try:
                    return f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    return f"killed by signal {-code}"
            return f"exit {code}"

        said = ", ".join(f"rank {r}: {how(s)}" for r, s in slots.items())
        where = f" (their output: {self.cfg.log_dir})" if self.cfg.log_dir else ""
        if all(how(s).startswith("killed") for s in slots.values()):
            return (
                f"every rank was lost at once ({said}): no replica is left to rebuild from; "
                f"restart from a checkpoint{where}"
            )
        tail = ""
        if self.cfg.log_dir is not None:
            path = self.cfg.log_dir / f"slot{self.table.roster[dead[0]]}.log"
            if path.exists():
                tail = "\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
        return (
            f"no rank is left to rebuild from ({said}); the script exited without "
            f"reporting an error{where}{tail}"
        )

    def _retry_paused(self, now: float) -> None:
        assert self.current is not None
        if self.free_spare() is not None:
            self._place_spares(now)
            if self.table.status is not P.JobStatus.PAUSED:
                self.table.status = P.JobStatus.RUNNING
            return
        if self.pause_deadline is not None and now >= self.pause_deadline:
            self.fail(
                self.table.message + " — no spare came",
                code=NoSpareAvailable.code,
                checkpoint=True,
            )

    def _checkpoint_plan(self, reason: str) -> tuple[P.CheckpointPlan | None, str]:
        """The stop checkpoint of the recovery in progress, or why there can be none.

        There can be one when every survivor stands at the boundary of the same failed step,
        none of them stepped its optimizer in it, and no rank registered rank-unique state
        (a lost rank's share would be in no replica): the lowest survivor writes the replica
        state, every survivor its own state, and each lost rank's state comes from its
        mirror.
        """
        rec = self.current
        if self.cfg.checkpoint_dir is None:
            return None, ""
        if rec is None or not rec.alive:
            return None, "no rank survived"
        alive = rec.alive
        steps = {a["step"] for a in alive.values()}
        if len(steps) != 1 or any(a["stepped"] for a in alive.values()):
            return None, "the survivors do not stand at one boundary with their optimizer unstepped"
        roster = self.table.roster
        if any(self.kv.check([P.unique_key(roster[r])]) for r in roster):
            return None, "the job registered rank-unique state, which no replica holds"
        plan: P.CheckpointPlan = {
            "id": f"g{rec.gen}",
            "step": steps.pop(),
            "writer": min(alive),
            "live": sorted(alive),
            "lost": sorted(rec.dead),
            "reason": reason,
        }
        return plan, ""

    def fail(
        self, message: str, code: str = "migration_error", *, checkpoint: bool = False
    ) -> None:
        """End the job with ``message``; the waiting survivors raise the error of ``code``.

        ``checkpoint``: the survivors first write the stop checkpoint (when the job has a
        checkpoint directory and the survivors' state allows one, :meth:`_checkpoint_plan`);
        :attr:`checkpoint` holds its plan for the agent to wait on.
        """
        # One line in the log; the whole message (a traceback, say) is the job's final
        # status, which its launcher prints once when it exits.
        log.error("job %s failed: %s", self.cfg.job_id, (message.splitlines() or [""])[0])
        self.table.status, self.table.message = P.JobStatus.FAILED, message
        if self.current is not None:
            decision: P.RecoveryDecision = {
                "status": P.Decision.FAILED,
                "code": code,
                "message": message,
            }
            if checkpoint:
                plan, why = self._checkpoint_plan(code)
                if plan is not None:
                    decision["checkpoint"] = self.checkpoint = plan
                elif why:
                    message += f"; no checkpoint: {why}"
                    decision["message"] = self.table.message = message
            P.put_json(self.kv, P.recovery_key(self.current.gen), decision)
        if self.table.inflight is not None:
            P.put_json(
                self.kv,
                P.MigrationKeys(self.table.inflight.migration_id).failed,
                {"code": code, "message": message},
            )
            self.supervisor.finish(self.table.inflight, P.Outcome.FAILED, error=message)
            self.table.inflight = None
