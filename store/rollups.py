"""Per-minute rollups of raw samples, and their compact packing (one blob per GPU and span).

A rollup row summarises one GPU's samples within one UTC minute:

- ``n``: how many samples the minute held;
- every gauge (temperatures, power, clocks, utilisation, memory, the throttle bitmask, PCIe
  link width and generation, the boolean flags as 0/1): ``<field>_min``, ``_max``, ``_mean``
  and ``_last`` (the newest non-null value), nulls skipped;
- every cumulative counter (ECC, retired pages, row remaps, NVLink, PCIe replays):
  ``<field>_delta``, what it grew by within the minute, and ``<field>_last``. The delta sums
  the steps between consecutive non-null samples of the GPU whose later sample falls in the
  minute; a step down is a reset (reboot, driver reload), after which the counter counted up
  from zero, so the step is the new value. A GPU's first sample (no predecessor) adds 0.
  A minute where the counter was never reported has a null delta.

Spans of rollup rows are stored packed: one blob per (GPU, span) holding the minute offsets
and a float64 matrix (minutes x stats), byte-shuffled and zstd-compressed. Telemetry within a
GPU-hour is mostly constant or slowly varying, so this costs a few bytes per raw sample —
what TimescaleDB's compressed chunks and Prometheus' blocks do for the same reason.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from store.schema import BOOL_COLUMNS, FLOAT_COLUMNS, INT_COLUMNS

__all__ = [
    "COUNTER_COLUMNS",
    "GAUGE_COLUMNS",
    "HOUR_MS",
    "MINUTE_MS",
    "STAT_COLUMNS",
    "coarsen",
    "coarsen_frame",
    "newest_known",
    "pack",
    "representative",
    "rollup",
    "unpack",
]

MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS

_NOT_COUNTERS = ("throttle_reasons", "pcie_link_width", "pcie_link_width_max", "pcie_link_gen")
COUNTER_COLUMNS: tuple[str, ...] = tuple(c for c in INT_COLUMNS if c not in _NOT_COUNTERS)
"""Cumulative hardware counters: rolled up as delta and last."""
GAUGE_COLUMNS: tuple[str, ...] = (
    *FLOAT_COLUMNS,
    *(c for c in INT_COLUMNS if c in _NOT_COUNTERS),
    *BOOL_COLUMNS,
)
"""Everything else: rolled up as min, max, mean and last."""

STAT_COLUMNS: tuple[str, ...] = (
    "n",
    *(f"{c}_{s}" for c in GAUGE_COLUMNS for s in ("min", "max", "mean", "last")),
    *(f"{c}_{s}" for c in COUNTER_COLUMNS for s in ("delta", "last")),
)
"""The value columns of a rollup frame (after ``ts_ms``, ``node``, ``gpu``), in blob order."""

_KEY = ["node", "gpu"]


def _float(frame: pd.DataFrame, column: str) -> np.ndarray:
    if column not in frame:
        return np.full(len(frame), np.nan)
    return pd.to_numeric(frame[column], errors="coerce").astype("float64").to_numpy()


def rollup(
    raw: pd.DataFrame, *, before: pd.DataFrame | None = None, step_ms: int = MINUTE_MS
) -> pd.DataFrame:
    """Per-minute rollup rows of raw samples.

    Args:
        raw: sample rows (``ts_ms``, ``node``, ``gpu`` and any sample columns; missing ones
            roll up to nulls), any order, no duplicate (node, gpu, ts_ms).
        before: for counters, each GPU's previous sample(s) before ``raw`` (only used as
            predecessors: they make no rows of their own).
        step_ms: the span a row summarises (a minute; an hour is what :func:`coarsen_frame`
            is checked against).

    Returns:
        One row per (GPU, minute) with at least one sample: ``ts_ms`` (minute start),
        ``node``, ``gpu``, then :data:`STAT_COLUMNS` (float64), sorted by node, gpu, ts_ms.
    """
    if before is not None and len(before):
        both = pd.concat(
            [before.assign(_pre=True), raw.assign(_pre=False)], ignore_index=True, sort=False
        )
    else:
        both = raw.assign(_pre=False)
    if not len(both):
        return pd.DataFrame(columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])
    both = both.sort_values([*_KEY, "ts_ms"], kind="stable", ignore_index=True)
    gpu_code = both.groupby(_KEY, sort=False).ngroup().to_numpy(np.int64)
    minute = both["ts_ms"].to_numpy(np.int64) // step_ms
    pre = both["_pre"].to_numpy(bool)

    data: dict[str, np.ndarray] = {}
    for c in GAUGE_COLUMNS:
        data[c] = _float(both, c)
    for c in COUNTER_COLUMNS:
        value = _float(both, c)
        data[f"{c}_delta"] = _deltas(value, gpu_code)
        data[c] = value
    keep = ~pre
    if not keep.any():  # only predecessors: a GPU that stopped reporting before the window
        return pd.DataFrame(columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])
    work = pd.DataFrame(data)[keep]
    group = (gpu_code[keep] << 32) | (minute[keep] - minute[keep].min())
    grouped = work.groupby(group, sort=False)
    out: dict[str, np.ndarray] = {}
    first = np.r_[True, group[1:] != group[:-1]]
    out["ts_ms"] = minute[keep][first] * step_ms
    out["node"] = both["node"].to_numpy()[keep][first]
    out["gpu"] = both["gpu"].to_numpy(np.int64)[keep][first]
    out["n"] = grouped.size().to_numpy(np.float64)
    gauges = grouped[list(GAUGE_COLUMNS)]
    stats = {s: gauges.agg(s) for s in ("min", "max", "mean", "last")}
    for c in GAUGE_COLUMNS:
        for s in ("min", "max", "mean", "last"):
            out[f"{c}_{s}"] = stats[s][c].to_numpy(np.float64)
    deltas = grouped[[f"{c}_delta" for c in COUNTER_COLUMNS]].sum(min_count=1)
    lasts = grouped[list(COUNTER_COLUMNS)].last()
    for c in COUNTER_COLUMNS:
        out[f"{c}_delta"] = deltas[f"{c}_delta"].to_numpy(np.float64)
        out[f"{c}_last"] = lasts[c].to_numpy(np.float64)
    return pd.DataFrame(out, columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])


def newest_known(frame: pd.DataFrame) -> pd.DataFrame:
    """Each GPU's newest sample of ``frame``, each counter in it the newest value the GPU
    reported (a sample can lack one): the predecessors a following roll-up counts from."""
    ordered = frame.sort_values("ts_ms", kind="stable")
    newest = ordered.drop_duplicates(_KEY, keep="last").reset_index(drop=True)
    counters = [c for c in COUNTER_COLUMNS if c in frame]
    if not counters or not newest[counters].isna().to_numpy().any():
        return newest
    known = ordered.groupby(_KEY, sort=False)[counters].last()  # skips nulls
    at = pd.MultiIndex.from_frame(newest[_KEY])
    for c in counters:
        newest[c] = known[c].reindex(at).array
    return newest


def _deltas(value: np.ndarray, gpu_code: np.ndarray) -> np.ndarray:
    """Reset-aware increase since the GPU's previous non-null value (0 without one)."""
    out = np.full(len(value), np.nan)
    valid = ~np.isnan(value)
    v = value[valid]
    g = gpu_code[valid]
    if not len(v):
        return out
    step = np.empty(len(v))
    step[0] = 0.0
    step[1:] = v[1:] - v[:-1]
    reset = step < 0
    step[reset] = v[reset]
    step[np.r_[True, g[1:] != g[:-1]]] = 0.0
    out[valid] = step
    return out


