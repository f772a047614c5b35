"""``models/``: what its README says the service loads from it, checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from api.settings import Settings
from predictor import registry

ROOT = Path(__file__).resolve().parents[2]


def test_the_directory_is_in_the_tree_and_is_the_default() -> None:
    assert (ROOT / "models" / "README.md").is_file()
    assert Settings().models_dir == Path("models")
    assert registry.list_models(ROOT / "models") == []  # the README is not a model


def test_the_newest_card_wins_else_the_shipped_model(tmp_path: Path) -> None:
    shipped = registry.load_default(tmp_path)  # nothing here: the shipped one
    assert (
        shipped.card["created_at"] == registry.load_latest(registry.SHIPPED_DIR).card["created_at"]
    )
    (card,) = registry.SHIPPED_DIR.glob("*.json")
    for stem, created in (("b-older", "2030-01-01T00:00:00+00:00"),
                          ("a-newer", "2031-01-01T00:00:00+00:00")):  # fmt: skip
        data = json.loads(card.read_text())
        booster = registry.SHIPPED_DIR / data["booster_file"]
        shutil.copy(booster, tmp_path / f"{stem}.lgb.txt")
        data.update(created_at=created, booster_file=f"{stem}.lgb.txt")
        (tmp_path / f"{stem}.json").write_text(json.dumps(data))
    (tmp_path / "README.md").write_text("not a model")
    assert registry.load_default(tmp_path).card["created_at"].startswith("2031")
