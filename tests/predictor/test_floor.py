"""The rules as a floor under the model (:mod:`predictor.floor`): hard evidence alarms
whatever the model says, named among the reasons, live and in evaluation."""

from __future__ import annotations

import numpy as np
import pandas as pd

from predictor import baseline
from predictor.dataset import Dataset, replay
from predictor.features import FEATURE_NAMES, RULE_RECENT_S, RULES, compute
from predictor.floor import FLOOR_RULES, floor_hits, floor_kinds, floored
from predictor.model import RiskModel
from predictor.report import evaluate_dataset
from predictor.scoring import Scorer
from predictor.state import GpuWindowState, SampleBlock

T0 = 1_800_000_000_000


def _samples(minutes: int, pending_gpu: int | None) -> pd.DataFrame:
    rows = []
    for k in range(minutes):
        for gpu in range(4):
            rows.append(
                {
                    "ts_ms": T0 + k * 60_000,
                    "node": "n0",
                    "gpu": gpu,
                    "temp_gpu_c": 60.0,
                    "ecc_sbe_volatile": 0,
                    "remap_pending": 1 if gpu == pending_gpu and k >= minutes - 3 else 0,
                    "remap_failure": 0,
                    "pcie_link_width": 16,
                    "pcie_link_width_max": 16,
                }
            )
    return pd.DataFrame(rows)


def test_a_gpu_with_a_remap_pending_scores_at_least_the_floor_with_the_rule_named(
    tiny_model: RiskModel,
) -> None:
    scorer = Scorer(tiny_model)
    frame = _samples(30, pending_gpu=2)
    scorer.update(frame, None, now_ms=int(frame["ts_ms"].max()))
    out = scorer.score().set_index("gpu")
    worn = out.loc[2]
    assert worn["floor"] and worn["floor_kinds"] == ["memory"]
    assert worn["risk"] >= tiny_model.threshold and worn["alarm"]
    assert worn["risk"] >= worn["model_risk"]
    assert worn["reasons"][0] == "rule remap: row remap pending or failed (memory)"
    healthy = out.loc[[0, 1, 3]]
    assert not healthy["floor"].any()
    assert (healthy["risk"] == healthy["model_risk"]).all()
    assert not any(r.startswith("rule ") for rs in healthy["reasons"] for r in rs)


def test_each_rule_trips_on_its_own_evidence_and_names_its_kind() -> None:
    x = np.zeros((7, len(FEATURE_NAMES)), dtype=np.float32)
    x[:, FEATURE_NAMES.index("since_dbe_s")] = 7 * 86400
    x[:, FEATURE_NAMES.index("since_fatal_xid_s")] = 7 * 86400
    x[:, FEATURE_NAMES.index("since_link_down_s")] = 7 * 86400
    for c in ("since_xid_memory_s", "since_xid_nvlink_s", "since_xid_bus_s"):
        x[:, FEATURE_NAMES.index(c)] = 7 * 86400
    x[0, FEATURE_NAMES.index("since_dbe_s")] = 60
    x[1, FEATURE_NAMES.index("remap_failure")] = 1
    x[2, FEATURE_NAMES.index("retired_pages_pending")] = 1
    x[3, FEATURE_NAMES.index("since_fatal_xid_s")] = 60
    x[3, FEATURE_NAMES.index("since_xid_bus_s")] = 60
    x[4, FEATURE_NAMES.index("thermal_throttle_5m")] = 0.5
    x[5, FEATURE_NAMES.index("thermal_shutdown_1h")] = 0.9
    x[6, FEATURE_NAMES.index("since_link_down_s")] = 600
    hits = floor_hits(x)
    assert (hits == np.eye(len(FLOOR_RULES), dtype=bool)).all()
    kinds = floor_kinds(x, hits)
    assert kinds == [["memory"], ["memory"], ["memory"], ["pcie"], ["thermal"], ["thermal"],
                     ["nvlink"]]  # fmt: skip
    assert floor_hits(np.zeros((1, len(FEATURE_NAMES)))).sum() == 3  # DBE, Xid, link down now
    assert list(floored(np.array([0.1, 0.9]), np.array([True, True]), 0.5)) == [0.5, 0.9]


def test_with_the_floor_every_kind_is_caught_at_least_as_often_as_by_the_rules(
    tiny: Dataset, tiny_model: RiskModel
) -> None:
    """A model that never alarms on its own (threshold 1) plus the floor catches, kind by
    kind, what the rules catch; met live by the alarm budget, the model and the floor
    catch at least what the rules catch at their own setting and at the same false-alarm
    rate."""
    summary = evaluate_dataset(tiny, tiny_model, threshold=1.0, budget=2.0).summary
    rules = summary["baseline"]["by_kind"]
    assert sum(d["caught"] for d in rules.values()) > 0
    assert summary["model"]["caught"] == 0
    floor = summary["model_floor"]["by_kind"]
    for kind, d in rules.items():
        assert floor[kind]["caught"] >= d["caught"], kind
    assert summary["floor_kinds_below_rules"] == []
    for d in summary["floor_vs_rules_by_kind"].values():
        assert d["model_floor"] >= max(d["rules"], d["rules_at_rate"] or 0)


