"""Training: sampled feature rows, a split by node and by time, trees, calibration, threshold.

1. Each dataset is replayed through the live feature path (60 s steps by default). Rows are
   kept by stratum, each with weight ``1 / keep probability`` so that the weighted rows still
   stand for the whole fleet: every row within ``context_s`` (6 h) before a failure of its GPU
   (positives and the hard negatives just before them), ``active_rate`` (10 %) of rows where
   anything happens (a counter moves, a hardware event, throttling, a
   narrow link, stale telemetry), ``quiet_rate`` (0.5 %) of the rest. Rows just before a
   failure that had no precursors are left out (``sudden_positives``).
2. Split, so that validation never sees what training saw: nodes are hashed into a training
   and a validation group (``val_node_frac``, whole nodes, so node-mates and node-scope failures
   do not straddle), and time is cut at ``val_from`` of each dataset: training rows end one
   horizon before the cut (their labels look one horizon ahead), validation rows start at it.
3. One booster per training target "a failure within T" (``label_horizons_s``, default the
   horizon H alone; wider targets teach the whole precursor ramp of long-lead kinds), each
   fitted with the positives re-weighted to a tenth of the negatives' weight (class
   imbalance). Training rows stop the widest T before the cut.
4. The validation rows are replayed again in full (every step, every validation GPU) and
   scored by every booster; the one of best event-level recall (failures with precursors)
   within the false-alarm budget is kept (the card lists every candidate), and an isotonic
   map from its output to observed failure frequency is fitted on them; the alarm threshold
   is the one of best event-level recall whose false alarms stay within
   ``max_false_alarms`` per 1,000 GPU-days on that validation replay.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.isotonic import IsotonicRegression

from forewarn import __version__
from forewarn.errors import InvalidInput
from predictor import baseline, evaluate
from predictor.dataset import Dataset, load_dataset, read_failures, read_manifest, replay
from predictor.features import FEATURE_NAMES, compute
from predictor.labels import Labeller, failure_table
from predictor.model import DEFAULT_PARAMS, DEFAULT_ROUNDS, RiskModel, fit_booster
from predictor.scored import score_dataset
from predictor.state import GpuWindowState, SampleBlock

__all__ = ["TrainConfig", "activity", "collect", "split_masks", "train"]

Progress = Callable[[str, int], None]


@dataclass
class TrainConfig:
    step_s: float = 60.0
    horizon_s: float = 1800.0
    lead_min_s: float = 120.0
    merge_s: float = 600.0
    context_s: float = 6 * 3600.0
    active_rate: float = 0.1
    quiet_rate: float = 0.005
    val_node_frac: float = 0.3
    val_from: float = 0.6
    max_false_alarms: float = 2.0
    # True: ``max_false_alarms`` counts only false alarms on GPUs that did not fail within a
    # day (evaluate.EARLY_S), the healthy time an alarm budget counts. Training fleets fail
    # ten times as often as a real one, so many of their "false" alarms are early ones, and
    # counting them sets the card's threshold for a fleet far sicker than any in service.
    threshold_not_early: bool = False
    rounds: int = DEFAULT_ROUNDS
    seed: int = 0
    # Training targets tried: "a failure within T" for each T; each gives one booster, all
    # are scored on the validation replay and the one of best event-level recall at the
    # false-alarm budget is kept (a wider T teaches the whole precursor ramp of long-lead
    # kinds; the evaluation's definition — alarm L..H before — never changes).
    label_horizons_s: tuple[float, ...] = (1800.0,)
    # Which nodes go to validation is a hash of the node name and this seed. None: the first
    # of ``seed``, ``seed + 1``, ... whose split leaves failures with precursors on both sides
    # (training refuses when none of :data:`SPLIT_TRIES` does).
    split_seed: int | None = None
    # Features the trees may not split on (their training column is blanked): e.g.
    # :data:`predictor.features.ABSOLUTE_LEVELS`, so that another fleet's normal temperature
    # or power does not read as danger; the model keeps their relative forms.
    ignore_features: tuple[str, ...] = ()
    # False: the rows within the widest target before a failure that had no precursors are
    # left out of training. Nothing in them foretells it, so as positives they only teach the
    # trees noise (hot or busy GPUs, whatever the sudden deaths happened to share), which then
    # fires on healthy GPUs; the evaluation counts recall of failures with precursors anyway.
    sudden_positives: bool = False


def _cols(*names: str) -> list[int]:
    return [FEATURE_NAMES.index(n) for n in names]


_RATE_1H = [i for i, n in enumerate(FEATURE_NAMES) if n.endswith("_rate_1h")]
_HW_EVENTS_24H = [
    i
    for i, n in enumerate(FEATURE_NAMES)
    if n.endswith("_24h")
    and not n.startswith(("xid_app", "counter_reset", "telemetry"))
    and ("xid_" in n or n.split("_24h")[0] in ("ecc_storm", "link_down", "thermal_shutdown"))
]


def activity(x: np.ndarray) -> np.ndarray:
    """Rows where anything happens: the stratum sampled more densely than the quiet rest."""
    with np.errstate(invalid="ignore"):
        moving = np.nansum(x[:, _RATE_1H], axis=1) > 0.5  # decayed sums never reach 0
        events = np.nansum(x[:, _HW_EVENTS_24H], axis=1) > 0.05
        thr = np.nansum(x[:, _cols("thermal_throttle_1h", "hw_slowdown_1h")], axis=1) > 0
        temp = np.nan_to_num(np.abs(x[:, _cols("temp_gpu_c_slope")[0]])) > 10.0
        narrow = np.nan_to_num(x[:, _cols("pcie_width_ratio")[0]], nan=1.0) < 1.0
        remap = np.nansum(x[:, _cols("remap_pending", "remap_failure")], axis=1) > 0
        stale = np.nan_to_num(x[:, _cols("staleness_s")[0]]) > 120.0
    return moving | events | thr | temp | narrow | remap | stale


SPLIT_TRIES = 64


def _node_in_val(nodes: Sequence[str], frac: float, seed: int) -> np.ndarray:
    in_val = [zlib.crc32(f"{seed}:{n}".encode()) % 10_000 < frac * 10_000 for n in nodes]
    return np.array(in_val, dtype=bool)  # an empty list too: bool, so ``~`` applies


def split_masks(
    node_is_val: np.ndarray, ts_ms: np.ndarray, cut_ms: int, horizon_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) masks: training nodes before ``cut - horizon``, validation nodes
    from ``cut`` on."""
    train = ~node_is_val & (ts_ms <= cut_ms - horizon_s * 1000)
    val = node_is_val & (ts_ms >= cut_ms)
    return train, val


