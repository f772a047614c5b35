"""Labels: will this GPU suffer a job-killing hardware failure within the horizon?

A row (GPU, t) is positive when ``failures.parquet`` has a failure of that GPU in
``(t, t + H]`` (H default 30 min). Only hardware failures are in that table (the simulator
writes the ground truth); application Xids never make a label. Rows from a failure until the
GPU is back in service (``recovered_ts_ms``, or the end of the data when unknown) are dropped:
a dead GPU is not "at risk", it is gone. A failure with no GPU (a node-scope failure recorded
once) applies to every GPU of its node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from predictor.state import GpuWindowState

__all__ = ["DEFAULT_HORIZON_S", "Labeller", "failure_table"]

DEFAULT_HORIZON_S = 1800.0


def failure_table(failures: pd.DataFrame, gpus_per_node: int = 8) -> pd.DataFrame:
    """Failures with one row per GPU: ``ts_ms``, ``node``, ``gpu``, ``kind``,
    ``has_precursors``, ``recovered_ts_ms`` (float ms, NaN = never), ``in_window`` (False for
    failures the simulator drew just outside the data: they still label the rows before them
    but are not counted by the evaluation), ``precursor_lead_s`` (from the onset of its
    precursors to the failure; NaN when unknown), sorted by time."""
    cols = [
        "ts_ms",
        "node",
        "gpu",
        "kind",
        "has_precursors",
        "recovered_ts_ms",
        "in_window",
        "precursor_lead_s",
    ]
    if failures is None or not len(failures):
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    f = failures.copy()
    if "has_precursors" not in f:
        f["has_precursors"] = False
    if "in_window" not in f:
        f["in_window"] = True
    if "recovered_ts_ms" not in f:
        f["recovered_ts_ms"] = np.nan
    if "precursor_onset_ts_ms" not in f:
        f["precursor_onset_ts_ms"] = np.nan
    gpu = pd.to_numeric(f["gpu"], errors="coerce")
    whole = f[gpu.isna()]
    f = f[gpu.notna()].assign(gpu=gpu[gpu.notna()].astype(np.int64))
    if len(whole):
        expanded = whole.loc[whole.index.repeat(gpus_per_node)].copy()
        expanded["gpu"] = np.tile(np.arange(gpus_per_node), len(whole))
        f = pd.concat([f, expanded], ignore_index=True)
    out = pd.DataFrame(
        {
            "ts_ms": f["ts_ms"].astype(np.int64).to_numpy(),
            "node": f["node"].astype(str).to_numpy(),
            "gpu": f["gpu"].astype(np.int64).to_numpy(),
            "kind": f["kind"].astype(str).to_numpy(),
            "has_precursors": f["has_precursors"].astype(bool).to_numpy(),
            "recovered_ts_ms": pd.to_numeric(f["recovered_ts_ms"], errors="coerce")
            .astype(np.float64)
            .to_numpy(),
            "in_window": f["in_window"].astype(bool).to_numpy(),
            "precursor_lead_s": (
                f["ts_ms"].astype(np.float64)
                - pd.to_numeric(f["precursor_onset_ts_ms"], errors="coerce").astype(np.float64)
            ).to_numpy()
            / 1000.0,
        }
    )
    return out.sort_values("ts_ms", kind="stable").reset_index(drop=True)


@dataclass
class Labels:
    """Per slot at one instant: ``y`` (1: a failure within H), ``keep`` (False: the GPU is
    down), ``until_s`` (seconds to that GPU's next failure, inf when none is known),
    ``foretold`` (that next failure had precursors; False when there is none)."""

    y: np.ndarray
    keep: np.ndarray
    until_s: np.ndarray
    foretold: np.ndarray


class Labeller:
    """Labels the slots of a :class:`GpuWindowState` at an instant."""

    def __init__(self, failures: pd.DataFrame, horizon_s: float = DEFAULT_HORIZON_S) -> None:
        self.failures = failures
        self.horizon_ms = horizon_s * 1000.0
        self._ts = failures["ts_ms"].to_numpy(dtype=np.float64)
        self._rec = failures["recovered_ts_ms"].to_numpy(dtype=np.float64)
        self._foretold = failures["has_precursors"].to_numpy(dtype=bool)
        self._slots: np.ndarray | None = None
        self._size = -1

    def slots(self, state: GpuWindowState) -> np.ndarray:
        """Slot of each failure's GPU (-1 while the GPU has not been seen)."""
        if self._slots is None or self._size != state.size:
            self._slots = state.slots(
                self.failures["node"].to_numpy(), self.failures["gpu"].to_numpy(), create=False
            )
            self._size = state.size
        return self._slots

    def at(self, state: GpuWindowState, now_ms: int) -> Labels:
        n = state.size
        y = np.zeros(n, dtype=np.int8)
        keep = np.ones(n, dtype=bool)
        until = np.full(n, np.inf)
        foretold = np.zeros(n, dtype=bool)
        if not len(self.failures):
            return Labels(y, keep, until, foretold)
        slot = self.slots(state)
        known = slot >= 0
        ahead = known & (self._ts > now_ms)
        if ahead.any():
            # Next failure per slot: failures are sorted by time, so the first write wins when
            # we write in reverse order.
            idx = np.flatnonzero(ahead)[::-1]
            until[slot[idx]] = (self._ts[idx] - now_ms) / 1000.0
            foretold[slot[idx]] = self._foretold[idx]
            soon = idx[self._ts[idx] <= now_ms + self.horizon_ms]
            y[slot[soon]] = 1
        rec = np.where(np.isnan(self._rec), np.inf, self._rec)
        down = known & (self._ts <= now_ms) & (now_ms < rec)
        keep[slot[down]] = False
        y[~keep] = 0
        return Labels(y, keep, until, foretold)
