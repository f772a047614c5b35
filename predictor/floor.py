"""The rules as a floor under the model: hard evidence always alarms, whatever the model says.

A model trained on simulated fleets can score a GPU with a row remap pending as healthy; the
health checks production tools run (DCGM health watches, NVSentinel) never do. So the score
the policy acts on is never below what the hard evidence implies: when one of the rules below
fires, the GPU is alarmed at any threshold in force, and the rule is named first among its
reasons, with the failure kind it foretells.

Rules (each read from the features of :mod:`predictor.features`, the same code the baseline
of :mod:`predictor.baseline` uses):

- ``dbe``: an uncorrectable ECC error in the last hour (memory);
- ``remap``: a row remap pending, or remapping failed (memory);
- ``retired_pages``: retired pages pending (memory, GPUs before Ampere);
- ``fatal_xid``: a fatal Xid (48/63/64/74/79/94/95/119/120) in the last hour; its kind is the
  class of the most recent Xid (memory, nvlink, pcie);
- ``thermal``: thermal slowdown in at least 20 % of the last 5 min (thermal);
- ``thermal_shutdown``: a thermal shutdown in the last hour (thermal);
- ``link_down``: an NVLink link down in the last hour (nvlink).

The floor's false alarms are the operator's alarm budget's too: the live budget
(:class:`predictor.budget.AlarmBudget`) observes a floored GPU as scoring at the top of the
scale (:data:`FLOOR_SCORE`), so the rules' alarms on healthy GPUs use up part of the budget
and the model's own threshold rises to leave room for them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from predictor.features import FEATURE_NAMES, RULE_RECENT_S, RULE_THERMAL_SHARE

__all__ = [
    "FLOOR_RULES",
    "FLOOR_SCORE",
    "NONE",
    "FloorRule",
    "floor_hits",
    "floor_kinds",
    "floor_reasons",
    "floored",
]

FLOOR_SCORE = 1.0 - 1e-9
"""The score a floored GPU counts as in the alarm budget (above any threshold it can fit)."""

NONE: tuple[str, ...] = ()
"""What a row says when it has nothing to say (no rule trips, no reason): one shared empty
tuple, where a list per row made a 100,000-GPU tick allocate 300,000 of them, which outlived
the garbage collector's young generations and set off its full passes over the heap."""

_RECENT_EVENT = math.exp(-1.0) - 1e-9  # a decayed 1 h event count this high: one within the hour


@dataclass(frozen=True)
class FloorRule:
    """One piece of hard evidence: its ``name``, the failure ``kind`` it foretells (None: by
    the class of the most recent Xid) and how it is said to an operator."""

    name: str
    kind: str | None
    says: str


FLOOR_RULES: tuple[FloorRule, ...] = (
    FloorRule("dbe", "memory", "uncorrectable ECC error in the last hour"),
    FloorRule("remap", "memory", "row remap pending or failed"),
    FloorRule("retired_pages", "memory", "retired pages pending"),
    FloorRule("fatal_xid", None, "fatal Xid in the last hour"),
    FloorRule("thermal", "thermal", "thermal slowdown in at least 20 % of the last 5 min"),
    FloorRule("thermal_shutdown", "thermal", "thermal shutdown in the last hour"),
    FloorRule("link_down", "nvlink", "NVLink link down in the last hour"),
)
"""The rules, in the order they are named."""

_XID_KIND: tuple[tuple[str, str], ...] = (
    ("since_xid_memory_s", "memory"),
    ("since_xid_nvlink_s", "nvlink"),
    ("since_xid_bus_s", "pcie"),
)


def _col(x: np.ndarray, name: str) -> np.ndarray:
    return x[:, FEATURE_NAMES.index(name)].astype(np.float64)


def floor_hits(x: np.ndarray) -> np.ndarray:
    """Boolean matrix (rows of the feature matrix ``x`` x :data:`FLOOR_RULES`): which rule
    each row trips."""
    with np.errstate(invalid="ignore"):
        hits = {
            "dbe": _col(x, "since_dbe_s") <= RULE_RECENT_S,
            "remap": (np.nan_to_num(_col(x, "remap_pending")) > 0)
            | (np.nan_to_num(_col(x, "remap_failure")) > 0),
            "retired_pages": np.nan_to_num(_col(x, "retired_pages_pending")) > 0,
            "fatal_xid": _col(x, "since_fatal_xid_s") <= RULE_RECENT_S,
            "thermal": np.nan_to_num(_col(x, "thermal_throttle_5m")) >= RULE_THERMAL_SHARE,
            "thermal_shutdown": np.nan_to_num(_col(x, "thermal_shutdown_1h")) >= _RECENT_EVENT,
            "link_down": _col(x, "since_link_down_s") <= RULE_RECENT_S,
        }
    if not len(x):
        return np.zeros((0, len(FLOOR_RULES)), dtype=bool)
    return np.column_stack([hits[r.name] for r in FLOOR_RULES])


def _xid_kind(x: np.ndarray) -> np.ndarray:
    since = np.column_stack([_col(x, c) for c, _ in _XID_KIND])
    kinds = np.array([k for _, k in _XID_KIND] + ["other"], dtype=object)
    recent = np.where(np.isnan(since), np.inf, since)
    pick = np.argmin(recent, axis=1)
    return np.where(np.isfinite(recent.min(axis=1)), kinds[pick], kinds[-1])


def floor_kinds(x: np.ndarray, hits: np.ndarray | None = None) -> list[Sequence[str]]:
    """Per row, the failure kinds the tripped rules foretell (empty: no rule trips; the rows
    without one share one empty tuple, see :data:`NONE`)."""
    hits = floor_hits(x) if hits is None else hits
    out: list[Sequence[str]] = [NONE] * len(x)
    rows = np.flatnonzero(hits.any(axis=1))
    xid_kind = _xid_kind(x[rows]) if len(rows) else np.zeros(0, dtype=object)
    for i, r in enumerate(rows):
        kinds: list[str] = []
        for j, rule in enumerate(FLOOR_RULES):
            kind = rule.kind or str(xid_kind[i])
            if hits[r, j] and kind not in kinds:
                kinds.append(kind)
        out[r] = kinds
    return out


def floor_reasons(x: np.ndarray, hits: np.ndarray | None = None) -> list[Sequence[str]]:
    """Per row, one sentence per tripped rule: ``"rule remap: row remap pending or failed
    (memory)"`` (:data:`NONE` where none trips)."""
    hits = floor_hits(x) if hits is None else hits
    out: list[Sequence[str]] = [NONE] * len(x)
    rows = np.flatnonzero(hits.any(axis=1))
    xid_kind = _xid_kind(x[rows]) if len(rows) else np.zeros(0, dtype=object)
    for i, r in enumerate(rows):
        out[r] = [
            f"rule {rule.name}: {rule.says} ({rule.kind or xid_kind[i]})"
            for j, rule in enumerate(FLOOR_RULES)
            if hits[r, j]
        ]
    return out


def floored(score: npt.ArrayLike, hit: npt.ArrayLike, threshold: float) -> np.ndarray:
    """``score`` raised to ``threshold`` where a rule trips (``hit``: bool per row), so that
    a GPU with hard evidence is alarmed at the threshold in force."""
    s = np.asarray(score, dtype=np.float64)
    return np.where(np.asarray(hit, dtype=bool), np.fmax(s, threshold), s)
