"""Failure labels guessed from telemetry alone, for fleet history that comes without them.

``forewarn import prometheus`` uses these rules when no labels CSV is given; the dataset's
manifest says so (``labels.source = "heuristic"``). They are a heuristic, not ground truth:

- **fatal Xid**: a ``DCGM_FI_DEV_XID_ERRORS`` change to one of the Xids after which the GPU
  cannot go on (:data:`predictor.catalog.GPU_DOWN_XIDS`: 48, 64, 74, 79, 94, 95, 119, 120;
  not 63, a row remap recorded, which is a precursor) is a failure at that time, its kind
  from the Xid's class (memory, nvlink, pcie for bus errors, thermal, else other). The first
  value of a GPU's series only sets the baseline: when it happened is unknown. dcgm-exporter
  keeps only the *last* Xid, so a repeat of the same Xid, or an Xid overwritten within one
  scrape, is not seen.
- **lost GPU**: a GPU's series stop for at least ``lost_after_s`` while other GPUs of the fleet
  go on reporting is a ``gpu_lost`` failure at its first missing step; it recovers when its
  series come back (never, when they do not). A scrape outage of the whole fleet is not a
  failure; a whole node going silent (its exporter restarted, or the node lost power) is, on
  every GPU of the node, since the two cannot be told apart from the series.
- a fatal Xid and a lost GPU within ``merge_s`` on the same GPU are one failure (the first).
- ``has_precursors``: any hardware counter of that GPU rose (ECC, row remap, retired pages,
  NVLink, PCIe replays), a row remap was pending or had failed, or its PCIe link ran narrow,
  between ``precursor_window_s`` and ``lead_min_s`` before the failure; the first such moment
  is ``precursor_onset_ts_ms``.

:class:`LabelTracker` sees the samples chunk by chunk in time order (the importer's requests)
and keeps only what the rules need: per GPU the last counters, the moments they moved, its
silent gaps and its last Xid.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from collector.xid import describe
from forewarn.datasets import EVENT_DTYPES, FAILURE_COLUMNS, FAILURE_DTYPES
from forewarn.wire import COUNTER_FIELDS
from predictor.catalog import GPU_DOWN_XIDS, xid_class

__all__ = ["HeuristicRules", "LabelTracker", "xid_kind"]

MOVING_COUNTERS = COUNTER_FIELDS
"""Counters whose rise before a GPU went quiet says it was failing (every wire counter)."""
_KIND_OF_CLASS = {"memory": "memory", "nvlink": "nvlink", "bus": "pcie", "thermal": "thermal"}

Gpu = tuple[str, int]


def xid_kind(code: int) -> str:
    """The failure kind a fatal Xid stands for (``other`` when its class says nothing)."""
    return _KIND_OF_CLASS.get(xid_class(code), "other")


@dataclass(frozen=True)
class HeuristicRules:
    """The heuristic's knobs (seconds); recorded in the manifest."""

    lost_after_s: float = 300.0
    merge_s: float = 600.0
    precursor_window_s: float = 6 * 3600.0
    lead_min_s: float = 120.0

    def describe(self) -> dict[str, Any]:
        return {
            "source": "heuristic",
            "rules": ["fatal_xid", "series_stopped"],
            "fatal_xids": sorted(GPU_DOWN_XIDS),
            "lost_after_s": self.lost_after_s,
            "merge_s": self.merge_s,
            "precursor_window_s": self.precursor_window_s,
            "lead_min_s": self.lead_min_s,
        }


@dataclass
class _GpuTrack:
    last_ts: int | None = None
    last_counters: np.ndarray | None = None
    moved: list[np.ndarray] = field(default_factory=list)
    gaps: list[tuple[int, int | None]] = field(default_factory=list)  # (last seen, back at)
    last_xid: int | None = None
    ts: list[np.ndarray] = field(default_factory=list)


