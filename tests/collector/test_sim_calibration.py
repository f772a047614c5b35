"""Calibration of the fleet simulator: fleet MTTF, failure-kind mix, and the trace table."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from sim import FleetModel, load_params
from sim.calibration import Calibration, per_gpu_hazard_per_h, trace_mix

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "stepfun-fault-trace"


def test_per_gpu_rate_is_the_published_fleet_mttf() -> None:
    rate = per_gpu_hazard_per_h(load_params())
    assert rate == pytest.approx(1.2362e-4, rel=1e-3)
    assert 1.0 / (rate * 1024) == pytest.approx(7.9)


def test_year_of_1024_gpus_reproduces_mttf_and_mix() -> None:
    """400 simulated days of a 1,024-GPU fleet, in 4-hour ticks (failure times are drawn
    exactly; a tick only delays when they are processed).

    Tolerances: MTTF per in-service GPU-hour within 8 % of 7.9 h (about 1,100 incidents,
    Poisson sd 3 %); each kind's share within 4 binomial standard deviations of the mix.
    """
    params = load_params()
    model = FleetModel(1024, params, seed=11)
    dt, ticks, in_service_h = 4 * 3600.0, 400 * 6, 0.0
    for k in range(ticks):
        model.step(dt, k * int(dt * 1000))
        in_service_h += float(model.up.sum()) * dt / 3600
    incidents: dict[int, str] = {}
    for f in model.failures:
        incidents.setdefault(f["incident_id"], f["kind"])
    n = len(incidents)
    assert n > 900
    mttf_h = in_service_h / 1024 / n
    assert mttf_h == pytest.approx(7.9, rel=0.08)
    wall_mttf_h = ticks * dt / 3600 / n
    assert 7.9 <= wall_mttf_h < 7.9 * 1.12  # repairs take GPUs out of service for a while
    seen = Counter(incidents.values())
    for kind, share in Calibration(params).kind_mix().items():
        sd = math.sqrt(share * (1 - share) / n)
        assert abs(seen[kind] / n - share) <= 4 * sd + 1e-9, (kind, seen[kind] / n, share)
    # Lemon nodes are repeat offenders: about lemon_hazard_multiplier times the others' rate.
    lemons = {model.node_names[i] for i in range(model.nodes) if model.lemon[i]}
    assert lemons
    on_lemon = sum(f["node"] in lemons for f in model.failures)
    share = len(lemons) / model.nodes
    ratio = (on_lemon / share) / ((len(model.failures) - on_lemon) / (1 - share))
    assert 5.0 < ratio < 20.0, ratio
    # Node-scope incidents take every GPU of the node that was in service.
    node_rows = Counter(f["incident_id"] for f in model.failures if f["scope"] == "node")
    assert node_rows and max(node_rows.values()) == 8


def test_precursor_share_follows_the_parameters() -> None:
    params = load_params()
    cal = Calibration(params)
    mix = cal.kind_mix()
    expected = sum(mix[k] * params["kinds"][k]["precursor_prob"] for k in mix)
    assert 0.3 < expected < 0.5  # most failures of the mix can be seen coming, not all
    for kind in ("power_loss", "gpu_lost", "other"):
        assert params["kinds"][kind]["precursor_prob"] == 0.0


@pytest.mark.skipif(not TRACE.exists(), reason="reference data not present")
def test_trace_table_matches_the_stepfun_trace() -> None:
    table = trace_mix(TRACE)
    params = load_params()
    listed = {(e["class"], e["desc"]): e for e in params["trace_classes"]}
    assert set(listed) == set(table)  # every hardware class is mapped, none invented
    for key, entry in listed.items():
        assert entry["trace_count"] == table[key]["count"], key
        assert entry["repair_median_s"] == pytest.approx(table[key]["repair_median_s"], abs=60)
    killing = sum(e["trace_count"] for e in listed.values() if e["kills_job"])
    assert killing == 293  # 298 hardware faults less 5 that do not stop a job
