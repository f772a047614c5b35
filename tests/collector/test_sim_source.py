"""The simulated source as a collector sees it: wire objects, injection, control API, CLI."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from collector.base import Source
from forewarn import cli
from forewarn.errors import InvalidInput, NotFound
from forewarn.wire import Event, EventKind, GpuSample, IngestBatch
from sim.cli import parse_inject
from sim.control import ControlServer
from sim.source import SimulatedSource

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _run(src: SimulatedSource, seconds: int, step_s: float = 1.0) -> list:  # type: ignore[type-arg]
    out = []
    for k in range(int(seconds / step_s) + 1):
        out.extend(src.read(T0 + timedelta(seconds=k * step_s)))
    return out


def test_emits_valid_wire_objects_for_every_gpu() -> None:
    src = SimulatedSource(gpus=16, seed=1)
    assert isinstance(src, Source) and src.name == "simulated"
    first = list(src.read(T0))
    samples = [r for r in first if isinstance(r, GpuSample)]
    assert {(s.node, s.gpu) for s in samples} <= {(n, g) for n in src.node_names for g in range(8)}
    assert len(samples) >= 14  # a rare missing sample is allowed
    s = samples[0]
    assert s.ts == T0 and s.vendor == "nvidia" and s.uuid and s.uuid.startswith("GPU-")
    assert s.ecc_sbe_volatile is not None and s.remap_pending is not None
    assert s.retired_pages_sbe is None  # Ampere+: row remapping, no page retirement
    by_node: dict[str, list] = {}  # type: ignore[type-arg]
    for r in first + list(src.read(T0 + timedelta(seconds=1))):
        by_node.setdefault(r.node, []).append(r)
    for node, rows in by_node.items():
        batch = IngestBatch(
            node=node,
            samples=[r.model_dump(mode="json") for r in rows if isinstance(r, GpuSample)],
            events=[r.model_dump(mode="json") for r in rows if isinstance(r, Event)],
        )
        for row in batch.samples:
            GpuSample.model_validate(row)
    src.close()
    src.close()


def test_injected_failure_shows_precursors_then_dies() -> None:
    src = SimulatedSource(gpus=16, seed=2, speed=1.0)
    got = src.inject("sim-node-0001", 4, "memory", lead_s=600)
    assert got == {"node": "sim-node-0001", "gpu": 4, "kind": "memory", "fails_in_s": 600.0}
    readings = _run(src, 660, step_s=5.0)
    mine = [r for r in readings if r.node == "sim-node-0001" and r.gpu == 4]
    sbe = [r.ecc_sbe_aggregate for r in mine if isinstance(r, GpuSample)]
    assert sbe[-1] > sbe[0]  # corrected errors climbed before the end
    xids = [r.xid for r in mine if isinstance(r, Event) and r.kind == EventKind.XID]
    assert 48 in xids and (94 in xids or 95 in xids)
    dbe_at = min(r.ts for r in mine if isinstance(r, Event) and r.xid == 48)
    assert all(r.ts < dbe_at for r in mine if isinstance(r, GpuSample))  # then no more samples
    assert dbe_at - T0 >= timedelta(seconds=600)
    (f,) = src.failures()
    assert f["kind"] == "memory" and f["has_precursors"] and f["injected"]


def test_speed_runs_failure_dynamics_faster_not_timestamps() -> None:
    src = SimulatedSource(gpus=8, seed=3, speed=60.0)
    src.inject(0, 1, "pcie")  # lead drawn from the kind's distribution, in failure time
    readings = _run(src, 3 * 3600 // 60 * 4, step_s=1.0)  # 12 wall minutes
    (f,) = [x for x in src.failures() if x["gpu"] == 1]
    assert f["kind"] == "pcie" and f["ts_ms"] <= int((T0 + timedelta(minutes=12)).timestamp() * 1e3)
    samples = [r for r in readings if isinstance(r, GpuSample)]
    assert max(s.ts for s in samples) <= T0 + timedelta(minutes=12)


def test_inject_refuses_what_does_not_exist() -> None:
    src = SimulatedSource(gpus=8, seed=0)
    with pytest.raises(NotFound):
        src.inject("no-such-node", 0, "memory")
    with pytest.raises(NotFound):
        src.inject(0, 8, "memory")
    with pytest.raises(InvalidInput):
        src.inject(0, 0, "meltdown")
    with pytest.raises(InvalidInput):
        SimulatedSource(gpus=8, params={"kinds.memory.lead_median_sec": 1})


def test_control_api_injects_and_reports() -> None:
    src = SimulatedSource(gpus=16, seed=4)
    server = ControlServer(src).start()
    try:
        r = httpx.post(
            f"{server.url}/inject", json={"node": "sim-node-0000", "gpu": 3, "kind": "gpu_lost"}
        )
        assert r.status_code == 200 and r.json()["fails_in_s"] == 0.0
        bad = httpx.post(f"{server.url}/inject", json={"node": "x", "gpu": 0, "kind": "memory"})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "not_found"
        bad = httpx.post(f"{server.url}/inject", json={"node": "sim-node-0000"})
        assert bad.status_code == 422
        readings = _run(src, 2)
        lost = [r for r in readings if isinstance(r, Event) and r.kind == EventKind.GPU_LOST]
        assert [(e.node, e.gpu) for e in lost] == [("sim-node-0000", 3)]
        status = httpx.get(f"{server.url}/status").json()
        assert status["gpus"] == 16 and status["gpus_up"] == 15 and status["failures"] == 1
        (f,) = httpx.get(f"{server.url}/failures").json()["data"]
        assert f["kind"] == "gpu_lost" and not f["has_precursors"]
        again = httpx.post(
            f"{server.url}/inject", json={"node": "sim-node-0000", "gpu": 3, "kind": "memory"}
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
    finally:
        server.close()


def test_parse_inject() -> None:
    assert parse_inject("sim-node-0002:3:memory:300@60") == {
        "node": "sim-node-0002",
        "gpu": 3,
        "kind": "memory",
        "lead_s": 300.0,
        "at_s": 60.0,
    }
    assert parse_inject("1:0:gpu_lost")["lead_s"] is None
    with pytest.raises(InvalidInput):
        parse_inject("1:gpu_lost")


def test_cli_writes_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ds"
    rc = cli.main(
        [
            "simulate",
            "--gpus",
            "16",
            "--days",
            "0.02",
            "--seed",
            "9",
            "--out",
            str(out),
            "--interval",
            "30",
            "--inject",
            "sim-node-0001:2:nvlink:600@60",
        ]
    )
    assert rc == 0
    assert "samples" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 9 and manifest["gpus"] == 16 and manifest["interval_s"] == 30.0
    assert manifest["counts"]["failures"] >= 1


def test_live_mode_streams_into_the_service(live_service) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    env = {**os.environ, "FOREWARN_INGEST_TOKEN": live_service.ingest_token}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "forewarn",
            "simulate",
            "--gpus",
            "16",
            "--service",
            live_service.url,
            "--interval",
            "0.5",
            "--duration",
            "3",
            "--control-port",
            "0",
            "--speed",
            "100",
            "--inject",
            "sim-node-0001:5:gpu_lost@1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    headers = {"Authorization": f"Bearer {live_service.read_token}"}
    nodes = httpx.get(f"{live_service.url}/v1/nodes", headers=headers).json()["data"]
    assert {n["node"] for n in nodes} == {"sim-node-0000", "sim-node-0001"}
    events = httpx.get(f"{live_service.url}/v1/events", headers=headers).json()["data"]
    assert any(e["kind"] == "gpu_lost" and e["gpu"] == 5 for e in events)
    gpus = httpx.get(f"{live_service.url}/v1/gpus", headers=headers).json()
    assert len(gpus["data"]) == 16


def test_convert_nvidia_smi_csv(tmp_path: Path) -> None:
    import pandas as pd

    from forewarn.datasets import FAILURE_COLUMNS, SAMPLE_COLUMNS, sample_dtypes
    from sim.csv_import import convert_csv

    data = Path(__file__).parent / "data"
    out = tmp_path / "real"
    rc = cli.main(
        [
            "simulate",
            "convert-csv",
            "--csv",
            str(data / "nvidia_smi_sample.csv"),
            "--node",
            "host-a",
            "--failures-csv",
            str(data / "failures_sample.csv"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    s = pd.read_parquet(out / "samples")
    assert tuple(s.columns) == SAMPLE_COLUMNS
    assert {c: str(t) for c, t in s.dtypes.items()} == sample_dtypes()
    assert len(s) == 4 and set(s["node"]) == {"host-a"}
    last = s.iloc[-1]
    assert last["ts_ms"] == int(datetime(2026, 11, 30, 12, 0, 10, tzinfo=UTC).timestamp() * 1000)
    assert pd.isna(last["power_w"]) and last["throttle_reasons"] == 0x24
    assert last["pcie_link_width"] == 8 and bool(last["remap_pending"]) is True
    assert s["ecc_deferred"].isna().all()
    f = pd.read_parquet(out / "failures.parquet")
    assert tuple(f.columns) == FAILURE_COLUMNS
    assert f.loc[0, "kind"] == "pcie" and bool(f.loc[0, "has_precursors"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["interval_s"] == 10.0 and manifest["gpus"] == 2
    with pytest.raises(InvalidInput):
        convert_csv([data / "nvidia_smi_sample.csv"], tmp_path / "x")  # no node given
