"""The bucketed point-to-point transport: message plan, round trips of awkward tensor lists,
the fault hook's order, and a peer process killed mid-transfer."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from migrator.groups import Graveyard, pair_group
from migrator.transport import PGTransport, plan

ROOT = Path(__file__).resolve().parents[2]
_KEEP = Graveyard()  # groups whose peer died are kept referenced, never destroyed


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _transport(group: dist.ProcessGroup, hook: Callable[[int], None] | None) -> PGTransport:
    t = PGTransport(group, on_tensor=hook)
    t.small_bytes, t.bucket_bytes = 1024, 4096  # small enough to exercise every path
    return t


def _round_trip(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]
) -> tuple[dict[str, Any], list[int], list[int]]:
    """Send ``src`` into ``dst`` in process (receiver in a thread); returns the meta received
    and the indexes each side's hook saw."""
    store = _store()
    sent: list[int] = []
    seen: list[int] = []
    got: dict[str, Any] = {}

    def receive() -> None:
        group = pair_group(_client(store.port), "t", sender=False, backend="gloo", timeout_s=20)
        got["meta"], _ = _transport(group, seen.append).recv(lambda m: dst, timeout_s=20)

    thread = threading.Thread(target=receive)
    thread.start()
    group = pair_group(_client(store.port), "t", sender=True, backend="gloo", timeout_s=20)
    stats = _transport(group, sent.append).send({"n": len(src)}, src, timeout_s=20)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert stats.bytes >= sum(t.numel() * t.element_size() for t in src)
    return got["meta"], sent, seen


# -- the plan -------------------------------------------------------------------------------


def test_plan_first_tensor_alone_large_alone_small_packed() -> None:
    sizes = [(10, "cpu"), (10, "cpu"), (10, "cpu"), (5000, "cpu"), (10, "cpu"), (10, "cuda")]
    assert plan(sizes, small_bytes=1024, bucket_bytes=4096) == [[0], [1, 2], [3], [4], [5]]


def test_plan_bucket_cap_counts_alignment() -> None:
    # 100 tensors of 3 bytes: 16 bytes each once aligned, 4096 / 16 = 256 per bucket.
    msgs = plan([(3, "cpu")] * 600, small_bytes=1024, bucket_bytes=4096)
    assert msgs[0] == [0]
    assert [len(m) for m in msgs[1:]] == [256, 256, 87]
    assert [i for m in msgs for i in m] == list(range(600))


def test_plan_empty() -> None:
    assert plan([], small_bytes=1024, bucket_bytes=4096) == []


# -- round trips -----------------------------------------------------------------------------


def test_empty_list_sends_the_meta_alone() -> None:
    meta, sent, seen = _round_trip([], [])
    assert meta == {"n": 0}
    assert sent == seen == []


def test_awkward_tensors_land_in_place_and_equal() -> None:
    """Non-contiguous on either side, mixed dtypes at odd byte sizes, zero-size tensors, a
    tensor larger than a bucket, and many tiny ones (several buckets)."""
    g = torch.Generator().manual_seed(0)

    def make(fill: bool) -> list[torch.Tensor]:
        def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            x = torch.randn(*shape, generator=g) if fill else torch.zeros(*shape)
            return x.to(dtype)

        out = [
            r(3, dtype=torch.uint8),  # first, alone; 3 bytes: the next slice is unaligned
            r(5, dtype=torch.float64),
            r(3, 7, dtype=torch.float16),
            r(2, 2, dtype=torch.bfloat16),
            torch.tensor(True) if fill else torch.tensor(False),
            r(4, 3).t(),  # non-contiguous, small
            r(0, 5),  # zero-size
            r(64, 48),  # 12 KB > bucket (4 KB): alone, in place
            r(80, 40, dtype=torch.float64).t(),  # large and non-contiguous
            r(3, dtype=torch.complex64),
        ]
        out += [r(1).reshape(()) for _ in range(700)]  # many scalars: several buckets
        out.append(torch.arange(5, dtype=torch.int64) if fill else torch.zeros(5).long())
        return out

    src = make(True)
    dst = make(False)
    dst[5] = torch.zeros(3, 4)  # contiguous receiver, non-contiguous sender
    dst[2] = torch.zeros(7, 3, dtype=torch.float16).t()  # strided receiver, contiguous sender
    ptrs = [t.data_ptr() for t in dst]
    meta, sent, seen = _round_trip(src, dst)
    assert meta == {"n": len(src)}
    for i, (a, b) in enumerate(zip(src, dst, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), i
    assert [t.data_ptr() for t in dst] == ptrs, "received in place"
    assert sent == seen == list(range(len(src)))


# -- a peer killed mid-transfer ---------------------------------------------------------------

_PEER = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from migrator.groups import pair_group
from migrator.transport import PGTransport

port, role = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
group = pair_group(store, "k", sender=role == "send", backend="gloo", timeout_s=10)
die = lambda i: os._exit(3) if i == 0 else None
tensors = [torch.ones(2**20) for _ in range(16)]
if role == "send":
    PGTransport(group, on_tensor=die).send({}, tensors, timeout_s=10)
else:
    PGTransport(group, on_tensor=die).recv(lambda m: tensors, timeout_s=10)
"""


def _peer(port: int, role: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _PEER, str(port), role], env=env)


@pytest.mark.parametrize("dies", ["sender", "receiver"])
def test_peer_killed_mid_transfer_raises(dies: str) -> None:
    """The peer's hook kills it after its first tensor (64 MB in all: more than the socket
    buffers hold); this side raises within the timeout instead of hanging."""
    store = _store()
    proc = _peer(store.port, "send" if dies == "sender" else "recv")
    try:
        group = pair_group(store, "k", sender=dies == "receiver", backend="gloo", timeout_s=10)
        _KEEP.bury(group, broken=True)
        tensors = [torch.zeros(2**20) for _ in range(16)]
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError):
            if dies == "sender":
                PGTransport(group).recv(lambda m: tensors, timeout_s=10)
            else:
                PGTransport(group).send({}, tensors, timeout_s=10)
        assert time.perf_counter() - t0 < 25
        assert proc.wait(timeout=30) == 3
        assert torch.equal(tensors[0], torch.ones(2**20)) or dies == "receiver"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
