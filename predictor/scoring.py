"""Live scoring for the service: the fleet's newest rows in, risk and reasons per GPU out.

The control loop keeps one :class:`Scorer` for the life of the process and, every tick, hands
it what the store received since the previous tick (sample rows in the store's frame columns,
and events), then asks for scores. The scorer folds the rows into its
:class:`predictor.state.GpuWindowState` — decayed 5 min / 1 h / 24 h / 7 d window sums per GPU —
so a tick costs O(GPUs), never a re-read of 24 h of raw rows. Features are then computed by
:func:`predictor.features.compute`, the code that made the training rows, so the model sees in
production what it saw in training (``tests/predictor`` checks the numbers are equal).

After a restart, warm the state up once with the trailing window the store still holds
(``scorer.update(window_frame, events, now_ms=...)``: rows of any age, oldest first, are
folded the same way); the 24 h features are normalised by how long each GPU has been watched.

Reasons (up to three plain-word sentences) are computed only for GPUs whose risk is at least
``reason_floor`` (default: half the alarm threshold): attributions cost more than a predict, and
a GPU at 0.1 % risk needs no explanation.

The rules are a floor (:mod:`predictor.floor`): a GPU with hard evidence (a row remap pending,
an uncorrectable ECC error, a fatal Xid, ...) is alarmed whatever the model says, its risk
raised to the threshold, and the rule is named first among its reasons.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from predictor.features import compute
from predictor.floor import NONE, floor_hits, floor_kinds, floor_reasons, floored
from predictor.floor_budget import floor_mask
from predictor.model import RiskModel
from predictor.reasons import MAX_REASONS
from predictor.state import GpuWindowState, SampleBlock

__all__ = ["Scorer", "score_fleet"]


@dataclass
class Scorer:
    """Risk per GPU from the newest rows; one instance per control loop.

    Example::

        scorer = Scorer(registry.load_default("models"))
        scorer.update(new_samples, new_events, now_ms=now)
        frame = scorer.score()   # node, gpu, risk, score, alarm, reasons, staleness_s

    With an alarm budget instead of the card's fixed threshold (row ``i`` is slot ``i``)::

        budget = AlarmBudget(2.0, fallback=model.card["raw_threshold"])
        budget.observe(frame["score"].to_numpy(), now_ms=now)
        alarm = frame["score"].to_numpy() >= budget.threshold
    """

    model: RiskModel
    reason_floor: float | None = None
    max_reasons: int = MAX_REASONS

    def __post_init__(self) -> None:
        self.state = GpuWindowState(capacity=1024)

    def update(
        self,
        samples: pd.DataFrame | SampleBlock | None,
        events: pd.DataFrame | None = None,
        *,
        now_ms: int,
    ) -> None:
        """Fold in rows received since the last call (see :meth:`GpuWindowState.update`)."""
        self.state.update(samples, events, now_ms=now_ms)

    def features(self) -> np.ndarray:
        """The current feature matrix, one row per GPU seen (slot order)."""
        assert self.state.now_ms is not None, "update() first"
        return compute(self.state, self.state.now_ms)

    def score(self, *, reasons: bool = True) -> pd.DataFrame:
        """Risk of every GPU seen so far, at the state's clock.

        Returns:
            a frame with ``node``, ``gpu``, ``risk`` (calibrated probability of a failure
            within the model's horizon, raised to the model's threshold where a rule of
            :mod:`predictor.floor` trips), ``model_risk`` (the model's own, before the floor),
            ``floor`` (a rule trips), ``floor_rules`` (which: bit ``j`` for rule ``j`` of
            :data:`predictor.floor.FLOOR_RULES`), ``floor_kinds`` (the failure kinds the
            tripped rules foretell), ``alarm`` (risk >= the model's threshold), ``reasons``
            (up to ``max_reasons`` sentences, the tripped rules first; below the floor the
            shared empty :data:`predictor.floor.NONE`),
            ``score`` (the booster's own output, before the calibration map: the
            scale :class:`predictor.budget.AlarmBudget` keeps its threshold on),
            ``last_seen_ms`` and ``staleness_s``.
        """
        x = self.features()
        return score_fleet(
            self.model,
            self.state,
            x,
            reasons=reasons,
            reason_floor=self.reason_floor,
            max_reasons=self.max_reasons,
        )


def score_fleet(
    model: RiskModel,
    state: GpuWindowState,
    x: np.ndarray,
    *,
    reasons: bool = True,
    reason_floor: float | None = None,
    max_reasons: int = MAX_REASONS,
) -> pd.DataFrame:
    """Risk and reasons for the feature matrix ``x`` of ``state``'s slots."""
    n = state.size
    raw = model.raw(x)
    own = model.calibrate(raw)
    hits = floor_hits(x)
    hit = hits.any(axis=1)
    risk = floored(own, hit, model.threshold)
    floor = model.threshold / 2 if reason_floor is None else reason_floor
    said: list[Sequence[str]] = [NONE] * n
    if reasons:
        rules = floor_reasons(x, hits)
        hot = np.flatnonzero((own >= floor) | hit)
        if len(hot):
            for i, r in zip(hot, model.reasons(x[hot], max_reasons), strict=True):
                said[i] = [*rules[i], *r][: max(max_reasons, len(rules[i]))]
    now = state.now_ms or 0
    last = state.last_ms[:n]
    return pd.DataFrame(
        {
            "node": np.asarray(state.nodes, dtype=object)[state.node_of[:n]],
            "gpu": state.gpu_of[:n],
            "risk": risk,
            "model_risk": own,
            "floor": hit,
            "floor_rules": floor_mask(hits),
            "floor_kinds": floor_kinds(x, hits),
            "score": raw,
            "alarm": risk >= model.threshold,
            "reasons": said,
            "last_seen_ms": last,
            "staleness_s": (now - last) / 1000.0,
        }
    )
