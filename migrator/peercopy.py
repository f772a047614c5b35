"""In-memory peer copies: a rank's state kept in another process's memory every k steps.

For a job whose state no other rank holds (FSDP2 shards, rank-unique tensors), a rank lost
without warning could only be restarted from a checkpoint. With peer copies
(``job.register(..., peer_copy_every=k)``) every rank, at each boundary ``c`` that is a
positive multiple of ``k`` (``peer_copy_every="auto"``: ``k`` derived :data:`PROBE` steps
after the start, so that the copy into memory costs under 1 % of a step, spread over its
k steps; copies from then on):

1. copies its whole state (every registered tensor, a DTensor's local shard; the optimizer
   hyper-parameters, schedulers and scaler; its RNG states, data position and step) into
   its own host memory (:class:`Copy`), at the boundary, before step ``c`` runs;
2. sends that copy, from a background thread while training goes on, to its *buddy*, the
   next rank in the job's ring (:func:`buddy_of`; with two or more nodes, a rank on another
   node: :func:`migrator.peerplan.ring_of`), which receives it, from a background thread too,
   into its host memory and then says so in the key-value store (:func:`held_key`: the step of the
   last copy of rank ``r`` the buddy holds whole).

Each process keeps its own last two copies and its ward's (the rank before it in the
ring, :func:`ward_of`) last two: four
times its state in host memory. A round waits for the previous round's threads before it
starts (at most one round in flight), so the buddy's last whole copy is the last round's or
the one before, and every rank still holds its own copy of that step.

When a rank is lost, the agent (:func:`rewind_plan`) takes the oldest step ``c`` among the
lost ranks' held copies; every survivor puts its own copy of ``c`` back in place
(:meth:`PeerCopies.restore`), each lost rank's buddy sends the spare its copy
(:meth:`PeerCopies.send_held`), and the job runs again from step ``c``: at most ``k`` steps
(``2k`` when the last round had not landed) replayed, deterministically. A rank lost together
with its buddy has no copy left: the job stops, naming both.

With ``disk_copy_every=m`` and a checkpoint directory, the round whose k steps hold a multiple
of ``m`` also writes each rank's own copy to that directory from a third background thread,
and the job's ``latest`` sharded checkpoint moves to it once every rank's file is in place
(:mod:`migrator.shards`). A rank lost together with its buddy then stops the job at that
consistent checkpoint, which ``forewarn launch --resume DIR`` continues bitwise.

The copies travel point to point over gloo, not through the key-value store: two two-rank
groups per process and generation, one to the buddy and one from the ward (prefix
``pc/g{gen}/{rank}/{step}``, ``step`` the round that built it), built at the generation's
first round and used by every round after it; a group whose transfer failed is left in the
job's graveyard (:mod:`migrator.groups`) and built anew at the next round, by both of its
ends (a round ends on both before either starts the next one). Building the two groups cost
a rendezvous each per round; their transfers are what a round costs now.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from migrator import protocol as P
from migrator import shards
from migrator.channels import Channels
from migrator.groups import Graveyard, pair_group
from migrator.peerplan import (
    EVERY_KEY,
    buddy_of,
    held_key,
    read_ring,
    rewind_plan,
    since_key,
    ward_of,
)
from migrator.state import Manifest, Registry, restore_rank_state
from migrator.transport import PGTransport

__all__ = ["Copy", "PeerCopies", "buddy_of", "held_key", "rewind_plan", "since_key", "ward_of"]

log = logging.getLogger(__name__)


PROBE = 5
"""With ``every="auto"``, the steps timed from the start before k is known."""


@dataclass
class Copy:
    """One rank's whole state at a step boundary, in host memory."""

    step: int
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    rank_state: bytes
    nbytes: int = field(default=0)


def _take(registry: Registry, step: int, rank_state: bytes) -> Copy:
    tensors = [t.detach().to("cpu", copy=True) for _, t in registry.tensors()]
    meta = registry.meta()
    meta.update(step=step, rank_state=rank_state, bucket_plans=[])
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return Copy(step, meta, tensors, rank_state, nbytes)