# Coarser rows from finer ones ----------------------------------------------------------------

_N = 0
_MIN = np.array([STAT_COLUMNS.index(f"{c}_min") for c in GAUGE_COLUMNS])
_MAX = _MIN + 1
_MEAN = _MIN + 2
_DELTA = np.array([STAT_COLUMNS.index(f"{c}_delta") for c in COUNTER_COLUMNS])
_LAST = np.array([STAT_COLUMNS.index(s) for s in STAT_COLUMNS if s.endswith("_last")])


def coarsen(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Rollup rows combined into coarser ones (minutes into hours).

    Args:
        values: rollup rows, :data:`STAT_COLUMNS` in order (float64), each group's rows
            together and in time order.
        starts: the index of each group's first row, ascending, the first 0.

    Returns:
        One row per group: ``n`` summed; ``_min`` and ``_max`` of the rows'; ``_last`` the
        newest non-null; a counter's ``_delta`` summed (null where every row's is); a gauge's
        ``_mean`` the rows' means weighted by their ``n``, which is its mean over the group's
        samples whenever the gauge was reported in every sample of the minutes that have one
        (a gauge missing from some samples of a minute weighs that minute by all its samples).
    """
    rows = len(values)
    if not rows:
        return np.empty((0, values.shape[1]))
    out = np.full((len(starts), values.shape[1]), np.nan)
    n = values[:, _N]
    out[:, _N] = np.add.reduceat(n, starts)
    out[:, _MIN] = np.fmin.reduceat(values[:, _MIN], starts, axis=0)
    out[:, _MAX] = np.fmax.reduceat(values[:, _MAX], starts, axis=0)
    mean = values[:, _MEAN]
    known = ~np.isnan(mean)
    weight = np.where(known, n[:, None], 0.0)
    total = np.add.reduceat(np.where(known, mean, 0.0) * weight, starts, axis=0)
    weights = np.add.reduceat(weight, starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out[:, _MEAN] = np.where(weights > 0, total / weights, np.nan)
    delta = values[:, _DELTA]
    counted = np.add.reduceat((~np.isnan(delta)).astype(np.int64), starts, axis=0)
    sums = np.add.reduceat(np.nan_to_num(delta, nan=0.0), starts, axis=0)
    out[:, _DELTA] = np.where(counted > 0, sums, np.nan)
    last = values[:, _LAST]
    at = np.where(~np.isnan(last), np.arange(rows)[:, None], -1)
    newest = np.maximum.reduceat(at, starts, axis=0)
    picked = np.take_along_axis(last, np.maximum(newest, 0), axis=0)
    out[:, _LAST] = np.where(newest >= 0, picked, np.nan)
    return out


def coarsen_frame(rolled: pd.DataFrame, step_ms: int) -> pd.DataFrame:
    """Rollup rows (a frame as :func:`rollup` returns, any finer step) as rows of ``step_ms``
    (see :func:`coarsen`), sorted by node, gpu, ts_ms."""
    if not len(rolled):
        return pd.DataFrame(columns=["ts_ms", "node", "gpu", *STAT_COLUMNS])
    ordered = rolled.sort_values(["node", "gpu", "ts_ms"], kind="stable", ignore_index=True)
    node = ordered["node"].to_numpy()
    gpu = ordered["gpu"].to_numpy(np.int64)
    bucket = ordered["ts_ms"].to_numpy(np.int64) // step_ms
    change = (node[1:] != node[:-1]) | (gpu[1:] != gpu[:-1]) | (bucket[1:] != bucket[:-1])
    starts = np.flatnonzero(np.r_[True, change])
    values = coarsen(ordered[list(STAT_COLUMNS)].to_numpy(np.float64), starts)
    out = pd.DataFrame(values, columns=list(STAT_COLUMNS))
    out.insert(0, "gpu", gpu[starts])
    out.insert(0, "node", node[starts])
    out.insert(0, "ts_ms", bucket[starts] * step_ms)
    return out


def representative(rolled: pd.DataFrame, fields: Sequence[str]) -> pd.DataFrame:
    """The sample-shaped view of rollup rows: each field as its minute's mean (gauges) or
    last value (counters, flags, bitmasks, link state), beside every stat column asked for."""
    out = rolled[["ts_ms", "node", "gpu"]].copy()
    for f in fields:
        if f in COUNTER_COLUMNS or f in BOOL_COLUMNS or f in _NOT_COUNTERS:
            out[f] = rolled[f"{f}_last"]
        else:
            out[f] = rolled[f"{f}_mean"]
    return out


# Packing -----------------------------------------------------------------------------------

_MAGIC = b"FWR"
_VERSION = 1
_HEADER = struct.Struct("<3sBIH")  # magic, version, minutes, stats
_CODEC = pa.Codec("zstd", compression_level=6)


def pack(minutes: np.ndarray, values: np.ndarray) -> bytes:
    """One GPU's rollup rows as a blob.

    Args:
        minutes: offsets from the span's start (int), ascending, in the tier's step (minutes
            in ``sample_rollups``, hours in ``hourly_rollups``).
        values: float64 matrix, one row per offset, :data:`STAT_COLUMNS` in order.
    """
    k, s = values.shape
    columns = np.ascontiguousarray(values.T, dtype="<f8")
    shuffled = columns.view(np.uint8).reshape(s, k, 8).transpose(0, 2, 1).tobytes()
    body = np.asarray(minutes, dtype="<u4").tobytes() + shuffled
    return _HEADER.pack(_MAGIC, _VERSION, k, s) + _CODEC.compress(body, asbytes=True)


def unpack(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(minute offsets, values) of a blob written by :func:`pack`.

    Raises:
        ValueError: not a rollup blob, or one of an unknown version.
    """
    magic, version, k, s = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError(f"not a version-{_VERSION} rollup blob")
    size = 4 * k + 8 * k * s
    body = _CODEC.decompress(blob[_HEADER.size :], decompressed_size=size, asbytes=True)
    minutes = np.frombuffer(body, dtype="<u4", count=k).astype(np.int64)
    shuffled = np.frombuffer(body, dtype=np.uint8, offset=4 * k).reshape(s, 8, k)
    columns = np.ascontiguousarray(shuffled.transpose(0, 2, 1)).view("<f8").reshape(s, k)
    return minutes, columns.T
