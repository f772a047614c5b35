"""Partitioned scoring: the control processes of several replicas share the fleet's scoring.

At 100,000 GPUs the tick's read and scoring are most of its cost (docs/control.md), and one
process does them for the whole fleet. With ``FOREWARN_PARTITIONED_SCORING`` (PostgreSQL),
every control process scores a share of the fleet and only the leader decides:

- **Buckets.** A node falls into one of :data:`store.control.BUCKETS` buckets by a hash of its
  name that the database computes (:func:`store.control.bucket_sql`), so a process reads only
  its share's samples, filtered in the database: the read's cost is per row the driver
  hands over.
- **Members.** Each control process is a member (``replica@host:pid``) with a heartbeat in
  ``score_shards``; the members seen in the last :data:`LIVE_TICKS` ticks are live. Buckets go
  to live members by rendezvous hashing (:func:`owners`): every member computes the same
  assignment from the same names, and a member that joins or leaves moves only its own share.
  A whole node is in one bucket, so the per-node features (a GPU against the rest of its
  node) are computed as they are by one scorer; the fleet-wide ones (a GPU against the
  fleet's median) are taken over the member's share, a sample of the fleet by hash.
- **Shares.** A member that gains buckets warms their GPUs from the store's window before it
  scores them (as a take-over warms the whole fleet); scores of buckets it no longer holds
  are not published. A follower writes its share's scores to its row (:func:`encode`) every
  tick; the leader scores its own share, merges every live follower's newest shard it has not
  merged yet, and runs the policy on the whole as before. A follower late by a tick leaves
  its GPUs' last decisions as they were for that tick; the leader's status names it.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from predictor.floor import NONE
from store.control import BUCKETS

__all__ = ["LIVE_TICKS", "SHARD_COLUMNS", "Share", "decode", "encode", "owners"]

LIVE_TICKS = 3
"""A member not seen for this many ticks (at least 5 s) is dead: its buckets are shared anew."""

SHARD_COLUMNS = ("node", "gpu", "model_risk", "floor", "floor_rules", "reasons", "last_seen_ms")
"""What the leader's policy reads of a GPU's score (:meth:`control.loop.ControlLoop.tick`)."""

_NUMERIC = {
    "gpu": np.int64,
    "model_risk": np.float64,
    "floor": np.bool_,
    "floor_rules": np.int64,
    "last_seen_ms": np.float64,  # NaN: a GPU known from its events only
}


def owners(members: Sequence[str], buckets: int = BUCKETS) -> np.ndarray:
    """For each bucket, the index in ``members`` of the member that scores it: the member of
    the highest hash of (member, bucket) (rendezvous hashing)."""
    if not members:
        return np.zeros(buckets, dtype=np.int64)
    weights = np.empty((len(members), buckets), dtype=np.uint64)
    for i, member in enumerate(members):
        prefix = member.encode() + b"\0"
        weights[i] = [
            int.from_bytes(hashlib.blake2b(prefix + b.to_bytes(2, "big"), digest_size=8).digest())
            for b in range(buckets)
        ]
    return np.argmax(weights, axis=0).astype(np.int64)


@dataclass
class Share:
    """Which buckets this member scores, and the bucket of each node it has met.

    ``buckets`` is None until the first assignment; ``whole`` when this member holds every
    bucket (then no filter is needed in the database)."""

    member: str
    members: tuple[str, ...] = ()
    buckets: np.ndarray | None = None
    node_bucket: dict[str, int] = field(default_factory=dict)

    @property
    def whole(self) -> bool:
        return self.buckets is not None and len(self.buckets) == BUCKETS

    def assign(self, live: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Take the buckets ``live`` members (this one among them) leave to this one; returns
        the buckets gained (all of them at the first call) and those lost."""
        members = tuple(sorted({*live, self.member}))
        before = self.buckets
        if members != self.members or before is None:
            self.members = members
            mine = members.index(self.member)
            self.buckets = np.flatnonzero(owners(members) == mine).astype(np.int64)
        assert self.buckets is not None
        if before is None:
            return self.buckets, np.zeros(0, dtype=np.int64)
        return (
            np.setdiff1d(self.buckets, before, assume_unique=True),
            np.setdiff1d(before, self.buckets, assume_unique=True),
        )

    def unknown(self, nodes: Sequence[str] | np.ndarray) -> list[str]:
        """The names among ``nodes`` whose bucket this member has not asked for yet."""
        known = self.node_bucket
        return [n for n in pd.unique(np.asarray(nodes, dtype=object)) if n not in known]

    def holds(
        self, nodes: Sequence[str] | np.ndarray, buckets: np.ndarray | None = None
    ) -> np.ndarray:
        """Mask of ``nodes`` in ``buckets`` (default: this member's; every name must be
        known)."""
        if buckets is None:
            assert self.buckets is not None
            if self.whole:
                return np.ones(len(nodes), dtype=bool)
            buckets = self.buckets
        known = self.node_bucket
        of = np.fromiter((known[n] for n in nodes), dtype=np.int64, count=len(nodes))
        return np.isin(of, buckets)

    @property
    def size(self) -> int:
        """How many buckets this member holds (0 before its first assignment)."""
        return 0 if self.buckets is None else len(self.buckets)


def encode(scores: pd.DataFrame) -> bytes:
    """A share's scores (:data:`SHARD_COLUMNS`) as bytes: a JSON header (the node names once,
    the reasons of the GPUs that have some) and the numeric columns as NumPy arrays. No
    pickle: the payload comes from the database."""
    names, node_index = np.unique(scores["node"].to_numpy(dtype=object), return_inverse=True)
    reasons = {i: r for i, r in enumerate(scores["reasons"].tolist()) if r}
    header = json.dumps({"nodes": names.tolist(), "reasons": reasons}).encode()
    arrays = io.BytesIO()
    columns: dict[str, np.ndarray] = {"node": node_index.astype(np.int32)}
    columns.update({k: scores[k].to_numpy(dtype=t) for k, t in _NUMERIC.items()})
    np.savez(arrays, **columns)  # type: ignore[arg-type]
    return struct.pack("<I", len(header)) + header + arrays.getvalue()


def decode(payload: bytes) -> pd.DataFrame:
    """The frame :func:`encode` was given (its :data:`SHARD_COLUMNS`)."""
    (size,) = struct.unpack_from("<I", payload)
    header = json.loads(payload[4 : 4 + size])
    with np.load(io.BytesIO(payload[4 + size :]), allow_pickle=False) as arrays:
        columns = {k: arrays[k] for k in _NUMERIC}
        node_index = arrays["node"]
    n = len(node_index)
    said: list[Sequence[str]] = [NONE] * n
    for i, r in header["reasons"].items():
        said[int(i)] = list(r)
    names = np.asarray(header["nodes"], dtype=object)
    return pd.DataFrame(
        {"node": names[node_index] if n else names[:0], **columns, "reasons": said},
        columns=list(SHARD_COLUMNS),
    )
