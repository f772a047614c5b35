"""Features of every GPU at an instant, from the decayed window state of :mod:`predictor.state`.

:func:`compute` is the only place features are made, for training and for live scoring alike.
Each feature has a :class:`Feature` spec (subject, measure, window) so that attributions can be
turned into plain words (:mod:`predictor.reasons`). Families:

- counter rates per hour over 5 min, 1 h and 24 h for every cumulative counter, the 1 h rate
  against the GPU's own 7-day rate (growth), against the fleet median and against the other
  GPUs of its node; lifetime totals of the remap and aggregate ECC counters;
- temperatures (GPU die, HBM): latest, 5 min mean, slope (°C/h, from the 5 min and 1 h means:
  a linear trend makes a decayed mean lag by ``slope * tau``), against node, fleet and the
  GPU's own 24 h mean; power, SM clock and utilisation against the node;
- throttle time (thermal, power, hardware slowdown) as the share of samples over 5 min / 1 h;
- PCIe link width against its maximum, row-remap pending/failure, retired-pages pending;
- events: Xid counts by class, ECC storms, link down, stalls, resets (5 min, 1 h, 24 h) and the
  time since the last of each (capped at 7 days);
- telemetry staleness (seconds since the last sample, against the node) and the sample rate
  of the last 5 min against the last day (missing data); the structure of the stream: the
  time-weighted mean gap between samples over the last hour, and against the GPU's own day,
  and how many readings the GPU reported before are missing now (in its latest sample, and
  per sample over 5 min: metrics that vanished);
- the rules of the baseline (:mod:`predictor.baseline`) as features (``rule_*``, and how many
  fire), so the trees start from what DCGM and NVSentinel already know.

:data:`MONOTONE` gives each feature's direction for the trees' monotone constraints: +1 for
signals that only ever mean more danger (uncorrectable ECC, remaps pending or failed, retired
pages, fatal Xids, thermal slowdown share, the rules), -1 where less means more danger (PCIe
link width against its maximum, time since a DBE or a fatal Xid), 0 elsewhere.

Windows are normalised by how long the GPU has been watched, so a scorer that started an hour
ago does not read every 24 h rate as 24 times too small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from forewarn.wire import COUNTER_FIELDS
from predictor.state import COLUMN, EVENT_CHANNELS, LATEST, TAU, WINDOWS, GpuWindowState

__all__ = [
    "ABSOLUTE_LEVELS",
    "FEATURES",
    "FEATURE_NAMES",
    "MONOTONE",
    "RULES",
    "Feature",
    "compute",
    "rule_hits",
]

SINCE_CAP_S = 7 * 86400.0
_FLOOR_PER_H = 1.0 / 24.0  # one error a day: the floor under every rate ratio


@dataclass(frozen=True)
class Feature:
    """What a feature measures, for people: ``subject`` (a counter, a reading, an event),
    ``measure`` (rate, vs_fleet, slope, ...) and the window it covers."""

    name: str
    subject: str
    measure: str
    window: str = ""


def _specs() -> list[Feature]:
    out: list[Feature] = []
    for c in COUNTER_FIELDS:
        out += [Feature(f"{c}_rate_{w}", c, "rate", w) for w in ("5m", "1h", "24h")]
        out += [Feature(f"{c}_rate_1h_vs_{r}", c, f"vs_{r}", "1h") for r in ("own", "fleet")]
        out.append(Feature(f"{c}_rate_1h_vs_node", c, "vs_node", "1h"))
    for c in ("ecc_sbe_aggregate", "ecc_dbe_aggregate", "remap_correctable", "remap_uncorrectable"):
        out.append(Feature(f"{c}_total", c, "total"))
    for g in ("temp_gpu_c", "temp_mem_c"):
        out += [
            Feature(f"{g}_now", g, "now"),
            Feature(f"{g}_mean_5m", g, "mean", "5m"),
            Feature(f"{g}_slope", g, "slope", "1h"),
            Feature(f"{g}_vs_node", g, "vs_node", "5m"),
            Feature(f"{g}_vs_fleet", g, "vs_fleet", "5m"),
            Feature(f"{g}_vs_own", g, "vs_own", "24h"),
        ]
    for g in ("power_w", "sm_clock_mhz", "util_gpu_pct"):
        out += [Feature(f"{g}_mean_5m", g, "mean", "5m"), Feature(f"{g}_vs_node", g, "vs_node")]
    for f in ("thermal_throttle", "power_throttle", "hw_slowdown"):
        out += [Feature(f"{f}_{w}", f, "share", w) for w in ("5m", "1h")]
    out.append(Feature("thermal_throttle_5m_vs_node", "thermal_throttle", "vs_node", "5m"))
    out += [
        Feature("pcie_width_ratio", "pcie_link_width", "ratio"),
        Feature("remap_pending", "remap_pending", "flag"),
        Feature("remap_failure", "remap_failure", "flag"),
        Feature("retired_pages_pending", "retired_pages_pending", "flag"),
        Feature("counter_resets_24h", "counter_reset", "count", "24h"),
        Feature("staleness_s", "telemetry", "staleness"),
        Feature("staleness_vs_node", "telemetry", "vs_node"),
        Feature("sample_rate_5m_vs_24h", "telemetry", "sample_rate", "5m"),
        Feature("gap_len_1h", "telemetry", "gap_len", "1h"),
        Feature("gap_len_1h_vs_24h", "telemetry", "gap_len_vs_own", "1h"),
        Feature("metrics_vanished_now", "telemetry", "vanished_now"),
        Feature("metrics_vanished_5m", "telemetry", "vanished", "5m"),
    ]
    for e in EVENT_CHANNELS:
        out += [Feature(f"{e}_{w}", e, "count", w) for w in ("5m", "1h", "24h")]
    out.append(Feature("xid_app_1h_node", "xid_app", "node_count", "1h"))
    for e in SINCE:
        out.append(Feature(f"since_{e}_s", e, "since"))
    out += [Feature(f"rule_{r}", r, "rule") for r in RULES]
    out.append(Feature("rules_fired", "rules", "count"))
    return out


RULES: tuple[str, ...] = ("dbe", "remap", "fatal_xid", "thermal")
"""The baseline's rules (DCGM health watches, NVSentinel), in feature order."""
RULE_RECENT_S = 3600.0  # a DBE or fatal Xid counts for an hour
RULE_THERMAL_SHARE = 0.2  # thermal slowdown in at least 20 % of the last 5 min


