"""Leave-one-family-out: the folds cover every family once, and the table and card section
are built from evaluation summaries."""

from __future__ import annotations

import json

from predictor.lofo import FOLDS, LofoConfig, card_section, format_table
from predictor.report import evaluate_dataset
from sim.shapes import SHAPES, all_families


def test_folds_hold_out_every_non_default_family_once() -> None:
    held = [f for fold in FOLDS.values() for f in fold]
    defaults = {f"{k}:{v[0]}" for k, v in SHAPES.items()}
    assert sorted(held) == sorted(set(all_families()) - defaults)
    for fold in FOLDS.values():
        physics = [f.split(":")[0] for f in fold if not f.startswith("benign:")]
        assert len(physics) == len(set(physics))  # one fleet can be made with all of them


def test_table_and_card_section(tiny, tiny_model) -> None:
    report = evaluate_dataset(tiny, tiny_model, budget=2.0)
    results = [{"fold": "A", "held_out": list(FOLDS["A"]), "summary": report.summary}]
    table = format_table(results)
    assert table.splitlines()[-1].startswith("| A: memory:bursts")
    section = card_section(results, LofoConfig())
    json.dumps(section, allow_nan=False)
    fold = section["folds"][0]
    assert fold["model_at_budget"]["failures"] == report.summary["model"]["failures"]
    assert set(fold["baseline"]["by_kind"]) == set(report.summary["baseline"]["by_kind"])
    # the union alarms wherever the remap rule does: it catches at least what that rule catches
    union = report.summary["union"]
    assert union["rules"] == ["remap"] and fold["union_rules"] == ["remap"]
    for kind, caught in report.summary["rule_settings"]["rule remap"]["by_kind"].items():
        assert union["by_kind"][kind]["caught"] >= caught
    assert len(table.splitlines()[-1].split(" | ")) == 9
