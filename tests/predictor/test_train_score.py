"""Training split, registry, one code path for training and live scoring, reasons."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from forewarn.errors import InvalidInput, NotFound
from predictor import registry
from predictor.dataset import Dataset, replay
from predictor.features import FEATURE_NAMES, compute
from predictor.scoring import Scorer
from predictor.state import GpuWindowState
from predictor.train import _node_in_val, split_masks


def test_split_separates_nodes_and_time_by_a_horizon() -> None:
    nodes = [f"sim-node-{i:04d}" for i in range(200)]
    is_val = _node_in_val(nodes, 0.3, seed=0)
    assert 0.15 < is_val.mean() < 0.45
    rng = np.random.default_rng(0)
    node_of_row = rng.integers(0, 200, 5000)
    ts = rng.integers(0, 86_400_000, 5000)
    train, val = split_masks(is_val[node_of_row], ts, cut_ms=50_000_000, horizon_s=1800)
    assert not (train & val).any()
    assert set(node_of_row[train]).isdisjoint(node_of_row[val])
    assert ts[train].max() + 1800 * 1000 <= ts[val].min()


def test_training_and_live_scoring_give_the_same_numbers(tiny: Dataset, tiny_dir) -> None:
    """The replay (60 s steps over prepared blocks) and a scorer fed the store's per-tick
    frames (read back with pandas, as the store hands them) agree feature for feature."""
    checkpoints = {}
    wanted = {tiny.start_ms + k * 60_000 for k in (30, 200, 500)}

    def sink(now_ms, state):
        if now_ms in wanted:
            checkpoints[now_ms] = (
                compute(state, now_ms),
                state.nodes[:],
                state.node_of.copy(),
                state.gpu_of.copy(),
                state.size,
            )

    replay(tiny, sink, step_s=60.0)
    frame = pd.read_parquet(tiny_dir / "samples")
    events = pd.read_parquet(tiny_dir / "events.parquet")
    state = GpuWindowState()  # what Scorer.update feeds
    for t in sorted(frame["ts_ms"].unique()):
        if t > max(wanted):
            break
        tick = frame[frame["ts_ms"] == t]
        ev = events[(events["ts_ms"] > t - 60_000) & (events["ts_ms"] <= t)]
        state.update(tick, ev, now_ms=int(t))
        if int(t) in wanted:
            live = compute(state, int(t))
            ref, nodes, node_of, gpu_of, size = checkpoints[int(t)]
            key_ref = [(nodes[node_of[i]], gpu_of[i]) for i in range(size)]
            key_live = {
                (state.nodes[state.node_of[i]], state.gpu_of[i]): i for i in range(state.size)
            }
            order = [key_live[k] for k in key_ref]
            np.testing.assert_allclose(live[order], ref, rtol=1e-5, atol=1e-4, equal_nan=True)
    assert len(checkpoints) == 3


def test_registry_round_trip_and_latest(tiny_model, tiny_model_path, tmp_path) -> None:
    x = np.random.default_rng(0).normal(size=(50, len(FEATURE_NAMES))).astype(np.float32)
    again = registry.load(tiny_model_path)
    np.testing.assert_array_equal(again.risk(x), tiny_model.risk(x))
    older = registry.save(tiny_model, tmp_path, stem="forewarn-risk-a")
    card = json.loads(older.read_text())
    card["created_at"] = "2000-01-01T00:00:00+00:00"
    older.write_text(json.dumps(card))
    newer = registry.save(tiny_model, tmp_path, stem="forewarn-risk-b")
    assert registry.list_models(tmp_path)[-1][1] == newer
    for key in ("features", "hyper_parameters", "threshold", "metrics", "data", "created_at"):
        assert key in card
    with pytest.raises(NotFound):
        registry.load_latest(tmp_path / "empty")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(InvalidInput):
        registry.load(bad)


def test_scorer_gives_risk_and_reasons_for_the_failing_gpu(tiny_model, tiny: Dataset) -> None:
    scorer = Scorer(tiny_model, reason_floor=0.0)
    # feed up to 20 min before the thermal failure of sim-node-0002 GPU 0 (at 25200 + 3000 s)
    until = tiny.start_ms + (25200 + 3000 - 1200) * 1000
    s = tiny.samples
    hi = int(np.searchsorted(s.ts_ms, until, side="right"))
    ev = tiny.events[tiny.events["ts_ms"] <= until]
    scorer.update(s[:hi], ev, now_ms=until)
    out = scorer.score()
    assert list(out.columns) == [
        "node",
        "gpu",
        "risk",
        "model_risk",
        "floor",
        "floor_rules",
        "floor_kinds",
        "score",
        "alarm",
        "reasons",
        "last_seen_ms",
        "staleness_s",
    ]
    assert len(out) == 32 and out["risk"].between(0, 1).all()
    row = out[(out["node"] == "sim-node-0002") & (out["gpu"] == 0)].iloc[0]
    assert row["risk"] >= out["risk"].median()
    hottest = out.iloc[int(np.argmax(tiny_model.raw(scorer.features())))]
    assert 1 <= len(hottest["reasons"]) <= 3
    assert all(isinstance(r, str) and r for r in hottest["reasons"])
    assert out["reasons"][~out["floor"]].map(len).max() <= 3


def test_card_keeps_the_best_validation_candidate(tiny_model) -> None:
    """One booster per training target; the card names each and the kept one ranks first."""
    cands = tiny_model.card["metrics"]["validation_candidates"]
    assert set(cands) == {"raw_h1800", "raw_h3600"}
    kept = f"raw_h{int(tiny_model.card['training']['label_horizon_s'])}"
    assert kept in cands
    key = ("within_budget", "recall_with_precursors")
    best = max(tuple(float(cands[c][k] or 0.0) for k in key) for c in cands)
    assert tuple(float(cands[kept][k] or 0.0) for k in key) == best
    assert tiny_model.card["raw_threshold"] == cands[kept]["raw_threshold"]


def test_ignored_features_are_never_split_on(tiny_dir) -> None:
    from dataclasses import replace

    from predictor.features import ABSOLUTE_LEVELS
    from predictor.train import train
    from tests.predictor.conftest import TINY_CONFIG

    cfg = replace(TINY_CONFIG, ignore_features=ABSOLUTE_LEVELS, label_horizons_s=(1800.0,))
    model = train([tiny_dir], cfg)
    splits = dict(
        zip(model.booster.feature_name(), model.booster.feature_importance("split"), strict=True)
    )
    assert all(splits[n] == 0 for n in ABSOLUTE_LEVELS)
    assert sum(splits.values()) > 0
    assert list(model.card["training"]["ignore_features"]) == list(ABSOLUTE_LEVELS)


def test_the_threshold_can_count_only_false_alarms_that_are_not_early(tiny_dir, tiny_model) -> None:
    """``threshold_not_early``: the same boosters, a threshold chosen against the false alarms
    on GPUs that did not fail within a day; never stricter than counting every one."""
    from dataclasses import replace

    from predictor.train import train
    from tests.predictor.conftest import TINY_CONFIG

    model = train([tiny_dir], replace(TINY_CONFIG, threshold_not_early=True))
    assert model.card["training"]["threshold_not_early"] is True
    cands, before = (m.card["metrics"]["validation_candidates"] for m in (model, tiny_model))
    for name in cands:  # same seed, same boosters: only the threshold may move, and only down
        assert cands[name]["raw_threshold"] <= before[name]["raw_threshold"]
    val = model.card["metrics"]["validation"]["model"]
    assert val["false_alarms_not_early_per_1000_gpu_days"] <= TINY_CONFIG.max_false_alarms


def test_rows_before_sudden_failures_are_left_out_of_training(tiny: Dataset) -> None:
    """A failure nothing foretold teaches nothing: the rows within the widest target before
    it are not training rows (``sudden_positives`` False, the default), and are when asked."""
    from dataclasses import replace

    from predictor.train import collect
    from tests.predictor.conftest import TINY_CONFIG

    reach = max(TINY_CONFIG.label_horizons_s)
    sudden = replace(tiny, failures=tiny.failures.assign(has_precursors=False))
    left_out = collect(sudden, TINY_CONFIG)
    kept = collect(sudden, replace(TINY_CONFIG, sudden_positives=True))
    assert left_out["y"].sum() == 0 and (left_out["until_s"] <= reach).sum() == 0
    assert kept["y"].sum() > 0 and (kept["until_s"] <= reach).sum() > kept["y"].sum()
    assert len(left_out["y"]) > 0.5 * len(kept["y"])  # the rest of the fleet is still there
    assert collect(tiny, TINY_CONFIG)["y"].sum() > 0  # the injected failures: foretold