SINCE: tuple[str, ...] = (
    "sbe",
    "dbe",
    "xid_memory",
    "xid_nvlink",
    "xid_bus",
    "xid_gsp",
    "xid_app",
    "ecc_storm",
    "link_down",
    "fatal_xid",
    "counter_reset",
)
FEATURES: tuple[Feature, ...] = tuple(_specs())
FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in FEATURES)


def _node_others(x: np.ndarray, node: np.ndarray, n_nodes: int) -> np.ndarray:
    """Mean of ``x`` over the other GPUs of each GPU's node (NaN-aware; NaN when alone)."""
    ok = ~np.isnan(x)
    x0 = np.where(ok, x, 0.0)
    sums = np.bincount(node, weights=x0, minlength=n_nodes)
    cnts = np.bincount(node, weights=ok.astype(np.float64), minlength=n_nodes)
    den = cnts[node] - ok
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (sums[node] - x0) / np.maximum(den, 1), np.nan)


def _fleet_median(x: np.ndarray) -> float:
    ok = x[~np.isnan(x)]
    return float(np.median(ok)) if len(ok) else np.nan


def compute(state: GpuWindowState, now_ms: int | None = None) -> np.ndarray:
    """The feature matrix (float32, one row per slot ``0..state.size-1``, columns
    :data:`FEATURE_NAMES`, column-major; NaN where a feature is missing or not finite) at
    ``now_ms`` (default: the state's clock).

    The state must be at ``now_ms``: windows are decayed to the state's clock, so call
    ``state.update(..., now_ms=now_ms)`` first (with no rows if nothing arrived).
    """
    now = state.now_ms if now_ms is None else int(now_ms)
    if state.now_ms is None or now != state.now_ms:
        raise ValueError("the state must be updated to now_ms before computing features")
    n = state.size
    acc = state.acc[:n]
    node = state.node_of[:n]
    n_nodes = max(len(state.nodes), 1)
    age = np.maximum((now - state.first_ms[:n]) / 1000.0, 60.0)
    age = np.where(np.isnan(age), 60.0, age)
    norm = {w: tau * -np.expm1(-age / tau) for w, tau in WINDOWS.items()}
    cols: dict[str, np.ndarray] = {}
    errs = np.seterr(invalid="ignore", divide="ignore")
    try:
        seen = ~np.isnan(state.last_counter[:n])
        for j, c in enumerate(COUNTER_FIELDS):
            rate = {
                w: np.where(seen[:, j], acc[:, COLUMN[f"inc:{c}:{w}"]] / norm[w] * 3600.0, np.nan)
                for w in WINDOWS
            }
            for w in ("5m", "1h", "24h"):
                cols[f"{c}_rate_{w}"] = rate[w]
            cols[f"{c}_rate_1h_vs_own"] = rate["1h"] / (rate["7d"] + _FLOOR_PER_H)
            cols[f"{c}_rate_1h_vs_fleet"] = rate["1h"] / (_fleet_median(rate["1h"]) + _FLOOR_PER_H)
            cols[f"{c}_rate_1h_vs_node"] = rate["1h"] - _node_others(rate["1h"], node, n_nodes)
        for c in (
            "ecc_sbe_aggregate",
            "ecc_dbe_aggregate",
            "remap_correctable",
            "remap_uncorrectable",
        ):
            cols[f"{c}_total"] = state.last_counter[:n, COUNTER_FIELDS.index(c)]

        def mean(g: str, w: str) -> np.ndarray:
            return acc[:, COLUMN[f"num:{g}:{w}"]] / acc[:, COLUMN[f"den:{g}:{w}"]]

        latest = {name: state.latest[:n, i] for i, name in enumerate(LATEST)}
        for g in ("temp_gpu_c", "temp_mem_c"):
            m5, m1h, m24 = mean(g, "5m"), mean(g, "1h"), mean(g, "24h")
            cols[f"{g}_now"] = latest[g]
            cols[f"{g}_mean_5m"] = m5
            cols[f"{g}_slope"] = (m5 - m1h) / (WINDOWS["1h"] - WINDOWS["5m"]) * 3600.0
            cols[f"{g}_vs_node"] = m5 - _node_others(m5, node, n_nodes)
            cols[f"{g}_vs_fleet"] = m5 - _fleet_median(m5)
            cols[f"{g}_vs_own"] = m5 - m24
        for g in ("power_w", "sm_clock_mhz", "util_gpu_pct"):
            m5 = mean(g, "5m")
            cols[f"{g}_mean_5m"] = m5
            cols[f"{g}_vs_node"] = m5 - _node_others(m5, node, n_nodes)
        for f in ("thermal_throttle", "power_throttle", "hw_slowdown"):
            for w in ("5m", "1h"):
                share = acc[:, COLUMN[f"flag:{f}:{w}"]] / acc[:, COLUMN[f"den:throttle:{w}"]]
                cols[f"{f}_{w}"] = share
        tt = cols["thermal_throttle_5m"]
        cols["thermal_throttle_5m_vs_node"] = tt - _node_others(tt, node, n_nodes)
        cols["pcie_width_ratio"] = latest["pcie_link_width"] / latest["pcie_link_width_max"]
        for flag in ("remap_pending", "remap_failure", "retired_pages_pending"):
            cols[flag] = latest[flag]
        cols["counter_resets_24h"] = acc[:, COLUMN["reset:24h"]]
        stale = (now - state.last_ms[:n]) / 1000.0
        cols["staleness_s"] = stale
        cols["staleness_vs_node"] = stale - _node_others(stale, node, n_nodes)
        cols["sample_rate_5m_vs_24h"] = (acc[:, COLUMN["n:5m"]] / norm["5m"]) / (
            acc[:, COLUMN["n:24h"]] / norm["24h"]
        )
        # Gap lengths weighted by time: the mean length of the gap a moment of the window
        # falls in (the sampling interval when nothing is missing).
        gap_1h = acc[:, COLUMN["gap2:1h"]] / acc[:, COLUMN["gap:1h"]]
        cols["gap_len_1h"] = gap_1h
        cols["gap_len_1h_vs_24h"] = gap_1h / (
            acc[:, COLUMN["gap2:24h"]] / acc[:, COLUMN["gap:24h"]]
        )
        cols["metrics_vanished_now"] = state.vanished_now[:n]
        cols["metrics_vanished_5m"] = acc[:, COLUMN["vanish:5m"]] / acc[:, COLUMN["n:5m"]]
        for e in EVENT_CHANNELS:
            for w in ("5m", "1h", "24h"):
                cols[f"{e}_{w}"] = acc[:, COLUMN[f"ev:{e}:{w}"]].copy()
        app = cols["xid_app_1h"]
        cols["xid_app_1h_node"] = _node_others(app, node, n_nodes)
        for e in SINCE:
            since = (now - state.last_time_of(e)) / 1000.0
            cols[f"since_{e}_s"] = np.where(
                np.isnan(since), SINCE_CAP_S, np.minimum(since, SINCE_CAP_S)
            )
    finally:
        np.seterr(**errs)
    _rules(cols)
    # Column-major: each feature is written whole, and the booster reads the matrix as it is
    # (a row-major one cost a strided pass per feature here and a copy of the model's columns
    # there: 0.1 s a tick at 100,000 GPUs).
    columns = np.empty((len(FEATURE_NAMES), n), dtype=np.float32)
    with np.errstate(over="ignore"):  # what float32 cannot hold becomes infinite, then NaN
        for i, name in enumerate(FEATURE_NAMES):
            columns[i] = cols[name]
    columns[~np.isfinite(columns)] = np.nan
    return columns.T


