"""Unplanned failures: a lost or wedged rank replaced by a spare rebuilt from a replica.

The half of the job agent (:class:`migrator.agent.Agent` mixes :class:`Recovery` in) that
handles what nobody asked for:

- detection: once a rank exits or a survivor reports a failed collective, every rank of the
  generation has ``detect_grace_s`` (default ``timeout_s``) to report its last completed
  step; one that neither reports nor exits is declared wedged and killed;
- the checks before a rebuild: no rank-unique state (it is in no replica), and survivors
  agreeing on the last completed step;
- choosing the spares (a warm one first) and the healthy replica they are rebuilt from, and
  posting the recovery plan where the survivors wait for it;
- the script's own errors: every rank dead at once is the script's failure (its traceback is
  reported, nothing is rebuilt), and the same error on the same rank and step after a spare
  took it over is a crash loop (the job stops instead of using up every spare);
- with too few spares, the pause (said on stderr, on the endpoint and in the store) and the
  failure after ``pause_timeout_s``; and :meth:`Recovery._fail`, which ends the job.

It holds no state of its own: everything lives on the agent, under its lock.
"""

from __future__ import annotations

import logging
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forewarn.errors import NoSpareAvailable, StateNotReplicated
from forewarn.wire import MigrationReason
from migrator import protocol as P

if TYPE_CHECKING:
    import torch.distributed as dist

    from migrator.agent import AgentConfig, Slot

__all__ = ["Recovery"]

# The agent's own logger: its records read as one stream, whichever half wrote them.
log = logging.getLogger("migrator.agent")


@dataclass
class _Migration:
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


def _same_error(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["rank"], a["step"], a["type"]) == (b["rank"], b["step"], b["type"])


