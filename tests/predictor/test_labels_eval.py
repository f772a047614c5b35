"""Labels, the rule baseline and the event-level metrics on hand-built frames."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from predictor import baseline, evaluate
from predictor.features import FEATURE_NAMES
from predictor.labels import Labeller, failure_table
from predictor.state import GpuWindowState

T0 = 1_735_689_600_000
MIN = 60_000


def _state(gpus: int = 4) -> GpuWindowState:
    state = GpuWindowState()
    frame = pd.DataFrame({"ts_ms": T0, "node": "n0", "gpu": np.arange(gpus), "temp_gpu_c": 50.0})
    state.update(frame, now_ms=T0)
    return state


def test_labels_look_one_horizon_ahead_and_drop_down_time() -> None:
    failures = pd.DataFrame(
        {
            "ts_ms": [T0 + 60 * MIN],
            "node": ["n0"],
            "gpu": [1],
            "kind": ["memory"],
            "has_precursors": [True],
            "recovered_ts_ms": pd.array([T0 + 120 * MIN], dtype="Int64"),
        }
    )
    lab = Labeller(failure_table(failures), horizon_s=1800)
    state = _state()
    assert lab.at(state, T0 + 29 * MIN).y.tolist() == [0, 0, 0, 0]
    assert lab.at(state, T0 + 31 * MIN).y.tolist() == [0, 1, 0, 0]
    assert lab.at(state, T0 + 59 * MIN).y[1] == 1
    at_failure = lab.at(state, T0 + 60 * MIN)
    assert not at_failure.keep[1] and at_failure.y[1] == 0
    assert not lab.at(state, T0 + 119 * MIN).keep[1]
    assert lab.at(state, T0 + 120 * MIN).keep[1]


def test_labels_say_whether_the_next_failure_was_foretold() -> None:
    failures = pd.DataFrame(
        {
            "ts_ms": [T0 + 10 * MIN, T0 + 20 * MIN, T0 + 40 * MIN],
            "node": ["n0", "n0", "n0"],
            "gpu": [0, 1, 1],
            "kind": ["gpu_lost", "memory", "memory"],
            "has_precursors": [False, True, False],
            "recovered_ts_ms": [T0 + 11 * MIN, T0 + 21 * MIN, np.nan],
        }
    )
    lab = Labeller(failure_table(failures), horizon_s=1800)
    state = _state()
    now = lab.at(state, T0)
    assert now.foretold.tolist() == [False, True, False, False]  # the next one, not any
    assert now.until_s[:2].tolist() == [600.0, 1200.0]
    later = lab.at(state, T0 + 30 * MIN)
    assert later.foretold.tolist() == [False, False, False, False]
    assert later.until_s[1] == 600.0 and later.y[1] == 1


def test_node_scope_failure_without_gpu_applies_to_every_gpu() -> None:
    failures = pd.DataFrame(
        {
            "ts_ms": [T0 + 10 * MIN],
            "node": ["n0"],
            "gpu": pd.array([None], dtype="Int64"),
            "kind": ["power_loss"],
            "has_precursors": [False],
        }
    )
    table = failure_table(failures, gpus_per_node=4)
    assert sorted(table["gpu"]) == [0, 1, 2, 3]


def _table(scores: dict[int, list[float]], failures: list[tuple[int, int]]) -> evaluate.ScoreTable:
    rows = pd.DataFrame(
        [
            {"ts_ms": T0 + k * MIN, "slot": slot, "s": v, "y": 0}
            for slot, series in scores.items()
            for k, v in enumerate(series)
        ]
    )
    fails = pd.DataFrame(
        {
            "ts_ms": [T0 + m * MIN for _, m in failures],
            "slot": [s for s, _ in failures],
            "kind": ["memory"] * len(failures),
            "has_precursors": [True] * len(failures),
            "in_window": [True] * len(failures),
        }
    )
    return evaluate.ScoreTable(rows, fails, step_s=60.0)


def test_event_metrics_count_failures_alarms_and_lead() -> None:
    n = 120
    caught = [0.0] * n
    for k in range(40, 59):  # alarm from minute 40 to 58, failure at minute 60
        caught[k] = 0.9
    late = [0.0] * n
    late[119] = 0.9  # alarmed one minute before failing at 120: too late (L = 2 min)
    noisy = [0.0] * n
    for k in (10, 11, 50, 100):  # 10/11 merge into one alarm: three false alarms
        noisy[k] = 0.8
    table = _table({0: caught, 1: late, 2: noisy}, [(0, 60), (1, 120)])
    m = evaluate.metrics(table, "s", 0.5)
    assert m["failures"] == 2 and m["caught"] == 1
    assert m["recall"] == 0.5
    assert m["lead_time_median_s"] == 20 * 60
    assert m["false_alarms"] == 3
    assert m["by_kind"]["memory"]["caught"] == 1
    points = evaluate.curve(table, "s", np.array([0.5, 0.85, 0.95]))
    assert points["recall"].tolist() == [0.5, 0.5, 0.0]
    assert points["false_alarms_per_1000_gpu_days"].iloc[1] == 0.0
    assert evaluate.choose_threshold(points, 0.0) == 0.85


def test_a_false_alarm_before_a_later_failure_is_also_early() -> None:
    n = 2000
    early = [0.0] * n
    early[10] = 0.9  # the GPU fails at minute 1,000: 990 min later, false, early
    healthy = [0.0] * n
    healthy[10] = 0.9  # never fails
    late = [0.0] * n
    late[10] = 0.9  # fails 26 h later: false, not early
    table = _table({0: early, 1: healthy, 2: late}, [(0, 1000), (2, 10 + 26 * 60)])
    m = evaluate.metrics(table, "s", 0.5)
    assert (m["false_alarms"], m["false_alarms_early"]) == (3, 1)
    assert m["false_alarms_not_early_per_1000_gpu_days"] == pytest.approx(2 / table.gpu_days * 1000)


def test_a_threshold_can_be_chosen_on_false_alarms_that_are_not_early() -> None:
    """Training fleets fail ten times as often as a real one: a threshold chosen counting
    early alarms (the GPU failed within a day) as false is set for a far sicker fleet."""
    n = 2000
    caught = [0.0] * n
    caught[1990:1998] = [0.6] * 8  # caught at 0.6, failing at minute 2,000
    early = [0.0] * n
    early[10] = 0.7  # the GPU fails at minute 1,000: false, early
    healthy = [0.0] * n
    healthy[10] = 0.5  # never fails
    table = _table({0: caught, 1: early, 2: healthy}, [(0, 2000), (1, 1000)])
    points = evaluate.curve(table, "s", np.array([0.55, 0.65, 0.75]))
    for thr, row in zip([0.55, 0.65, 0.75], points.itertuples(), strict=True):
        m = evaluate.metrics(table, "s", thr)
        assert row.false_alarms_not_early_per_1000_gpu_days == pytest.approx(
            m["false_alarms_not_early_per_1000_gpu_days"]
        )
    assert points["false_alarms_per_1000_gpu_days"].iloc[0] > 0  # the early alarm at 0.55
    assert evaluate.choose_threshold(points, 0.0) == 0.75  # all false alarms count: none caught
    not_early = "false_alarms_not_early_per_1000_gpu_days"
    assert evaluate.choose_threshold(points, 0.0, not_early) == 0.55


def test_baseline_rules_fire_on_their_signals() -> None:
    x = np.full((4, len(FEATURE_NAMES)), np.nan, dtype=np.float32)
    x[:, FEATURE_NAMES.index("since_dbe_s")] = 7 * 86400
    x[:, FEATURE_NAMES.index("since_fatal_xid_s")] = 7 * 86400
    x[1, FEATURE_NAMES.index("remap_pending")] = 1
    x[2, FEATURE_NAMES.index("since_fatal_xid_s")] = 60
    x[3, FEATURE_NAMES.index("thermal_throttle_5m")] = 0.5
    x[3, FEATURE_NAMES.index("since_dbe_s")] = 10
    assert baseline.score(x).tolist() == [0, 1, 1, 2]
