"""Mechanism families: alternative shapes of each failure physics, and benign look-alikes.

A model trained on one shape of a physics learns that shape, not the physics. Training
fleets therefore draw the *shape* at random (``[shapes]`` in ``defaults.toml``), besides the
numbers of ``[ranges]``; a family is a name ``"<physics>:<shape>"`` (``"memory:bursts"``)
or ``"benign:<look-alike>"`` (``"benign:ecc_bursts"``), and every dataset's manifest lists
the families it was made with (``families``). Leave-one-family-out evaluation trains
without a family and judges on fleets made with it.

Failure shapes (the first of each is the default):

- ``memory``: ``ramp`` — corrected errors at a geometrically rising rate; ``bursts`` — the
  same mean rate arriving in self-exciting clusters (long quiet spells, then dozens at once);
- ``memory_remap``: when a remap stays pending — ``mid`` (the kind's
  ``remap_pending_from``), ``early``, ``late``, ``never``;
- ``thermal``: ``load`` — resistance grows quadratically, the die heats under load late;
  ``time`` — linear growth from the onset; ``step`` — a fan dies: flat, then a jump;
- ``nvlink`` / ``pcie``: ``smooth`` geometric growth or ``steps`` (the rate jumps at
  quarters of the lead);
- ``pcie_width``: when the link retrains to fewer lanes — ``mid``, ``early``, ``never``.

Benign look-alikes (:data:`BENIGN`): healthy GPUs that show what failing ones show.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import numpy as np

from forewarn.errors import InvalidInput

__all__ = ["BENIGN", "SHAPES", "draw", "families", "with_families"]

SHAPES: dict[str, tuple[str, ...]] = {
    "memory": ("ramp", "bursts"),
    "memory_remap": ("mid", "early", "late", "never"),
    "thermal": ("load", "time", "step"),
    "nvlink": ("smooth", "steps"),
    "pcie": ("smooth", "steps"),
    "pcie_width": ("mid", "early", "never"),
}
"""Physics -> its shapes, the default first."""

BENIGN: dict[str, dict[str, float]] = {
    # corrected-ECC bursts on healthy GPUs (a cosmic-ray shower, a marginal DIMM-like cell)
    "ecc_bursts": {"noise.sbe_rate_per_gpu_day": 0.6, "noise.sbe_burst_mean": 40.0},
    # a pending remap that clears at the next reset, and resets that clear it
    "remap_clears": {
        "noise.benign_remap_rate_per_gpu_day": 0.05,
        "noise.reboot_rate_per_node_day": 0.3,
    },
    # hot but healthy nodes: inlet air warm enough to throttle, for hours
    "hot_nodes": {
        "workload.hot_aisle_rate_per_node_day": 2.0,
        "workload.hot_aisle_rise_c": 16.0,
        "workload.hot_aisle_median_s": 5400.0,
    },
    # the board slows every GPU of a node for a while (power brake, chassis event)
    "node_slowdown": {"workload.node_slowdown_rate_per_node_day": 1.0},
    # application crashes: Xid 13/31/43 on every GPU of a job, often
    "app_xids": {"noise.app_xid_rate_per_node_day": 8.0},
    # reboots and driver reloads: counters reset
    "counter_resets": {"noise.reboot_rate_per_node_day": 1.0, "noise.reboot_median_s": 120.0},
    # collector gaps and stalls
    "gaps_stalls": {
        "sampling.missing_sample_prob": 0.05,
        "sampling.stall_rate_per_node_day": 2.0,
        "sampling.stall_median_s": 900.0,
    },
    # NVLink and PCIe retrains on healthy links: big CRC and replay bursts
    "link_retrains": {
        "noise.nvlink_crc_burst_rate_per_gpu_day": 3.0,
        "noise.nvlink_crc_burst_mean": 300.0,
        "noise.pcie_replay_burst_rate_per_gpu_day": 2.0,
        "noise.pcie_replay_burst_mean": 60.0,
    },
}
"""Benign look-alike -> the parameters it turns up."""


def all_families() -> list[str]:
    """Every family name: each shape of each physics, then each look-alike."""
    out = [f"{k}:{s}" for k, shapes in SHAPES.items() for s in shapes]
    return out + [f"benign:{b}" for b in BENIGN]


def families(params: dict[str, Any]) -> list[str]:
    """The families a parameter set makes (every physics' shape, the look-alikes on)."""
    shapes = params["shapes"]
    out = [f"{k}:{shapes[k]}" for k in SHAPES]
    return out + [f"benign:{b}" for b in sorted(shapes.get("benign", []))]


def _set(params: dict[str, Any], dotted: str, value: Any) -> None:
    node = params
    *parts, last = dotted.split(".")
    for part in parts:
        node = node[part]
    node[last] = value


def with_families(params: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """A copy of ``params`` with the families ``names`` (``"thermal:step"``,
    ``"benign:hot_nodes"``); physics not named keep their shape.

    Raises:
        InvalidInput: an unknown family.
    """
    out = copy.deepcopy(params)
    benign = set(out["shapes"].get("benign", []))
    for name in names:
        physics, _, shape = name.partition(":")
        if physics == "benign" and shape in BENIGN:
            benign.add(shape)
            for key, value in BENIGN[shape].items():
                _set(out, key, value)
        elif shape in SHAPES.get(physics, ()):
            out["shapes"][physics] = shape
        else:
            raise InvalidInput(f"unknown simulator family {name!r}", details={"family": name})
    out["shapes"]["benign"] = sorted(benign)
    return out


def draw(
    rng: np.random.Generator, exclude: Iterable[str] = (), benign_prob: float = 0.5
) -> list[str]:
    """A random shape per physics and each look-alike with ``benign_prob``, never one of
    ``exclude``.

    Raises:
        InvalidInput: every shape of a physics is excluded.
    """
    banned = set(exclude)
    out = []
    for physics, shapes in SHAPES.items():
        allowed = [s for s in shapes if f"{physics}:{s}" not in banned]
        if not allowed:
            raise InvalidInput(f"every shape of {physics} is excluded")
        out.append(f"{physics}:{allowed[int(rng.integers(len(allowed)))]}")
    for b in BENIGN:
        if f"benign:{b}" not in banned and rng.random() < benign_prob:
            out.append(f"benign:{b}")
    return out


def check(shapes: dict[str, Any]) -> None:
    """Refuse unknown shapes (``config.validate`` calls it)."""
    for physics, allowed in SHAPES.items():
        if shapes.get(physics) not in allowed:
            raise InvalidInput(f"invalid simulator parameter: shapes.{physics} in {allowed}")
    for b in shapes.get("benign", []):
        if b not in BENIGN:
            raise InvalidInput(f"invalid simulator parameter: shapes.benign {b!r}")
