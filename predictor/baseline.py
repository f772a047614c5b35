"""The rule baseline: the health checks production tools run today (DCGM health watches,
NVSentinel), computed from the same features the model sees.

A GPU is alarmed when any rule fires:

- ``dbe``: an uncorrectable (double-bit) ECC error in the last hour;
- ``remap``: a row remap is pending, or remapping failed (no spare row left);
- ``fatal_xid``: one of the fatal Xids 48/63/64/74/79/94/95/119/120 in the last hour;
- ``thermal``: thermal slowdown asserted in recent samples (at least 20 % of the last 5 min).

The baseline's score is the number of rules firing (0-4), so a threshold of 1 is the rule set
itself and higher thresholds give the other points of its recall/false-alarm curve.
"""

from __future__ import annotations

import numpy as np

from predictor import features as _features
from predictor.features import FEATURE_NAMES, RULES

__all__ = ["RULES", "THRESHOLD", "rule_hits", "score"]

THRESHOLD = 1.0


def rule_hits(features: np.ndarray) -> np.ndarray:
    """Boolean matrix (rows x :data:`RULES`) of the rules each row trips (the rules are
    defined once, in :func:`predictor.features.rule_hits`; the model sees them as features)."""

    def col(name: str) -> np.ndarray:
        return features[:, FEATURE_NAMES.index(name)].astype(np.float64)

    hits = _features.rule_hits(col)
    return np.column_stack([hits[r] for r in RULES])


def score(features: np.ndarray) -> np.ndarray:
    """How many rules each row trips (float, for the evaluation's threshold sweep)."""
    return rule_hits(features).sum(axis=1).astype(np.float64)
