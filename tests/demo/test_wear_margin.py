"""The thresholds the demo and the end-to-end test set, against the shipped model.

Both inject a short memory wear episode, far shorter than the precursors the model learnt, and
set a policy threshold below the card's. Replayed offline here (the simulator's injection,
written to a store and read back as the control loop reads it, scored every second): the worn
GPU must cross the threshold with time left to move its rank, and no healthy GPU may come
near it. A new default model that scores these episodes otherwise fails here first, with the
numbers to choose new thresholds by.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from demo.cli import DEMO_THRESHOLD
from forewarn.wire import Event, GpuSample
from predictor import registry
from predictor.scoring import Scorer
from sim.config import load_params
from sim.source import SimulatedSource
from store import Store
from store import control as db
from store.writes import event_row, sample_row
from tests.control.scene import POLICY, WEAR_LEAD_S, WEAR_PARAMS

E2E_THRESHOLD = float(json.loads(POLICY)["threshold"])
T0 = 1_800_000_000.0


def replay(
    tmp: Path, *, gpus: int, seed: int, lead_s: float, warm_s: int = 60, params: Path | None = None
) -> tuple[list[tuple[int, float]], float]:
    """Inject memory wear on sim-node-0000 GPU 1 after ``warm_s`` into a fleet with ``params``
    (a TOML file of overrides, as ``forewarn simulate --params`` takes); returns the worn GPU's
    risk per second after the injection, and the highest risk of any other GPU throughout."""
    model = registry.load_latest(registry.SHIPPED_DIR)
    store = Store.open(f"sqlite:///{tmp / 'wear.db'}")
    fleet = load_params(params) if params else None  # as `forewarn simulate --params` reads it
    source = SimulatedSource(gpus, seed=seed, params=fleet, speed=60.0)
    scorer = Scorer(model)
    samples_at, events_at = 0, 0
    worn: list[tuple[int, float]] = []
    others = 0.0
    try:
        for k in range(warm_s + int(lead_s)):
            if k == warm_s:
                source.inject("sim-node-0000", 1, "memory", lead_s)
            rows = source.read(datetime.fromtimestamp(T0 + k, UTC))
            store.write(
                samples=[sample_row(r) for r in rows if isinstance(r, GpuSample)],
                events=[event_row(r) for r in rows if isinstance(r, Event)],
            )
            with store.engine.connect() as c:
                frame, seqs = db.samples_after(c, samples_at)
                events, ids = db.events_after(c, events_at)
            samples_at = max(seqs, default=samples_at)
            events_at = max(ids, default=events_at)
            scorer.update(frame, events, now_ms=int((T0 + k) * 1000) + 1)
            scores = scorer.score(reasons=False)
            is_worn = ((scores["node"] == "sim-node-0000") & (scores["gpu"] == 1)).to_numpy()
            risk = scores["risk"].to_numpy()
            if k >= warm_s:
                worn.append((k - warm_s, float(risk[is_worn].max())))
            others = max(others, float(np.max(risk[~is_worn], initial=0.0)))
    finally:
        store.close()
    return worn, others


@pytest.mark.parametrize(
    ("gpus", "lead_s", "threshold", "ahead_s", "params"),
    [
        pytest.param(64, 90.0, DEMO_THRESHOLD, 10.0, None, id="demo"),
        pytest.param(16, float(WEAR_LEAD_S), E2E_THRESHOLD, 40.0, WEAR_PARAMS, id="end-to-end"),
    ],
)
def test_the_worn_gpu_crosses_in_time_and_no_healthy_one_comes_near(
    tmp_path: Path,
    gpus: int,
    lead_s: float,
    threshold: float,
    ahead_s: float,
    params: Path | None,
) -> None:
    worn, others = replay(tmp_path, gpus=gpus, seed=1, lead_s=lead_s, params=params)
    crossed = next((t for t, risk in worn if risk >= threshold), None)
    peak = max(risk for _, risk in worn)
    assert crossed is not None, f"the worn GPU peaked at {peak:.4f} < {threshold}"
    assert lead_s - crossed >= ahead_s, f"crossed {lead_s - crossed:.0f} s before the failure"
    assert others < threshold / 3, f"a healthy GPU reached {others:.4f}"
