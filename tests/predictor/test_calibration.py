"""The calibration map climbs with the raw score: no plateau crossed in one tick, and the
threshold is where the card's raw threshold maps, not a step value the model emits."""

from __future__ import annotations

import numpy as np
import pytest

from predictor import registry
from predictor.model import RiskModel


@pytest.fixture(scope="module")
def shipped() -> RiskModel:
    return registry.load_latest(registry.SHIPPED_DIR)


def test_risk_rises_with_the_raw_score_between_the_first_and_last_step(
    shipped: RiskModel,
) -> None:
    model = shipped
    x, y = model.calibration_x, model.calibration_y
    steps = np.unique(y)
    assert len(steps) >= 3, "the fixture's isotonic fit has too few steps to judge"
    lo = float(x[np.argmax(y > y[0])])  # where the staircase leaves its first step
    hi = float(x[np.argmax(y >= y[-1])])  # where it reaches its last
    raw = np.linspace(lo, hi, 200)
    risk = model.calibrate(raw)
    assert (np.diff(risk) > 0).all(), "a flat stretch: the risk would plateau"
    # about the same calibration: between its first and last steps, within the staircase's
    # own range
    assert risk.min() >= y.min() and risk.max() <= y.max()
    assert (np.diff(model.calibrate(np.linspace(0.0, 1.0, 1001))) >= 0).all()


@pytest.mark.parametrize("which", ["shipped", "tiny_model"])
def test_the_threshold_is_where_the_cards_raw_threshold_maps(
    which: str, request: pytest.FixtureRequest
) -> None:
    model: RiskModel = request.getfixturevalue(which)
    raw_thr = float(model.card["raw_threshold"])
    assert model.threshold == float(model.calibrate(np.array([raw_thr]))[0])
    raw = np.linspace(0.0, 1.0, 2001)
    alarmed = model.calibrate(raw) >= model.threshold
    # the card's operating point: the same raw scores alarm
    assert (alarmed == (raw >= raw_thr)).all()
