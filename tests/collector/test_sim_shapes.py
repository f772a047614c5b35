"""Mechanism families: each shape of a physics and each benign look-alike is drawable, and a
dataset's manifest names the families it was made with."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forewarn.errors import InvalidInput
from sim import FleetModel, generate_dataset, load_params
from sim.shapes import BENIGN, SHAPES, all_families, draw, families, with_families


def test_default_families_and_overrides() -> None:
    p = load_params()
    assert families(p) == [f"{k}:{v[0]}" for k, v in SHAPES.items()]
    q = with_families(p, ["thermal:step", "benign:hot_nodes"])
    assert "thermal:step" in families(q) and "benign:hot_nodes" in families(q)
    assert q["workload"]["hot_aisle_rise_c"] == BENIGN["hot_nodes"]["workload.hot_aisle_rise_c"]
    assert families(p)[2] == "thermal:load"  # the original is untouched
    with pytest.raises(InvalidInput):
        with_families(p, ["thermal:melting"])
    with pytest.raises(InvalidInput):
        load_params(overrides={"shapes.memory": "sudden"})


def test_draw_never_picks_an_excluded_family() -> None:
    rng = np.random.default_rng(0)
    banned = {"memory:bursts", "thermal:step", "benign:ecc_bursts"}
    for _ in range(50):
        picked = draw(rng, exclude=banned)
        assert not banned & set(picked)
        assert len([f for f in picked if not f.startswith("benign:")]) == len(SHAPES)
    assert set(all_families()) >= {"memory:bursts", "benign:gaps_stalls"}


@pytest.mark.parametrize("family", [f for f in all_families() if not f.endswith(":ramp")])
def test_every_family_runs(family: str) -> None:
    p = with_families(load_params(overrides={"hazard.fleet_mttf_h": 0.05}), [family])
    m = FleetModel(16, p, seed=1)
    for i in range(30):
        m.step(60.0, 1_700_000_000_000 + i * 60_000)
    assert m.t == pytest.approx(1800.0)


def test_bursty_memory_errors_cluster_and_the_manifest_names_families(tmp_path) -> None:
    inj = [{"at_s": 0, "node": 0, "gpu": g, "kind": "memory", "lead_s": 36000} for g in range(8)]
    sbe = {}
    for shape in ("ramp", "bursts"):
        p = with_families(load_params(), [f"memory:{shape}"])
        info = generate_dataset(
            tmp_path / shape, gpus=8, days=0.4, interval_s=60.0, seed=2, params=p, injections=inj
        )
        assert f"memory:{shape}" in info.manifest["families"]
        s = pd.read_parquet(tmp_path / shape / "samples")
        inc = s.sort_values("ts_ms").groupby("gpu")["ecc_sbe_aggregate"].diff().dropna()
        sbe[shape] = inc.to_numpy(dtype=float)
    # the same order of errors, but bursts put them into fewer, bigger steps
    assert (sbe["bursts"] > 0).sum() < (sbe["ramp"] > 0).sum()
