"""The live stream in columns: the same samples as the wire objects, through the pusher and
into a real service, and a simulator that says when the machine cannot hold the rate asked."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from api.ingest_decode import decode_fast, rows_from_columns
from collector.push import Backoff, BatchingPusher, IngestClient, batch_body
from forewarn import cli
from forewarn.wire import Event, GpuSample
from sim.cli import TickCost
from sim.config import TELEMETRY_COLLAPSE
from sim.source import SimulatedSource
from store.writes import SampleColumns

T0 = datetime(2026, 11, 30, 12, 0, 0, 123000, tzinfo=UTC)


def _store_rows(raw: bytes) -> list[tuple[Any, ...]]:
    """What the service's decoder makes of a body: store rows (either shape)."""
    fast = decode_fast(raw, max_rows=100_000, node_ok=lambda node: True)
    assert fast is not None and not fast.rejected
    if isinstance(fast.samples, SampleColumns):  # the columns shape decoded whole
        body = json.loads(raw)
        rows, _, bad = rows_from_columns(body["node"], body["sample_columns"], 100_000)
        assert not bad
        return rows
    return list(fast.samples)


def test_columns_decode_to_the_same_rows_as_the_wire_objects() -> None:
    params = dict(TELEMETRY_COLLAPSE)  # readings that vanish: nulls in both shapes
    old = SimulatedSource(32, seed=4, params=params, speed=2000.0)
    new = SimulatedSource(32, seed=4, params=params, speed=2000.0)
    for src in (old, new):
        src.inject("sim-node-0001", 3, "gpu_lost", lead_s=40)
        src.inject("sim-node-0002", 5, "memory", lead_s=60)
        src.inject("sim-node-0003", 0, "power_loss", lead_s=20)
    nulls = events = samples = 0
    for k in range(90):
        now = T0 + timedelta(seconds=k, milliseconds=7 * k)
        readings = old.read(now)
        batches = new.read_batches(now)
        by_node: dict[str, tuple[list[GpuSample], list[Event]]] = {}
        for r in readings:
            pair = by_node.setdefault(r.node, ([], []))
            if isinstance(r, GpuSample):
                pair[0].append(r)
            else:
                pair[1].append(r)
        assert [b.node for b in batches] == sorted(by_node)
        for batch in batches:
            rows, evs = by_node[batch.node]
            assert batch.events == evs
            assert batch.rows == len(rows) + len(evs)
            want = _store_rows(json.dumps(batch_body(batch.node, rows)).encode())
            if not batch.columns:
                assert want == []
                continue
            body = {"node": batch.node, "sample_columns": batch.columns}
            got = _store_rows(json.dumps(body).encode())
            assert got == want
            samples += len(got)
            nulls += sum(v is None for v in batch.columns["power_w"])
        events += sum(len(b.events) for b in batches)
    assert samples > 80 * 28 and events >= 3 and nulls > 0
    assert [f["kind"] for f in new.failures()] == [f["kind"] for f in old.failures()]


def _mock(replies: list[int], seen: list[dict[str, Any]]) -> IngestClient:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(gzip.decompress(request.content))
        seen.append(body)
        status = replies.pop(0) if replies else 200
        if status != 200:
            code = {413: "payload_too_large", 503: "unavailable"}[status]
            return httpx.Response(status, json={"error": {"code": code, "message": "m"}})
        if "sample_columns" in body:
            _, _, bad = rows_from_columns(body["node"], body["sample_columns"], 100_000)
            assert not bad
        n = len(body.get("samples", [])) + len(body.get("sample_columns", {}).get("gpu", []))
        result: dict[str, Any] = {"stored_samples": n, "duplicate_samples": 0, "rejected": []}
        result |= {"stored_events": len(body["events"]), "duplicate_events": 0}
        return httpx.Response(200, json=result)

    return IngestClient("http://svc", "t", transport=httpx.MockTransport(handler))