class PeerCopies:
    """This process's side of the peer copies; see the module docstring.

    Args:
        kv: a client of the job's key-value store.
        registry: the training state.
        channels: opens the transport of a copy sent to a spare.
        every: ``k``, the steps between two copies.
        world: the job's ranks.
        timeout_s: bound on joining a copy's channel and on each of its operations.
        where: the current (generation, rank) of this process.
        backend: the copies' groups' backend (``"gloo"``: host memory).
        graveyard: where each copy's groups go when its round ends.
        cost_target: with ``every="auto"``, the share of a step the copy into memory may
            take, spread over the k steps (default 1 %).
        disk: the checkpoint directory the copies also go to (with ``disk_every``).
        disk_every: ``m``: the round whose k steps hold a multiple of ``m`` also writes each
            rank's copy to ``disk`` (:mod:`migrator.shards`).
    """

    def __init__(
        self,
        kv: P.KVStore,
        registry: Registry,
        channels: Channels,
        *,
        every: int | str,
        world: int,
        timeout_s: float,
        where: Callable[[], tuple[int, int | None]],
        backend: str = "gloo",
        graveyard: Graveyard | None = None,
        cost_target: float = 0.01,
        disk: Path | None = None,
        disk_every: int | None = None,
    ) -> None:
        if every != "auto" and (not isinstance(every, int) or every < 1):
            raise ValueError(f"peer_copy_every must be >= 1 or 'auto', not {every!r}")
        if disk_every is not None and (not isinstance(disk_every, int) or disk_every < 1):
            raise ValueError(f"disk_copy_every must be >= 1, not {disk_every!r}")
        if disk_every is not None and disk is None:
            raise ValueError(
                "disk_copy_every needs a checkpoint directory (forewarn launch --checkpoint-dir, "
                "FOREWARN_CHECKPOINT_DIR)"
            )
        if world < 2:
            raise ValueError("peer copies need a second rank to hold them")
        self.kv = kv
        self.registry = registry
        self.channels = channels
        self.every: int | None = every if isinstance(every, int) else None
        """k; None until derived (``"auto"``: :meth:`_derive`)."""
        self.cost_target = cost_target
        self._probe: list[float] = []  # rank 0's boundary times while k is derived
        self._first = 1 if self.every is not None else -1  # the first step a copy may be at
        self._skip: int | None = None  # the boundary whose round ran before this took over
        self.world = world
        self._ring: list[int] | None = None
        self.timeout_s = timeout_s
        self.where = where
        self.backend = backend
        self.graveyard = graveyard or Graveyard()
        self.own: dict[int, Copy] = {}
        self.held: dict[int, Copy] = {}
        self._threads: list[threading.Thread] = []
        self.copy_s = 0.0  # the last round's time at the boundary (copy and groups)
        # This generation's pair groups, by direction (True: to the buddy), kept from round
        # to round; a direction whose transfer failed is in _broken until it is built anew.
        self._pairs: dict[bool, Any] = {}
        self._pairs_of: tuple[int, int] | None = None  # the (generation, rank) they serve
        self._broken: set[bool] = set()
        self.disk = disk
        self.disk_every = disk_every

    def ring(self) -> list[int]:
        """The job's ring (:func:`read_ring`), read once."""
        if self._ring is None:
            self._ring = read_ring(self.kv, self.world)
        return self._ring

    def due(self, step: int) -> bool:
        return self.every is not None and step >= self._first and step % self.every == 0

    def disk_due(self, step: int) -> bool:
        """Whether the round at ``step`` also goes to disk: its k steps, ``(step - k, step]``,
        hold a multiple of ``m``. The same on every rank (and a spare), from k and m alone."""
        if self.disk_every is None or self.every is None:
            return False
        return step // self.disk_every > (step - self.every) // self.disk_every

    def _derive(self, step: int, rank: int) -> None:
        """``every="auto"``: the active ranks start together at some step s; rank 0 times
        the steps up to boundary ``s + PROBE`` and one copy of its state into memory, and
        publishes ``k = ceil(copy / (cost_target * step))``; every rank reads it at that
        boundary (a spare that joins later, at once), so all agree."""
        if self._first < 0:
            self._first = step + PROBE
            if self.kv.check([EVERY_KEY]):  # a spare joining a running job
                self.every, self._first = int(self.kv.get(EVERY_KEY)), step
                return
        if rank == 0:
            self._probe.append(time.perf_counter())
            if step == self._first:
                gaps = sorted(b - a for a, b in zip(self._probe, self._probe[1:], strict=False))
                step_s = gaps[len(gaps) // 2]
                t0 = time.perf_counter()
                _take(self.registry, step, b"")
                copy_s = time.perf_counter() - t0
                every = max(1, math.ceil(copy_s / (self.cost_target * step_s)))
                self.kv.set(EVERY_KEY, str(every))
                log.info(
                    "peer copies every %d steps: a copy takes %.1f ms, a step %.1f ms",
                    every,
                    copy_s * 1e3,
                    step_s * 1e3,
                )
        if step == self._first:
            self.every = int(
                self.kv.get(EVERY_KEY)
            )  # waits for rank 0 (the key-value store's timeout)

    def at_boundary(self, step: int, rank_state: bytes) -> None:
        """At boundary ``step``: when a copy is due, take this rank's own copy, build the
        generation's two pair groups (to the buddy, from the ward) unless they are built,
        and run the send and the receive in the background.

        The groups are built here, on the training thread: building a gloo group blocks
        with the interpreter lock held, so two built at once by threads of one process wait
        on each other. The ranks at even places of the ring build the group to their buddy
        first, the others the one from their ward first, so the ring of rendezvous never
        waits on itself.
        """
        gen, rank = self.where()
        if rank is None:
            return
        if self.every is None:
            self._derive(step, rank)
        if not self.due(step) or step == self._skip:
            return
        self.wait()
        t0 = time.perf_counter()
        mine = _take(self.registry, step, rank_state)
        self.own[step] = mine
        for old in sorted(self.own)[:-2]:
            del self.own[old]
        ring = self.ring()
        ward = ward_of(rank, ring)
        prefixes = {
            True: P.peer_copy_prefix(gen, rank, step),
            False: P.peer_copy_prefix(gen, ward, step),
        }
        if self._pairs_of != (gen, rank):  # a new generation: new peers, new groups
            for group in self._pairs.values():
                self.graveyard.bury(group, broken=False)
            self._pairs, self._broken, self._pairs_of = {}, set(), (gen, rank)
        for sender in self._broken:
            self.graveyard.bury(self._pairs.pop(sender, None), broken=True)
        self._broken = set()
        try:
            for sender in (True, False) if ring.index(rank) % 2 == 0 else (False, True):
                if sender not in self._pairs:
                    self._pairs[sender] = pair_group(
                        self.kv,
                        prefixes[sender],
                        sender=sender,
                        backend=self.backend,
                        timeout_s=self.timeout_s,
                    )
        except (RuntimeError, OSError) as exc:  # a peer is gone: the agent handles it
            log.warning("peer copy round of step %d not started: %s", step, exc)
            for group in self._pairs.values():
                self.graveyard.bury(group, broken=True)
            self._pairs = {}
            return
        groups = self._pairs
        self.copy_s = time.perf_counter() - t0
        self._threads = [
            threading.Thread(target=self._send, args=(groups[True], mine), daemon=True),
            threading.Thread(target=self._receive, args=(groups[False], ward, step), daemon=True),
        ]
        if self.disk_due(step):
            self._threads.append(
                threading.Thread(target=self._to_disk, args=(mine, rank), daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def wait(self) -> None:
        """Wait for the round in flight (each of its operations is bounded)."""
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _send(self, group: Any, copy: Copy) -> None:
        try:
            PGTransport(group).send(copy.meta, copy.tensors, timeout_s=self.timeout_s)
        except (RuntimeError, OSError) as exc:  # the buddy is gone: the agent handles it
            log.warning("peer copy of step %d not sent: %s", copy.step, exc)
            self._broken.add(True)

    def _to_disk(self, copy: Copy, rank: int) -> None:
        """Write this rank's copy to the sharded checkpoint of its step; the first rank to
        find every rank's file in place seals it (:func:`migrator.shards.seal`)."""
        assert self.disk is not None
        try:
            shards.write_shard(
                self.disk,
                step=copy.step,
                rank=rank,
                world_size=self.world,
                meta=copy.meta,
                tensors=copy.tensors,
                rank_state=copy.rank_state,
            )
            self.kv.set(P.disk_copy_key(copy.step, rank), "1")
            every = [P.disk_copy_key(copy.step, r) for r in range(self.world)]
            if self.kv.check(every) and int(self.kv.add(P.disk_sealed_key(copy.step), 1)) == 1:
                info = {"ranks": self.world, "every": self.every, "disk_every": self.disk_every}
                if shards.seal(self.disk, step=copy.step, world_size=self.world, info=info):
                    log.info("sharded checkpoint of step %d sealed in %s", copy.step, self.disk)
        except (RuntimeError, OSError) as exc:  # a full disk, a store gone: training goes on
            log.warning("disk copy of step %d not written: %s", copy.step, exc)

    def _receive(self, group: Any, ward: int, step: int) -> None:
        got: dict[str, Any] = {}

        def prepare(meta: dict[str, Any]) -> list[torch.Tensor]:
            manifest: Manifest = meta["manifest"]
            got["tensors"] = [
                torch.empty(shape, dtype=getattr(torch, dtype[6:])) for _, shape, dtype in manifest
            ]
            return list(got["tensors"])

        try:
            meta, stats = PGTransport(group).recv(prepare, timeout_s=self.timeout_s)
        except (RuntimeError, OSError) as exc:  # the ward is gone: its last copy stays
            log.warning("peer copy of rank %d at step %d not received: %s", ward, step, exc)
            self._broken.add(False)
            return
        self.held[step] = Copy(step, meta, got["tensors"], meta["rank_state"], stats.bytes)
        for old in sorted(self.held)[:-2]:
            del self.held[old]
        self.kv.set(held_key(ward), str(step))

    def restore(self, step: int) -> None:
        """Put this rank's own copy of boundary ``step`` back in place (tensors in place,
        the non-tensor state, the RNG states and data position); later copies are dropped.

        Raises:
            KeyError: this process holds no copy of its own at ``step``.
        """
        copy = self.own[step]
        dsts = self.registry.prepare(copy.meta["manifest"])
        with torch.no_grad():
            for dst, src in zip(dsts, copy.tensors, strict=True):
                dst.copy_(src)
        self.registry.apply_meta(copy.meta)
        restore_rank_state(copy.rank_state, self.registry.data)
        self.own = {s: c for s, c in self.own.items() if s <= step}

    def send_held(self, prefix: str, step: int) -> None:
        """Send the ward's copy of boundary ``step`` to the spare taking the ward's rank.

        Raises:
            KeyError: no whole copy of that step is held.
        """
        copy = self.held[step]
        with self.channels.open(prefix, sender=True) as transport:
            transport.send(copy.meta, copy.tensors, timeout_s=self.timeout_s)

    def took_over(self, rank: int, step: int, rank_state: bytes, *, planned: bool) -> None:
        """This process (a spare) now holds rank ``rank`` at boundary ``step``: its state,
        just received, is its own copy of that step; the ward's copies were in the old
        process's memory, and no copy of an earlier step is held here (:func:`since_key`).

        ``planned``: the other ranks hand over at this boundary after its copy round ran
        (with the source), so this process skips the round there; after an unplanned
        recovery every rank runs the boundary again, its round included."""
        self.own = {step: _take(self.registry, step, rank_state)}
        self._skip = step if planned else None
        self.kv.delete_key(held_key(ward_of(rank, self.ring())))
        self.kv.set(since_key(rank), str(step))

    def forget_after(self, step: int) -> None:
        """Drop the ward's copies of steps after ``step`` (the job went back to it)."""
        self.held = {s: c for s, c in self.held.items() if s <= step}

    def memory_bytes(self) -> int:
        """Host memory the copies this process keeps take now."""
        return sum(c.nbytes for c in (*self.own.values(), *self.held.values()))
