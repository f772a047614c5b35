"""`forewarn train --base`: the base card's settings and hyper-parameters, the new data mixed
with the base's datasets that are still here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forewarn.cli import main
from forewarn.errors import InvalidInput, NotFound
from predictor import registry
from predictor.features import FEATURE_NAMES
from predictor.retrain import load_base
from sim import generate_dataset

from .conftest import INJECTIONS, TINY_CONFIG


def _copy_model(card_path: Path, to: Path, **changes: object) -> Path:
    to.mkdir(parents=True, exist_ok=True)
    card = json.loads(card_path.read_text())
    shutil.copy(card_path.with_name(card["booster_file"]), to / card["booster_file"])
    card.update(changes)
    out = to / card_path.name
    out.write_text(json.dumps(card))
    return out


def test_base_settings_and_data_from_its_card(tiny_model_path: Path, tiny_dir: Path) -> None:
    base = load_base(tiny_model_path.parent)
    assert base.card_path == tiny_model_path
    assert base.found == [str(tiny_dir)] and base.missing == {}
    cfg = base.config()
    assert cfg.rounds == TINY_CONFIG.rounds and cfg.val_node_frac == TINY_CONFIG.val_node_frac
    assert cfg.label_horizons_s == TINY_CONFIG.label_horizons_s
    assert cfg.split_seed is None  # chosen anew for the new data
    assert base.config({"rounds": 7}).rounds == 7
    hp = base.booster_params()
    assert "rounds" not in hp and hp["num_leaves"] == base.card["hyper_parameters"]["num_leaves"]


def test_missing_or_changed_base_data_is_named(tiny_model_path: Path, tmp_path: Path) -> None:
    card = json.loads(tiny_model_path.read_text())
    moved = [dict(card["data"][0], path=str(tmp_path / "gone")), dict(card["data"][0], seed=99)]
    base = load_base(_copy_model(tiny_model_path, tmp_path / "m", data=moved))
    assert base.found == []
    assert base.missing[str(tmp_path / "gone")] == "not found here"
    assert "differs" in base.missing[card["data"][0]["path"]]


def test_a_base_with_unknown_features_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    odd = _copy_model(tiny_model_path, tmp_path / "m", features=[*FEATURE_NAMES, "no_such"])
    with pytest.raises(InvalidInput, match="no_such"):
        load_base(odd)
    with pytest.raises(NotFound):
        load_base(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()  # as the service does: an empty models/ means the shipped one
    assert load_base(tmp_path / "empty").card_path.parent == registry.SHIPPED_DIR


def test_the_shipped_model_can_be_a_base() -> None:
    base = load_base(registry.SHIPPED_DIR)
    cfg = base.config()
    assert (cfg.label_horizons_s, cfg.rounds) == ((1800.0,), 150)
    assert cfg.threshold_not_early  # a retrained model chooses its threshold the same way
    # the structural telemetry features came after it: a retrain on it adds them
    assert base.added_features == [
        "gap_len_1h",
        "gap_len_1h_vs_24h",
        "metrics_vanished_now",
        "metrics_vanished_5m",
    ]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_train_with_base_mixes_in_the_base_data(
    tiny_model_path: Path, tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "own-fleet"
    generate_dataset(new, gpus=32, days=0.5, interval_s=60.0, seed=12, injections=INJECTIONS)
    out = tmp_path / "models"
    argv = ["train", "--data", str(new), "--base", str(tiny_model_path.parent)]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    assert "base: " in capsys.readouterr().err
    card = registry.load(out).card
    base_card = json.loads(tiny_model_path.read_text())
    assert [d["path"] for d in card["data"]] == [str(tiny_dir), str(new)]
    assert card["base"]["card"] == str(tiny_model_path)
    assert card["base"]["datasets_used"] == [str(tiny_dir)]
    assert card["training"]["rounds"] == TINY_CONFIG.rounds
    assert card["training"]["label_horizons_s"] == list(TINY_CONFIG.label_horizons_s)
    assert card["hyper_parameters"] == base_card["hyper_parameters"]
