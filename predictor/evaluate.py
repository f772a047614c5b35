"""Event-level evaluation: failures caught in time, false alarms per GPU-day, lead times.

A score series is judged the way an operator lives with it, per failure and per alarm, not
per row:

- a failure is *caught* when the GPU was alarmed (score >= threshold) at some instant at least
  L (default 2 min, time to migrate) and at most H (default 30 min) before it; its *lead time*
  is measured from the onset of that alarm (the alarm may have started earlier than H);
- an *alarm* is a run of alarmed scores of one GPU, runs closer than ``merge_s`` (default
  10 min, the policy's hysteresis) being one alarm; an alarm is *false* when no failure of
  that GPU follows within H of its end; false alarms are counted per 1,000 GPU-days of scored
  time (rows of a GPU that is down are not scored); a false alarm whose GPU fails within a
  day of its end is also counted as *early* (right about the GPU, too soon to be a catch);
- PR-AUC is the row-level average precision of the scores against the labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score

__all__ = ["ScoreTable", "choose_threshold", "curve", "json_safe", "metrics"]

_SHIFT = 42  # key = slot << 42 | (ts - origin): 2**42 ms is 139 years


@dataclass
class Params:
    lead_min_s: float = 120.0
    horizon_s: float = 1800.0
    merge_s: float = 600.0


class ScoreTable:
    """Scored rows of a replay (``ts_ms``, ``slot``, one column per scorer, ``y``) and the
    failures (``ts_ms``, ``slot``, ``kind``, ``has_precursors``, ``in_window``), indexed for
    the metrics. Failures outside the window are not counted but do make alarms before them
    true; failures of GPUs never scored (slot -1) are ignored."""

    def __init__(
        self,
        rows: pd.DataFrame,
        failures: pd.DataFrame,
        *,
        step_s: float,
        params: Params | None = None,
    ) -> None:
        self.params = params or Params()
        first_row = int(rows["ts_ms"].min()) if len(rows) else 0
        self.origin = min(first_row, int(failures["ts_ms"].min()) if len(failures) else first_row)
        keys = (rows["slot"].to_numpy(np.int64) << _SHIFT) | (
            rows["ts_ms"].to_numpy(np.int64) - self.origin
        )
        order = np.argsort(keys, kind="stable")
        self.rows = rows.iloc[order].reset_index(drop=True)
        self.keys = keys[order]
        self.ts = self.rows["ts_ms"].to_numpy(np.int64)
        self.slot = self.rows["slot"].to_numpy(np.int64)
        known = failures[failures["slot"] >= 0]
        counted = known["in_window"].to_numpy(bool) if "in_window" in known else True
        self.failures = known[counted].reset_index(drop=True)
        self.gpu_days = len(rows) * step_s / 86400.0
        p = self.params
        f_slot = self.failures["slot"].to_numpy(np.int64)
        f_ts = self.failures["ts_ms"].to_numpy(np.int64) - self.origin
        lo = (f_slot << _SHIFT) | np.maximum(f_ts - int(p.horizon_s * 1000), 0)
        hi = (f_slot << _SHIFT) | np.maximum(f_ts - int(p.lead_min_s * 1000), 0)
        self._win_lo = np.searchsorted(self.keys, lo, side="left")
        self._win_hi = np.searchsorted(self.keys, hi, side="right")
        # Every known failure (also those just past the data) makes an alarm before it true.
        all_ts = np.maximum(known["ts_ms"].to_numpy(np.int64) - self.origin, 0)
        fkeys = (known["slot"].to_numpy(np.int64) << _SHIFT) | all_ts
        self._f_order = np.argsort(fkeys)
        self._f_keys = fkeys[self._f_order]

    def window_max(self, column: str) -> np.ndarray:
        """Per failure, the highest score in its [t - H, t - L] window (-inf: no row)."""
        s = self.rows[column].to_numpy(np.float64)
        return np.array(
            [
                s[a:b].max() if b > a else -np.inf
                for a, b in zip(self._win_lo, self._win_hi, strict=True)
            ]
        )

    def alarms(self, column: str, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Alarm episodes at ``threshold``: (row index of each alarmed row's episode onset,
        episode id per row or -1, is-false per episode)."""
        onset, episode, false, _ = self.episodes(column, threshold)
        return onset, episode, false

    def episodes(
        self, column: str, threshold: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`alarms`, and per episode the seconds from its end to its GPU's next failure
        (inf: none follows)."""
        p = self.params
        s = self.rows[column].to_numpy(np.float64)
        a = np.flatnonzero(s >= threshold)
        episode = np.full(len(s), -1, dtype=np.int64)
        if not len(a):
            none = np.array([], dtype=np.int64)
            return none, episode, np.array([], dtype=bool), np.array([], dtype=np.float64)
        gap = np.diff(self.ts[a]) > p.merge_s * 1000
        new = np.r_[True, (np.diff(self.slot[a]) != 0) | gap]
        ep = np.cumsum(new) - 1
        episode[a] = ep
        onset = a[new]
        last = np.r_[a[np.flatnonzero(new)[1:] - 1], a[-1]]
        to_next = np.full(len(onset), np.inf)
        if len(self._f_keys):
            j = np.searchsorted(self._f_keys, self.keys[onset], side="left")
            j_ok = j < len(self._f_keys)
            nxt = np.where(j_ok, self._f_keys[np.minimum(j, len(self._f_keys) - 1)], -1)
            same = j_ok & ((nxt >> _SHIFT) == self.slot[onset])
            nxt_ms = nxt & ((1 << _SHIFT) - 1)
            end_ms = self.ts[last] - self.origin
            to_next = np.where(same, (nxt_ms - end_ms) / 1000.0, np.inf)
        return onset, episode, ~(to_next <= p.horizon_s), to_next


LEAD_BUCKETS_S: tuple[tuple[str, float, float], ...] = (
    ("< 10 min", 0.0, 600.0),
    ("10-30 min", 600.0, 1800.0),
    ("30 min-2 h", 1800.0, 7200.0),
    ("2-8 h", 7200.0, 28800.0),
    ("> 8 h", 28800.0, np.inf),
)
"""Buckets of a failure's precursor lead (onset of its precursors to the failure)."""
EARLY_S = 86400.0
"""A false alarm followed by its GPU's failure within this long is also counted as *early*."""
AHEAD_S: tuple[tuple[str, float], ...] = (("2 min", 120), ("10 min", 600), ("30 min", 1800))
"""Marks for "caught at least this far ahead" (share of failures with precursors)."""


def metrics(
    table: ScoreTable,
    column: str,
    threshold: float,
    *,
    cause: str | None = None,
    causes: Sequence[str] = (),
) -> dict[str, Any]:
    """Every figure of one scorer at one threshold (see the module docstring).

    ``cause``: a row column holding, per row, an index into ``causes`` (what made the score,
    NaN when unknown); false alarms are then counted by the cause at their onset."""
    p = table.params
    onset, episode, false, to_next = table.episodes(column, threshold)
    f = table.failures
    s = table.rows[column].to_numpy(np.float64)
    lead_of = np.full(len(f), np.nan)
    for i, (a, b) in enumerate(zip(table._win_lo, table._win_hi, strict=True)):
        hit = np.flatnonzero(s[a:b] >= threshold)
        if len(hit):
            first = a + hit[0]
            lead_of[i] = (f["ts_ms"].iat[i] - table.ts[onset[episode[first]]]) / 1000.0
    caught = ~np.isnan(lead_of)
    lead = lead_of[caught]
    prec = f["has_precursors"].to_numpy(bool)
    n_false = int(false.sum())
    n_early = int((false & (to_next <= EARLY_S)).sum())
    y = table.rows["y"].to_numpy()
    pr_auc = float(average_precision_score(y, s)) if 0 < y.sum() < len(y) else float("nan")

    def recall(mask: np.ndarray) -> float | None:
        return float(caught[mask].mean()) if mask.any() else None

    plead = (
        f["precursor_lead_s"].to_numpy(np.float64)
        if "precursor_lead_s" in f
        else np.full(len(f), np.nan)
    )
    by_lead: dict[str, Any] = {}
    for name, lo, hi in LEAD_BUCKETS_S:
        m = prec & (plead >= lo) & (plead < hi)
        by_lead[name] = {"failures": int(m.sum()), "caught": int((caught & m).sum())}
        by_lead[name]["recall"] = recall(m)
    ahead = {
        name: (float((caught & prec & (lead_of >= s)).sum() / prec.sum()) if prec.any() else None)
        for name, s in AHEAD_S
    }
    false_by_cause: dict[str, int] = {}
    if cause is not None and len(onset):
        codes = table.rows[cause].to_numpy(np.float64)[onset[false]]
        for c in codes:
            key = (
                causes[int(c)] if np.isfinite(c) and 0 <= int(c) < len(causes) else "not attributed"
            )
            false_by_cause[key] = false_by_cause.get(key, 0) + 1
    by_kind: dict[str, Any] = {}
    for kind in sorted(set(f["kind"])):
        m = (f["kind"] == kind).to_numpy()
        lead_k = lead_of[caught & m]
        by_kind[kind] = {
            "failures": int(m.sum()),
            "with_precursors": int((m & prec).sum()),
            "caught": int((caught & m).sum()),
            "recall": recall(m),
            "recall_with_precursors": recall(m & prec),
            "lead_time_median_s": float(np.median(lead_k)) if len(lead_k) else None,
        }
    return {
        "threshold": float(threshold),
        "failures": len(f),
        "failures_with_precursors": int(prec.sum()),
        "caught": int(caught.sum()),
        "caught_with_precursors": int((caught & prec).sum()),
        "recall": recall(np.ones(len(f), dtype=bool)),
        "recall_with_precursors": recall(prec),
        "lead_time_median_s": float(np.median(lead)) if len(lead) else None,
        "lead_time_p10_s": float(np.percentile(lead, 10)) if len(lead) else None,
        "false_alarms": n_false,
        "alarms": len(false),
        "gpu_days": table.gpu_days,
        "false_alarms_per_1000_gpu_days": n_false / table.gpu_days * 1000.0
        if table.gpu_days
        else None,
        # false by the definition above, yet their GPU failed within a day of their end
        "false_alarms_early": n_early,
        # the rest: alarms on GPUs that stayed up for a day after (what an alarm budget, which
        # counts healthy GPU-time only, is about)
        "false_alarms_not_early_per_1000_gpu_days": (n_false - n_early) / table.gpu_days * 1000.0
        if table.gpu_days
        else None,
        "pr_auc": pr_auc,
        "lead_min_s": p.lead_min_s,
        "horizon_s": p.horizon_s,
        "by_kind": by_kind,
        "recall_by_precursor_lead": by_lead,
        "caught_at_least_ahead": ahead,
        "false_alarms_by_cause": dict(sorted(false_by_cause.items(), key=lambda kv: -kv[1])),
    }


def curve(table: ScoreTable, column: str, thresholds: np.ndarray | None = None) -> pd.DataFrame:
    """Recall (all failures and those with precursors) and false alarms per 1,000 GPU-days
    (all of them, and those not early: on GPUs that did not fail within :data:`EARLY_S`) over
    a sweep of thresholds (default: 60 quantiles of the top 5 % of scores plus every failure's
    best score)."""
    s = table.rows[column].to_numpy(np.float64)
    best = table.window_max(column)
    if thresholds is None:
        qs = np.quantile(s, np.linspace(0.95, 1.0, 60)) if len(s) else np.array([])
        thresholds = np.unique(np.r_[qs, best[np.isfinite(best)]])
    prec = table.failures["has_precursors"].to_numpy(bool)
    per = 1e3 / max(table.gpu_days, 1e-9)
    out = []
    for thr in np.asarray(thresholds, dtype=np.float64):
        _, _, false, to_next = table.episodes(column, float(thr))
        hit = best >= thr
        out.append(
            {
                "threshold": float(thr),
                "recall": float(hit.mean()) if len(hit) else np.nan,
                "recall_with_precursors": float(hit[prec].mean()) if prec.any() else np.nan,
                "false_alarms_per_1000_gpu_days": false.sum() * per,
                "false_alarms_not_early_per_1000_gpu_days": (false & (to_next > EARLY_S)).sum()
                * per,
            }
        )
    return pd.DataFrame(out)


def choose_threshold(
    points: pd.DataFrame,
    max_false_alarms: float,
    rate: str = "false_alarms_per_1000_gpu_days",
) -> float:
    """The threshold of best recall (failures with precursors, then all) whose false-alarm
    rate (the column ``rate`` of :func:`curve`) is within ``max_false_alarms`` per 1,000
    GPU-days; the strictest one if none is."""
    ok = points[points[rate] <= max_false_alarms]
    if not len(ok):
        return float(points["threshold"].max())
    ok = ok.fillna({"recall_with_precursors": 0.0, "recall": 0.0})
    best = ok.sort_values(
        ["recall_with_precursors", "recall", "threshold"], ascending=[False, False, True]
    )
    return float(best["threshold"].to_numpy()[0])


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN: no failure to judge by) as ``None``, so
    that ``json.dumps`` writes valid JSON."""
    if isinstance(value, float | np.floating):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