class LabelTracker:
    """Xid events and heuristic failures from samples seen chunk by chunk, in time order."""

    def __init__(self, rules: HeuristicRules | None = None, *, step_ms: int) -> None:
        self.rules = rules or HeuristicRules()
        self.step_ms = int(step_ms)
        self._gpus: dict[Gpu, _GpuTrack] = defaultdict(_GpuTrack)
        self._fleet_ts: list[np.ndarray] = []
        self._xid_failures: list[tuple[int, str, int, int]] = []

    def observe(self, samples: pd.DataFrame, xid: pd.DataFrame) -> pd.DataFrame:
        """Take one chunk: wide ``samples`` (dataset columns, any order) and the long Xid
        points (``node``, ``gpu``, ``ts_ms``, ``value``). Returns the chunk's Xid events."""
        if len(samples):
            self._fleet_ts.append(np.unique(samples["ts_ms"].to_numpy(np.int64)))
            for key, rows in samples.groupby(["node", "gpu"], sort=False):
                self._observe_gpu(self._gpus[_gpu_key(key)], rows)
        return self._xid_events(xid)

    def _observe_gpu(self, track: _GpuTrack, rows: pd.DataFrame) -> None:
        rows = rows.sort_values("ts_ms", kind="stable")
        ts = rows["ts_ms"].to_numpy(np.int64)
        cols = [c for c in MOVING_COUNTERS if c in rows]
        values = rows[cols].to_numpy(np.float64, na_value=np.nan)
        before = track.last_counters if track.last_counters is not None else values[:1]
        with np.errstate(invalid="ignore"):
            rose = (np.diff(np.vstack([before, values]), axis=0) > 0).any(axis=1)
        flags = np.zeros(len(rows), dtype=bool)
        for flag in ("remap_pending", "remap_failure"):
            if flag in rows:
                flags |= rows[flag].fillna(False).to_numpy(bool)
        if "pcie_link_width" in rows and "pcie_link_width_max" in rows:
            w = rows["pcie_link_width"].to_numpy(np.float64, na_value=np.nan)
            wmax = rows["pcie_link_width_max"].to_numpy(np.float64, na_value=np.nan)
            with np.errstate(invalid="ignore"):
                flags |= w < wmax
        moved = ts[rose | flags]
        if len(moved):
            track.moved.append(moved)
        # carry the last known value of each counter (a null keeps the one before)
        last = values[-1].copy()
        if track.last_counters is not None:
            last = np.where(np.isnan(last), track.last_counters[0], last)
        track.last_counters = last[None, :]
        prev = np.concatenate([[track.last_ts], ts[:-1]]) if track.last_ts is not None else None
        lost_ms = self.rules.lost_after_s * 1000.0
        if prev is not None:
            gap = ts - prev
            for i in np.flatnonzero(gap >= lost_ms).tolist():
                track.gaps.append((int(prev[i]), int(ts[i])))
        else:
            gap = np.diff(ts)
            for i in np.flatnonzero(gap >= lost_ms).tolist():
                track.gaps.append((int(ts[i]), int(ts[i + 1])))
        track.ts.append(ts)
        track.last_ts = int(ts[-1])

    def _xid_events(self, xid: pd.DataFrame) -> pd.DataFrame:
        out: list[dict[str, Any]] = []
        if len(xid):
            xid = xid.sort_values(["node", "gpu", "ts_ms"], kind="stable")
            for key, rows in xid.groupby(["node", "gpu"], sort=False):
                node, gpu = _gpu_key(key)
                track = self._gpus[(node, gpu)]
                for ts, value in zip(
                    rows["ts_ms"].to_numpy(np.int64), rows["value"].to_numpy(), strict=True
                ):
                    code, previous = int(value), track.last_xid
                    track.last_xid = code
                    if previous is None or code == previous or not 0 < code <= 1023:
                        continue
                    out.append(
                        {
                            "ts_ms": int(ts),
                            "node": node,
                            "gpu": gpu,
                            "kind": "xid",
                            "xid": code,
                            "message": describe(code, "dcgm-exporter DCGM_FI_DEV_XID_ERRORS"),
                            "source": "prometheus",
                        }
                    )
                    if code in GPU_DOWN_XIDS:
                        self._xid_failures.append((int(ts), node, gpu, code))
        frame = pd.DataFrame(out, columns=list(EVENT_DTYPES))
        return frame.astype(EVENT_DTYPES)

    def failures(self, uuids: dict[Gpu, str]) -> pd.DataFrame:
        """The heuristic failures of everything observed (``failures.parquet`` columns)."""
        fleet_ts = (
            np.unique(np.concatenate(self._fleet_ts)) if self._fleet_ts else np.zeros(0, np.int64)
        )
        lost_ms = int(self.rules.lost_after_s * 1000)
        found: list[dict[str, Any]] = []
        for ts, node, gpu, code in self._xid_failures:
            found.append(_row(ts, node, gpu, xid_kind(code), "fatal_xid", None))
        end = int(fleet_ts[-1]) if len(fleet_ts) else 0
        for (node, gpu), track in self._gpus.items():
            gaps = list(track.gaps)
            if track.last_ts is not None and end - track.last_ts >= lost_ms:
                gaps.append((track.last_ts, None))
            for seen, back in gaps:
                # the rest of the fleet kept reporting lost_after_s after this GPU went silent
                hi = back if back is not None else end + 1
                i = int(np.searchsorted(fleet_ts, seen + lost_ms, side="left"))
                if i < len(fleet_ts) and fleet_ts[i] < hi:
                    found.append(_row(seen + self.step_ms, node, gpu, "gpu_lost", "", back))
        rows = self._merge(found)
        for r in rows:
            r["uuid"] = uuids.get((r["node"], r["gpu"]), "")
            self._precursors(r)
        frame = pd.DataFrame(rows, columns=list(FAILURE_COLUMNS))
        frame["incident_id"] = np.arange(1, len(frame) + 1, dtype=np.int64)
        return frame.astype(FAILURE_DTYPES).reset_index(drop=True)

    def _merge(self, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in found:  # a fatal Xid: the GPU is back at its next sample (if any)
            if r["trace_class"] == "fatal_xid":
                r["recovered_ts_ms"] = self._next_sample(r["node"], r["gpu"], r["ts_ms"])
        merge_ms = self.rules.merge_s * 1000.0
        kept: list[dict[str, Any]] = []
        for r in sorted(found, key=lambda r: (r["node"], r["gpu"], r["ts_ms"])):
            last = kept[-1] if kept else None
            if last is not None and (last["node"], last["gpu"]) == (r["node"], r["gpu"]):
                rec = last["recovered_ts_ms"]
                if r["ts_ms"] - last["ts_ms"] <= merge_ms or rec is None or r["ts_ms"] < rec:
                    later = r["recovered_ts_ms"]
                    if rec is not None and (later is None or later > rec):
                        last["recovered_ts_ms"] = later
                    continue
            kept.append(r)
        return sorted(kept, key=lambda r: (r["ts_ms"], r["node"], r["gpu"]))

    def _next_sample(self, node: str, gpu: int, ts_ms: int) -> int | None:
        track = self._gpus.get((node, gpu))
        if track is None or not track.ts:
            return None
        ts = np.concatenate(track.ts)
        after = ts[ts > ts_ms]
        return int(after[0]) if len(after) else None

    def _precursors(self, r: dict[str, Any]) -> None:
        track = self._gpus.get((r["node"], r["gpu"]))
        moved = np.concatenate(track.moved) if track is not None and track.moved else None
        lo = r["ts_ms"] - self.rules.precursor_window_s * 1000.0
        hi = r["ts_ms"] - self.rules.lead_min_s * 1000.0
        inside = moved[(moved >= lo) & (moved <= hi)] if moved is not None else np.zeros(0)
        r["has_precursors"] = bool(len(inside))
        r["precursor_onset_ts_ms"] = int(inside.min()) if len(inside) else None


def _gpu_key(key: Any) -> Gpu:
    node, gpu = key
    return str(node), int(gpu)


def _row(ts: int, node: str, gpu: int, kind: str, rule: str, back: int | None) -> dict[str, Any]:
    return {
        "ts_ms": int(ts),
        "node": node,
        "gpu": int(gpu),
        "kind": kind,
        "has_precursors": False,
        "recovered_ts_ms": back,
        "trace_class": rule or "series_stopped",
        "scope": "gpu",
        "incident_id": 0,
        "precursor_onset_ts_ms": None,
        "injected": False,
        "in_window": True,
        "uuid": "",
    }
