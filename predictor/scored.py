"""Replaying a dataset through features and scorers: the rows that evaluation and
calibration judge.

Every step of the replay computes the fleet's features (the live path), drops GPUs that are
down, labels the rest, and keeps the scores of each scorer (the model, the rule baseline, or
any function of the feature matrix) for the selected rows. Predictions are batched across steps
so that the booster is not called once per step for a handful of rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from predictor import baseline
from predictor.dataset import Dataset, replay
from predictor.features import compute
from predictor.labels import DEFAULT_HORIZON_S, Labeller, failure_table
from predictor.state import GpuWindowState

__all__ = ["Scored", "score_dataset"]

Scorer = Callable[[np.ndarray], np.ndarray]
Select = Callable[[int, GpuWindowState], np.ndarray]
_BATCH_ROWS = 200_000


@dataclass
class Scored:
    """Rows (``ts_ms``, ``slot``, ``y``, one column per scorer) and failures with their slot."""

    rows: pd.DataFrame
    failures: pd.DataFrame
    state: GpuWindowState


def score_dataset(
    dataset: Dataset,
    scorers: dict[str, Scorer],
    *,
    step_s: float = 60.0,
    horizon_s: float = DEFAULT_HORIZON_S,
    select: Select | None = None,
    with_baseline: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Scored:
    """Score every (GPU, step) of ``dataset`` that is up and chosen by ``select``.

    Args:
        scorers: name -> function from a feature matrix to one score per row.
        select: ``(now_ms, state) -> bool mask over slots``; default every slot.
        with_baseline: add the rule baseline's score as column ``baseline``.
    """
    fails = failure_table(dataset.failures, int(dataset.manifest.get("gpus_per_node", 8)))
    labeller = Labeller(fails, horizon_s)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("ts_ms", "slot", "y", *scorers)}
    if with_baseline:
        parts["baseline"] = []
    pending_x: list[np.ndarray] = []
    pending_n = 0

    def flush() -> None:
        nonlocal pending_n
        if not pending_x:
            return
        x = np.vstack(pending_x)
        for name, fn in scorers.items():
            parts[name].append(np.asarray(fn(x), dtype=np.float64))
        if with_baseline:
            parts["baseline"].append(baseline.score(x))
        pending_x.clear()
        pending_n = 0

    def sink(now_ms: int, state: GpuWindowState) -> None:
        nonlocal pending_n
        if state.size == 0:
            return
        x = compute(state, now_ms)
        lab = labeller.at(state, now_ms)
        mask = lab.keep & ~np.isnan(state.first_ms[: state.size])
        if select is not None:
            mask &= select(now_ms, state)
        idx = np.flatnonzero(mask)
        if not len(idx):
            return
        parts["ts_ms"].append(np.full(len(idx), now_ms, dtype=np.int64))
        parts["slot"].append(idx.astype(np.int64))
        parts["y"].append(lab.y[idx])
        pending_x.append(x[idx])
        pending_n += len(idx)
        if pending_n >= _BATCH_ROWS:
            flush()

    state = replay(dataset, sink, step_s=step_s, progress=progress)
    flush()
    rows = pd.DataFrame(
        {k: np.concatenate(v) if v else np.zeros(0) for k, v in parts.items()}
    ).astype({"ts_ms": np.int64, "slot": np.int64, "y": np.int8})
    fails = fails.assign(
        slot=state.slots(fails["node"].to_numpy(), fails["gpu"].to_numpy(), create=False)
        if len(fails)
        else np.zeros(0, dtype=np.int64)
    )
    return Scored(rows, fails, state)
