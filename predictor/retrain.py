"""Retraining on top of a base model: ``forewarn train --data DIR --base models/``.

What "on top of" means here, and nothing more (LightGBM trees are not fine-tuned in place):

- the **settings** come from the base's model card: the training settings (``training``: replay
  step, horizon, minimum lead, false-alarm budget, label horizons, rounds, validation split
  fractions, sampling rates, seed) and the booster's hyper-parameters (``hyper_parameters``,
  on top of today's defaults for any the card does not list). A command-line option set to
  something other than its default wins over the card. The validation split is chosen anew
  for the new data;
- the **data** is the new datasets plus the datasets the card lists (``data[].path``, read
  relative to the working directory), when they are still there and still the same (same
  manifest seed, size and time range); a listed dataset that is missing or differs is
  reported and left out, and the model is trained on what remains;
- the features are this version's (:data:`predictor.features.FEATURE_NAMES`): the base's own
  list when it is the same; a base trained on an older list that lacks some of them (the
  shipped model lacks the ``rule_*`` features) gets them added, and the command says so; a
  base with features this version no longer computes is refused.

The new card records the base (``base``: its card, the datasets used and those missing).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from forewarn.errors import InvalidInput, NotFound
from predictor import registry
from predictor.dataset import read_manifest
from predictor.features import FEATURE_NAMES
from predictor.train import TrainConfig

__all__ = ["Base", "load_base"]

_SAME = ("seed", "gpus", "start_ms", "end_ms")


@dataclass(frozen=True)
class Base:
    """A base model's card, where it was read from, and its datasets found here or not."""

    card_path: Path
    card: dict[str, Any]
    found: list[str]
    missing: dict[str, str]
    added_features: list[str]

    def config(self, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """The card's training settings (defaults for any it lacks), then ``overrides``."""
        training = self.card.get("training") or {}
        known = {f.name for f in fields(TrainConfig)}
        values = {k: v for k, v in training.items() if k in known and k != "split_seed"}
        if "label_horizons_s" in values:
            values["label_horizons_s"] = tuple(float(h) for h in values["label_horizons_s"])
        if "ignore_features" in values:
            values["ignore_features"] = tuple(values["ignore_features"])
        return replace(TrainConfig(**values), **(overrides or {}))

    def booster_params(self) -> dict[str, Any]:
        """The card's booster hyper-parameters (rounds and seed are training settings)."""
        hp = dict(self.card.get("hyper_parameters") or {})
        hp.pop("rounds", None)
        hp.pop("seed", None)
        return hp

    def describe(self, used: list[str]) -> dict[str, Any]:
        """What the new card records about its base."""
        return {
            "card": str(self.card_path),
            "created_at": self.card.get("created_at"),
            "datasets_used": used,
            "datasets_missing": self.missing,
            "features_added": self.added_features,
        }


def _card_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        models = registry.list_models(p) or registry.list_models(registry.SHIPPED_DIR)
        if not models:
            raise NotFound(f"no model card in {p}, and no shipped model")
        return models[-1][1]
    if p.name.endswith(registry.BOOSTER_SUFFIX):
        p = p.with_name(p.name[: -len(registry.BOOSTER_SUFFIX)] + registry.CARD_SUFFIX)
    if not p.is_file():
        raise NotFound(f"no model card at {p}")
    return p


def _check(entry: dict[str, Any]) -> str | None:
    """Why a dataset the card lists cannot be used here (None: it can)."""
    path = entry.get("path")
    if not path:
        return "the card gives no path"
    try:
        manifest = read_manifest(path)
    except InvalidInput:
        return "not found here"
    differs = [k for k in _SAME if k in entry and manifest.get(k) != entry[k]]
    return f"differs from the one trained on ({', '.join(differs)})" if differs else None


def load_base(path: str | Path) -> Base:
    """The base model at ``path``: a card, its booster file, or a directory: its newest model,
    or the shipped one when it holds none (the model the service would load from it).

    Raises:
        NotFound: no model there.
        InvalidInput: not a Forewarn model card, or one trained on other features.
    """
    card_path = _card_path(path)
    card = registry.load(card_path).card
    features = list(card.get("features") or [])
    gone = sorted(set(features) - set(FEATURE_NAMES))
    if gone:
        raise InvalidInput(
            f"{card_path} uses features this version does not compute ({', '.join(gone[:5])}); "
            "train without --base",
            details={"features": gone},
        )
    added = [f for f in FEATURE_NAMES if f not in features]
    found, missing = [], {}
    for entry in card.get("data") or []:
        why = _check(entry)
        if why is None:
            found.append(str(entry["path"]))
        else:
            missing[str(entry.get("path"))] = why
    return Base(card_path, card, found, missing, added)
