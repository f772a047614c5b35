"""Fixtures: a tiny simulated fleet with forced failures, and a tiny model trained on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor import registry
from predictor.dataset import Dataset, load_dataset
from predictor.model import RiskModel
from predictor.train import TrainConfig, train
from sim import generate_dataset

# Failures with precursors on a 32-GPU fleet over 12 h, sampled every 60 s.
INJECTIONS = [
    {"at_s": 3600, "node": 0, "gpu": 1, "kind": "memory", "lead_s": 7200},
    {"at_s": 5400, "node": 1, "gpu": 2, "kind": "thermal", "lead_s": 2400},
    {"at_s": 9000, "node": 2, "gpu": 3, "kind": "nvlink", "lead_s": 5400},
    {"at_s": 14400, "node": 3, "gpu": 4, "kind": "pcie", "lead_s": 3600},
    {"at_s": 21600, "node": 1, "gpu": 6, "kind": "memory", "lead_s": 5400},
    {"at_s": 25200, "node": 2, "gpu": 0, "kind": "thermal", "lead_s": 3000},
    {"at_s": 28800, "node": 3, "gpu": 7, "kind": "nvlink", "lead_s": 7200},
    {"at_s": 30000, "node": 0, "gpu": 5, "kind": "gpu_lost"},
]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "tiny"
    generate_dataset(out, gpus=32, days=0.5, interval_s=60.0, seed=11, injections=INJECTIONS)
    return out


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> Dataset:
    return load_dataset(tiny_dir)


TINY_CONFIG = TrainConfig(
    rounds=40,
    val_node_frac=0.5,
    val_from=0.5,
    active_rate=0.5,
    quiet_rate=0.05,
    seed=3,
    label_horizons_s=(1800.0, 3600.0),
)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = train([tiny_dir], TINY_CONFIG)
    return registry.save(model, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: Path) -> RiskModel:
    return registry.load(tiny_model_path)
