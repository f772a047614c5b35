"""Simulator parameters: the defaults file, overrides, validation and randomised draws.

Every parameter lives in ``sim/defaults.toml``. A parameter set is a plain nested
dict (what TOML gives), so that it can be written into a dataset manifest as it is and read
back to regenerate the same fleet. Overrides may change values but never add keys: a typo in
an override file must fail loudly, not silently keep the default.

``randomised(seed)`` draws a parameter set over the documented ``[ranges]`` so that a
predictor can be trained on many fleets rather than on one set of exact lead times, noise
levels and sampling periods.
"""

from __future__ import annotations

import copy
import math
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from forewarn.errors import InvalidInput

__all__ = [
    "FAILURE_KINDS",
    "TELEMETRY_COLLAPSE",
    "Params",
    "default_params",
    "get",
    "load_params",
    "randomised",
]

Params = dict[str, Any]

TELEMETRY_COLLAPSE: dict[str, Any] = {
    "kinds.gpu_lost.collapse": True,
    "kinds.gpu_lost.precursor_prob": 0.7,
    "kinds.gpu_lost.lead_median_s": 1200.0,
    "kinds.gpu_lost.lead_sigma": 0.5,
}
"""Overrides that turn on the failure mode "detachment preceded by telemetry collapse": 70 %
of the GPUs that fall off the bus show it, over about 20 min (``forewarn simulate
--telemetry-collapse``; ``generate_dataset(params=TELEMETRY_COLLAPSE)``)."""

FAILURE_KINDS: tuple[str, ...] = (
    "memory",
    "thermal",
    "nvlink",
    "pcie",
    "power_loss",
    "gpu_lost",
    "other",
)
"""The ground-truth failure kinds of ``failures.parquet``."""

_DEFAULTS: Params | None = None


def default_params() -> Params:
    """A fresh copy of the defaults in ``defaults.toml``."""
    global _DEFAULTS
    if _DEFAULTS is None:
        text = resources.files("sim").joinpath("defaults.toml").read_text("utf-8")
        _DEFAULTS = tomllib.loads(text)
    return copy.deepcopy(_DEFAULTS)


def _merge(base: Params, over: Mapping[str, Any], path: str) -> None:
    for key, value in over.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in base:
            raise InvalidInput(f"unknown simulator parameter {where!r}", details={"key": where})
        if isinstance(base[key], dict):
            if not isinstance(value, Mapping):
                raise InvalidInput(f"simulator parameter {where!r} must be a table")
            if key in ("app_xid_mix",):
                base[key] = {str(k): v for k, v in value.items()}
            else:
                _merge(base[key], value, where)
        else:
            base[key] = copy.deepcopy(value)


def _dotted(overrides: Mapping[str, Any]) -> Params:
    """Turn ``{"kinds.memory.lead_median_s": 60}`` into nested dicts (nested ones pass)."""
    nested: Params = {}
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, Mapping) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]].update(value)
        else:
            node[parts[-1]] = value
    return nested


