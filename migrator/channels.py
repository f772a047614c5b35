"""Where a point-to-point transfer of a rank's state gets its :class:`Transport`.

A handover does not build process groups itself: it asks its :class:`Channels` for a
transport under a key prefix unique to the transfer (``x/{id}/peer``,
``x/{id}/replica/{rank}``), uses it for one ``send`` or ``recv``, and closes it.
:class:`PairChannels` is the implementation the job uses: a two-rank group (sender rank 0)
built from the job's key-value store, a :class:`~migrator.transport.PGTransport` over it,
and the group left in the job's :class:`~migrator.groups.Graveyard` afterwards (never destroyed, see
:mod:`migrator.groups`). Tests may pass any other object with the same ``open``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from migrator.groups import Graveyard, pair_group
from migrator.protocol import KVStore
from migrator.transport import PGTransport, Transport

__all__ = ["Channels", "PairChannels"]


class Channels(Protocol):
    """Opens one transport per transfer."""

    def open(
        self, prefix: str, *, sender: bool, on_tensor: Callable[[int], None] | None = None
    ) -> contextlib.AbstractContextManager[Transport]:
        """A transport between this process and its peer under ``prefix``; blocks until the
        peer joined (bounded by the channels' timeout). ``on_tensor``: called after each
        tensor with its index (fault injection)."""
        ...


class PairChannels:
    """:class:`Channels` over two-rank process groups of the job's key-value store.

    Args:
        kv: a client of the job's key-value store.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: bound on joining the pair and on each operation, in seconds.
        graveyard: where each pair's group goes when the transfer ends.
    """

    def __init__(
        self, kv: KVStore, *, backend: str, timeout_s: float, graveyard: Graveyard
    ) -> None:
        self.kv = kv
        self.backend = backend
        self.timeout_s = timeout_s
        self.graveyard = graveyard

    @contextlib.contextmanager
    def open(
        self, prefix: str, *, sender: bool, on_tensor: Callable[[int], None] | None = None
    ) -> Iterator[Transport]:
        group = pair_group(
            self.kv, prefix, sender=sender, backend=self.backend, timeout_s=self.timeout_s
        )
        try:
            yield PGTransport(group, on_tensor=on_tensor)
        finally:
            # The receiver's side is aborted (NCCL): a failed receive may leave it stuck.
            self.graveyard.bury(group, broken=not sender)
