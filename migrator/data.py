"""A resumable data position for data-parallel training: which samples a rank reads next.

:class:`ShardedIndices` deals the indices ``0..n-1`` out to ranks, a fresh seeded
permutation each epoch (like ``DistributedSampler``), and yields batches of indices. Its
``state_dict`` holds everything rank-specific (rank, epoch, offset), so a spare that loads it
reads exactly the samples the rank it replaces would have read.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShardedIndices"]


class ShardedIndices:
    """Batches of sample indices for one rank of ``world_size``.

    Args:
        n: number of samples.
        batch_size: indices per batch (per rank).
        rank: this rank (a spare may pass any value; loading a state sets it).
        world_size: number of data-parallel ranks.
        seed: shuffle seed, the same on every rank.
    """

    def __init__(self, n: int, batch_size: int, *, rank: int, world_size: int, seed: int = 0):
        if n < batch_size * world_size:
            raise ValueError("fewer samples than one batch on every rank")
        self.n, self.batch_size, self.world_size, self.seed = n, batch_size, world_size, seed
        self.rank, self.epoch, self.offset = rank, 0, 0
        self._order: torch.Tensor | None = None

    def _shard(self) -> torch.Tensor:
        if self._order is None:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.n, generator=g)
            usable = self.n - self.n % self.world_size
            self._order = perm[:usable][self.rank :: self.world_size]
        return self._order

    def next(self) -> torch.Tensor:
        """The next batch of indices (a new epoch starts when the shard runs out)."""
        shard = self._shard()
        if self.offset + self.batch_size > len(shard):
            self.epoch, self.offset, self._order = self.epoch + 1, 0, None
            shard = self._shard()
        out = shard[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rank"] != self.rank or state["epoch"] != self.epoch:
            self._order = None
        self.rank, self.epoch, self.offset = state["rank"], state["epoch"], state["offset"]
