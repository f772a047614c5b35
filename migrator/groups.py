"""Process-group generations: one communicator per membership, never repaired in place.

Each generation ``g`` of a job is a fresh process group built from the agent's key-value store under
the prefix ``g{g}/pg`` (a ``torch.distributed.PrefixStore``), so a new generation never reads
a key a dead generation left behind. The groups are built directly from their backend classes
instead of through ``init_process_group``: a job changes membership several times, and the
global default group cannot be replaced without ``destroy_process_group``, which can hang on
a group whose peer died.

An abandoned generation is not destroyed. Its group goes to a :class:`Graveyard` that keeps a
reference (so no destructor runs while a collective might still be stuck in it) and, for
NCCL, aborts the communicator so that kernels waiting on a dead peer are released. Leaking a
few sockets of an aborted gloo group is cheaper than a hang.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from migrator.protocol import KVStore

__all__ = ["Graveyard", "c10d_store", "new_group", "pair_group"]

log = logging.getLogger(__name__)


def c10d_store(kv: KVStore) -> dist.Store:
    """``kv`` as the c10d store it is, for the process groups' rendezvous.

    Raises:
        TypeError: ``kv`` is not a c10d store (a fake: no group can rendezvous in it).
    """
    if not isinstance(kv, dist.Store):
        raise TypeError(f"a process group needs a c10d store, not {type(kv).__name__}")
    return kv


def new_group(
    kv: KVStore,
    prefix: str,
    *,
    rank: int,
    size: int,
    backend: str = "gloo",
    timeout_s: float = 30.0,
    device: torch.device | None = None,
) -> dist.ProcessGroup:
    """Build a process group of ``size`` ranks that rendezvous under ``prefix`` in ``kv``.

    Blocks until all ``size`` ranks have joined; gloo gives up after ``timeout_s`` seconds.
    The same ``timeout_s`` bounds every collective on the group afterwards: a peer that
    stops answering (wedged or dead) makes each pending operation raise within it.

    Args:
        kv: the job's rendezvous store (the agent's TCPStore or a client of it).
        prefix: key prefix of this group; unique per generation or transfer.
        rank: this process's rank in the group.
        size: number of ranks.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; gloo is added
            beside it for CPU tensors).
        timeout_s: bound for joining and for every collective, in seconds.
        device: the CUDA device of this rank, for NCCL.
    """
    prefixed = dist.PrefixStore(prefix, c10d_store(kv))
    timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroup(prefixed, rank, size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", prefixed), rank, size, timeout)
    gloo._set_sequence_number_for_group()
    if backend == "gloo":
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        if torch.cuda.is_available():
            group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, gloo)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", prefixed), rank, size, opts)
        nccl._set_sequence_number_for_group()
        if device is not None:
            # Bind the communicator to this rank's GPU now: the first collective then
            # does not pay the lazy init inside the pause.
            nccl.eager_connect_single_device(device)
        group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    else:
        raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")
    return group


def pair_group(
    kv: KVStore, prefix: str, *, sender: bool, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """A two-rank group for one point-to-point transfer: the sender is rank 0."""
    return new_group(
        kv, prefix, rank=0 if sender else 1, size=2, backend=backend, timeout_s=timeout_s
    )


class Graveyard:
    """Keeps abandoned process groups referenced; aborts NCCL communicators.

    Dropping the last reference to a gloo group whose peer died runs its destructor, which
    may wait on a worker thread still stuck on the dead peer. Holding the reference until
    the process exits costs a few sockets and no hang.
    """

    def __init__(self) -> None:
        self._groups: list[dist.ProcessGroup] = []
        self._kept: list[Any] = []  # formations abandoned, some still forming in a thread

    def keep(self, formation: Any) -> None:
        """Keep an abandoned formation of a next generation (its thread may still be in the
        rendezvous with a dead peer; its group, once formed, is buried by that thread)."""
        self._kept.append(formation)

    def bury(self, group: dist.ProcessGroup | None, *, broken: bool) -> None:
        if group is None:
            return
        if broken and group._get_backend_name() == "nccl":
            try:
                group.abort()
            except RuntimeError as exc:  # pragma: no cover - needs a GPU
                log.warning("aborting an NCCL group failed: %s", exc)
        self._groups.append(group)

    def __len__(self) -> int:
        return len(self._groups)
