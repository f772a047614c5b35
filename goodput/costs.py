"""Measured costs the comparison uses instead of assumptions: forming a process group, and
the stall of a preventive move.

Every move of a rank (preventive, planned, a recovery) forms a new process-group
generation over all the job's ranks. A preventive or planned move forms it while training
goes on (the migrator agrees on the handover step once it is formed), so only an unplanned
recovery has it in its stall; a preventive move's stall is the transfer and the switch,
measured by ``benchmarks/migration.py --parts f --write-stall
goodput/data/preventive_stall.json`` (4 ranks, loopback) and fitted as
``stall = per_transfer x bytes/bandwidth + fixed_s`` (:func:`preventive_stall`).

``benchmarks/group_formation.py --write goodput/data/group_formation.json`` measures how
long forming a generation takes against the number of ranks (gloo, real processes, one
host) and fits the scaling rule kept beside the figures:

    formation_s(ranks) = a_s + b_s_per_rank x ranks        (least squares on the medians)

:func:`group_formation_s` evaluates that rule at a job's size. It is an extrapolation: the
figures come from 2-16 processes on loopback, the rule is linear in ranks (each gloo rank
connects to every other), and an NCCL communicator over thousands of GPUs on a real network
is not measured here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "GROUP_FORMATION_PATH",
    "PREVENTIVE_STALL_PATH",
    "GroupFormation",
    "group_formation",
    "group_formation_s",
    "preventive_stall",
]

GROUP_FORMATION_PATH = Path(__file__).with_name("data") / "group_formation.json"
PREVENTIVE_STALL_PATH = Path(__file__).with_name("data") / "preventive_stall.json"


def preventive_stall(path: Path = PREVENTIVE_STALL_PATH) -> tuple[float, float]:
    """(per_transfer, fixed_s) of a preventive move's measured stall, g+1 formed ahead."""
    fit = json.loads(path.read_text())["fit"]
    return float(fit["per_transfer"]), float(fit["fixed_s"])


@dataclass(frozen=True)
class GroupFormation:
    """The fitted rule and where it comes from."""

    a_s: float
    b_s_per_rank: float
    measured_ranks: tuple[int, ...]
    source: str

    def at(self, ranks: int) -> float:
        """Seconds to form one generation of ``ranks`` ranks (the rule, never below 0)."""
        return max(0.0, self.a_s + self.b_s_per_rank * ranks)


@cache
def group_formation(path: Path = GROUP_FORMATION_PATH) -> GroupFormation:
    """The rule kept in ``path`` (written by ``benchmarks/group_formation.py --write``)."""
    doc = json.loads(path.read_text())
    fit = doc["fit"]
    load = ", ".join(f"{v:.2f}" for v in doc.get("load_average", []))
    return GroupFormation(
        a_s=float(fit["a_s"]),
        b_s_per_rank=float(fit["b_s_per_rank"]),
        measured_ranks=tuple(int(r) for r in doc["by_ranks"]),
        source=(
            f"{doc['benchmark']} ({doc['backend']}, {doc['transport']}, {doc['cpu_cores']} "
            f"cores, load {load}, {doc['measured_at']})"
        ),
    )


def group_formation_s(ranks: int) -> float:
    """Seconds to form a process-group generation of ``ranks`` ranks, by the measured rule."""
    return group_formation().at(ranks)
