"""The commands on awkward data: no failure at all, no split with failures, piped output."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from forewarn.cli import main
from forewarn.errors import InvalidInput
from predictor.train import TrainConfig, choose_split, split_counts, train
from sim import generate_dataset, load_params


def _strict(text: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def quiet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 GPUs for 3 hours that never fail."""
    out = tmp_path_factory.mktemp("quiet") / "ds"
    params = load_params(overrides={"hazard.fleet_mttf_h": 1e12})
    generate_dataset(out, gpus=8, days=0.125, interval_s=60.0, seed=5, params=params)
    assert len(pd.read_parquet(out / "failures.parquet")) == 0
    return out


def test_evaluate_a_fleet_without_failures(quiet_dir, tiny_model_path, tmp_path, capsys) -> None:
    png = tmp_path / "c.png"
    args = ["evaluate", "--data", str(quiet_dir), "--model", str(tiny_model_path)]
    assert main([*args, "--json", "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    report = _strict(out)
    assert report["model"]["failures"] == 0 and report["model"]["recall"] is None
    assert report["model"]["false_alarms_per_1000_gpu_days"] is not None
    assert png.is_file()
    assert main([*args, "--plot", ""]) == 0
    text, err = capsys.readouterr()
    assert "baseline" in text
    assert err == ""  # no progress bar when stderr is not a terminal


def test_train_refuses_data_without_a_split_that_holds_failures(quiet_dir, tmp_path, capsys):
    out = tmp_path / "models"
    assert main(["train", "--data", str(quiet_dir), "--out", str(out)]) == 2
    _, err = capsys.readouterr()
    assert "no split" in err and "failures with precursors" in err
    assert not out.exists() or not list(out.iterdir())
    with pytest.raises(InvalidInput):
        train([quiet_dir], TrainConfig(rounds=5))


def _failure(node: str, ts_s: float) -> dict:
    return {"node": node, "ts_ms": int(ts_s * 1000), "has_precursors": True, "in_window": True}


def test_split_is_chosen_so_that_validation_holds_failures(tmp_path) -> None:
    day_ms = 86_400_000
    # one failure late (validation side), one early (training side), each on its own node
    failures = pd.DataFrame([_failure("n-a", 0.9 * 86400), _failure("n-b", 0.1 * 86400)])
    failures.to_parquet(tmp_path / "failures.parquet")
    manifest = {"format": "forewarn-dataset", "start_ms": 0, "end_ms": day_ms}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cfg = TrainConfig(val_node_frac=0.5, val_from=0.6, seed=0)
    chosen = choose_split([tmp_path], cfg)
    assert chosen.split_seed is not None
    assert split_counts([(failures, 0, day_ms)], cfg, chosen.split_seed) == (1, 1)
    # a seed that puts both nodes on one side is never chosen
    one_sided = [s for s in range(64) if 0 in split_counts([(failures, 0, day_ms)], cfg, s)]
    assert one_sided and chosen.split_seed not in one_sided
