"""The three ways a rank changes hands, as run inside each process of the job.

- :meth:`HandoverMixin._handover` — planned or preventive, at the agreed boundary S: the
  source sends its whole state to the spare point-to-point; the other ranks wait for the spare
  to confirm, then everyone joins generation g+1 with the spare at the source's rank. If the
  source dies mid-transfer, the spare says so and the lowest other rank (a healthy replica)
  sends its replica state instead; the source's own state comes from its mirror at S.
- :meth:`HandoverMixin._recover` — unplanned: a collective failed inside a step. The survivor
  reports to the agent and waits for its decision: a spare for each lost rank (the replica
  sends), a pause (no spare left), a refusal (rank-unique state), or "no peer was lost" (the
  error is the script's own and propagates).
- :meth:`HandoverMixin._serve_as_spare` — a spare waits for its assignment, receives the
  state in place, restores the rank state and joins the new generation.

Store keys of a migration ``id``: ``m/{id}/received/{rank}``, ``m/{id}/fallback/{rank}``,
``m/{id}/aborted``, ``m/{id}/failed``, ``m/{id}/pause/{rank}``, ``m/{id}/report/{rank}``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from forewarn.errors import MigrationError, NoSpareAvailable, StateNotReplicated
from migrator import protocol as P
from migrator.groups import pair_group
from migrator.state import peek_step, restore_rank_state
from migrator.transport import PGTransport

__all__ = ["HandoverMixin"]

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[MigrationError]] = {
    StateNotReplicated.code: StateNotReplicated,
    NoSpareAvailable.code: NoSpareAvailable,
}


def _raise_failed(store: Any, key: str) -> None:
    info = P.get_json(store, key)
    cls = _ERRORS.get(info.get("code", ""), MigrationError)
    raise cls(info.get("message", "migration failed"), details=info)


class HandoverMixin:
    """Handover procedures of :class:`migrator.job.Job` (kept apart for length)."""

    group: Any
    _stop: int | None
    _cmd: dict[str, Any] | None

    # -- sending ----------------------------------------------------------------------------

    def _send(self: Any, prefix: str, *, step: int, rank_state: bytes | None) -> Any:
        group = pair_group(
            self.store, prefix, sender=True, backend=self.backend, timeout_s=self.timeout_s
        )
        fire = None
        if self.faults.due("transfer", self.rank or 0, step):
            rank = self.rank or 0

            def fire(i: int) -> None:
                if i == 0:
                    self.faults.fire("transfer", rank, step, store=self.store, job=self)

        meta = self.registry.meta()
        meta.update(step=step, rank_state=rank_state, layouts=self.layouts())
        tensors = [t for _, t in self.registry.tensors()]
        try:
            return PGTransport(group, on_tensor=fire).send(meta, tensors, timeout_s=self.timeout_s)
        finally:
            self._graveyard.bury(group, broken=False)

    def _receive(self: Any, prefix: str, rank: int) -> tuple[dict[str, Any], Any]:
        group = pair_group(
            self.store, prefix, sender=False, backend=self.backend, timeout_s=self.timeout_s
        )
        at: dict[str, int] = {}

        def prepare(meta: dict[str, Any]) -> Any:
            at["step"] = meta["step"]
            return self.registry.prepare(meta["manifest"])

        def fire(i: int) -> None:  # a "receive" fault: this spare dies mid-transfer
            if i == 0:
                self.faults.fire("receive", rank, at["step"], store=self.store, job=self)

        hook = fire if any(f.where == "receive" for f in self.faults.faults) else None
        try:
            return PGTransport(group, on_tensor=hook).recv(prepare, timeout_s=self.timeout_s)
        finally:
            self._graveyard.bury(group, broken=True)

    # -- planned / preventive ---------------------------------------------------------------

    def _handover(self: Any, step: int) -> None:
        cmd = self._cmd
        assert cmd is not None and self.rank is not None
        mid, src, replica = cmd["migration_id"], cmd["rank"], cmd["replica"]
        # The pause as this rank sees it: from reaching boundary S (waiting for S included)
        # to the new generation joined.
        t0 = self._boundary_t or time.perf_counter()
        base = f"m/{mid}"
        outcomes = [f"{base}/received/{src}", f"{base}/fallback/{src}", f"{base}/aborted"]
        outcomes.append(f"{base}/failed")
        bound = 4 * self.timeout_s + 30
        if self.rank == src:
            try:
                if "spare" in cmd:  # a spare still starting (importing torch) is waited for
                    ready = [f"slot{cmd['spare']}/ready", f"{base}/aborted"]
                    P.first_present(self.store, ready, timeout_s=self.join_timeout_s, what="spare")
                self._send(f"x/{mid}/peer", step=step, rank_state=self._snapshot)
            except (RuntimeError, MigrationError) as exc:
                log.warning("sending rank %d to the spare failed: %s", src, exc)
            got = P.first_present(self.store, outcomes, timeout_s=bound, what="the spare")
            if got.endswith("/aborted"):  # the spare died: this rank trains on
                self.commands.abort(mid)
                self._stop, self._cmd = None, None
                return
            self.commands.close()
            self.note("retired", rank=src, step=step, migration=mid)
            self._graveyard.bury(self.group, broken=False)
            self.group = None
            raise SystemExit(0)
        got = P.first_present(self.store, outcomes, timeout_s=bound, what="the spare")
        if got.endswith("/aborted"):
            self.commands.abort(mid)
            self._stop, self._cmd = None, None
            return
        if got.endswith("/failed"):
            _raise_failed(self.store, got)
        if "/fallback/" in got:
            if self.rank == replica:
                self._send(P.replica_prefix(mid, src), step=step, rank_state=None)
            got = P.first_present(
                self.store, [outcomes[0], outcomes[3]], timeout_s=bound, what="the spare"
            )
            if got.endswith("/failed"):
                _raise_failed(self.store, got)
        layouts = self.layouts()
        self._graveyard.bury(self.group, broken=False)
        self._join(self.gen + 1, self.rank, layouts)
        self.store.set(f"{base}/pause/{self.rank}", repr(time.perf_counter() - t0))

    # -- unplanned --------------------------------------------------------------------------

    def _recover(self: Any, exc: BaseException, step: int) -> bool:
        """Handle a failed collective at ``step``; True: the step is to be run again."""
        if self.group is None or self.rank is None:
            return False
        t0 = time.perf_counter()
        gen, rank = self.gen, self.rank
        report = {"step": step, "stepped": self._stepped, "slot": self.slot, "error": str(exc)}
        P.put_json(self.store, P.alive_key(gen, rank), report)
        self.store.add(P.alive_count_key(gen), 1)
        log.warning("rank %d: a collective failed at step %d (%s)", rank, step, exc)
        key = P.recovery_key(gen)
        P.first_present(self.store, [key], timeout_s=4 * self.timeout_s + 30, what="the agent")
        decision = P.get_json(self.store, key)
        paused_said = False
        while decision["status"] == "paused":
            if not paused_said:
                log.error("rank %d waits: %s", rank, decision.get("message"))
                paused_said = True
            time.sleep(0.1)
            decision = P.get_json(self.store, key)
        if decision["status"] == "none":
            return False
        if decision["status"] == "failed":
            cls = _ERRORS.get(decision.get("code", ""), MigrationError)
            raise cls(decision.get("message", "recovery failed"), details=decision) from exc
        # A spare takes each lost rank; this rank redoes the step from its boundary state.
        layouts = self.layouts()
        self._graveyard.bury(self.group, broken=True)
        self.group = None
        assert self._snapshot is not None
        restore_rank_state(self._snapshot, self.registry.data)
        self.registry.zero_grad()
        mid = decision["migration_id"]
        for lost in decision["replacements"]:
            self._await_spare(mid, lost, step, sender=rank == decision["replica"])
        self._join(decision["gen"], rank, layouts)
        self.store.set(f"m/{mid}/pause/{rank}", repr(time.perf_counter() - t0))
        self.note("recovered", rank=rank, step=step, migration=mid)
        return True

    def _await_spare(self: Any, mid: str, lost: int, step: int, *, sender: bool) -> None:
        """Wait until a spare holds rank ``lost``; the replica (``sender``) sends it the state.

        A spare that dies while it receives is replaced by the agent with another one (a new
        attempt, announced under :func:`protocol.attempt_key`); the replica sends again.
        """
        base = f"m/{mid}"
        attempt = 0
        bound = 4 * self.timeout_s + 30
        while True:
            if sender:
                try:
                    self._send(P.replica_prefix(mid, lost, attempt), step=step, rank_state=None)
                except (RuntimeError, MigrationError) as exc:
                    log.warning("sending rank %d (attempt %d) failed: %s", lost, attempt, exc)
            keys = [f"{base}/received/{lost}", f"{base}/failed"]
            keys.append(P.attempt_key(mid, lost, attempt + 1))
            got = P.first_present(self.store, keys, timeout_s=bound, what=f"the spare for {lost}")
            if got == keys[0]:
                return
            if got == keys[1]:
                _raise_failed(self.store, got)
            attempt += 1

    # -- spare ------------------------------------------------------------------------------

    def _mirror_at(self: Any, rank: int, step: int) -> bytes:
        """Rank ``rank``'s mirrored state at boundary ``step``: the boundary's own mirror, or
        the one written inside the step before (the rank died after that step's last
        collective, before it reached the boundary)."""
        seen = []
        for key in (P.mirror_key(rank), P.mirror_ahead_key(rank)):
            if not self.store.check([key]):
                continue
            blob: bytes = self.store.get(key)
            at = peek_step(blob)
            if at == step:
                return blob
            seen.append(at)
        raise MigrationError(f"rank {rank}'s mirrors are at steps {seen}, not {step}")

    def _serve_as_spare(self: Any) -> None:
        key = P.assign_key(self.slot)
        self.store.set(f"slot{self.slot}/ready", "1")
        while not self.store.check([key]):
            # Each check is bounded by the store's timeout: if the agent is gone, it raises.
            time.sleep(0.02)
        a = P.get_json(self.store, key)
        if a["mode"] == "exit":
            raise SystemExit(0)
        t0 = time.perf_counter()
        mid, rank = a["migration_id"], a["rank"]
        base = f"m/{mid}"
        source = "peer"
        try:
            if a["mode"] != "peer":
                raise MigrationError("rebuilding from a replica")
            meta, stats = self._receive(f"x/{mid}/peer", rank)
            rank_state = meta["rank_state"]
        except (RuntimeError, MigrationError) as exc:
            if a["mode"] == "peer":
                log.warning("spare: the source of rank %d failed mid-transfer: %s", rank, exc)
            if self.registry.rank_unique:
                msg = f"rank {rank} holds rank-unique state and its source is gone"
                failure = {"code": StateNotReplicated.code, "message": msg}
                P.put_json(self.store, f"{base}/failed", failure)
                raise StateNotReplicated(msg) from exc
            source = "replica"
            if a["mode"] == "peer":
                self.store.set(f"{base}/fallback/{rank}", str(exc)[:500])
            meta, stats = self._receive(P.replica_prefix(mid, rank, a.get("attempt", 0)), rank)
            rank_state = self._mirror_at(rank, meta["step"])
        self.registry.apply_meta(meta)
        step = restore_rank_state(rank_state, self.registry.data)
        if step != meta["step"]:
            raise MigrationError(f"rank {rank}'s state is at step {step}, not {meta['step']}")
        self._next = step
        self.store.set(f"{base}/received/{rank}", str(self.slot))
        self._join(a["gen"], rank, meta["layouts"])
        # From the first byte received to the new generation joined: the agent uses it as
        # the pause only when there is no other rank to measure it (a one-rank job).
        joined_s = time.perf_counter() - t0 - stats.wait_s
        report = {"step": step, "bytes": stats.bytes, "transfer_s": stats.seconds}
        report.update(joined_s=joined_s)
        report.update(source=source, slot=self.slot)
        self.store.set(f"{base}/report/{rank}", json.dumps(report))
        self.note("took over", rank=rank, migration=mid, **report)
