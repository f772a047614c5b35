"""The fleets the default model is trained and judged on."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from predictor import registry
from predictor.dataset import read_manifest
from predictor.fleets import EVALUATION, SHIPPED, TRAINING, Fleet, make
from sim import default_params
from sim.shapes import families


def test_training_fleets_fail_more_and_evaluation_fleets_keep_the_calibrated_rate() -> None:
    calibrated = default_params()["hazard"]["fleet_mttf_h"]
    for f in TRAINING:
        params, interval_s = f.params()
        assert params["hazard"]["fleet_mttf_h"] < calibrated / 5
        assert interval_s >= 30.0
    for f in EVALUATION:
        params, _ = f.params()
        assert params["hazard"]["fleet_mttf_h"] == calibrated
    assert {f.seed for f in TRAINING}.isdisjoint({f.seed for f in EVALUATION})
    settings = {f.setting for f in TRAINING}
    assert settings == {"default", "mechanism"}
    drawn = {fam for f in TRAINING for fam in families(f.params()[0])}
    assert {"memory:bursts", "thermal:step"} & drawn and any(d.startswith("benign:") for d in drawn)


def test_mechanism_fleets_never_draw_an_excluded_family() -> None:
    held = ("memory:bursts", "thermal:step", "benign:hot_nodes")
    for seed in range(20):
        params, _ = Fleet("x", "mechanism", seed, exclude=held).params()
        assert not set(held) & set(families(params))
    params, _ = Fleet("y", "families", 1, families=held).params()
    assert set(held) <= set(families(params))


def test_make_writes_a_dataset_once(tmp_path) -> None:
    small = Fleet("t", "default", 5, gpus=8, days=0.02)
    path = make(small, tmp_path)
    first = (path / "manifest.json").stat().st_mtime_ns
    assert make(small, tmp_path) == path
    assert (path / "manifest.json").stat().st_mtime_ns == first
    longer = Fleet("t", "default", 5, gpus=8, days=0.5)  # same name, another fleet
    with pytest.raises(ValueError, match="holds another fleet"):
        make(longer, tmp_path)


def _card_fleets(card: dict) -> list[tuple[Fleet, dict]]:
    """Each dataset of the card with the fleet of ``fleets`` it came from: TRAINING under
    var/ds3, SHIPPED (the six fleet-weeks) under var/ds2."""
    groups = {"var/ds3": TRAINING, "var/ds2": SHIPPED}
    out = []
    for data in card["data"]:
        path = Path(data["path"])
        (fleet,) = [f for f in groups[path.parent.as_posix()] if f.name == path.name]
        out.append((fleet, data))
    return out


def test_the_shipped_models_training_command_names_its_fleets() -> None:
    """The card's command rebuilds the shipped model: it writes both groups, then trains on
    every fleet of TRAINING and SHIPPED, with the seed, size and sampling the card records."""
    card = registry.load_latest(registry.SHIPPED_DIR).card
    steps = [shlex.split(step) for step in card["training"]["command"].split(" && ")]
    assert steps[0] == ["python", "-m", "predictor.fleets", "var/ds3", "--only", "training"]
    assert steps[1] == ["python", "-m", "predictor.fleets", "var/ds2", "--only", "shipped"]
    words = steps[2]
    named = [words[i + 1] for i, w in enumerate(words) if w == "--data"]
    assert named == [f"var/ds3/{f.name}" for f in TRAINING] + [f"var/ds2/{f.name}" for f in SHIPPED]
    assert [d["path"] for d in card["data"]] == named
    for fleet, data in _card_fleets(card):
        _, interval_s = fleet.params()
        assert (data["seed"], data["gpus"], data["interval_s"]) == (
            fleet.seed,
            fleet.gpus,
            interval_s,
        )
        days = (data["end_ms"] - data["start_ms"]) / 86_400_000
        assert abs(days - fleet.days) < 0.01


@pytest.mark.slow
def test_todays_simulator_still_writes_the_shipped_models_first_fleet(tmp_path: Path) -> None:
    """The card's command rebuilds the model only while the simulator writes the same fleets:
    the first one (1,024 GPUs for 3 days, about 10 s) must have the counts, lemon nodes and
    span that the card recorded when the model was trained."""
    card = registry.load_latest(registry.SHIPPED_DIR).card
    fleet, recorded = _card_fleets(card)[0]
    written = read_manifest(make(fleet, tmp_path))
    for key in ("counts", "lemon_nodes", "start_ms", "end_ms", "interval_s", "gpus", "seed"):
        assert written[key] == recorded[key], key
