"""Stragglers: a slowed GPU shows the telemetry of its cause, live and in a labelled history,
and is never a failure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest

from forewarn import cli
from forewarn.errors import InvalidInput
from forewarn.wire import Event, GpuSample
from sim.cli import parse_slow
from sim.config import default_params
from sim.control import ControlServer
from sim.dataset import generate_dataset
from sim.source import SimulatedSource

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
P = default_params()
CLOCK_MAX = P["workload"]["sm_clock_max_mhz"]
SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_POWER_BRAKE = 0x4, 0x8, 0x20, 0x80
SLOW = {  # (node index, gpu) -> kind
    (0, 1): "thermal",
    (0, 2): "power_cap",
    (1, 3): "power_brake",
    (1, 4): "pcie",
}


def _check(kind: str, s: dict[str, Any]) -> None:
    """One sample of a GPU slowed by ``kind`` while it runs a job."""
    bits = s["throttle_reasons"]
    if kind == "pcie":
        assert s["pcie_link_width"] == 8 < s["pcie_link_width_max"] == 16
        assert s["pcie_link_gen"] == 4
        assert s["sm_clock_mhz"] >= 0.9 * CLOCK_MAX  # the healthy power-cap dip at most
        return
    assert s["pcie_link_width"] == 16 and s["pcie_link_gen"] == 5
    assert s["sm_clock_mhz"] <= 0.7 * CLOCK_MAX  # well below the application clock
    if kind == "thermal":
        assert bits & SW_THERMAL and s["temp_gpu_c"] >= P["workload"]["slowdown_c"]
    elif kind == "power_cap":
        assert bits & SW_POWER_CAP and s["power_w"] == P["workload"]["power_max_w"]
    else:
        assert bits & HW_SLOWDOWN and bits & HW_POWER_BRAKE
        assert s["temp_gpu_c"] < P["workload"]["slowdown_c"]


def test_a_live_source_shows_each_slowdown_and_never_a_failure() -> None:
    src = SimulatedSource(gpus=16, seed=3)
    src.read(T0)
    recs = {key: src.slow(key[0], key[1], kind, duration_s=60.0) for key, kind in SLOW.items()}
    assert recs[(0, 1)]["factor"] == pytest.approx(1 / P["slowdowns"]["thermal"]["clock_frac"])
    assert recs[(1, 4)]["factor"] == P["slowdowns"]["pcie"]["factor"]
    assert src.slowdown_factor(1, 3) == 2.0 and src.slowdown_factor(1, 5) == 1.0
    assert src.status()["gpus_slowed"] == 4
    seen: dict[tuple[int, int], int] = {}
    events: list[Event] = []
    for k in range(1, 7):
        now = T0 + timedelta(seconds=5 * k)
        readings = src.read(now) if k % 2 else None
        if readings is None:  # the columnar path carries the same telemetry
            rows = []
            for batch in src.read_batches(now):
                events += batch.events
                cols = batch.columns
                for i in range(len(cols.get("gpu", ()))):
                    rows.append({"node": batch.node, **{f: v[i] for f, v in cols.items()}})
        else:
            events += [r for r in readings if isinstance(r, Event)]
            rows = [r.model_dump() for r in readings if isinstance(r, GpuSample)]
        for r in rows:
            key = (src.node_names.index(r["node"]), r["gpu"])
            if key in SLOW and r["util_gpu_pct"] >= 5:
                _check(SLOW[key], r)
                seen[key] = seen.get(key, 0) + 1
    assert set(seen) == set(SLOW)
    slowed = {(src.node_names[n], g) for n, g in SLOW}
    assert not [e for e in events if (e.node, e.gpu) in slowed]  # no Xid, no event at all
    assert not [f for f in src.failures() if (f["node"], f["gpu"]) in slowed]
    # the episodes end: full speed, full link
    later = src.read(T0 + timedelta(seconds=90))
    after = {(s.node, s.gpu): s for s in later if isinstance(s, GpuSample)}
    assert src.status()["gpus_slowed"] == 0 and src.slowdown_factor(1, 3) == 1.0
    pcie = after.get(("sim-node-0001", 4))
    assert pcie is None or (pcie.pcie_link_width == 16 and pcie.pcie_link_gen == 5)
    assert [r["end_ts_ms"] - r["ts_ms"] for r in src.slowdowns()] == [60_000] * 4


def test_a_labelled_history_has_the_telemetry_and_no_failure(tmp_path: Path) -> None:
    info = generate_dataset(
        tmp_path,
        gpus=16,
        days=0.01,
        interval_s=10.0,
        seed=2,
        params={"hazard.fleet_mttf_h": 1e9},
        slowdowns=[
            {"at_s": 60, "node": "sim-node-0000", "gpu": 1, "kind": "thermal", "duration_s": 300},
            {"at_s": 0, "node": 1, "gpu": 4, "kind": "pcie", "duration_s": 200, "factor": 1.5},
        ],
    )
    assert info.failures == 0 and info.manifest["counts"]["slowdowns"] == 2
    sl = pd.read_parquet(tmp_path / "slowdowns.parquet")
    assert list(sl["kind"]) == ["pcie", "thermal"] and sl["factor"].iloc[0] == 1.5
    assert (sl["end_ts_ms"] - sl["ts_ms"]).tolist() == [200_000, 300_000]
    samples = pd.read_parquet(tmp_path / "samples")
    for node, gpu, kind in (("sim-node-0000", 1, "thermal"), ("sim-node-0001", 4, "pcie")):
        ep = sl[(sl["node"] == node) & (sl["gpu"] == gpu)].iloc[0]
        mine = samples[(samples["node"] == node) & (samples["gpu"] == gpu)]
        during = mine[(mine["ts_ms"] > ep["ts_ms"]) & (mine["ts_ms"] < ep["end_ts_ms"])]
        during = during[during["util_gpu_pct"] >= 5]
        assert len(during) >= 10
        for row in during.to_dict("records"):
            _check(kind, row)
        after = mine[mine["ts_ms"] > ep["end_ts_ms"]]
        assert (after["pcie_link_width"] == 16).all() and (
            after["throttle_reasons"] & 0x20 == 0
        ).all()
    assert len(pd.read_parquet(tmp_path / "failures.parquet")) == 0
    assert len(pd.read_parquet(tmp_path / "events.parquet").query("gpu in (1, 4)")) == 0


def test_the_rate_draws_episodes_that_are_never_failures(tmp_path: Path) -> None:
    params = {"slowdowns.rate_per_gpu_day": 200.0, "slowdowns.duration_median_s": 120.0}
    info = generate_dataset(tmp_path, gpus=16, days=0.02, interval_s=10.0, seed=5, params=params)
    sl = pd.read_parquet(tmp_path / "slowdowns.parquet")
    assert len(sl) == info.manifest["counts"]["slowdowns"] >= 10
    assert set(sl["kind"]) == {"thermal", "power_cap", "power_brake", "pcie"}
    assert not sl["injected"].any() and (sl["factor"] > 1.0).all()
    fl = pd.read_parquet(tmp_path / "failures.parquet")
    assert len(fl) <= 1  # the fleet's own hazard, not the 60-odd episodes
    off = generate_dataset(tmp_path / "off", gpus=16, days=0.02, interval_s=10.0, seed=5)
    assert "slowdowns" not in off.manifest["counts"]  # the manifest as it was, too
    assert not (tmp_path / "off" / "slowdowns.parquet").exists()  # the format as it was


def test_control_api_and_cli_take_a_slowdown_and_refuse_bad_ones() -> None:
    src = SimulatedSource(gpus=16, seed=1)
    src.read(T0)
    server = ControlServer(src).start()
    try:
        body = {"node": "sim-node-0001", "gpu": 2, "kind": "power_brake", "duration_s": 30}
        r = httpx.post(f"{server.url}/slow", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["factor"] == 2.0
        assert httpx.get(f"{server.url}/slowdowns", timeout=10).json()["data"][0]["gpu"] == 2
        bad = httpx.post(f"{server.url}/slow", json={**body, "kind": "memory"}, timeout=10)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_input"
        bad = httpx.post(f"{server.url}/slow", json={**body, "factor": 0.5}, timeout=10)
        assert bad.status_code == 422
        assert (
            httpx.post(f"{server.url}/slow", json={**body, "node": "x"}, timeout=10).status_code
            == 404
        )
        argv = ["simulate", "slow", "--control", server.url, "--node", "sim-node-0000"]
        assert cli.main([*argv, "--gpu", "5", "--kind", "thermal", "--factor", "1.6"]) == 0
        assert src.slowdown_factor("sim-node-0000", 5) == 1.6
        assert cli.main([*argv, "--gpu", "5", "--kind", "nvlink"]) == 1
    finally:
        server.close()
    assert parse_slow("sim-node-0002:3:pcie:600:1.4@30") == {
        "node": "sim-node-0002",
        "gpu": 3,
        "kind": "pcie",
        "duration_s": 600.0,
        "factor": 1.4,
        "at_s": 30.0,
    }
    for text in ("n:1:memory", "n:1", "n:x:pcie", "n:1:pcie:0", "n:1:thermal:60:0.9"):
        with pytest.raises(InvalidInput):
            parse_slow(text)
