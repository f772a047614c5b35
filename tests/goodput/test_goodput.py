"""forewarn goodput: the trace replay, the strategies' arithmetic and the command."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from goodput.compare import Scenario, compare
from goodput.costs import (
    GROUP_FORMATION_PATH,
    PREVENTIVE_STALL_PATH,
    group_formation,
    group_formation_s,
    preventive_stall,
)
from goodput.layouts import LAYOUTS, simulate_layout
from goodput.model import Assumptions, Outcome, simulate
from goodput.profile import DEFAULT_PROFILE, KINDS, PredictorProfile, find_card, from_card
from goodput.published import PUBLISHED_MIN, run_sanity_check
from goodput.schedule import Failure, fleet_schedule, job_mttf_h, trace_classes, trace_schedule
from goodput.trace import derive, find_trace_dir, load

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0
NO_ALARMS = replace(DEFAULT_PROFILE, false_alarms_per_1000_gpu_days=0.0)
CATCH_ALL = replace(NO_ALARMS, recall=dict.fromkeys(KINDS, 1.0))
CATCH_NONE = replace(NO_ALARMS, recall=dict.fromkeys(KINDS, 0.0))


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng(list(seed))


# -- the trace --------------------------------------------------------------------------------


def test_shipped_trace_parses() -> None:
    faults, source = load()
    assert "shipped" in source
    assert len(faults) == 584
    assert sum(f.level == "Hardware Failure" for f in faults) == 298
    assert all(0 <= f.node < 400 and 0 <= f.start_day <= 349 for f in faults)
    assert all(f.end_day is None or f.end_day >= f.start_day for f in faults)


def test_shipped_trace_is_derived_from_the_original(tmp_path: Path) -> None:
    original = find_trace_dir(ROOT)
    if original is None:
        pytest.skip("the original StepFun trace is not beside this checkout")
    shipped = ROOT / "goodput" / "data" / "stepfun_faults.tsv"
    if os.environ.get("WRITE_FIXTURE") == "1":
        derive(original, shipped)
    derive(original, tmp_path / "t.tsv")
    assert (tmp_path / "t.tsv").read_text() == shipped.read_text()
    assert load(original)[0] == load()[0]


def test_trace_replay_on_the_whole_trace_cluster_is_the_trace() -> None:
    faults, _ = load()
    classes = trace_classes()
    stopping = sorted(
        f.start_day * DAY
        for f in faults
        if f.level == "Hardware Failure" and (f.cls, f.desc) in classes
    )
    schedule = trace_schedule(faults, 3200, 349 * DAY, _rng(0))  # 400 nodes: all of them
    assert [f.t_s for f in schedule] == pytest.approx(stopping)
    assert {f.kind for f in schedule} <= set(KINDS)


def test_trace_replay_scales_with_the_cluster() -> None:
    faults, _ = load()
    full = len(trace_schedule(faults, 3200, 349 * DAY, _rng(0)))
    small = np.mean([len(trace_schedule(faults, 1024, 349 * DAY, _rng(s))) for s in range(20)])
    big = len(trace_schedule(faults, 16384, 349 * DAY, _rng(0)))
    assert small == pytest.approx(full * 128 / 400, rel=0.15)
    assert big == pytest.approx(full * 2048 / 400, rel=0.1)
    # a window twice the trace replays it twice
    assert len(trace_schedule(faults, 3200, 2 * 349 * DAY, _rng(0))) == 2 * full


def test_fleet_schedule_follows_the_published_mttf() -> None:
    # Meta FAIR, HPCA 2025: 7.9 h at 1,024 GPUs, 1.8 h at 16,384 (not 0.49 h, the linear
    # extrapolation of a constant per-GPU rate), about 14 min at 131,072.
    assert job_mttf_h(1024) == pytest.approx(7.9)
    assert job_mttf_h(16384) == pytest.approx(1.8)
    assert job_mttf_h(131072) == pytest.approx(14 / 60)
    assert job_mttf_h(1024) > job_mttf_h(4096) > job_mttf_h(16384)
    assert len(fleet_schedule(16384, 2000 * 3600.0, _rng(2))) == pytest.approx(2000 / 1.8, rel=0.1)
    schedule = fleet_schedule(1024, 2000 * 3600.0, _rng(1))
    assert len(schedule) == pytest.approx(2000 / 7.9, rel=0.2)
    assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(schedule))


# -- the strategies ---------------------------------------------------------------------------


def test_checkpoint_restart_without_failures_pays_only_saves() -> None:
    a = Assumptions(ckpt_interval_s=3000.0, ckpt_save_s=60.0)
    out = simulate("checkpoint-restart", [], a, gpus=8, rng=_rng(0), work_s=30000.0)
    assert out.wall_s == pytest.approx(30000.0 + 9 * 60.0)  # no save after the last interval
    window = simulate("checkpoint-restart", [], a, gpus=8, rng=_rng(0), horizon_s=30600.0)
    assert window.ettr == pytest.approx(30000.0 / 30600.0)


def test_checkpoint_restart_loses_the_work_since_the_last_save() -> None:
    a = Assumptions(ckpt_interval_s=1000.0, ckpt_save_s=100.0, restart_s=500.0)
    # 2 saves done by t=2200, failure at 2600: 400 s of training rolled back, 500 s restart.
    out = simulate(
        "checkpoint-restart",
        [Failure(2600.0, "memory", "gpu")],
        a,
        gpus=8,
        rng=_rng(0),
        work_s=5000.0,
    )
    assert out.lost_s["work rolled back"] == pytest.approx(400.0)
    assert out.lost_s["restart"] == pytest.approx(500.0)
    assert out.wall_s == pytest.approx(2600.0 + 500.0 + 3000.0 + 2 * 100.0)


def test_peer_replica_loses_at_most_the_step_in_flight() -> None:
    a = Assumptions(wrapper_overhead=0.0, migrating_ckpt_interval_s=None, step_s=10.0)
    failures = [Failure(1000.0 * i, "power_loss", "node") for i in range(1, 11)]
    out = simulate("peer-replica", failures, a, gpus=8, rng=_rng(0), work_s=20000.0)
    assert out.replica_recoveries == 10 and out.at_most_one_step_share == 1.0
    assert 0 < out.lost_s["step in flight"] <= 10 * 10.0
    assert out.wall_s == pytest.approx(
        20000.0 + 10 * a.replica_recovery_s(8) + out.lost_s["step in flight"]
    )


def test_same_seed_same_result_and_another_seed_differs() -> None:
    scenario = Scenario(gpus=(1024,), sources=("fleet", "trace"), days=60.0, seed=3)
    faults, _ = load()
    first = compare(scenario, Assumptions(), DEFAULT_PROFILE, faults)
    again = compare(scenario, Assumptions(), DEFAULT_PROFILE, faults)
    other = compare(replace(scenario, seed=4), Assumptions(), DEFAULT_PROFILE, faults)
    assert [r.as_dict() for r in first] == [r.as_dict() for r in again]
    assert [r.ettr for r in first] != [r.ettr for r in other]


@pytest.mark.parametrize("strategy", ["checkpoint-restart", "peer-replica", "forewarn"])
def test_more_failures_lower_ettr(strategy: str) -> None:
    a, horizon = Assumptions(ckpt_interval_s=1800.0), 60 * DAY
    ettr = {}
    for gpus in (1024, 4096):
        ettr[gpus] = np.mean(
            [
                simulate(
                    strategy,
                    fleet_schedule(gpus, horizon, _rng(s)),
                    a,
                    gpus=gpus,
                    rng=_rng(s, 1),
                    profile=DEFAULT_PROFILE,
                    horizon_s=horizon,
                ).ettr
                for s in range(5)
            ]
        )
    assert ettr[4096] < ettr[1024] < 1.0


def test_forewarn_never_below_peer_replica_when_it_catches_failures() -> None:
    a, horizon = Assumptions(), 90 * DAY
    failures = fleet_schedule(4096, horizon, _rng(5))
    kwargs = {"gpus": 4096, "horizon_s": horizon}
    replica = simulate("peer-replica", failures, a, rng=_rng(9), **kwargs)
    none = simulate("forewarn", failures, a, rng=_rng(9), profile=CATCH_NONE, **kwargs)
    some = simulate("forewarn", failures, a, rng=_rng(9), profile=NO_ALARMS, **kwargs)
    every = simulate("forewarn", failures, a, rng=_rng(9), profile=CATCH_ALL, **kwargs)
    assert none.ettr == pytest.approx(replica.ettr)  # recall 0: the replica path exactly
    assert replica.ettr < some.ettr < every.ettr
    assert 0 < some.no_loss_share < 1 and every.no_loss_share == 1.0


def test_false_alarms_cost_one_migration_each() -> None:
    a, horizon = Assumptions(), 30 * DAY
    noisy = replace(CATCH_NONE, false_alarms_per_1000_gpu_days=100.0)
    out = simulate("forewarn", [], a, gpus=1000, rng=_rng(0), profile=noisy, horizon_s=horizon)
    assert out.false_alarms == pytest.approx(100 * 30, rel=0.1)
    assert out.lost_s["false alarm"] == pytest.approx(out.false_alarms * a.migration_pause_s(1000))


# -- the predictor's figures ------------------------------------------------------------------


def test_profile_from_the_model_card() -> None:
    card = find_card(ROOT / "goodput" / "x")
    if card is None:
        pytest.skip("no model card in models/")
    profile = from_card(card)
    assert set(profile.recall) == set(KINDS)
    assert all(0.0 <= r <= 1.0 for r in profile.recall.values())
    for kind in ("power_loss", "gpu_lost", "other"):  # no warning, never caught
        assert profile.recall[kind] == 0.0 and profile.lead_median_s[kind] is None
    assert profile.false_alarms_per_1000_gpu_days > 0


def test_profile_pools_held_out_sets(tmp_path: Path) -> None:
    by_kind = {"memory": {"failures": 4, "caught": 3, "lead_time_median_s": 600.0}}
    card = {
        "format": "forewarn-model",
        "metrics": {
            "validation": {"model": {"by_kind": by_kind, "false_alarms_per_1000_gpu_days": 1.0}},
            "evaluation": {
                "x": {
                    "model": {
                        "by_kind": {"memory": {"failures": 6, "caught": 1}},
                        "false_alarms_per_1000_gpu_days": 2.5,
                    }
                },
                "sicker": {  # early alarms (the GPU failed within a day) cost no pause for nothing
                    "model": {
                        "by_kind": {},
                        "false_alarms_per_1000_gpu_days": 9.0,
                        "false_alarms_not_early_per_1000_gpu_days": 2.0,
                    }
                },
            },
        },
    }
    (tmp_path / "m.json").write_text(json.dumps(card))
    profile: PredictorProfile = from_card(tmp_path)
    assert profile.recall["memory"] == pytest.approx(0.4)
    assert profile.lead_median_s["memory"] == 600.0
    assert profile.false_alarms_per_1000_gpu_days == 2.5
    with pytest.raises(ValueError):
        profile.with_recall({"cosmic_ray": 1.0})


# -- the published comparison and the command -------------------------------------------------


def test_sanity_check_reproduces_the_published_shape() -> None:
    result = run_sanity_check(seeds=6)
    ratios = result.ratios()
    live = result.minutes["live migration"][0]
    assert live == pytest.approx(PUBLISHED_MIN["live migration"], rel=0.05)
    assert 1.6 < ratios["checkpoint-restart"] < 2.4
    assert ratios["peer-replica"] == pytest.approx(930 / 405, rel=0.05)
    assert ratios["checkpoint-restart"] < ratios["peer-replica"]


@pytest.mark.timeout(180)
def test_command_prints_assumptions_table_and_png(tmp_path: Path) -> None:
    png = tmp_path / "g.png"
    cmd = [
        sys.executable,
        "-m",
        "forewarn",
        "goodput",
        "--gpus",
        "1024",
        "--days",
        "30",
        "--sanity-seeds",
        "2",
        "--png",
        str(png),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=True).stdout
    for text in (
        "Assumptions",
        "restart_s",
        "false alarms",
        "checkpoint-restart",
        "peer-replica",
        "forewarn",
        "Sanity check, 64xH200",
        "published   818",
    ):
        assert text in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_command_json(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "forewarn",
        "goodput",
        "--gpus",
        "1024",
        "2048",
        "--days",
        "20",
        "--json",
        "--no-png",
        "--sanity-seeds",
        "0",
        "--trace",
        str(ROOT / "goodput" / "data" / "stepfun_faults.tsv"),
    ]
    doc = json.loads(
        subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=True).stdout
    )
    assert len(doc["rows"]) == 2 * 2 * 3
    assert {r["strategy"] for r in doc["rows"]} == {
        "checkpoint-restart",
        "peer-replica",
        "forewarn",
    }
    assert all(0 < r["ettr"] <= 1 for r in doc["rows"])
    assert doc["assumptions"]["restart_s"] == 900.0 and doc["sanity_64xh200"] is None
    assert math.isclose(doc["fleet_model_mttf_h"]["1024"], 7.9)


# -- layouts and measured costs ---------------------------------------------------------------


def test_each_layout_has_its_own_strategies() -> None:
    assert LAYOUTS["ddp"].strategies == ("checkpoint-restart", "peer-replica", "forewarn")
    assert LAYOUTS["hsdp"].strategies == ("checkpoint-restart", "peer-replica", "forewarn")
    assert LAYOUTS["sharded"].strategies == ("checkpoint-restart", "forewarn")
    assert LAYOUTS["peer-copy"].strategies == ("checkpoint-restart", "peer-copy", "forewarn")
    a = Assumptions(rank_state_gb=16.0, shard_ranks=8)
    assert LAYOUTS["ddp"].assumptions(a).rank_state_gb == 16.0
    assert LAYOUTS["hsdp"].assumptions(a).rank_state_gb == 2.0


def _layout_run(layout: str, strategy: str, profile: PredictorProfile, **a: float) -> Outcome:
    horizon = 60 * DAY
    failures = fleet_schedule(16384, horizon, _rng(11))
    return simulate_layout(
        LAYOUTS[layout],
        strategy,
        failures,
        Assumptions(**a),  # type: ignore[arg-type]
        gpus=16384,
        rng=_rng(4),
        profile=profile,
        horizon_s=horizon,
        mttf_s=horizon / len(failures),
    )


def test_without_a_replica_a_missed_failure_is_a_restart_and_a_caught_one_a_pause() -> None:
    restart = _layout_run("sharded", "checkpoint-restart", CATCH_NONE)
    blind = _layout_run("sharded", "forewarn", CATCH_NONE)
    seeing = _layout_run("sharded", "forewarn", CATCH_ALL)
    # Recall 0: every failure restarts from the last checkpoint, as checkpoint-restart.
    assert blind.restarts == restart.restarts == blind.failures > 0
    assert blind.ettr == pytest.approx(restart.ettr, abs=0.005)
    assert blind.no_loss_share == 0.0
    # Recall 1: nothing is rolled back or restarted; the YOCO ratio is 1.
    assert seeing.restarts == 0 and seeing.no_loss_share == 1.0
    assert "work rolled back" not in seeing.lost_s and seeing.ettr > restart.ettr + 0.05


def test_peer_copy_replays_up_to_k_steps_and_pays_its_copies() -> None:
    out = _layout_run("peer-copy", "peer-copy", CATCH_NONE, step_s=2.0, peer_copy_every_steps=10)
    assert out.replica_recoveries == out.failures > 0
    assert 0 < out.lost_s["steps replayed from the copy"] <= out.failures * 10 * 2.0
    assert out.at_most_one_step_share == 0.0  # a replay is more than the step in flight
    cheap = _layout_run("peer-copy", "peer-copy", CATCH_NONE, step_s=2.0, peer_copy_overhead=0.0)
    assert cheap.ettr > out.ettr


def test_the_group_formation_cost_is_the_measured_rule() -> None:
    rule = group_formation()
    doc = json.loads(GROUP_FORMATION_PATH.read_text())
    assert doc["benchmark"] == "benchmarks/group_formation.py"
    assert rule.measured_ranks == (2, 4, 8, 16) and rule.b_s_per_rank > 0
    for ranks, figures in doc["by_ranks"].items():
        fitted = rule.at(int(ranks))
        measured = figures["formation_median_s"]
        assert fitted == pytest.approx(measured, rel=doc["fit"]["max_relative_residual"] + 1e-9)
    a = Assumptions()
    assert a.regroup_s is None and a.regroup_at(16384) == pytest.approx(rule.at(16384))
    # A preventive move's group is formed ahead, while training goes on: its stall is the
    # transfer and the switch at every size; an unplanned recovery still forms it in the stall.
    assert a.migration_pause_s(16384) == a.migration_pause_s(1024) == a.migration_pause_s()
    assert a.replica_recovery_s(16384) - a.replica_recovery_s(1024) == pytest.approx(
        rule.at(16384) - rule.at(1024)
    )
    at_switch = Assumptions(formation_at_switch=True)
    assert at_switch.migration_pause_s(16384) - at_switch.migration_pause_s(1024) == pytest.approx(
        rule.at(16384) - rule.at(1024)
    )
    assert Assumptions(regroup_s=10.0).regroup_at(16384) == 10.0
    with pytest.raises(ValueError):
        at_switch.migration_pause_s()  # the measured rule needs the job's size


@pytest.mark.timeout(180)
def test_command_layouts_json() -> None:
    cmd = [sys.executable, "-m", "forewarn", "goodput", "--gpus", "1024", "--days", "20"]
    cmd += ["--layout", "ddp", "hsdp", "sharded", "peer-copy", "--json", "--no-png"]
    cmd += ["--sanity-seeds", "0", "--trace", str(ROOT / "goodput" / "data" / "stepfun_faults.tsv")]
    doc = json.loads(
        subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=True).stdout
    )
    got = {(r["source"], r["layout"], r["strategy"]) for r in doc["rows"]}
    for source in ("fleet", "trace"):
        for name, layout in LAYOUTS.items():
            assert {(source, name, s) for s in layout.strategies} <= got
    assert len(doc["rows"]) == 2 * sum(len(x.strategies) for x in LAYOUTS.values())
    assert doc["group_formation"]["at"]["1024"] == pytest.approx(group_formation_s(1024))


def test_a_preventive_moves_stall_is_the_measured_transfer_and_switch() -> None:
    """The default charges a preventive move the stall measured with the next generation
    formed ahead (benchmarks/migration.py --parts f), never the group formation."""
    doc = json.loads(PREVENTIVE_STALL_PATH.read_text())
    assert doc["benchmark"] == "benchmarks/migration.py --parts f" and doc["ranks"] == 4
    runs = [run for row in doc["rows"] for run in row["ahead"]]
    assert len(runs) >= 6 and all(run["preformed"] for run in runs)
    per_transfer, fixed_s = preventive_stall()
    a = Assumptions()
    assert a.pause_per_transfer == pytest.approx(per_transfer, abs=0.01)
    assert a.pause_fixed_s == pytest.approx(fixed_s, abs=0.005)
    transfer = a.rank_state_gb / a.transfer_gb_s
    assert a.migration_pause_s(16384) == pytest.approx(per_transfer * transfer + fixed_s, abs=0.02)
