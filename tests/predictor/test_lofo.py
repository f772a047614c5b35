"""Leave-one-family-out: the folds cover every family once, the table and card section are
built from evaluation summaries, a given model is judged without training (and its kept rows
replayed through the budget again), and extra training data that holds a fold's families is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predictor.fleets import Fleet, make
from predictor.lofo import (
    FOLDS,
    LofoConfig,
    card_section,
    format_table,
    main,
    replay_budget,
    run_fold,
)
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
    assert len(table.splitlines()[-1].split(" | ")) == 11
    # the rules as a floor: every kind caught at least as often as by the rules, at their own
    # setting and at the same false-alarm rate
    for kind, d in fold["floor_vs_rules_by_kind"].items():
        assert d["model_floor"] >= max(d["rules"], d["rules_at_rate"] or 0), kind
    assert table.splitlines()[-1].endswith("| none |")


def test_a_given_model_is_judged_on_the_held_out_fleet_without_training(
    tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lofo"
    args = ["--folds", "B", "--model", str(tiny_model_path), "--eval-gpus", "32", "--keep-scored"]
    assert main([str(out), *args, "--eval-days", "0.25", "--eval-mttf-h", "0.02"]) == 0
    assert sorted(p.name for p in (out / "data").iterdir()) == ["lofo-B-eval"]  # nothing trained
    res = json.loads((out / "fold-B.json").read_text())
    assert res["model"] == tiny_model_path.name.removesuffix(".json")
    assert res["held_out_seen_in_training"] == []
    live = res["summary"]["model_at_budget"]
    assert live["failures"] > 0 and 0 < live["gpu_days"] <= 32 * 0.25  # less the repairs
    assert (out / "lofo.md").read_text().splitlines()[-1].startswith("| B: memory_remap:never")
    # the kept rows met by the budget again give the evaluation's own live figures
    again = replay_budget(out / "fold-B-scored", 2.0)
    for k in ("caught_with_precursors", "false_alarms", "false_alarms_per_1000_gpu_days"):
        assert again[k] == live[k]
    assert main([str(out), "--replay-budget"]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith(
            f"| B | {live['caught_with_precursors']} / {live['failures_with_precursors']} |"
        )
    )
    assert main([str(tmp_path / "none"), "--replay-budget"]) == 2


def test_extra_training_data_must_not_hold_the_folds_families(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    leaky = make(Fleet("leaky", "families", 5, gpus=8, days=0.05, families=FOLDS["C"]), tmp_path)
    out = tmp_path / "lofo"
    with pytest.raises(ValueError, match="pcie:steps"):
        run_fold("C", out, LofoConfig(), extra_data=[leaky])
    assert not (out / "data").exists()  # refused before any fleet was written
    assert main([str(out), "--folds", "C", "--extra-data", str(leaky)]) == 2
    assert "held-out families" in capsys.readouterr().err
    assert main([str(out), "--folds", "E"]) == 2
    assert "no fold E" in capsys.readouterr().err
    assert main([str(out), "--model", str(out), "--extra-data", str(leaky)]) == 2
    assert "--model trains nothing" in capsys.readouterr().err
    assert main([str(out), "--eval-days", "1", "--adapt-days", "1"]) == 2
    assert "--adapt-days must be at least 0 and below --eval-days" in capsys.readouterr().err


def test_extra_training_data_joins_every_folds_training(tmp_path: Path, tiny_dir: Path) -> None:
    small = LofoConfig(
        train_fleets=1, train_gpus=32, train_days=0.25, train_mttf_h=0.02,
        eval_gpus=32, eval_days=0.25, eval_mttf_h=0.02, rounds=10,
    )  # fmt: skip
    res = run_fold("D", tmp_path, small, extra_data=[tiny_dir])
    card = json.loads(next((tmp_path / "models" / "D").glob("*.json")).read_text())
    assert res["model"] + ".json" == next((tmp_path / "models" / "D").glob("*.json")).name
    assert [d["path"] for d in card["data"]] == [str(tmp_path / "data" / "lofo-D-train-0"),
                                                 str(tiny_dir)]  # fmt: skip
    assert res["extra_data"] == [str(tiny_dir)]
    assert not set(res["training_families"]) & set(FOLDS["D"])


def test_prequential_folds_judge_the_adapted_model_beside_the_unadapted_and_the_rules(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """--adapt-days D: the held-out fleet's first D days adapt the model (trained on top of
    it with them); the unadapted and the adapted model are judged on the same later days,
    each beside the rules, in the table (two rows) and the card section."""
    out = tmp_path / "lofo"
    args = ["--folds", "B", "--model", str(tiny_model_path), "--eval-gpus", "32"]
    sizes = ["--eval-days", "0.5", "--eval-mttf-h", "0.01", "--adapt-days", "0.25"]
    assert main([str(out), *args, *sizes]) == 0
    res = json.loads((out / "fold-B.json").read_text())
    assert res["adapt_days"] == 0.25 and res["adapt_error"] is None
    unadapted, adapted = res["summary"], res["adapted"]
    for s in (unadapted, adapted):  # the same days: the fleet after its first quarter day
        assert s["model_at_budget"]["gpu_days"] <= 32 * 0.25 + 1e-9
        assert s["baseline"]["failures"] == unadapted["baseline"]["failures"] > 0
    assert adapted["model_at_budget"]["gpu_days"] == unadapted["model_at_budget"]["gpu_days"]
    assert res["adapted_model"] != json.loads(tiny_model_path.read_text())["created_at"]
    rows = (out / "lofo.md").read_text().splitlines()
    assert rows[-2].startswith("| B: memory_remap:never") and "unadapted" in rows[-2]
    assert rows[-1].startswith("| B, adapted on its first 0.25 days |")
    assert len(rows[-1].split(" | ")) == 11
    fold = card_section([res], LofoConfig(adapt_days=0.25))["folds"][0]
    pre = fold["prequential"]
    assert pre["adapt_days"] == 0.25
    assert pre["adapted_model_at_budget"]["failures"] == fold["model_at_budget"]["failures"]
    assert pre["baseline"]["by_kind"] == fold["baseline"]["by_kind"]