def test_the_pusher_sends_column_chunks_together_replays_and_splits_them() -> None:
    src = SimulatedSource(8, seed=2, params={"sampling.missing_sample_prob": 0.0})
    ticks = [src.read_batches(T0 + timedelta(seconds=k)) for k in range(3)]
    assert [[b.rows for b in t] for t in ticks] == [[8], [8], [8]]
    seen: list[dict[str, Any]] = []
    pusher = BatchingPusher(
        _mock([503], seen), max_rows=40, max_delay_s=10.0, backoff=Backoff(0.01, 0.02)
    ).start()
    pusher.add_columns(ticks[0][0].node, ticks[0][0].columns, ticks[0][0].events)
    assert not pusher.flush(5)  # the service answered 503: kept in the spool
    assert pusher.stats.spooled == 8
    for tick in ticks[1:]:
        pusher.add_columns(tick[0].node, tick[0].columns, tick[0].events)
    assert pusher.flush(5)
    pusher.close()
    # The two later ticks went out as one batch behind the spooled one, and the replay sent
    # both spooled batches as one request, oldest first.
    assert [len(b["sample_columns"]["gpu"]) for b in seen] == [8, 24]
    first = seen[0]["sample_columns"]["ts_ms"][0]
    assert seen[1]["sample_columns"]["ts_ms"] == [
        first + 1000 * k for k in range(3) for _ in range(8)
    ]
    assert pusher.stats.sent_total == 24 and pusher.stats.dropped_total == 0

    seen = []
    pusher = BatchingPusher(_mock([], seen), max_rows=16, max_delay_s=10.0).start()
    for tick in ticks:
        pusher.add_columns(tick[0].node, tick[0].columns)
    assert pusher.flush(5)
    pusher.close()
    assert [len(b["sample_columns"]["gpu"]) for b in seen] == [16, 8]  # chunks never cut

    seen = []
    pusher = BatchingPusher(_mock([413], seen), max_delay_s=10.0).start()
    pusher.add_columns(ticks[0][0].node, ticks[0][0].columns)
    assert pusher.flush(5)
    pusher.close()
    assert [len(b["sample_columns"]["gpu"]) for b in seen] == [8, 4, 4]
    assert pusher.stats.sent_total == 8


def test_time_on_a_tick_past_the_interval_says_the_rate_cannot_be_held() -> None:
    fits = TickCost(gpus=1024, interval_s=1.0, wall_s=0.05, cpu_s=0.04)
    assert fits.holds and "cannot" not in fits.describe()
    over = TickCost(gpus=16384, interval_s=1.0, wall_s=2.0, cpu_s=1.5)
    text = over.describe()
    assert not over.holds
    assert "cannot hold 16384 GPUs every 1 s" in text and "about 8192 GPUs fit" in text


def test_a_rate_the_machine_cannot_hold_is_said_at_start_and_late_ticks_are_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No machine steps a fleet in a tenth of a millisecond: every tick is late.
    rc = cli.main(
        [
            "simulate",
            "--gpus",
            "64",
            "--interval",
            "0.0001",
            "--duration",
            "0.5",
            "--serve-dcgm-exporter",
            "0",
            "--control-port",
            "0",
        ]
    )
    assert rc == 0
    out = capsys.readouterr()
    assert "cannot hold 64 GPUs every 0.0001 s" in out.err
    last = out.out.strip().splitlines()[-1]
    late = int(last.split(", ")[1].split()[0])
    assert late > 0 and "samples missed" in last


def test_live_columns_reach_the_service_every_one_stored(live_service) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "FOREWARN_INGEST_TOKEN": live_service.ingest_token}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "forewarn",
            "simulate",
            "--gpus",
            "24",
            "--seed",
            "6",
            "--service",
            live_service.url,
            "--interval",
            "0.5",
            "--duration",
            "3",
            "--control-port",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert "dropped 0, spooled 0" in last, proc.stdout
    sent = int(last.split("sent ")[1].split()[0])
    headers = {"Authorization": f"Bearer {live_service.read_token}"}
    stored = 0
    for node in ("sim-node-0000", "sim-node-0001", "sim-node-0002"):
        for gpu in range(8):
            r = httpx.get(
                f"{live_service.url}/v1/gpus/{node}/{gpu}/samples",
                headers=headers,
                params={"since": "2000-01-01T00:00:00Z", "limit": 100000},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            stored += len(r.json()["data"])
    events = httpx.get(f"{live_service.url}/v1/events", headers=headers, timeout=30)
    assert stored + len(events.json()["data"]) == sent and stored >= 24 * 4


def test_the_exporter_text_from_columns_is_the_text_from_wire_objects() -> None:
    from sim.exposition import DcgmExposition

    params = {**TELEMETRY_COLLAPSE, "sampling.missing_sample_prob": 0.05}
    old, new = (SimulatedSource(24, seed=8, params=params, speed=3000.0) for _ in range(2))
    by_rows, by_columns = DcgmExposition(), DcgmExposition()
    for src in (old, new):
        src.inject("sim-node-0001", 2, "gpu_lost", lead_s=30)
        src.inject("sim-node-0002", 4, "memory", lead_s=40)
    for k in range(60):
        now = T0 + timedelta(seconds=k)
        by_rows.update(old.read(now))
        by_columns.update_batches(new.read_batches(now))
        assert by_columns.text() == by_rows.text()
    xids = [x for x in by_rows.text().splitlines() if x.startswith("DCGM_FI_DEV_XID_ERRORS{")]
    assert any(not x.endswith(" 0") for x in xids)  # the memory failure's Xid shows
