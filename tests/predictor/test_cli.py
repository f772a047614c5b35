"""`forewarn train` and `forewarn evaluate` end to end on the tiny fleet."""

from __future__ import annotations

import json

import pytest

from forewarn.cli import main


@pytest.mark.timeout(360)  # trains, then replays the fleet twice: slow on a busy machine
def test_train_then_evaluate_json_and_png(tiny_dir, tmp_path, capsys) -> None:
    out = tmp_path / "models"
    assert (
        main(
            ["train", "--data", str(tiny_dir), "--out", str(out), "--rounds", "20", "--no-progress"]
        )
        == 0
    )
    assert list(out.glob("*.json")) and list(out.glob("*.lgb.txt"))
    capsys.readouterr()
    png = tmp_path / "curve.png"
    assert (
        main(
            ["evaluate", "--data", str(tiny_dir), "--model", str(out), "--json", "--plot", str(png)]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"model", "baseline", "threshold"}
    for side in ("model", "baseline"):
        for key in (
            "recall",
            "false_alarms_per_1000_gpu_days",
            "lead_time_median_s",
            "pr_auc",
            "by_kind",
        ):
            assert key in report[side]
    assert report["model"]["failures"] >= 7
    assert set(report["model"]["recall_by_precursor_lead"]) >= {"10-30 min", "2-8 h"}
    assert set(report["model"]["caught_at_least_ahead"]) == {"2 min", "10 min", "30 min"}
    live = report["model_at_budget"]
    assert live["budget"]["false_alarms_per_1000_gpu_days"] == 2.0
    assert isinstance(live["false_alarms_by_cause"], dict)
    assert "model_at_budget_hindsight" in report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        main(
            [
                "evaluate",
                "--data",
                str(tiny_dir),
                "--model",
                str(out),
                "--plot",
                "",
                "--budget",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "baseline" in text and "memory" in text


def test_evaluate_refuses_a_directory_that_is_not_a_dataset(tmp_path, tiny_model_path) -> None:
    assert (
        main(
            ["evaluate", "--data", str(tmp_path), "--model", str(tiny_model_path), "--no-progress"]
        )
        == 2
    )


@pytest.mark.timeout(360)
def test_evaluate_prequential_adapts_on_the_first_days_and_judges_the_rest(
    tiny_dir, tiny_model_path, capsys
) -> None:
    """``--adapt-days``: the first days are the fleet's own history, a model is trained on
    top of the given one with them, and both are judged on the rest beside the rules."""
    args = ["evaluate", "--data", str(tiny_dir), "--model", str(tiny_model_path)]
    assert main([*args, "--json", "--plot", "", "--adapt-days", "0.3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adapt_days"] == 0.3 and report["adapt_error"] is None
    for side in ("unadapted", "adapted"):
        s = report[side]
        # judged on the rest only: the failures of the first 0.3 days are not counted
        assert s["model"]["failures"] == report["unadapted"]["model"]["failures"]
        assert 0 < s["model"]["failures"] < 8
        assert "model_floor_at_budget" in s and "floor_vs_rules_by_kind" in s
        assert s["dataset"]["days"] == pytest.approx(0.2, abs=0.01)
