"""The dataset the simulator writes: its format, its ground truth and its physics."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forewarn.datasets import EVENT_COLUMNS, FAILURE_COLUMNS, SAMPLE_COLUMNS, sample_dtypes
from forewarn.wire import COUNTER_FIELDS, EventKind
from sim import FleetModel, generate_dataset, load_params

# A busy fleet: failures every few GPU-hours, short repairs, every benign confounder frequent.
BUSY = {
    "hazard.fleet_mttf_h": 0.03,
    "hazard.repair_time_scale": 0.002,
    "kinds.memory.lead_median_s": 3600.0,
    "kinds.nvlink.lead_median_s": 1800.0,
    "kinds.pcie.lead_median_s": 1800.0,
    "kinds.thermal.lead_median_s": 900.0,
    "sampling.missing_sample_prob": 0.01,
    "sampling.stall_rate_per_node_day": 3.0,
    "noise.reboot_rate_per_node_day": 2.0,
    "noise.app_xid_rate_per_node_day": 6.0,
}
INJECT = [
    {"at_s": 3600, "node": "sim-node-0001", "gpu": 2, "kind": "memory", "lead_s": 3600},
    {"at_s": 3600, "node": 2, "gpu": 5, "kind": "thermal", "lead_s": 1800},
    {"at_s": 7200, "node": 3, "gpu": 1, "kind": "pcie", "lead_s": 2400},
    {"at_s": 7200, "node": 4, "gpu": 0, "kind": "nvlink", "lead_s": 2400},
    {"at_s": 9000, "node": 5, "gpu": 7, "kind": "power_loss"},
]
HW_XIDS = {48, 74, 79, 94, 95, 119}
APP_XIDS = {13, 31, 43}


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("busy")
    generate_dataset(
        out, gpus=64, days=0.5, interval_s=30.0, seed=42, params=BUSY, injections=INJECT
    )
    return out


@pytest.fixture(scope="module")
def frames(busy: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict]:
    return (
        pd.read_parquet(busy / "samples"),
        pd.read_parquet(busy / "events.parquet"),
        pd.read_parquet(busy / "failures.parquet"),
        json.loads((busy / "manifest.json").read_text()),
    )


def test_format_follows_the_contract(frames) -> None:  # type: ignore[no-untyped-def]
    samples, events, failures, manifest = frames
    for key in (
        "format",
        "version",
        "generator",
        "seed",
        "gpus",
        "nodes",
        "gpus_per_node",
        "start_ms",
        "end_ms",
        "interval_s",
        "params",
    ):
        assert key in manifest
    assert manifest["format"] == "forewarn-dataset" and manifest["version"] == 1
    assert (manifest["gpus"], manifest["nodes"], manifest["interval_s"]) == (64, 8, 30.0)
    assert manifest["params"]["hazard"]["fleet_mttf_h"] == 0.03
    assert tuple(samples.columns) == SAMPLE_COLUMNS
    for col, dtype in sample_dtypes().items():
        assert str(samples[col].dtype) == dtype, col
    key = samples[["ts_ms", "node", "gpu"]]
    assert key.equals(key.sort_values(["ts_ms", "node", "gpu"]).reset_index(drop=True))
    assert not key.duplicated().any()
    assert samples["ts_ms"].between(manifest["start_ms"], manifest["end_ms"]).all()
    assert tuple(events.columns) == EVENT_COLUMNS
    assert set(events["kind"]) <= {k.value for k in EventKind}
    assert str(events["gpu"].dtype) == "Int64" and str(events["xid"].dtype) == "Int64"
    assert tuple(failures.columns) == FAILURE_COLUMNS
    assert set(failures["kind"]) <= {
        "memory",
        "thermal",
        "nvlink",
        "pcie",
        "power_loss",
        "gpu_lost",
        "other",
    }
    assert str(failures["recovered_ts_ms"].dtype) == "Int64"
    assert failures["has_precursors"].dtype == bool
    assert set(manifest["lemon_nodes"]) <= set(samples["node"])


def test_failures_kill_the_gpu_until_it_recovers(frames) -> None:  # type: ignore[no-untyped-def]
    samples, events, failures, _ = frames
    real = failures[failures["in_window"]]
    assert len(real) >= 20
    assert {"memory", "thermal", "nvlink", "pcie", "power_loss"} <= set(real["kind"])
    injected = real[real["injected"]]
    assert set(injected["kind"]) == {"memory", "thermal", "nvlink", "pcie", "power_loss"}
    assert (injected["kind"] == "power_loss").sum() == 8  # the whole node
    by_gpu = dict(tuple(samples.groupby(["node", "gpu"])["ts_ms"]))
    for f in real.itertuples():
        ts = by_gpu[(f.node, f.gpu)].to_numpy()
        back = f.recovered_ts_ms if f.recovered_ts_ms is not pd.NA else np.iinfo(np.int64).max
        assert not ((ts >= f.ts_ms) & (ts < back)).any(), f
    recovered = events[events["kind"] == "gpu_recovered"]
    assert len(recovered) > 0


def _windows(failures: pd.DataFrame, kind: str) -> dict[tuple[str, int], list[tuple[int, int]]]:
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for f in failures[(failures["kind"] == kind) & failures["has_precursors"]].itertuples():
        out.setdefault((f.node, f.gpu), []).append((int(f.precursor_onset_ts_ms), int(f.ts_ms)))
    return out


def _inside(windows, node: str, gpu: int, ts: int, slack_ms: int = 0) -> bool:  # type: ignore[no-untyped-def]
    return any(a - slack_ms <= ts <= b for a, b in windows.get((node, gpu), []))


def test_every_precursor_precedes_its_failure(frames) -> None:  # type: ignore[no-untyped-def]
    samples, events, failures, _ = frames
    with_prec = failures[failures["has_precursors"] & failures["in_window"]]
    assert len(with_prec) >= 5
    assert (with_prec["precursor_onset_ts_ms"] < with_prec["ts_ms"]).all()
    assert failures.loc[~failures["has_precursors"], "precursor_onset_ts_ms"].isna().all()
    signal = {"memory": "ecc_sbe_aggregate", "nvlink": "nvlink_crc_flit", "pcie": "pcie_replay"}
    for f in with_prec.itertuples():
        gpu = samples[(samples["node"] == f.node) & (samples["gpu"] == f.gpu)]
        during = gpu[gpu["ts_ms"].between(f.precursor_onset_ts_ms, f.ts_ms - 1)]
        if len(during) < 4:
            continue  # a precursor too short to be seen at this sampling period
        if f.kind in signal:
            col = during[signal[f.kind]].astype("int64")
            assert col.iloc[-1] > col.iloc[0] or f.kind == "pcie", f
        if f.kind == "thermal" and f.injected:
            assert during["temp_gpu_c"].max() >= 85.0, f
    # The signals only failure physics makes appear inside a precursor window, never before.
    thermal = _windows(failures, "thermal")
    hot = samples[(samples["throttle_reasons"].astype("int64") & 0x20) > 0]
    assert len(hot) > 0
    for r in hot.itertuples():
        near = [(r.node, g) for g in (r.gpu - 1, r.gpu, r.gpu + 1)]
        assert any(_inside(thermal, n, g, r.ts_ms, 120_000) for n, g in near), r
    pcie = _windows(failures, "pcie")
    narrow = samples[samples["pcie_link_width"] < samples["pcie_link_width_max"]]
    width = samples.groupby(["node", "gpu"])["pcie_link_width"].agg(["min", "max"])
    always_x8 = set(width.index[width["max"] == 8])
    assert len(narrow) > 0
    for r in narrow.itertuples():
        assert (r.node, r.gpu) in always_x8 or _inside(pcie, r.node, r.gpu, r.ts_ms), r
    memory = _windows(failures, "memory")
    storms = events[events["kind"] == "ecc_storm"]
    for r in storms.itertuples():
        assert _inside(memory, r.node, int(r.gpu), r.ts_ms), r


def test_counters_never_decrease_except_at_a_reset(frames) -> None:  # type: ignore[no-untyped-def]
    samples, events, _, _ = frames
    resets = events[events["kind"] == "counter_reset"]
    reset_at = {k: np.sort(v.to_numpy()) for k, v in resets.groupby(["node", "gpu"])["ts_ms"]}
    assert len(resets) > 0
    decreases = 0
    for (node, gpu), g in samples.groupby(["node", "gpu"]):
        ts = g["ts_ms"].to_numpy()
        for col in COUNTER_FIELDS:
            v = g[col].to_numpy(dtype="float64", na_value=np.nan)
            if np.isnan(v).all():
                continue
            drops = np.flatnonzero(np.diff(v) < 0)
            if col.endswith("_aggregate") or col.startswith("remap"):
                assert drops.size == 0, (node, gpu, col)
            r = reset_at.get((node, int(gpu)), np.array([], dtype=np.int64))
            for i in drops:
                decreases += 1
                assert ((r > ts[i]) & (r <= ts[i + 1])).any(), (node, gpu, col, ts[i + 1])
    assert decreases > 0  # resets happened and were visible


def test_benign_xids_on_healthy_gpus(frames) -> None:  # type: ignore[no-untyped-def]
    _, events, failures, _ = frames
    failed = set(zip(failures["node"], failures["gpu"], strict=True))
    xids = events[events["kind"] == "xid"]
    app = xids[xids["xid"].isin(list(APP_XIDS))]
    healthy_app = [k for k in zip(app["node"], app["gpu"], strict=True) if k not in failed]
    assert len(healthy_app) > 0
    fail_at = set(zip(failures["node"], failures["gpu"], failures["ts_ms"], strict=True))
    for r in xids[xids["xid"].isin(list(HW_XIDS))].itertuples():
        assert (r.node, r.gpu, r.ts_ms) in fail_at, r  # hardware Xids only when a GPU dies


def test_application_xid_mix_is_summit_like() -> None:
    params = load_params(overrides={"noise.app_xid_rate_per_node_day": 20.0})
    model = FleetModel(1024, params, seed=3)
    seen: Counter[int] = Counter()
    for k in range(2 * 144):
        for ev in model.step(600.0, k * 600_000).events:
            if ev[3] == "xid" and ev[4] in APP_XIDS:
                seen[ev[4]] += 1
    total = sum(seen.values())
    assert total > 5000
    summit = {31: 186_496, 13: 32_339, 43: 22_649}
    for xid, n in summit.items():
        # Crashes are per node (8 GPUs at once): about total/8 independent draws.
        share, want = seen[xid] / total, n / sum(summit.values())
        assert abs(share - want) < 4 * np.sqrt(want * (1 - want) / (total / 8)), xid


def test_gaps_and_stalls_are_there(frames) -> None:  # type: ignore[no-untyped-def]
    samples, events, _, manifest = frames
    ticks = (manifest["end_ms"] - manifest["start_ms"]) // 30_000 + 1
    assert len(samples) < ticks * 64
    stalls = events[events["kind"] == "telemetry_stalled"]
    assert len(stalls) > 0 and stalls["gpu"].isna().all()
    s = stalls.iloc[0]
    node = samples[samples["node"] == s["node"]]
    before = node[node["ts_ms"] < s["ts_ms"]]["ts_ms"].drop_duplicates()
    assert before.empty or s["ts_ms"] - before.max() > 30_000  # the node was silent


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    def files(d: Path) -> dict[str, bytes]:
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*.*"))}

    kw = {"gpus": 16, "days": 0.1, "interval_s": 10.0, "params": BUSY}
    generate_dataset(tmp_path / "a", seed=5, **kw)
    generate_dataset(tmp_path / "b", seed=5, **kw)
    generate_dataset(tmp_path / "c", seed=6, **kw)
    a, b, c = files(tmp_path / "a"), files(tmp_path / "b"), files(tmp_path / "c")
    assert set(a) == {
        "manifest.json",
        "events.parquet",
        "failures.parquet",
        "samples/part-00000.parquet",
    }
    assert a == b
    manifest = json.loads(a["manifest.json"])
    generate_dataset(
        tmp_path / "d", seed=manifest["seed"], gpus=16, days=0.1, params=manifest["params"]
    )  # the manifest is enough to regenerate
    assert files(tmp_path / "d") == a
    assert a["samples/part-00000.parquet"] != c["samples/part-00000.parquet"]
