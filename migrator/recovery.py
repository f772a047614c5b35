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


class Recovery:
    """Failure handling of :class:`migrator.agent.Agent`; call only with the agent's lock held."""

    if TYPE_CHECKING:
        cfg: AgentConfig
        store: dist.TCPStore
        slots: list[Slot]
        roster: dict[int, int]
        gen: int
        status: str
        message: str
        inflight: _Migration | None
        _recovery: dict[str, Any] | None
        _pause_deadline: float | None

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
        healthy = [r for r in range(self.cfg.nproc) if r not in lost]
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
        if self.inflight is not None and set(self.inflight.ranks) != set(dead):
            self._fail("a rank failed during a planned migration of another rank")
            return
        if not dead:
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
