"""The risk model: gradient-boosted trees, a calibration map, a threshold and reasons.

:class:`RiskModel` wraps a LightGBM booster trained on :data:`predictor.features.FEATURE_NAMES`.
``raw`` is the booster's probability (trained with re-weighted classes, so not a calibrated
one); ``risk`` maps it through the isotonic calibration fitted on held-out data, so a risk of
0.2 means about one GPU in five with that score fails within the horizon. ``threshold`` is the
alarm threshold on ``risk`` chosen at training time for the false-alarm budget in the card.

An isotonic fit is a staircase: every raw score within a step gets the same risk, and a GPU
whose raw score climbs for an hour shows a flat risk that jumps to the next step in one tick
(the card's threshold being one of those steps, a value the model emits as a constant). The
map is therefore drawn through the middle of each step, piecewise linear and strictly
increasing between them (centred isotonic regression): the same order, about the same
calibration, and a risk that rises as the raw score does. The threshold on ``risk`` is where
the card's ``raw_threshold`` maps, so it alarms on the same raw scores as the card says. Below
the first step's middle the map runs down to (0, 0), above the last one up to (1, 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightgbm as lgb
import numpy as np

from forewarn.errors import InvalidInput
from predictor.features import FEATURE_NAMES, MONOTONE
from predictor.reasons import MAX_REASONS, top_reasons

__all__ = ["RiskModel", "fit_booster"]

DEFAULT_PARAMS: dict[str, Any] = {
    "objective": "binary",
    "learning_rate": 0.05,
    "num_leaves": 15,
    "min_data_in_leaf": 40,
    "feature_fraction": 0.7,
    "bagging_fraction": 0.8,
    "bagging_freq": 1,
    "lambda_l2": 1.0,
    "max_bin": 63,
    "verbose": -1,
    "num_threads": 2,
    "monotone_constraints": list(MONOTONE),
    "monotone_constraints_method": "advanced",
}
DEFAULT_ROUNDS = 200


def fit_booster(
    x: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    *,
    params: dict[str, Any] | None = None,
    rounds: int = DEFAULT_ROUNDS,
    seed: int = 0,
) -> lgb.Booster:
    """Train the trees on rows ``x`` (columns :data:`FEATURE_NAMES`), labels and weights."""
    if x.shape[1] != len(FEATURE_NAMES):
        raise InvalidInput(f"expected {len(FEATURE_NAMES)} feature columns, got {x.shape[1]}")
    if y.min() == y.max():
        raise InvalidInput("the training rows hold one class only (no failure within horizon?)")
    merged = {**DEFAULT_PARAMS, **(params or {}), "seed": seed}
    data = lgb.Dataset(x, label=y, weight=w, feature_name=list(FEATURE_NAMES), free_raw_data=True)
    return lgb.train(merged, data, num_boost_round=rounds)


def _centred(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knots through the middle of each step of an isotonic staircase (its ``X_thresholds_``
    and ``y_thresholds_``, where a step is a run of equal ``y``), and the ends of the raw
    scale: 0 maps to 0 and 1 to 1, so that the map climbs over the whole scale (a threshold in
    the first or last step included) rather than staying flat there."""
    if len(x) < 2:
        return x, y
    new = np.r_[True, np.diff(y) != 0]
    block = np.cumsum(new) - 1
    kx = np.bincount(block, weights=x) / np.bincount(block)
    ky = y[new]
    lo, hi = min(0.0, float(kx[0])), max(1.0, float(kx[-1]))
    return np.r_[lo, kx, hi], np.r_[min(0.0, float(ky[0])), ky, max(1.0, float(ky[-1]))]


@dataclass
class RiskModel:
    """A trained model as the scorer and the evaluation use it."""

    booster: lgb.Booster
    calibration_x: np.ndarray
    calibration_y: np.ndarray
    threshold: float
    card: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._knots = _centred(np.asarray(self.calibration_x), np.asarray(self.calibration_y))
        raw_thr = self.card.get("raw_threshold")
        if raw_thr is not None and len(self.calibration_x):
            self.threshold = float(self.calibrate(np.array([float(raw_thr)]))[0])
        names = tuple(self.booster.feature_name())
        # A model trained on an earlier feature list still loads when this version computes
        # every feature it knows: its columns are picked by name.
        self._cols: np.ndarray | None = None
        if names != FEATURE_NAMES:
            missing = sorted(set(names) - set(FEATURE_NAMES))
            if missing:
                raise InvalidInput(
                    "the model was trained on features this version does not compute",
                    details={"differences": missing[:5]},
                )
            self._cols = np.array([FEATURE_NAMES.index(n) for n in names])

    def _own(self, x: np.ndarray) -> np.ndarray:
        return x if self._cols is None else x[:, self._cols]

    def raw(self, x: np.ndarray) -> np.ndarray:
        """The booster's own probability for each row (before calibration)."""
        if not len(x):
            return np.zeros(0)
        return np.asarray(self.booster.predict(self._own(x), num_threads=2), dtype=np.float64)

    def calibrate(self, raw: np.ndarray) -> np.ndarray:
        """Map booster probabilities to calibrated risk (isotonic, through the middle of each
        step: strictly increasing between the first and the last step)."""
        if not len(self.calibration_x):
            return raw
        return np.interp(raw, *self._knots)

    def risk(self, x: np.ndarray) -> np.ndarray:
        """Calibrated probability that the GPU fails within the horizon, per row."""
        return self.calibrate(self.raw(x))

    def contributions(self, x: np.ndarray) -> np.ndarray:
        """Per-row, per-feature log-odds attributions (TreeSHAP); last column is the bias."""
        if not len(x):
            return np.zeros((0, len(FEATURE_NAMES) + 1))
        out = np.asarray(
            self.booster.predict(self._own(x), pred_contrib=True, num_threads=2), dtype=np.float64
        )
        if self._cols is None:
            return out
        full = np.zeros((len(x), len(FEATURE_NAMES) + 1))
        full[:, self._cols] = out[:, :-1]
        full[:, -1] = out[:, -1]
        return full

    def reasons(self, x: np.ndarray, k: int = MAX_REASONS) -> list[list[str]]:
        """Up to ``k`` plain-word reasons per row."""
        return top_reasons(self.contributions(x), x, k)

    def importances(self) -> dict[str, float]:
        """Total gain of each feature, largest first."""
        gain = self.booster.feature_importance(importance_type="gain")
        names = self.booster.feature_name()
        pairs = sorted(zip(names, gain, strict=True), key=lambda p: -p[1])
        return {name: float(g) for name, g in pairs}