def load_params(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Params:
    """The defaults, then the TOML file at ``path``, then ``overrides`` (dotted keys allowed).

    Raises:
        InvalidInput: an unknown key, a value of the wrong kind or out of range.
    """
    params = default_params()
    if path is not None:
        try:
            with open(path, "rb") as fh:
                from_file = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidInput(f"cannot read simulator parameters {path}: {exc}") from exc
        _merge(params, from_file, "")
    if overrides:
        _merge(params, _dotted(overrides), "")
    validate(params)
    return params


def get(params: Params, dotted: str) -> Any:
    node: Any = params
    for part in dotted.split("."):
        node = node[part]
    return node


def _set(params: Params, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = params
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value


def validate(params: Params) -> None:
    """Refuse a parameter set the model cannot run (negative rates, probabilities above 1)."""

    def check(ok: bool, what: str) -> None:
        if not ok:
            raise InvalidInput(f"invalid simulator parameter: {what}")

    fleet, sampling, hazard = params["fleet"], params["sampling"], params["hazard"]
    check(1 <= int(fleet["gpus_per_node"]) <= 64, "fleet.gpus_per_node in [1, 64]")
    check(0.0 <= fleet["lemon_node_fraction"] <= 1.0, "fleet.lemon_node_fraction in [0, 1]")
    check(fleet["lemon_hazard_multiplier"] >= 1.0, "fleet.lemon_hazard_multiplier >= 1")
    check(0.0 < sampling["interval_s"] <= 3600.0, "sampling.interval_s in (0, 3600]")
    check(0.0 <= sampling["missing_sample_prob"] < 1.0, "sampling.missing_sample_prob in [0,1)")
    check(hazard["fleet_mttf_h"] > 0 and hazard["reference_gpus"] > 0, "hazard.* > 0")
    for section in ("noise", "workload"):
        for key, value in params[section].items():
            if key.endswith(("_per_gpu_day", "_per_node_day", "_s", "_mean")):
                check(float(value) >= 0.0, f"{section}.{key} >= 0")
    for kind in FAILURE_KINDS:
        spec = params["kinds"][kind]
        check(0.0 <= spec["precursor_prob"] <= 1.0, f"kinds.{kind}.precursor_prob in [0, 1]")
        check(spec["lead_median_s"] >= 0 and spec["lead_sigma"] >= 0, f"kinds.{kind}.lead >= 0")
        if spec["precursor_prob"] > 0:
            check(spec["lead_median_s"] > 0, f"kinds.{kind}.lead_median_s > 0 with precursors")
    total = 0.0
    for entry in params["trace_classes"]:
        check(entry["kind"] in FAILURE_KINDS, f"trace class kind {entry['kind']!r}")
        check(entry["scope"] in ("gpu", "node"), f"trace class scope {entry['scope']!r}")
        check(entry["trace_count"] >= 0, "trace class trace_count >= 0")
        if entry["kills_job"]:
            total += entry["trace_count"]
    check(total > 0, "at least one trace class that kills a job")
    check(sum(params["noise"]["app_xid_mix"].values()) > 0, "noise.app_xid_mix not empty")
    slow = params["slowdowns"]
    check(slow["rate_per_gpu_day"] >= 0, "slowdowns.rate_per_gpu_day >= 0")
    check(slow["duration_median_s"] > 0, "slowdowns.duration_median_s > 0")
    check(slow["duration_sigma"] >= 0, "slowdowns.duration_sigma >= 0")
    kinds = ("thermal", "power_cap", "power_brake", "pcie")
    check(all(slow[k]["weight"] >= 0 for k in kinds), "slowdowns.<kind>.weight >= 0")
    check(sum(slow[k]["weight"] for k in kinds) > 0, "a slowdowns.<kind>.weight above 0")
    for k in ("thermal", "power_cap", "power_brake"):
        check(0.0 < slow[k]["clock_frac"] <= 1.0, f"slowdowns.{k}.clock_frac in (0, 1]")
    check(slow["pcie"]["factor"] >= 1.0, "slowdowns.pcie.factor >= 1")
    check(1 <= slow["pcie"]["width"] <= params["fleet"]["pcie_link_width_max"], "pcie width")
    check(1 <= slow["pcie"]["gen"] <= params["fleet"]["pcie_link_gen"], "slowdowns.pcie.gen")
    from sim.shapes import check as check_shapes

    check_shapes(params["shapes"])


def randomised(seed: int, base: Params | None = None) -> Params:
    """A parameter set with every ``[ranges]`` entry drawn from its range, from ``seed``.

    The same seed gives the same set. Parameters without a range keep their value in
    ``base`` (the defaults if None); the calibration (hazard, failure mix) is never drawn.
    """
    params = copy.deepcopy(base) if base is not None else default_params()
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5EED]))
    for dotted in sorted(params["ranges"]):
        spec = params["ranges"][dotted]
        if "choice" in spec:
            choices = list(spec["choice"])
            value: Any = choices[int(rng.integers(len(choices)))]
        elif "log" in spec:
            lo, hi = spec["log"]
            value = float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        else:
            lo, hi = spec["lin"]
            value = float(rng.uniform(lo, hi))
        _set(params, dotted, value)
    validate(params)
    return params