def _back_from_repair() -> tuple[pd.DataFrame, pd.DataFrame]:
    """GPU 0 of n0 fails of a double-bit error at minute 30 (the counters move with the
    failure, but it reports no more), is repaired, back in service at minute 150 reporting
    the DBE count of its failure, and shows a new DBE of its own at minute 200. GPU 1 is
    healthy throughout."""
    rows = []
    for k in range(240):
        for gpu in range(2):
            if gpu == 0 and 30 <= k < 150:
                continue  # failed, under repair
            failed_before = gpu == 0 and k >= 150
            rows.append(
                {
                    "ts_ms": T0 + k * 60_000,
                    "node": "n0",
                    "gpu": gpu,
                    "temp_gpu_c": 60.0,
                    "ecc_sbe_volatile": 0,
                    "ecc_dbe_volatile": 1 if gpu == 0 and k >= 200 else 0,  # reset at repair
                    "ecc_dbe_aggregate": (2 if failed_before else 0) + (gpu == 0 and k >= 200),
                    "remap_pending": 0,
                    "remap_failure": 0,
                    "pcie_link_width": 16,
                    "pcie_link_width_max": 16,
                }
            )
    events = pd.DataFrame(
        [
            {"ts_ms": T0 + 30 * 60_000, "node": "n0", "gpu": 0, "kind": "xid", "xid": 48},
            {"ts_ms": T0 + 150 * 60_000, "node": "n0", "gpu": 0, "kind": "gpu_recovered"},
            {"ts_ms": T0 + 150 * 60_000, "node": "n0", "gpu": 0, "kind": "counter_reset"},
        ]
    )
    events["xid"] = events["xid"].astype("Int64")
    return pd.DataFrame(rows), events


def _dbe_alarm_minutes(hits_at: dict[int, bool]) -> list[int]:
    return [k for k, hit in sorted(hits_at.items()) if hit]


def test_a_dbe_carried_over_a_repair_is_no_evidence_a_new_one_is(tiny_model: RiskModel) -> None:
    """Live: the DBE count of the failure, first read after the repair, raises no alarm;
    a DBE within the GPU's new life does (the dbe rule of the floor and of the baseline)."""
    samples, events = _back_from_repair()
    scorer = Scorer(tiny_model)
    floor_dbe, rule_dbe = {}, {}
    dbe = [r.name for r in FLOOR_RULES].index("dbe")
    for k in range(240):
        now = T0 + k * 60_000
        tick = samples[samples["ts_ms"] == now]
        ev = events[events["ts_ms"] == now]
        scorer.update(tick, ev if len(ev) else None, now_ms=now)
        if k < 150:
            continue
        x = scorer.features()
        floor_dbe[k] = bool(floor_hits(x)[0, dbe])
        rule_dbe[k] = bool(baseline.rule_hits(x)[0, RULES.index("dbe")])
        if k in (150, 199, 200):
            out = scorer.score().set_index("gpu")
            assert bool(out.loc[0, "floor"]) == (k == 200), k
            assert not out.loc[1, "floor"]
    assert _dbe_alarm_minutes(floor_dbe) == list(range(200, 240))
    assert floor_dbe == rule_dbe


def test_in_evaluation_a_dbe_carried_over_a_repair_is_no_evidence_either() -> None:
    """The replay that evaluation and lofo score (one step a minute, and ten minutes a step)
    reads the same evidence as the live scorer."""
    samples, events = _back_from_repair()
    block = SampleBlock.from_frame(samples.sort_values("ts_ms", kind="stable"))
    manifest = {"gpus": 2, "start_ms": T0 - 60_000, "end_ms": T0 + 240 * 60_000}
    fleet = Dataset("memory", manifest, block, events, pd.DataFrame())
    for step_s in (60.0, 600.0):
        since: dict[int, float] = {}

        def sink(now_ms: int, state: GpuWindowState, since: dict[int, float] = since) -> None:
            x = compute(state, now_ms)
            since[(now_ms - T0) // 60_000] = float(x[0, FEATURE_NAMES.index("since_dbe_s")])

        replay(fleet, sink, step_s=step_s)
        rule = {k: s <= RULE_RECENT_S for k, s in since.items() if k >= 150}
        assert _dbe_alarm_minutes(rule) == [k for k in rule if k >= 200], step_s
