"""Simulator parameters: defaults, overrides, randomised draws; counters across any of them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forewarn.errors import InvalidInput
from sim import FleetModel, default_params, load_params, randomised
from sim.config import get
from sim.fleet import PERSISTENT, VOLATILE


def test_overrides_change_values_never_add_keys(tmp_path: Path) -> None:
    p = load_params(overrides={"kinds.memory.lead_median_s": 60.0, "sampling": {"interval_s": 5}})
    assert p["kinds"]["memory"]["lead_median_s"] == 60.0 and p["sampling"]["interval_s"] == 5
    assert p["kinds"]["memory"]["lead_sigma"] == default_params()["kinds"]["memory"]["lead_sigma"]
    with pytest.raises(InvalidInput, match="unknown simulator parameter"):
        load_params(overrides={"kinds.memory.lead_median": 60.0})
    with pytest.raises(InvalidInput):
        load_params(overrides={"kinds.memory.precursor_prob": 1.5})
    f = tmp_path / "p.toml"
    f.write_text("[sampling]\nmissing_sample_prob = 0.05\n")
    assert load_params(f)["sampling"]["missing_sample_prob"] == 0.05
    f.write_text("[sampling\n")
    with pytest.raises(InvalidInput):
        load_params(f)


def test_randomised_is_reproducible_and_within_ranges() -> None:
    a, b, c = randomised(1), randomised(1), randomised(2)
    assert a == b and a != c
    for dotted, spec in default_params()["ranges"].items():
        value = get(a, dotted)
        if "choice" in spec:
            assert value in spec["choice"]
        else:
            lo, hi = spec.get("lin", spec.get("log"))
            assert lo <= value <= hi, dotted
    # The calibration is never drawn.
    assert a["hazard"] == default_params()["hazard"]
    assert a["trace_classes"] == default_params()["trace_classes"]
    draws = [randomised(s)["kinds"]["memory"]["lead_median_s"] for s in range(200)]
    logs = np.log(draws)
    assert logs.min() < math.log(7200) and logs.max() > math.log(43200)  # spans its range


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_counters_only_fall_at_a_reset_whatever_the_parameters(seed: int) -> None:
    params = randomised(
        seed,
        load_params(
            overrides={
                "hazard.fleet_mttf_h": 0.02,
                "hazard.repair_time_scale": 0.001,
                "noise.reboot_rate_per_node_day": 20.0,
            }
        ),
    )
    model = FleetModel(16, params, seed=seed, speed=5.0)
    last: dict[str, np.ndarray] = {}
    dt = float(params["sampling"]["interval_s"])
    for k in range(300):
        tick = model.step(dt, k * int(dt * 1000))
        reset = np.zeros(model.g, dtype=bool)
        for ev in tick.events:
            if ev[3] == "counter_reset":
                reset[ev[1] * model.gpn + ev[2]] = True
        for name in VOLATILE + PERSISTENT:
            now = tick.columns[name]
            if name in last:
                fell = now < last[name]
                assert not (fell & ~reset).any(), name
                if name in PERSISTENT:
                    assert not fell.any(), name
            last[name] = now
        assert (tick.columns["temp_gpu_c"] < 130).all() and (tick.columns["power_w"] >= 0).all()
