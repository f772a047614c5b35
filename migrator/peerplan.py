"""The plan of a peer-copy job's recovery, read from the job's key-value store: who holds whose copy
and which step every rank goes back to (:func:`rewind_plan`). Apart from the copies
themselves (:mod:`migrator.peercopy`, which needs torch), so that the launcher's recovery
imports it without torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from migrator.protocol import EVERY_KEY, held_key, since_key

__all__ = ["EVERY_KEY", "buddy_of", "held_key", "rewind_plan", "since_key"]


def buddy_of(rank: int, world: int) -> int:
    """The rank whose process holds ``rank``'s copies."""
    return (rank + 1) % world


def rewind_plan(
    kv: Any, world: int, lost: Iterable[int], healthy: Iterable[int]
) -> tuple[dict[int, int], int | None, str]:
    """For the lost ranks of a peer-copy job: the buddy that sends each one's copy, the step
    every rank goes back to (the oldest lost rank's last whole copy), and why not ("" if
    the plan holds)."""
    alive = set(healthy)
    senders: dict[int, int] = {}
    steps = []
    for rank in sorted(lost):
        buddy = buddy_of(rank, world)
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
