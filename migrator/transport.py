"""Moving a rank's state from one process to another, tensors received in place.

The contract (:class:`Transport`) is two calls, each bounded by a timeout:

- ``send(meta, tensors)`` — the sender's meta blob (pickled, with the manifest), then every
  tensor in manifest order. State may change again when it returns.
- ``recv(prepare)`` — receives the meta blob, calls ``prepare(meta)`` for the destination
  tensors (the receiver's own parameters and optimizer state, allocated up front), then
  receives each tensor directly into them. Returns the meta.

:class:`PGTransport` implements it over a two-rank process group (gloo on CPU, NCCL on GPUs):
point-to-point ``send``/``recv`` straight into the destination storage, no staging copy,
no serialisation of tensors. A peer that dies mid-transfer makes the pending operation raise
(gloo: "connection closed" at once, or the group's timeout for a wedged peer); the caller
falls back to a replica.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["PGTransport", "TransferStats", "Transport"]


class TransferStats:
    """Bytes and seconds of one transfer."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.wait_s = 0.0  # receiver: time spent waiting for the sender to start

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class Transport(Protocol):
    def send(
        self, meta: dict[str, Any], tensors: Sequence[torch.Tensor], *, timeout_s: float
    ) -> TransferStats:
        """Send ``meta`` then ``tensors``; returns when the receiver has every byte."""
        ...

    def recv(
        self,
        prepare: Callable[[dict[str, Any]], Sequence[torch.Tensor]],
        *,
        timeout_s: float,
    ) -> tuple[dict[str, Any], TransferStats]:
        """Receive the meta, then the tensors into ``prepare(meta)``; returns the meta."""
        ...


class PGTransport:
    """A :class:`Transport` over a two-rank process group; the sender is rank 0.

    Args:
        group: a two-rank group (see :func:`migrator.groups.pair_group`).
        on_tensor: called after each tensor sent or received, with its index (fault
            injection hook).
    """

    def __init__(
        self, group: dist.ProcessGroup, *, on_tensor: Callable[[int], None] | None = None
    ) -> None:
        self.group = group
        self.on_tensor = on_tensor

    def _wait(self, work: Any, timeout_s: float) -> None:
        work.wait(timedelta(seconds=timeout_s))

    def send(
        self, meta: dict[str, Any], tensors: Sequence[torch.Tensor], *, timeout_s: float
    ) -> TransferStats:
        stats = TransferStats()
        t0 = time.perf_counter()
        blob = torch.frombuffer(bytearray(pickle.dumps(meta, protocol=5)), dtype=torch.uint8)
        self._wait(self.group.send([torch.tensor([blob.numel()])], 1, 0), timeout_s)
        self._wait(self.group.send([blob], 1, 1), timeout_s)
        stats.bytes += blob.numel()
        for i, t in enumerate(tensors):
            src = t.detach()
            src = src if src.is_contiguous() else src.contiguous()
            self._wait(self.group.send([src], 1, 2 + i), timeout_s)
            stats.bytes += src.numel() * src.element_size()
            if self.on_tensor is not None:
                self.on_tensor(i)
        stats.seconds = time.perf_counter() - t0
        return stats

    def recv(
        self,
        prepare: Callable[[dict[str, Any]], Sequence[torch.Tensor]],
        *,
        timeout_s: float,
    ) -> tuple[dict[str, Any], TransferStats]:
        stats = TransferStats()
        size = torch.zeros(1, dtype=torch.int64)
        t_wait = time.perf_counter()
        self._wait(self.group.recv([size], 0, 0), timeout_s)
        t0 = time.perf_counter()
        stats.wait_s = t0 - t_wait
        blob = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self.group.recv([blob], 0, 1), timeout_s)
        meta = pickle.loads(blob.numpy().tobytes())
        stats.bytes += blob.numel()
        with torch.no_grad():
            for i, dst in enumerate(prepare(meta)):
                if dst.is_contiguous():
                    self._wait(self.group.recv([dst], 0, 2 + i), timeout_s)
                else:
                    tmp = torch.empty_like(dst, memory_format=torch.contiguous_format)
                    self._wait(self.group.recv([tmp], 0, 2 + i), timeout_s)
                    dst.copy_(tmp)
                stats.bytes += dst.numel() * dst.element_size()
                if self.on_tensor is not None:
                    self.on_tensor(i)
        stats.seconds = time.perf_counter() - t0
        return meta, stats
