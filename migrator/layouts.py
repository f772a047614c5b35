"""Where each rank's state lives, read from the job's mesh: the one object the migrator's
promises follow from.

A job's *mesh layout* (:class:`MeshLayout`) says how its ranks are arranged: ``replicate``
groups of ``shard`` ranks each (rank ``r * shard + s`` holds shard ``s`` in replica group
``r``). From it alone follows which other ranks hold the same state as a rank
(:meth:`MeshLayout.holders`), so where a rank lost without warning is rebuilt from:

- ``replicated`` (DDP, plain all-reduce): every rank holds the same state;
- ``rank_unique``, ``fsdp2``, ``fsdp2_tp``: no other rank holds a rank's state;
- ``hsdp``, ``hsdp_tp``: the ranks with the same place (shard index; with tensor
  parallelism, shard and tensor-parallel index) in the other replica groups;
- ``peer_copy``: no other rank holds it live; its buddy holds a copy of a recent boundary,
  and the whole job goes back to that boundary (:mod:`migrator.peercopy`).

Every active rank publishes the layout in the job's key-value store at its start
(:func:`publish_layout`, under :data:`LAYOUT_KEY`); the agent reads it when it chooses the
rank that sends a lost rank's state (:func:`senders`). Pure Python: the agent imports it
without torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from migrator.protocol import LAYOUT_KEY, KVStore

__all__ = ["LAYOUT_KEY", "MeshLayout", "publish_layout", "read_layout", "senders"]


@dataclass(frozen=True)
class MeshLayout:
    """How the job's ranks hold its state.

    Args:
        kind: ``"replicated"``, ``"rank_unique"``, ``"fsdp2"``, ``"hsdp"``, ``"fsdp2_tp"``
            (FSDP2 across, tensor parallel inside a group: no replica), ``"hsdp_tp"``
            (HSDP across, tensor parallel inside: replica groups of ``shard`` ranks) or
            ``"peer_copy"`` (no replica; copies in a buddy's memory, :mod:`migrator.peercopy`).
        world: active ranks.
        replicate: replica groups (1: no replica of a sharded rank's state).
        shard: ranks in a replica group (with tensor parallelism: its data-parallel shards
            times its tensor-parallel degree); ``world == replicate * shard``.
    """

    kind: str
    world: int
    replicate: int = 1
    shard: int = 1

    def __post_init__(self) -> None:
        if self.replicate < 1 or self.shard < 1 or self.replicate * self.shard != self.world:
            raise ValueError(
                f"a layout of {self.replicate} replica group(s) x {self.shard} shard(s) "
                f"does not cover {self.world} ranks"
            )

    @classmethod
    def of(cls, kind: str, world: int, *, replicate: int = 1) -> MeshLayout:
        """The layout of a job of ``world`` ranks; ``replicate`` groups for HSDP."""
        if kind == "replicated":
            return cls(kind, world, replicate=world, shard=1)
        if kind in ("hsdp", "hsdp_tp"):
            if replicate < 2 or world % replicate:
                raise ValueError(
                    f"HSDP needs replicate >= 2 dividing the {world} ranks, not {replicate}"
                )
            return cls(kind, world, replicate=replicate, shard=world // replicate)
        return cls(kind, world, replicate=1, shard=world)

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica group, index in it) of ``rank``."""
        return divmod(rank, self.shard)

    def holders(self, rank: int) -> list[int]:
        """The ranks that hold the same state as ``rank`` (``rank`` included), ascending."""
        if self.kind in ("rank_unique", "fsdp2", "fsdp2_tp", "peer_copy") or self.replicate == 1:
            return [rank]
        s = rank % self.shard
        return [r * self.shard + s for r in range(self.replicate)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> MeshLayout:
        data: dict[str, Any] = json.loads(text)
        return cls(**data)


def publish_layout(kv: KVStore, layout: MeshLayout) -> None:
    """Write ``layout`` under :data:`LAYOUT_KEY` (every active rank writes the same)."""
    kv.set(LAYOUT_KEY, layout.to_json())


def read_layout(kv: KVStore) -> MeshLayout | None:
    """The job's published layout; None if no rank published one (a job of an older
    library, or before the first rank started)."""
    if not kv.check([LAYOUT_KEY]):
        return None
    return MeshLayout.from_json(kv.get(LAYOUT_KEY))


def senders(
    layout: MeshLayout | None, lost: Iterable[int], healthy: Iterable[int]
) -> dict[int, int]:
    """For each lost rank that can be rebuilt, the healthy rank that sends its state (the
    lowest healthy holder); ranks missing from the answer have no healthy holder.

    Without a layout every rank is taken for a replica (the replicated layout).
    """
    alive = sorted(set(healthy))
    out: dict[int, int] = {}
    for rank in lost:
        holders = alive if layout is None else [r for r in layout.holders(rank) if r in alive]
        if holders:
            out[rank] = holders[0]
    return out
