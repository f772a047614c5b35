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

A gloo collective learns of a dead peer only on the sockets to that peer: in a ring the
dead rank's neighbours fail at once, and every other rank waits for a neighbour that has
stopped sending, until the group's timeout. gloo's ``abort()`` does not wake it. So a
generation's group remembers the sockets its construction made (:func:`new_group` with
``severable=True``), and a rank that saw the group fail shuts them down (:func:`sever`):
each of its peers' pending operations on it then fails at once, and the failure crosses
the job in a few hops instead of a timeout. Only sockets of the group's own are shut down:
made while it was built, and bound to this rank's gloo listener or connected to a listener
a peer of the group published (``{prefix}/listen/{rank}``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from migrator.protocol import KVStore

__all__ = ["Graveyard", "c10d_store", "new_group", "pair_group", "sever"]

log = logging.getLogger(__name__)


def c10d_store(kv: KVStore) -> dist.Store:
    """``kv`` as the c10d store it is, for the process groups' rendezvous.

    Raises:
        TypeError: ``kv`` is not a c10d store (a fake: no group can rendezvous in it).
    """
    if not isinstance(kv, dist.Store):
        raise TypeError(f"a process group needs a c10d store, not {type(kv).__name__}")
    return kv


def _sockets() -> dict[int, str]:
    """This process's open sockets: descriptor -> its ``/proc`` link (``socket:[inode]``)."""
    found: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: nothing to sever
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:"):
            found[int(fd)] = link
    return found


def _tcp(fd: int) -> socket.socket | None:
    """A duplicate of ``fd`` as a socket object when it is a TCP socket (the caller closes
    it; shutting it down shuts the connection down for the original too)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.close()
        return None
    return sock


@dataclass
class _Wires:
    """What :func:`sever` needs of a group: the sockets its construction made."""

    kv: KVStore
    prefix: str
    rank: int
    size: int
    made: dict[int, str]  # descriptor -> /proc link, to tell a reused descriptor
    listeners: set[int]  # this rank's gloo listening ports among them


_severable: dict[int, tuple[dist.ProcessGroup, _Wires]] = {}  # id(group) -> it, its wires
_severable_lock = threading.Lock()


def _listen_key(prefix: str, rank: int) -> str:
    return f"{prefix}/listen/{rank}"


def _remember_wires(
    group: dist.ProcessGroup,
    kv: KVStore,
    prefix: str,
    rank: int,
    size: int,
    before: dict[int, str],
) -> None:
    made = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}
    listeners: set[int] = set()
    for fd in made:
        sock = _tcp(fd)
        if sock is None:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                listeners.add(sock.getsockname()[1])
        except OSError:
            pass
        finally:
            sock.close()
    kv.set(_listen_key(prefix, rank), ",".join(str(p) for p in sorted(listeners)))
    with _severable_lock:
        _severable[id(group)] = (group, _Wires(kv, prefix, rank, size, made, listeners))


def sever(group: dist.ProcessGroup | None) -> int:
    """Shut down the connections of ``group`` (built with ``severable=True``) to its peers,
    so that their pending operations on it fail now rather than at the group's timeout.
    Call it once the group failed on this rank: nothing of it works afterwards. Returns how
    many connections were shut down (0 for a group that was not severable or already was)."""
    if group is None:
        return 0
    with _severable_lock:
        entry = _severable.pop(id(group), None)
    if entry is None:
        return 0
    w = entry[1]
    keys = [_listen_key(w.prefix, r) for r in range(w.size) if r != w.rank]
    remote: set[int] = set()
    try:  # a peer that died before it published has no connections to cut anyway
        present = keys if w.kv.check(keys) else [k for k in keys if w.kv.check([k])]
        for blob in w.kv.multi_get(present) if present else []:
            remote.update(int(p) for p in blob.decode().split(",") if p)
    except (RuntimeError, OSError, ValueError) as exc:  # the agent is gone: the own side only
        log.warning("could not read the peers' gloo listeners of %s: %s", w.prefix, exc)
    cut = 0
    for fd, link in w.made.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed, the descriptor reused by something else
        except OSError:
            continue
        sock = _tcp(fd)
        if sock is None:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # the listener: gloo's accept loop must not see it fail
            if sock.getsockname()[1] in w.listeners or sock.getpeername()[1] in remote:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:  # not connected (any more)
            pass
        finally:
            sock.close()
    return cut


def new_group(
    kv: KVStore,
    prefix: str,
    *,
    rank: int,
    size: int,
    backend: str = "gloo",
    timeout_s: float = 30.0,
    device: torch.device | None = None,
    severable: bool = False,
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
        severable: remember the gloo sockets the group makes, for :func:`sever` (a
            generation's groups; not a transfer's, which are dropped after use).
    """
    prefixed = dist.PrefixStore(prefix, c10d_store(kv))
    timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroup(prefixed, rank, size)
    before = _sockets() if severable else None
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", prefixed), rank, size, timeout)
    if before is not None:
        _remember_wires(group, kv, prefix, rank, size, before)
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
        with _severable_lock:  # left whole or severed already: nothing more to cut
            _severable.pop(id(group), None)
        if broken and group._get_backend_name() == "nccl":
            try:
                group.abort()
            except RuntimeError as exc:  # pragma: no cover - needs a GPU
                log.warning("aborting an NCCL group failed: %s", exc)
        self._groups.append(group)

    def __len__(self) -> int:
        return len(self._groups)
