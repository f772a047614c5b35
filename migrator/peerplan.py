"""The plan of a peer-copy job's recovery, read from the job's key-value store: who holds whose copy
and which step every rank goes back to (:func:`rewind_plan`). Apart from the copies
themselves (:mod:`migrator.peercopy`, which needs torch), so that the launcher's recovery
imports it without torch.

Who holds whose copy is a ring of the active ranks (:func:`ring_of`): each rank's *buddy* is
the next one in the ring, its *ward* the one before. The ring takes the nodes in turn (every
node's first rank, then every node's second, ...), so that with two or more nodes a rank's
buddy is on another node and a node lost whole leaves every copy of its ranks on the nodes
that remain. The coordinator writes it once (:data:`RING_KEY`); a job without it (one not
started by ``forewarn launch``) uses the ranks in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from migrator.protocol import EVERY_KEY, RING_KEY, KVStore, held_key, since_key

__all__ = [
    "EVERY_KEY",
    "RING_KEY",
    "buddy_of",
    "held_key",
    "read_ring",
    "rewind_plan",
    "ring_of",
    "since_key",
    "ward_of",
]


def ring_of(placed: Iterable[tuple[int, int, int]]) -> list[int]:
    """The ring of the active ranks from where they start: ``placed`` holds each rank's
    (rank, node, index on its node); the ranks sorted by (index on the node, node). On one
    node that is the ranks in order; on N nodes of L ranks each (torchrun's numbering),
    ``0, L, 2L, ..., 1, L + 1, ...``: two neighbours are never on the same node."""
    return [rank for rank, _, _ in sorted(placed, key=lambda p: (p[2], p[1], p[0]))]


def read_ring(kv: KVStore, world: int) -> list[int]:
    """The job's ring (:data:`RING_KEY`); the ranks in order when the coordinator wrote none
    or one for another world size."""
    if kv.check([RING_KEY]):
        ring = [int(r) for r in json.loads(kv.get(RING_KEY))]
        if sorted(ring) == list(range(world)):
            return ring
    return list(range(world))


def buddy_of(rank: int, ring: Sequence[int]) -> int:
    """The rank whose process holds ``rank``'s copies: the next one in the ring."""
    return ring[(ring.index(rank) + 1) % len(ring)]


def ward_of(rank: int, ring: Sequence[int]) -> int:
    """The rank whose copies ``rank``'s process holds: the one before it in the ring."""
    return ring[(ring.index(rank) - 1) % len(ring)]


def rewind_plan(
    kv: KVStore, world: int, lost: Iterable[int], healthy: Iterable[int]
) -> tuple[dict[int, int], int | None, str]:
    """For the lost ranks of a peer-copy job: the buddy that sends each one's copy, the step
    every rank goes back to (the oldest lost rank's last whole copy), and why not ("" if
    the plan holds)."""
    alive = set(healthy)
    ring = read_ring(kv, world)
    senders: dict[int, int] = {}
    steps = []
    for rank in sorted(lost):
        buddy = buddy_of(rank, ring)
        if buddy not in alive:
            return {}, None, f"rank {rank} and its buddy rank {buddy} were lost together"
        if not kv.check([held_key(rank)]):
            return {}, None, f"rank {rank} was lost before its first copy reached rank {buddy}"
        senders[rank] = buddy
        steps.append(int(kv.get(held_key(rank))))
    if not steps:
        return senders, None, ""
    step = min(steps)
    for rank in sorted(alive):
        if kv.check([since_key(rank)]) and int(kv.get(since_key(rank))) > step:
            since = int(kv.get(since_key(rank)))
            return {}, None, f"rank {rank} was taken over at step {since}, after the copy of {step}"
    return senders, step, ""
