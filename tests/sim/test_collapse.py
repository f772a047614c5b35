"""The failure mode "detachment preceded by telemetry collapse" (``kinds.gpu_lost.collapse``),
on fleets that have it and fleets that do not, and the structural features that see it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forewarn.wire import GpuSample
from predictor.dataset import load_dataset, replay
from predictor.features import FEATURE_NAMES, compute
from predictor.state import VALUE_COLUMNS, GpuWindowState
from sim import generate_dataset
from sim.config import TELEMETRY_COLLAPSE
from sim.precursors import COLLAPSE_VANISH
from sim.source import SimulatedSource

# A quiet fleet (no random failure within the day) with one GPU lost at 3 h, injected with a
# 40-min lead, sampled every 30 s.
QUIET = {"hazard.fleet_mttf_h": 1e6, "sampling.missing_sample_prob": 0.0}
LOST = {"at_s": 7200, "node": 1, "gpu": 3, "kind": "gpu_lost", "lead_s": 2400}
FAIL_S = 7200 + 2400


def _fleet(tmp: Path, collapse: bool) -> Path:
    out = tmp / ("collapse" if collapse else "plain")
    params = {**QUIET, **(TELEMETRY_COLLAPSE if collapse else {})}
    generate_dataset(
        out, gpus=16, days=0.125, interval_s=30.0, seed=5, params=params, injections=[LOST]
    )
    return out


@pytest.fixture(scope="module")
def fleets(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    tmp = tmp_path_factory.mktemp("collapse")
    return {c: _fleet(tmp, c) for c in (False, True)}


def _lost_gpu(samples: pd.DataFrame) -> pd.DataFrame:
    return samples[(samples["node"] == "sim-node-0001") & (samples["gpu"] == 3)]


@pytest.mark.parametrize("collapse", [False, True])
def test_samples_thin_out_and_readings_vanish_only_with_collapse(
    fleets: dict[bool, Path], collapse: bool
) -> None:
    ds = load_dataset(fleets[collapse])
    t0 = ds.start_ms
    lost = _lost_gpu(pd.read_parquet(fleets[collapse] / "samples"))
    rel = (lost["ts_ms"].to_numpy() - t0) / 1000.0
    before = lost[rel < 7200]
    last_half = lost[(rel >= 7200 + 1200 + 30) & (rel < FAIL_S)]
    last_quarter = (rel >= 7200 + 1800) & (rel < FAIL_S)
    expected = 600 / 30  # samples in the last 10 min with nothing missing
    (failure,) = ds.failures[ds.failures["kind"] == "gpu_lost"].to_dict("records")
    assert failure["has_precursors"] == collapse
    assert before[list(COLLAPSE_VANISH)].notna().all().all()
    if collapse:
        assert last_quarter.sum() < 0.8 * expected  # gaps: samples missing
        assert len(last_half) and last_half[list(COLLAPSE_VANISH)].isna().all().all()
        assert last_half["temp_gpu_c"].notna().all()  # not every reading vanishes
    else:
        assert last_quarter.sum() >= expected - 1
        assert lost[list(COLLAPSE_VANISH)].notna().all().all()


def _features_before_failure(path: Path) -> tuple[np.ndarray, int]:
    ds = load_dataset(path)
    at = ds.start_ms + (FAIL_S - 120) * 1000
    keep: dict[str, np.ndarray] = {}

    def sink(now_ms: int, state: GpuWindowState) -> None:
        if now_ms <= at:
            keep["x"] = compute(state, now_ms)
            keep["slot"] = state.slots(np.array(["sim-node-0001"]), np.array([3]), create=False)

    replay(ds, sink, step_s=60.0)
    return keep["x"], int(keep["slot"][0])


def test_the_structural_features_see_the_collapse_and_nothing_on_a_fleet_without_it(
    fleets: dict[bool, Path],
) -> None:
    col = FEATURE_NAMES.index
    x, lost = _features_before_failure(fleets[True])
    others = np.delete(np.arange(len(x)), lost)
    read = [c for c in COLLAPSE_VANISH if c in VALUE_COLUMNS]  # the readings features use
    assert len(read) >= 2
    assert x[lost, col("metrics_vanished_now")] == len(read)
    assert x[lost, col("metrics_vanished_5m")] >= 1
    assert (x[others, col("metrics_vanished_now")] == 0).all()
    assert x[lost, col("gap_len_1h")] > 1.5 * np.nanmax(x[others, col("gap_len_1h")])
    assert x[lost, col("gap_len_1h_vs_24h")] > 1.2
    x0, lost0 = _features_before_failure(fleets[False])
    assert x0[lost0, col("metrics_vanished_now")] == 0
    assert x0[lost0, col("gap_len_1h")] == pytest.approx(30.0, rel=0.05)


def test_a_live_source_sends_vanished_readings_as_nulls() -> None:
    source = SimulatedSource(8, seed=2, params=TELEMETRY_COLLAPSE)
    source.inject(0, 1, "gpu_lost", 60.0)
    t0 = 1_800_000_000.0
    seen: list[GpuSample] = []
    for k in range(58):
        rows = source.read(datetime.fromtimestamp(t0 + k, UTC))
        seen += [r for r in rows if isinstance(r, GpuSample) and (r.node, r.gpu) == (
            "sim-node-0000", 1)]  # fmt: skip
    late = [r for r in seen if r.ts.timestamp() >= t0 + 35]
    assert late and all(r.power_w is None and r.temp_mem_c is None for r in late)
    assert all(r.power_w is not None for r in seen if r.ts.timestamp() < t0 + 25)
    assert len(seen) < 55  # samples went missing