def _cut_ms(ds: Dataset, cfg: TrainConfig) -> int:
    return int(ds.start_ms + cfg.val_from * (ds.end_ms - ds.start_ms))


def collect(
    ds: Dataset, cfg: TrainConfig, progress: Callable[[int], None] | None = None
) -> dict[str, np.ndarray]:
    """Sampled training rows of one dataset: ``x``, ``y``, ``w``, ``ts_ms``, ``val`` (node
    in the validation group) — only rows on the training side of the split."""
    fails = failure_table(ds.failures, int(ds.manifest.get("gpus_per_node", 8)))
    labeller = Labeller(fails, cfg.horizon_s)
    rng = np.random.default_rng(cfg.seed)
    cut = _cut_ms(ds, cfg)
    # training labels look up to the widest target ahead: stop that long before the cut
    reach_s = max(cfg.horizon_s, *cfg.label_horizons_s)
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("x", "y", "w", "ts_ms", "until_s")}

    def sink(now_ms: int, state: GpuWindowState) -> None:
        if state.size == 0 or now_ms > cut - reach_s * 1000:
            return
        x = compute(state, now_ms)
        lab = labeller.at(state, now_ms)
        is_val = _node_in_val(state.nodes, cfg.val_node_frac, _split_seed(cfg))
        is_val = is_val[state.node_of[: state.size]]
        rate = np.where(activity(x), cfg.active_rate, cfg.quiet_rate)
        rate = np.where(lab.until_s <= max(cfg.context_s, *cfg.label_horizons_s), 1.0, rate)
        keep = lab.keep & ~is_val & (rng.random(state.size) < rate)
        if not cfg.sudden_positives:
            keep &= lab.foretold | (lab.until_s > reach_s)
        idx = np.flatnonzero(keep)
        out["x"].append(x[idx])
        out["y"].append(lab.y[idx])
        out["w"].append(1.0 / rate[idx])
        out["ts_ms"].append(np.full(len(idx), now_ms, dtype=np.int64))
        out["until_s"].append(lab.until_s[idx])

    replay(ds, sink, step_s=cfg.step_s, progress=progress)
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}