class Recovery:
    """Failure handling of :class:`migrator.agent.Agent`; call only with the agent's lock held."""

    if TYPE_CHECKING:
        cfg: AgentConfig
        world_size: int
        store: dist.TCPStore
        slots: list[Slot]
        roster: dict[int, int]
        gen: int
        status: str
        message: str
        inflight: _Migration | None
        _recovery: dict[str, Any] | None
        _pause_deadline: float | None
        _script_errors: list[dict[str, Any]]

        def _kill(self, slot: Slot) -> None: ...

        def _finish(self, m: _Migration, outcome: str, **fields: Any) -> None: ...

    # -- choosing -----------------------------------------------------------------------------

    def _free_spare(self) -> Slot | None:
        spares = [s for s in self.slots if s.role == "spare" and s.proc and s.proc.poll() is None]
        # A warm spare (model and optimizer allocated, waiting) first: one still starting
        # would make the ranks wait for it at the handover step.
        spares.sort(key=lambda s: not self.store.check([f"slot{s.index}/ready"]))
        return spares[0] if spares else None

    def _replica_for(self, lost: set[int]) -> int | None:
        healthy = [r for r in range(self.world_size) if r not in lost]
        return healthy[0] if healthy else None

    # -- unplanned --------------------------------------------------------------------------

    def _progress_recovery(self, now: float) -> None:
        g = self.gen
        if self._recovery is None:
            if self.inflight is not None and self.inflight.reason is MigrationReason.UNPLANNED:
                return
            lost = [
                s
                for s in self.slots
                if s.role == "dead" and s.rank is not None and self.roster.get(s.rank) == s.index
            ]
            reported = int(self.store.add(P.alive_count_key(g), 0))
            if not lost and not reported:
                return
            grace = self.cfg.detect_grace_s
            self._recovery = {
                "gen": g,
                "deadline": now + (self.cfg.timeout_s if grace is None else grace),
                "decided": False,
            }
            self.store.set(P.suspect_key(g), "1")  # ranks waiting for S join the recovery
            log.warning(
                "generation %d: failure suspected (%d lost, %d reports)", g, len(lost), reported
            )
        rec = self._recovery
        if rec["decided"]:
            if self.status == "paused":
                self._retry_paused(now)
            return
        alive: dict[int, dict[str, Any]] = {}
        dead: list[int] = []
        for rank, index in self.roster.items():
            if self.store.check([P.alive_key(g, rank)]):
                alive[rank] = P.get_json(self.store, P.alive_key(g, rank))
            elif self.slots[index].role in ("dead", "retired", "done"):
                dead.append(rank)
        undecided = [r for r in self.roster if r not in alive and r not in dead]
        if undecided and now < rec["deadline"]:
            return
        for rank in undecided:  # neither reported nor exited within the bound: wedged
            log.warning("rank %d did not answer within the bound: declared lost", rank)
            slot = self.slots[self.roster[rank]]
            self._kill(slot)
            slot.role = "dead"
            dead.append(rank)
        rec["decided"] = True
        rec["dead"] = sorted(dead)
        rec["alive"] = alive
        errors = self._script_errors_of(dead)
        if dead and not alive:
            self._fail(self._nobody_left(sorted(dead), errors), code="script_error")
            return
        for info in errors:
            if any(_same_error(info, seen) for seen in self._script_errors):
                self._fail(
                    f"crash loop: rank {info['rank']} raised {info['type']} at step "
                    f"{info['step']} again after a spare took it over; the error is the "
                    f"script's, not the GPU's. Its traceback:\n{info['traceback']}",
                    code="crash_loop",
                )
                return
        self._script_errors.extend(errors)
        if self.inflight is not None and set(self.inflight.ranks) != set(dead):
            self._fail("a rank failed during a planned migration of another rank")
            return
        if not dead:
            self.store.delete_key(P.suspect_key(g))
            P.put_json(self.store, P.recovery_key(g), {"status": "none"})
            self._recovery = None
            return
        if any(self.store.check([f"slot{self.roster[r]}/unique"]) for r in self.roster):
            self._fail(
                f"rank(s) {dead} lost; the job registered rank-unique state, which no "
                "replica holds: restart from a checkpoint",
                code=StateNotReplicated.code,
            )
            return
        steps = {a["step"] for a in alive.values()}
        if len(steps) > 1 or any(a["stepped"] for a in alive.values()):
            self._fail(
                f"survivors disagree on the last completed step ({sorted(steps)}): "
                "a collective failed after optimizer.step() on some of them"
            )
            return
        self._place_spares(now)

    def _place_spares(self, now: float) -> None:
        rec = self._recovery
        assert rec is not None
        g, dead = rec["gen"], rec["dead"]
        planned = self.inflight
        spares = [s for s in self.slots if s.role == "spare" and s.proc and s.proc.poll() is None]
        if planned is not None:  # the source died before its handover: reuse its spare
            spares = [self.slots[planned.targets[r]] for r in dead] + spares
        if len(spares) < len(dead):
            at = min(a["step"] for a in rec["alive"].values())
            msg = (
                f"job {self.cfg.job_id} paused at step {at}: "
                f"rank(s) {dead} lost and {len(spares)} spare(s) left; it fails in "
                f"{self.cfg.pause_timeout_s:.0f} s unless a spare appears"
            )
            msg += "".join(
                f"; rank {e['rank']} raised {e['type']}: {e['message'][:300]}"
                for e in self._script_errors
                if e["rank"] in dead
            )
            if self.status != "paused":
                print(f"forewarn launch: {msg}", file=sys.stderr, flush=True)
                self._pause_deadline = now + self.cfg.pause_timeout_s
            self.status, self.message = "paused", msg
            P.put_json(self.store, P.recovery_key(g), {"status": "paused", "message": msg})
            return
        mid = planned.migration_id if planned is not None else uuid.uuid4().hex[:12]
        replica = self._replica_for(set(dead))
        targets = {}
        for rank, spare in zip(dead, spares, strict=False):
            spare.role, spare.rank = "assigned", rank
            targets[rank] = spare.index
            if planned is None:
                P.put_json(
                    self.store,
                    P.assign_key(spare.index),
                    {"mode": "replica", "gen": g + 1, "rank": rank, "migration_id": mid},
                )
        P.put_json(
            self.store,
            P.recovery_key(g),
            {
                "status": "plan",
                "gen": g + 1,
                "replacements": dead,
                "replica": replica,
                "migration_id": mid,
            },
        )
        self.inflight = _Migration(
            mid, MigrationReason.UNPLANNED, dead, {r: self.roster[r] for r in dead}, targets, g, now
        )
        log.warning(
            "recovery %s: rank(s) %s -> slot(s) %s from replica rank %s",
            mid,
            dead,
            list(targets.values()),
            replica,
        )

    def _retarget(self, m: _Migration, dead_spare: Slot) -> None:
        """The spare of an unplanned recovery died: give its rank to another idle spare.

        The replica sends again to the new one (a new attempt under
        :func:`protocol.attempt_key`); with no spare left the job fails.
        """
        rank = next(r for r, index in m.targets.items() if index == dead_spare.index)
        spare = self._free_spare()
        if spare is None:
            self._fail(
                f"the spare taking over rank {rank} died and no other spare is left",
                code=NoSpareAvailable.code,
            )
            return
        mid = m.migration_id
        attempt = int(self.store.add(f"m/{mid}/attempts/{rank}", 1))
        spare.role, spare.rank = "assigned", rank
        m.targets[rank] = spare.index
        assignment = {"mode": "replica", "gen": m.gen + 1, "rank": rank, "migration_id": mid}
        assignment["attempt"] = attempt
        P.put_json(self.store, P.assign_key(spare.index), assignment)
        self.store.set(P.attempt_key(mid, rank, attempt), str(spare.index))
        log.warning(
            "recovery %s: the spare in slot %d died; rank %d -> slot %d (attempt %d)",
            mid,
            dead_spare.index,
            rank,
            spare.index,
            attempt,
        )

    def _script_errors_of(self, ranks: list[int]) -> list[dict[str, Any]]:
        """The exceptions the scripts of these (dead) ranks reported before they exited."""
        out = []
        for rank in sorted(ranks):
            key = P.error_key(self.roster[rank])
            if self.store.check([key]):
                out.append(P.get_json(self.store, key))
        return out

    def _nobody_left(self, dead: list[int], errors: list[dict[str, Any]]) -> str:
        """Why a job whose every rank died at once cannot go on (no replica is left)."""
        if errors:
            first = errors[0]
            return (
                f"every rank exited at once; rank {first['rank']} raised {first['type']} at "
                f"step {first['step']}: {first['message']}\n{first['traceback']}"
            )
        slots = {r: self.slots[self.roster[r]] for r in dead}
        said = ", ".join(
            f"rank {r}: " + ("finished" if s.role == "done" else f"exit {s.proc.returncode}")
            for r, s in slots.items()
        )
        where = f" (their output: {self.cfg.log_dir})" if self.cfg.log_dir else ""
        tail = ""
        if self.cfg.log_dir is not None:
            path = self.cfg.log_dir / f"slot{self.roster[dead[0]]}.log"
            if path.exists():
                tail = "\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
        return (
            f"no rank is left to rebuild from ({said}); the script's own error, or the "
            f"ranks' exit after their last step{where}{tail}"
        )

    def _retry_paused(self, now: float) -> None:
        assert self._recovery is not None
        if self._free_spare() is not None:
            self._place_spares(now)
            if self.status != "paused":
                self.status = "running"
            return
        if self._pause_deadline is not None and now >= self._pause_deadline:
            self._fail(self.message + " — no spare came", code=NoSpareAvailable.code)

    def _fail(self, message: str, code: str = "migration_error") -> None:
        log.error("%s", message)
        print(
            f"forewarn launch: job {self.cfg.job_id} failed: {message}", file=sys.stderr, flush=True
        )
        self.status, self.message = "failed", message
        if self._recovery is not None:
            P.put_json(
                self.store,
                P.recovery_key(self._recovery["gen"]),
                {"status": "failed", "code": code, "message": message},
            )
        if self.inflight is not None:
            P.put_json(
                self.store,
                f"m/{self.inflight.migration_id}/failed",
                {"code": code, "message": message},
            )
            self._finish(self.inflight, "failed", error=message)
            self.inflight = None
