"""Plain-word reasons: which features pushed a GPU's risk up, said the way an operator would.

The model's per-row attributions (LightGBM's TreeSHAP contributions, in log-odds) rank the
features; the three strongest positive ones, at most one per subject (one counter, one
reading, one kind of event), become sentences such as "corrected ECC rate 40x the fleet
median over the last hour" or "GPU temperature rising 6.2 °C/h".
"""

from __future__ import annotations

import math

import numpy as np

from predictor.features import FEATURES, Feature

__all__ = ["MAX_REASONS", "describe", "top_reasons"]

MAX_REASONS = 3

SUBJECTS: dict[str, str] = {
    "ecc_sbe_volatile": "corrected ECC",
    "ecc_sbe_aggregate": "corrected ECC",
    "ecc_dbe_volatile": "uncorrectable ECC",
    "ecc_dbe_aggregate": "uncorrectable ECC",
    "ecc_deferred": "deferred ECC",
    "retired_pages_sbe": "pages retired for corrected errors",
    "retired_pages_dbe": "pages retired for uncorrectable errors",
    "remap_correctable": "rows remapped (correctable)",
    "remap_uncorrectable": "rows remapped (uncorrectable)",
    "nvlink_crc_flit": "NVLink CRC flit error",
    "nvlink_crc_data": "NVLink CRC data error",
    "nvlink_replay": "NVLink replay",
    "nvlink_recovery": "NVLink recovery",
    "pcie_replay": "PCIe replay",
    "temp_gpu_c": "GPU temperature",
    "temp_mem_c": "HBM temperature",
    "power_w": "power draw",
    "sm_clock_mhz": "SM clock",
    "util_gpu_pct": "utilisation",
    "thermal_throttle": "thermal slowdown",
    "power_throttle": "power capping",
    "hw_slowdown": "hardware slowdown",
    "sbe": "last corrected ECC error",
    "dbe": "last uncorrectable ECC error",
    "fatal_xid": "last fatal Xid",
    "xid_app": "application Xids",
    "xid_memory": "memory Xids",
    "xid_nvlink": "NVLink Xids",
    "xid_bus": "bus Xids",
    "xid_gsp": "GSP firmware Xids",
    "xid_thermal": "thermal Xids",
    "xid_other": "other Xids",
    "ecc_storm": "ECC storms",
    "link_down": "link-down events",
    "thermal_shutdown": "thermal shutdowns",
    "telemetry_stalled": "telemetry stalls",
    "counter_reset": "counter resets",
    "gpu_lost": "GPU-lost events",
    "power_loss": "power-loss events",
}
_WINDOW = {"5m": "5 min", "1h": "hour", "24h": "day", "7d": "week", "": "hour"}
_UNIT = {"temp_gpu_c": "°C", "temp_mem_c": "°C", "power_w": "W", "sm_clock_mhz": "MHz"}


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def describe(feature: Feature, value: float) -> str:
    """One feature at one value, in words."""
    what = SUBJECTS.get(feature.subject, feature.subject.replace("_", " "))
    unit = _UNIT.get(feature.subject, "%" if feature.subject == "util_gpu_pct" else "")
    win = _WINDOW[feature.window]
    m = feature.measure
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{what}: not reported"
    if m == "rate":
        return f"{what} rate {value:.1f}/h over the last {win}"
    if m == "vs_fleet" and feature.subject in _UNIT:
        return f"{what} {value:+.1f} {unit} against the fleet median"
    if m == "vs_fleet":
        return f"{what} rate {value:.0f}x the fleet median over the last {win}"
    if m == "vs_own" and feature.subject in _UNIT:
        return f"{what} {value:+.1f} {unit} above this GPU's own daily mean"
    if m == "vs_own":
        return f"{what} rate {value:.0f}x this GPU's own rate of the past week"
    if m == "vs_node" and feature.subject == "telemetry":
        return f"telemetry {_duration(max(value, 0.0))} staler than the rest of its node"
    if (m == "vs_node" and feature.subject in _UNIT) or feature.subject == "util_gpu_pct":
        return f"{what} {value:+.1f} {unit} against the other GPUs of its node".replace("  ", " ")
    if m == "vs_node" and feature.subject == "thermal_throttle":
        return f"thermal slowdown {value * 100:+.0f} % of the time against its node"
    if m == "vs_node":
        return f"{what} rate {value:+.1f}/h against the other GPUs of its node"
    if m == "node_count":
        return f"{value:.1f} {what} per GPU on the rest of its node in the last hour"
    if m == "slope":
        trend = "rising" if value >= 0 else "falling"
        return f"{what} {trend} {abs(value):.1f} °C/h"
    if m in ("now", "mean"):
        return f"{what} at {value:.0f} {unit}".rstrip()
    if m == "share":
        return f"{what} {value * 100:.0f} % of the time over the last {win}"
    if m == "ratio":
        return f"PCIe link at {value * 100:.0f} % of its lanes"
    if m == "flag":
        return f"{feature.subject.replace('_', ' ')}" if value > 0 else f"no {what}"
    if m == "count":
        return f"{value:.1f} {what} in the last {win}"
    if m == "since":
        return f"{what} {_duration(value)} ago"
    if m == "staleness":
        return f"no telemetry for {_duration(value)}"
    if m == "gap_len":
        return f"gaps of {_duration(value)} between samples over the last hour"
    if m == "gap_len_vs_own":
        return f"gaps between samples {value:.0f}x this GPU's usual"
    if m == "vanished_now":
        return f"{value:.0f} readings this GPU reported before now missing"
    if m == "vanished":
        return f"{value:.1f} readings it reported before missing per sample over the last 5 min"
    if m == "sample_rate":
        return f"only {value * 100:.0f} % of the usual samples in the last 5 min"
    if m == "total":
        return f"{value:.0f} {what} over the GPU's lifetime"
    return f"{feature.name} = {value:.3g}"


def top_reasons(
    contributions: np.ndarray, values: np.ndarray, k: int = MAX_REASONS
) -> list[list[str]]:
    """Per row, up to ``k`` sentences for the strongest positive contributions.

    Args:
        contributions: rows x (features + 1) log-odds attributions (last column: bias).
        values: rows x features, the feature values the attributions were computed on.
    """
    out: list[list[str]] = []
    contrib = contributions[:, : len(FEATURES)]
    order = np.argsort(-contrib, axis=1)[:, : 4 * k]
    for r in range(len(contrib)):
        said: list[str] = []
        subjects: set[str] = set()
        for j in order[r]:
            if contrib[r, j] <= 0 or len(said) == k:
                break
            f = FEATURES[j]
            if f.subject in subjects:
                continue
            subjects.add(f.subject)
            said.append(describe(f, float(values[r, j])))
        out.append(said)
    return out