def _split_seed(cfg: TrainConfig) -> int:
    return cfg.seed if cfg.split_seed is None else cfg.split_seed


def _ground_truth(d: Dataset | str | Path) -> tuple[pd.DataFrame, int, int]:
    """(failures, start_ms, end_ms) of a dataset, without reading its samples."""
    if isinstance(d, Dataset):
        return d.failures, d.start_ms, d.end_ms
    m = read_manifest(d)
    return read_failures(d), int(m["start_ms"]), int(m["end_ms"])


def split_counts(
    truths: Sequence[tuple[pd.DataFrame, int, int]], cfg: TrainConfig, split_seed: int
) -> tuple[int, int]:
    """(training, validation) failures with precursors that a split would see."""
    n_train = n_val = 0
    for f, start, end in truths:
        if not len(f):
            continue
        f = f[f["has_precursors"].astype(bool)]
        if "in_window" in f:
            f = f[f["in_window"].astype(bool)]
        cut = int(start + cfg.val_from * (end - start))
        val_node = _node_in_val(f["node"].astype(str).tolist(), cfg.val_node_frac, split_seed)
        ts = f["ts_ms"].to_numpy(np.int64)
        reach_s = max(cfg.horizon_s, *cfg.label_horizons_s)
        n_train += int((~val_node & (ts <= cut - reach_s * 1000 + cfg.horizon_s * 1000)).sum())
        n_val += int((val_node & (ts >= cut + cfg.horizon_s * 1000) & (ts < end)).sum())
    return n_train, n_val