def rule_hits(col: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """Which rows trip each rule of :data:`RULES`, from the features ``col(name)`` returns."""
    with np.errstate(invalid="ignore"):
        return {
            "dbe": col("since_dbe_s") <= RULE_RECENT_S,
            "remap": (np.nan_to_num(col("remap_pending")) > 0)
            | (np.nan_to_num(col("remap_failure")) > 0),
            "fatal_xid": col("since_fatal_xid_s") <= RULE_RECENT_S,
            "thermal": np.nan_to_num(col("thermal_throttle_5m")) >= RULE_THERMAL_SHARE,
        }


def _rules(cols: dict[str, np.ndarray]) -> None:
    """The rules as features (0/1 each, and their count)."""
    hits = rule_hits(cols.__getitem__)
    for r in RULES:
        cols[f"rule_{r}"] = hits[r].astype(np.float64)
    cols["rules_fired"] = np.sum([cols[f"rule_{r}"] for r in RULES], axis=0)


def _direction(f: Feature) -> int:
    danger_up = (
        f.subject.startswith(("ecc_dbe", "remap_uncorrectable", "retired_pages"))
        or f.subject in ("remap_pending", "remap_failure", "thermal_shutdown", "link_down")
        or f.subject in ("xid_memory", "xid_nvlink", "xid_bus", "gpu_lost")
        or (f.measure in ("rule", "count") and f.subject == "rules")
    )
    if f.measure == "rule" or (
        danger_up and f.measure in ("rate", "total", "flag", "count", "rule")
    ):
        return 1
    if f.subject == "thermal_throttle" and f.measure == "share":
        return 1
    if f.name == "pcie_width_ratio" or f.name in ("since_dbe_s", "since_fatal_xid_s"):
        return -1
    return 0


ABSOLUTE_LEVELS: tuple[str, ...] = tuple(
    f.name
    for f in FEATURES
    if f.subject in ("temp_gpu_c", "temp_mem_c", "power_w", "sm_clock_mhz", "util_gpu_pct")
    and f.measure in ("now", "mean")
)
"""Absolute levels of readings whose normal value differs from fleet to fleet (inlet air,
cooling, workload): temperatures, power, clock and utilisation themselves. Training with
``TrainConfig.ignore_features`` set to these leaves the model only their relative forms
(against the node, the fleet, the GPU's own day, the slope)."""

MONOTONE: tuple[int, ...] = tuple(_direction(f) for f in FEATURES)
"""Monotone direction of each feature (+1 more is riskier, -1 less is riskier, 0 free)."""

assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
assert len(TAU) == len(COLUMN)
