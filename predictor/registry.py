"""The model registry: model files and their cards in a directory (``models/``).

A model is two files with the same stem: ``<stem>.lgb.txt`` (the LightGBM booster as text)
and ``<stem>.json`` (the model card: data manifests, features, hyper-parameters, held-out
metrics, threshold, calibration map, version, date). Stems are ``forewarn-risk-<UTC time>``,
so names sort by age; :func:`load_latest` takes the newest card by ``created_at``.

The model the project ships lives in the package (``predictor/shipped/``), so an installed
wheel has one: :func:`load_default` takes the newest model in the operator's directory and
falls back to it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np

from forewarn.errors import InvalidInput, NotFound
from predictor.evaluate import json_safe
from predictor.model import RiskModel

__all__ = ["SHIPPED_DIR", "list_models", "load", "load_default", "load_latest", "save"]

CARD_SUFFIX = ".json"
BOOSTER_SUFFIX = ".lgb.txt"
SHIPPED_DIR = Path(__file__).with_name("shipped")
"""The model shipped with Forewarn (package data)."""


def save(model: RiskModel, models_dir: str | Path, stem: str | None = None) -> Path:
    """Write the booster and its card; returns the card's path."""
    out = Path(models_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or "forewarn-risk-" + datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    booster_path = out / f"{stem}{BOOSTER_SUFFIX}"
    card = dict(model.card)
    card["model_id"] = stem
    card["threshold"] = float(model.threshold)
    card["booster_file"] = booster_path.name
    card.setdefault("created_at", datetime.now(UTC).isoformat(timespec="seconds"))
    card["calibration"] = {
        "method": card.get("calibration", {}).get("method", "isotonic"),
        "x": np.asarray(model.calibration_x).tolist(),
        "y": np.asarray(model.calibration_y).tolist(),
    }
    model.booster.save_model(str(booster_path))
    card_path = out / f"{stem}{CARD_SUFFIX}"
    text = json.dumps(json_safe(card), indent=1, default=_json_default, allow_nan=False)
    card_path.write_text(text + "\n", "utf-8")
    return card_path


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def load(path: str | Path) -> RiskModel:
    """A model from its card (``.json``), its booster file, or a directory (the newest).

    Raises:
        NotFound: no such file, or no model in the directory.
        InvalidInput: a card that is not a Forewarn model card, or features that differ.
    """
    p = Path(path)
    if p.is_dir():
        return load_latest(p)
    if p.name.endswith(BOOSTER_SUFFIX):
        p = p.with_name(p.name[: -len(BOOSTER_SUFFIX)] + CARD_SUFFIX)
    if not p.is_file():
        raise NotFound(f"no model card at {p}")
    try:
        card = json.loads(p.read_text("utf-8"))
    except ValueError as exc:
        raise InvalidInput(f"{p}: not JSON ({exc})") from exc
    if card.get("format") != "forewarn-model":
        raise InvalidInput(f"{p}: not a Forewarn model card")
    booster_path = p.with_name(card["booster_file"])
    if not booster_path.is_file():
        raise NotFound(f"model card {p} names a missing booster file {booster_path.name}")
    booster = lgb.Booster(model_file=str(booster_path))
    card["model_id"] = p.name[: -len(CARD_SUFFIX)]  # which model scored: its card's stem
    cal = card.get("calibration", {})
    return RiskModel(
        booster,
        np.asarray(cal.get("x", []), dtype=np.float64),
        np.asarray(cal.get("y", []), dtype=np.float64),
        float(card["threshold"]),
        card,
    )


def list_models(models_dir: str | Path) -> list[tuple[str, Path]]:
    """(created_at, card path) of every model card in the directory, oldest first."""
    found = []
    for card_path in Path(models_dir).glob(f"*{CARD_SUFFIX}"):
        try:
            card = json.loads(card_path.read_text("utf-8"))
        except (OSError, ValueError):
            continue
        if card.get("format") == "forewarn-model":
            found.append((str(card.get("created_at", "")), card_path))
    return sorted(found)


def load_latest(models_dir: str | Path) -> RiskModel:
    """The newest model in ``models_dir``.

    Raises:
        NotFound: the directory holds no model card.
    """
    models = list_models(models_dir)
    if not models:
        raise NotFound(f"no model in {models_dir}")
    return load(models[-1][1])


def load_default(models_dir: str | Path) -> RiskModel:
    """The newest model in ``models_dir``, else the one shipped with Forewarn."""
    if list_models(models_dir):
        return load_latest(models_dir)
    return load_latest(SHIPPED_DIR)