def choose_split(datasets: Sequence[Dataset | str | Path], cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with a ``split_seed`` whose split holds failures with precursors on the
    training side and in validation.

    Raises:
        InvalidInput: no such split among :data:`SPLIT_TRIES` seeds (too few failures).
    """
    truths = [_ground_truth(d) for d in datasets]
    tries = (
        [cfg.split_seed] if cfg.split_seed is not None else range(cfg.seed, cfg.seed + SPLIT_TRIES)
    )
    for seed in tries:
        n_train, n_val = split_counts(truths, cfg, seed)
        if n_train and n_val:
            return replace(cfg, split_seed=seed)
    total = sum(int(f["has_precursors"].astype(bool).sum()) if len(f) else 0 for f, _, _ in truths)
    raise InvalidInput(
        "no split of these datasets puts failures with precursors both in training and in "
        f"validation (the {cfg.val_node_frac:.0%} validation nodes after {cfg.val_from:.0%} of "
        f"the time); the data hold {total} such failures. Train on more GPUs or days, or "
        "change --val-from / --val-node-frac.",
        details={"failures_with_precursors": total},
    )


def _empty(block: SampleBlock) -> SampleBlock:
    return SampleBlock(
        *(np.array(a[:0]) for a in (block.ts_ms, block.node, block.gpu, block.values))
    )


def _open(d: Dataset | str | Path) -> Dataset:
    return d if isinstance(d, Dataset) else load_dataset(d)


def train(
    datasets: Sequence[Dataset | str | Path],
    cfg: TrainConfig | None = None,
    *,
    progress: Progress | None = None,
    booster_params: dict[str, Any] | None = None,
) -> RiskModel:
    """Train, calibrate and pick the threshold; the returned model carries its card.

    ``booster_params``: hyper-parameters over :data:`predictor.model.DEFAULT_PARAMS` (a base
    model's, when retraining: :mod:`predictor.retrain`).

    Datasets given as paths are loaded one at a time (twice: to collect, to validate), so
    several large fleets never sit in memory together.

    ``progress(phase, steps_done)`` is called as the replays advance (phases ``collect`` and
    ``validate``, one step per replayed ``step_s``).

    Raises:
        InvalidInput: no dataset, or no split of the data holds failures with precursors
            both on the training side and in validation.
    """
    cfg = cfg or TrainConfig()
    if not datasets:
        raise InvalidInput("no dataset to train on")
    cfg = choose_split(datasets, cfg)
    parts, manifests = [], []
    for d in datasets:
        ds = _open(d)
        manifests.append(
            # copies: a slice would keep the whole sample arrays of every fleet alive
            Dataset(
                ds.path,
                ds.manifest,
                _empty(ds.samples),
                ds.events[:0].copy(),
                ds.failures[:0].copy(),
            )
        )
        parts.append(
            collect(ds, cfg, None if progress is None else lambda n: progress("collect", n))
        )
        del ds
    x = np.vstack([p["x"] for p in parts]).astype(np.float32)
    y = np.concatenate([p["y"] for p in parts]).astype(np.int8)
    w0 = np.concatenate([p["w"] for p in parts])
    until = np.concatenate([p["until_s"] for p in parts])
    del parts
    for name in cfg.ignore_features:
        x[:, FEATURE_NAMES.index(name)] = np.nan
    if not len(y) or y.sum() == 0:
        raise InvalidInput("no failure within the horizon on the training side of the split")
    scorers: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
    boosters = {}
    for h in sorted(set(cfg.label_horizons_s)):
        yh = (until <= h).astype(np.int8) if h != cfg.horizon_s else y
        if yh.sum() == 0:
            continue
        w = np.where(yh == 1, w0 * 0.1 * w0[yh == 0].sum() / w0[yh == 1].sum(), w0)
        b = fit_booster(x, yh, w, params=booster_params, rounds=cfg.rounds, seed=cfg.seed)
        boosters[_cand(h)] = (h, b)
        scorers[_cand(h)] = RiskModel(b, np.zeros(0), np.zeros(0), 0.5).raw

    tables: list[Any] = []
    for d in datasets:
        ds = _open(d)
        cut = _cut_ms(ds, cfg)

        def select(now_ms: int, state: GpuWindowState, cut: int = cut) -> np.ndarray:
            is_val = _node_in_val(state.nodes, cfg.val_node_frac, _split_seed(cfg))
            return is_val[state.node_of[: state.size]] & (now_ms >= cut)

        scored = score_dataset(
            ds,
            scorers,
            step_s=cfg.step_s,
            horizon_s=cfg.horizon_s,
            select=select,
            progress=None if progress is None else lambda n: progress("validate", n),
        )
        tables.append(scored)
        del ds
    params = evaluate.Params(cfg.lead_min_s, cfg.horizon_s, cfg.merge_s)
    joined = _join(tables, cfg.horizon_s)
    table = evaluate.ScoreTable(joined[0], joined[1], step_s=cfg.step_s, params=params)
    if not table.failures["has_precursors"].astype(bool).any():
        raise InvalidInput(
            "the validation replay holds no failure with precursors to choose a threshold on; "
            "train on more GPUs or days, or change --val-from / --val-node-frac"
        )
    # Sweep the raw score (finer than the stepwise calibrated one), report the risk.
    candidates: dict[str, dict[str, Any]] = {}
    rate = (
        "false_alarms_not_early_per_1000_gpu_days"
        if cfg.threshold_not_early
        else "false_alarms_per_1000_gpu_days"
    )
    for name in boosters:
        thr = evaluate.choose_threshold(evaluate.curve(table, name), cfg.max_false_alarms, rate)
        m = evaluate.metrics(table, name, thr)
        candidates[name] = {
            "label_horizon_s": boosters[name][0],
            "raw_threshold": thr,
            **{k: m.get(k) for k in _BRIEF},
        }
        candidates[name]["within_budget"] = bool((m.get(rate) or 0.0) <= cfg.max_false_alarms)
    chosen = max(candidates, key=lambda k: _rank(candidates[k]))
    booster = boosters[chosen][1]
    table.rows["raw"] = table.rows[chosen]
    raw_all, y_all = table.rows["raw"].to_numpy(), table.rows["y"].to_numpy()
    iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip", increasing=True)
    if 0 < y_all.sum() < len(y_all):
        iso.fit(raw_all, y_all)
        cx, cy = np.asarray(iso.X_thresholds_), np.asarray(iso.y_thresholds_)
    else:  # no failure in validation: keep the booster's own probabilities
        cx, cy = np.array([0.0, 1.0]), np.array([0.0, 1.0])
    model = RiskModel(booster, cx, cy, 0.5)
    raw_thr = float(candidates[chosen]["raw_threshold"])
    model.threshold = float(model.calibrate(np.array([raw_thr]))[0])
    table.rows["risk"] = model.calibrate(table.rows["raw"].to_numpy())
    val_model = evaluate.metrics(table, "raw", raw_thr)
    val_model["threshold"] = model.threshold
    val_base = evaluate.metrics(table, "baseline", baseline.THRESHOLD)
    model.card = _card(
        manifests, cfg, model, len(y), int(y.sum()), val_model, val_base, booster_params
    )
    model.card["raw_threshold"] = raw_thr
    model.card["training"]["label_horizon_s"] = boosters[chosen][0]
    model.card["metrics"]["validation_candidates"] = candidates
    return model


_BRIEF = ("recall", "recall_with_precursors", "false_alarms_per_1000_gpu_days", "pr_auc")


def _cand(h: float) -> str:
    return f"raw_h{int(h)}"


def _rank(m: dict[str, Any]) -> tuple[float, float, float]:
    """Best validation recall (with precursors, then all) within the budget, then PR-AUC."""

    def num(v: Any) -> float:
        return float(v) if v is not None and np.isfinite(v) else 0.0

    return (
        float(m["within_budget"]),
        num(m["recall_with_precursors"]),
        num(m["recall"]) + 1e-3 * num(m["pr_auc"]),
    )


def _join(tables: list[Any], horizon_s: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stack scored replays of several datasets with disjoint slot numbers."""
    rows, fails, offset = [], [], 0
    for t in tables:
        r = t.rows.copy()
        f = t.failures.copy()
        r["slot"] += offset
        f["slot"] = np.where(f["slot"] >= 0, f["slot"] + offset, -1)
        # a GPU outside the validation group has no scored rows: its failures do not count
        scored_slots = np.unique(r["slot"].to_numpy())
        f.loc[~np.isin(f["slot"], scored_slots), "slot"] = -1
        cut_ts = r["ts_ms"].min() if len(r) else 0
        f.loc[f["ts_ms"] < cut_ts + horizon_s * 1000, "in_window"] = False
        rows.append(r)
        fails.append(f)
        offset += t.state.size
    return pd.concat(rows, ignore_index=True), pd.concat(fails, ignore_index=True)


def _card(
    datasets: Sequence[Dataset],
    cfg: TrainConfig,
    model: RiskModel,
    n_rows: int,
    n_pos: int,
    val_model: dict[str, Any],
    val_base: dict[str, Any],
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "format": "forewarn-model",
        "version": 1,
        "forewarn_version": __version__,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "kind": "lightgbm-binary",
        "target": f"hardware failure within {cfg.horizon_s:.0f} s",
        "threshold": model.threshold,
        "features": list(FEATURE_NAMES),
        "hyper_parameters": {
            **DEFAULT_PARAMS,
            **(params or {}),
            "rounds": cfg.rounds,
            "seed": cfg.seed,
        },
        "training": {**asdict(cfg), "rows": n_rows, "positive_rows": n_pos},
        "data": [
            {k: v for k, v in ds.manifest.items() if k != "params"} | {"path": str(ds.path)}
            for ds in datasets
        ],
        "data_params": [ds.manifest.get("params") for ds in datasets],
        "metrics": {"validation": {"model": val_model, "baseline": val_base}},
        "calibration": {
            "method": "isotonic",
            "x": model.calibration_x.tolist(),
            "y": model.calibration_y.tolist(),
        },
    }
