"""The simulated dcgm-exporter: its text read back by the collector's parser gives the same
readings, and ``forewarn simulate --serve-dcgm-exporter`` serves it over HTTP."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

import httpx
import pytest

from collector.dcgm_exporter import DCGM_FIELDS, parse_metrics, to_readings
from forewarn.wire import Event, EventKind, GpuSample
from sim.exposition import EXPORTED, DcgmExposition, ExporterServer
from sim.source import SimulatedSource
from tests.sim.exporter import served_exporter

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _samples(readings: list) -> dict[tuple[str, int], GpuSample]:
    return {(r.node, r.gpu): r for r in readings if isinstance(r, GpuSample)}


def test_every_exported_series_is_one_the_collector_reads() -> None:
    for name, (field, _, _) in EXPORTED.items():
        assert DCGM_FIELDS[name][0] == field


def test_round_trip_through_the_collector_parser() -> None:
    source = SimulatedSource(16, seed=3, speed=500.0)
    source.read(NOW)
    readings = source.read(NOW.replace(minute=5))
    exposition = DcgmExposition()
    exposition.update(readings)
    back = to_readings(parse_metrics(exposition.text()), node=None, now=NOW, last_xid={})
    want, got = _samples(readings), _samples(back)
    assert set(got) == set(want) and len(got) == 16
    for key, sample in want.items():
        a = sample.model_dump(exclude={"ts"})
        b = got[key].model_dump(exclude={"ts"})
        assert a == b, key


def test_xid_is_the_last_one_and_the_collector_sees_the_change() -> None:
    source = SimulatedSource(8, seed=1)
    readings = source.read(NOW)
    exposition = DcgmExposition()
    exposition.update(readings)
    last: dict[tuple[str, int], int] = {}
    first = to_readings(parse_metrics(exposition.text()), node=None, now=NOW, last_xid=last)
    assert not [r for r in first if isinstance(r, Event)]
    node = readings[0].node
    xid = Event(node=node, gpu=2, ts=NOW, kind=EventKind.XID, xid=79, message="x", source="t")
    exposition.update([*[r for r in readings if isinstance(r, GpuSample)], xid])
    text = exposition.text()
    assert re.search(r'DCGM_FI_DEV_XID_ERRORS\{gpu="2",[^}]*\} 79', text)
    events = [
        r
        for r in to_readings(parse_metrics(text), node=None, now=NOW, last_xid=last)
        if isinstance(r, Event)
    ]
    assert [(e.node, e.gpu, e.xid) for e in events] == [(node, 2, 79)]


def test_a_gpu_without_a_sample_has_no_series() -> None:
    readings = SimulatedSource(8, seed=1).read(NOW)
    exposition = DcgmExposition()
    exposition.update([r for r in readings if not (isinstance(r, GpuSample) and r.gpu == 5)])
    assert 'gpu="5"' not in exposition.text()
    assert exposition.text().count("DCGM_FI_DEV_GPU_TEMP{") == 7


def test_server_serves_metrics_and_404_elsewhere() -> None:
    exposition = DcgmExposition()
    exposition.update(SimulatedSource(8, seed=1).read(NOW))
    server = ExporterServer(exposition).start()
    try:
        with httpx.Client(timeout=5.0) as http:
            r = http.get(server.url)
            assert r.status_code == 200 and r.text == exposition.text()
            assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert http.get(server.url.replace("/metrics", "/other")).status_code == 404
    finally:
        server.close()


@pytest.mark.slow
def test_simulate_serves_dcgm_exporter_without_a_service() -> None:
    args = ("--gpus", "8", "--speed", "100", "--control-port", "0", "--interval", "0.2")
    with served_exporter(*args, "--duration", "30") as url, httpx.Client(timeout=5.0) as http:
        first = http.get(url).text
        time.sleep(0.6)
        second = http.get(url).text
    assert first.count("DCGM_FI_DEV_POWER_USAGE{") == 8
    assert first != second  # the fleet advances in real time
