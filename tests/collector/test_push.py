"""The spool, the batching pusher's answers to each service reply, the agent's clock, Xids."""

from __future__ import annotations

import gzip
import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from hypothesis import given
from hypothesis import strategies as st

from collector.agent import SamplingLoop
from collector.push import Backoff, BatchingPusher, IngestClient
from collector.spool import DiskSpool, MemorySpool
from collector.xid import XidClass, catalog, lookup
from forewarn.wire import GpuSample

T0 = datetime.now(UTC).replace(microsecond=0)


def rows(n: int, node: str = "n1", start: int = 0) -> list[GpuSample]:
    return [GpuSample(node=node, gpu=0, ts=T0 + timedelta(seconds=start + i)) for i in range(n)]


def body(n: int) -> dict:
    return {"node": "n1", "samples": [{"i": i} for i in range(n)], "events": []}


# -- spool -----------------------------------------------------------------------------------
def test_disk_spool_reopens_in_order_and_sets_corrupt_files_aside(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    for n in (1, 2, 3):
        spool.put(body(n), n)
    (tmp_path / "garbage.tmp").write_bytes(b"half a write")
    again = DiskSpool(tmp_path)
    assert len(again) == 3 and again.rows == 6 and not list(tmp_path.glob("*.tmp"))
    first = sorted(tmp_path.glob("*.json.gz"))[0]
    first.write_bytes(b"not gzip")
    assert [r for _, _, r in again.head(10)] == [2, 3]
    assert list(tmp_path.glob("*.bad")) and again.rows == 5
    again.put(body(4), 4)
    assert [r for _, _, r in again.head(10)] == [2, 3, 4]


@given(st.lists(st.integers(min_value=1, max_value=50), max_size=40))
def test_memory_spool_bound_drops_oldest_and_accounts_for_every_row(sizes: list[int]) -> None:
    spool = MemorySpool(max_rows=100)
    dropped = sum(spool.put(body(0), n) for n in sizes)
    assert spool.rows <= 100 and spool.rows + dropped == sum(sizes)
    kept = [r for _, _, r in spool.head(1000)]
    assert kept == sizes[len(sizes) - len(kept) :]  # the newest survive, in order


def test_disk_spool_bound_drops_oldest(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=2000)
    rnd = random.Random(1)
    for i in range(20):
        noise = "".join(rnd.choice("abcdef0123456789") for _ in range(300))
        spool.put({"node": "n1", "samples": [{"x": noise, "i": i}], "events": []}, 1)
    assert spool.bytes <= 2000 and 0 < len(spool) < 20
    assert spool.head(1)[0][1]["samples"][0]["i"] == 20 - len(spool)


@given(st.integers(min_value=0, max_value=200))
def test_backoff_is_bounded_and_jittered(attempt: int) -> None:
    b = Backoff(initial_s=0.5, max_s=30.0, rng=random.Random(attempt))
    d = min(30.0, 0.5 * 2 ** min(attempt, 64))
    assert d / 2 <= b.delay_s(attempt) <= d


# -- the pusher's answer to each reply -------------------------------------------------------
def mock_client(replies: list, seen: list) -> IngestClient:
    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(gzip.decompress(request.content))
        seen.append(payload)
        status, extra = replies.pop(0) if replies else (200, None)
        if status == 200:
            n = len(payload["samples"])
            return httpx.Response(
                200,
                json={
                    "stored_samples": n,
                    "duplicate_samples": 0,
                    "stored_events": 0,
                    "duplicate_events": 0,
                    "rejected": [],
                },
            )
        return httpx.Response(
            status,
            json={"error": {"code": extra or "x", "message": "m"}},
            headers={"Retry-After": "0"},
        )

    return IngestClient("http://svc", "t", transport=httpx.MockTransport(handler))


def test_server_errors_are_spooled_and_replayed_oldest_first_in_one_request() -> None:
    seen: list = []
    pusher = BatchingPusher(
        mock_client([(503, None)], seen),
        max_delay_s=0.0,
        backoff=Backoff(initial_s=0.01, max_s=0.02),
    ).start()
    pusher.add(rows(2))
    assert not pusher.flush(5)
    pusher.add(rows(3, start=10))
    assert pusher.flush(5)
    pusher.close()
    assert pusher.stats.sent_total == 5 and pusher.stats.dropped_total == 0
    replay = seen[-1]["samples"]
    assert [s["ts"] for s in replay] == sorted(s["ts"] for s in replay) and len(replay) == 5
    assert seen[-1]["agent"] is None or "agent_id" in seen[-1]["agent"]


def test_a_full_disk_drops_and_counts_the_batch_and_the_sender_goes_on(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path / "spool")
    # The next spool file is written through /dev/full: the kernel answers ENOSPC.
    (tmp_path / "spool" / "000000000001-2.json.gz.tmp").symlink_to("/dev/full")
    seen: list = []
    pusher = BatchingPusher(
        mock_client([(503, None)], seen),
        spool=spool,
        max_delay_s=0.0,
        backoff=Backoff(initial_s=0.01, max_s=0.02),
    ).start()
    pusher.add(rows(2))
    pusher.flush(5)
    stats = pusher.stats
    assert stats.spooled == 0 and stats.dropped_total == 2
    assert "spool write failed" in (stats.last_error or "")
    assert list((tmp_path / "spool").iterdir()) == []  # no half file left behind
    pusher.add(rows(3, start=10))  # the disk has room again, the service is back
    assert pusher.flush(5)
    pusher.close()
    assert pusher.stats.sent_total == 3 and pusher.stats.dropped_total == 2


def test_bad_token_keeps_rows_invalid_envelope_drops_them_too_large_splits() -> None:
    seen: list = []
    pusher = BatchingPusher(
        mock_client([(401, "unauthorized")], seen),
        max_delay_s=0.0,
        backoff=Backoff(initial_s=0.01, max_s=0.01),
    ).start()
    pusher.add(rows(2))
    pusher.flush(5)
    assert pusher.stats.spooled == 2 and pusher.stats.dropped_total == 0
    assert pusher.flush(5) and pusher.stats.sent_total == 2
    pusher.close()

    seen = []
    pusher = BatchingPusher(mock_client([(422, "invalid_input")], seen), max_delay_s=0.0).start()
    pusher.add(rows(3))
    pusher.flush(5)
    pusher.close()
    assert pusher.stats.dropped_total == 3 and pusher.stats.spooled == 0

    seen = []
    pusher = BatchingPusher(
        mock_client([(413, "payload_too_large")], seen), max_delay_s=0.0
    ).start()
    pusher.add(rows(4))
    assert pusher.flush(5)
    pusher.close()
    assert [len(p["samples"]) for p in seen] == [4, 2, 2] and pusher.stats.sent_total == 4


def test_batches_are_cut_at_max_rows_and_per_node() -> None:
    seen: list = []
    pusher = BatchingPusher(mock_client([], seen), max_rows=3, max_delay_s=10.0).start()
    pusher.add(rows(7) + rows(2, node="n2"))
    assert pusher.flush(5)
    pusher.close()
    assert sorted((p["node"], len(p["samples"])) for p in seen) == [
        ("n1", 1),
        ("n1", 3),
        ("n1", 3),
        ("n2", 2),
    ]


# -- the agent's clock -----------------------------------------------------------------------
class _Counter:
    name = "counter"

    def __init__(self) -> None:
        self.calls: list[datetime] = []

    def read(self, now: datetime) -> list:
        self.calls.append(now)
        return [GpuSample(node="n1", gpu=0, ts=now)]

    def close(self) -> None:
        pass


def test_agent_ticks_on_a_fixed_grid_and_skips_instead_of_bursting() -> None:
    t = [0.0]
    source = _Counter()
    pusher = BatchingPusher(mock_client([], []), max_delay_s=0.0)
    agent = SamplingLoop([source], pusher, interval_s=1.0, node="n1", clock=lambda: t[0])
    real_tick = agent.tick

    def slow_tick(now: datetime | None = None) -> list:
        out = real_tick(now)
        t[0] += 0.3 if len(source.calls) != 3 else 3.5  # the third read stalls 3.5 s
        return out

    agent.tick = slow_tick  # type: ignore[method-assign]
    agent._stop.wait = lambda delay: (t.__setitem__(0, t[0] + delay), False)[1]  # type: ignore[method-assign]
    agent.run(max_ticks=6)
    assert agent.stats.ticks == 6 and agent.stats.skipped_ticks == 2
    assert agent.status().sent_total == 6


def test_ticks_close_together_never_share_a_millisecond() -> None:
    source = _Counter()
    agent = SamplingLoop([source], BatchingPusher(mock_client([], [])), interval_s=0.1, node="n1")
    late = T0 + timedelta(microseconds=999_900)  # a late tick, then the next one on time
    agent.tick(late)
    agent.tick(late + timedelta(microseconds=50))
    agent.tick(late - timedelta(seconds=60))  # a wall clock stepped back far is kept as is
    assert source.calls[0] < source.calls[1]
    assert source.calls[1] - source.calls[0] == timedelta(milliseconds=1)
    assert source.calls[2] == (late - timedelta(seconds=60)).replace(microsecond=999_000)


# -- the Xid catalog -------------------------------------------------------------------------
def test_catalog_covers_every_code_of_the_reference_data() -> None:
    # NVIDIA's catalog as the reference data beside the checkout holds it (every code up to
    # 172 where it is absent).
    ref = Path(__file__).resolve().parents[3] / "shared" / "data" / "xid-catalog.tsv"
    if ref.exists():
        codes = {int(line.split("\t")[0]) for line in ref.read_text().splitlines()[1:] if line}
    else:
        codes = set(range(1, 173))
    assert codes <= set(catalog())
    assert lookup(13).xid_class is XidClass.APPLICATION and not lookup(13).hardware_fatal
    assert lookup(48).xid_class is XidClass.MEMORY and lookup(48).hardware_fatal
    assert lookup(79).xid_class is XidClass.BUS and lookup(74).xid_class is XidClass.INTERCONNECT
    assert lookup(119).xid_class is XidClass.FIRMWARE and not lookup(63).hardware_fatal
    assert not lookup(999).known and lookup(999).xid_class is XidClass.OTHER
