"""The model lifecycle: a worse candidate is not promoted, a better one is, rollback restores
the previous, a pin holds; retraining on the fleet's history judges on its last days."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from forewarn.errors import Conflict
from predictor import registry
from predictor.dataset import Dataset, load_dataset, split_at
from predictor.features import FEATURE_NAMES
from predictor.lifecycle import ModelLifecycle
from predictor.model import RiskModel
from predictor.train import train
from sim import generate_dataset
from tests.predictor.conftest import INJECTIONS, TINY_CONFIG

KEEP = ("temp_gpu_c_vs_node", "util_gpu_pct_vs_node")


@pytest.fixture(scope="module")
def holdout(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """Another fleet with the same failure schedule: the "recent days" both are judged on."""
    out = tmp_path_factory.mktemp("hold") / "hold"
    generate_dataset(out, gpus=32, days=0.5, interval_s=60.0, seed=21, injections=INJECTIONS)
    return load_dataset(out)


@pytest.fixture(scope="module")
def blind_model(tiny_dir: Path) -> RiskModel:
    """A model that sees two noise features only: worse than the tiny model."""
    ignore = tuple(f for f in FEATURE_NAMES if f not in KEEP)
    return train([tiny_dir], replace(TINY_CONFIG, ignore_features=ignore))


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        self.t += 60.0
        return self.t


def test_a_worse_candidate_is_not_promoted_a_better_one_is_and_rollback_restores(
    tmp_path: Path, tiny_model: RiskModel, blind_model: RiskModel, holdout: Dataset
) -> None:
    models = tmp_path / "models"
    registry.save(blind_model, models, stem="forewarn-risk-20260101T000000Z")
    life = ModelLifecycle(models, clock=Clock())
    assert life.in_force_id() == "forewarn-risk-20260101T000000Z"  # the newest, no state yet
    good = registry.save(tiny_model, tmp_path / "candidates", stem="forewarn-risk-good")

    decision = life.consider(good, holdout)
    assert decision["promoted"], decision
    judged = decision["judgements"]
    assert (
        judged["candidate"]["caught_with_precursors"] > judged["in_force"]["caught_with_precursors"]
    )
    assert life.in_force_id() == "forewarn-risk-good"
    assert life.in_force_path() == models / "forewarn-risk-good.json"  # copied in
    assert life.status()["replaced"] == ["forewarn-risk-20260101T000000Z"]

    worse = registry.save(blind_model, models, stem="forewarn-risk-worse")
    decision = life.consider(worse, holdout)
    assert not decision["promoted"] and decision["reason"] == "does not beat the model in force"
    assert life.in_force_id() == "forewarn-risk-good"

    back = life.rollback()
    assert back["model"] == "forewarn-risk-20260101T000000Z"
    assert life.in_force_id() == "forewarn-risk-20260101T000000Z"
    with pytest.raises(Conflict):
        life.rollback()  # nothing older left

    # a pinned model stays in force even against a better candidate
    life.pin("forewarn-risk-20260101T000000Z")
    decision = life.consider(good, holdout)
    assert not decision["promoted"] and decision["reason"] == "pinned by an operator"
    life.unpin()
    actions = [h["action"] for h in life.status()["history"]]
    assert actions == ["judged", "judged", "rolled_back", "pinned", "judged", "unpinned"]
    times = [h["at"] for h in life.status()["history"]]
    assert times == sorted(times)
    state = json.loads((models / "lifecycle.json").read_text())
    assert state["in_force"] == "forewarn-risk-20260101T000000Z" and not state["pinned"]
    ids = {m["id"] for m in life.models()}
    assert {"forewarn-risk-good", "forewarn-risk-worse"} <= ids  # the loser is kept


def test_split_at_cuts_samples_events_and_counted_failures(tiny: Dataset) -> None:
    cut = tiny.start_ms + 6 * 3_600_000
    before, after = split_at(tiny, cut)
    assert len(before.samples) + len(after.samples) == len(tiny.samples)
    assert before.samples.ts_ms.max() <= cut < after.samples.ts_ms.min()
    assert len(before.events) + len(after.events) == len(tiny.events)
    assert (before.end_ms, after.start_ms) == (cut, cut)
    counted = before.failures["in_window"].to_numpy() | after.failures["in_window"].to_numpy()
    assert counted.sum() == tiny.failures["in_window"].astype(bool).sum()
    assert not (before.failures["in_window"] & after.failures["in_window"]).any()
    assert np.all(before.failures.loc[before.failures["in_window"], "ts_ms"] <= cut)


@pytest.mark.timeout(300)
def test_retrain_on_the_fleets_history_trains_on_top_and_judges_on_its_last_days(
    tmp_path: Path, tiny_model_path: Path, tiny: Dataset
) -> None:
    models = tmp_path / "models"
    registry.save(registry.load(tiny_model_path), models, stem="forewarn-risk-20260101T000000Z")
    life = ModelLifecycle(models, clock=Clock())
    decision = life.retrain_on_history(tiny, holdout_days=0.2)
    assert decision["action"] == "judged" and decision["in_force"] == (
        "forewarn-risk-20260101T000000Z"
    )
    candidate = models / f"{decision['candidate']}.json"
    card = json.loads(candidate.read_text())
    assert card["base"]["card"] == "forewarn-risk-20260101T000000Z.json"
    # whatever the verdict, the model in force is one of the two and the other is kept
    assert life.in_force_id() in (decision["candidate"], "forewarn-risk-20260101T000000Z")
    assert candidate.is_file()
