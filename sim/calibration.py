"""Calibration: the per-GPU hazard and the failure-kind mix, from the published figures.

The fleet-level figure is Meta FAIR's projected job MTTF of 7.9 h at 1,024 GPUs (HPCA 2025).
A job dies when any of its GPUs (or the node under them) fails, so with independent failures
the per-GPU rate is ``1 / (7.9 h * 1024) = 1.2362e-4`` per GPU-hour, one failure every 337
GPU-days. Node-scope failures (a power supply, a motherboard) take all GPUs of a node at once;
they count as one interruption, so a node's rate for them is ``gpus_per_node`` times the
per-GPU rate times their share of the mix.

The mix is the StepFun trace's hardware classes, weighted by their fault counts, mapped to
kinds in ``defaults.toml`` (``[[trace_classes]]``). ``trace_mix`` recomputes the counts and
repair times from the trace files so that the table can be checked against its source.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.config import FAILURE_KINDS, Params

__all__ = [
    "Calibration",
    "TraceClass",
    "per_gpu_hazard_per_h",
    "trace_mix",
]


def per_gpu_hazard_per_h(params: Params) -> float:
    """Failures per GPU-hour that give ``fleet_mttf_h`` at ``reference_gpus`` GPUs."""
    hazard = params["hazard"]
    return 1.0 / (float(hazard["fleet_mttf_h"]) * float(hazard["reference_gpus"]))


@dataclass(frozen=True)
class TraceClass:
    """One StepFun hardware fault class and what it becomes in the simulator."""

    name: str
    kind: str
    scope: str
    xid: int
    weight: float
    repair_median_s: float


class Calibration:
    """The rates and tables the fleet model draws failures from."""

    def __init__(self, params: Params) -> None:
        self.gpus_per_node = int(params["fleet"]["gpus_per_node"])
        self.gpu_rate_per_s = per_gpu_hazard_per_h(params) / 3600.0
        classes = [
            TraceClass(
                name=f"{e['class']}: {e['desc']}",
                kind=e["kind"],
                scope=e["scope"],
                xid=int(e.get("xid", 0)),
                weight=float(e["trace_count"]),
                repair_median_s=float(e["repair_median_s"]),
            )
            for e in params["trace_classes"]
            if e["kills_job"] and e["trace_count"] > 0
        ]
        self.classes = classes
        total = sum(c.weight for c in classes)
        self.gpu_class_ids = np.array([i for i, c in enumerate(classes) if c.scope == "gpu"])
        self.node_class_ids = np.array([i for i, c in enumerate(classes) if c.scope == "node"])
        gpu_w = np.array([classes[i].weight for i in self.gpu_class_ids], dtype=float)
        node_w = np.array([classes[i].weight for i in self.node_class_ids], dtype=float)
        self.gpu_share = float(gpu_w.sum() / total)
        self.node_share = float(node_w.sum() / total)
        self.gpu_class_p = gpu_w / gpu_w.sum() if gpu_w.size else gpu_w
        self.node_class_p = node_w / node_w.sum() if node_w.size else node_w
        self.class_kind = np.array([FAILURE_KINDS.index(c.kind) for c in classes], dtype=np.int8)
        self.class_repair_s = np.array([c.repair_median_s for c in classes])
        self.class_xid = np.array([c.xid for c in classes], dtype=np.int64)

    def kind_mix(self) -> dict[str, float]:
        """Expected share of each kind among interruptions (node incidents count once)."""
        total = sum(c.weight for c in self.classes)
        mix = dict.fromkeys(FAILURE_KINDS, 0.0)
        for c in self.classes:
            mix[c.kind] += c.weight / total
        return mix

    def first_class_of(self, kind: str) -> int:
        """The most frequent trace class of ``kind`` (used for injected failures)."""
        best = [i for i, c in enumerate(self.classes) if c.kind == kind]
        if not best:
            raise KeyError(kind)
        return max(best, key=lambda i: self.classes[i].weight)


def trace_mix(trace_dir: str | Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Counts and median durations (s) of the trace's hardware classes, keyed (class, desc).

    Reads ``fault_statistics.json`` and ``fault_trace.json`` of the StepFun trace; the values
    of ``[[trace_classes]]`` in ``defaults.toml`` were taken from this function.
    """
    trace_dir = Path(trace_dir)
    stats = json.loads((trace_dir / "fault_statistics.json").read_text())
    trace = json.loads((trace_dir / "fault_trace.json").read_text())
    open_faults: dict[tuple[str, ...], list[float]] = defaultdict(list)
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    for ev in sorted(trace, key=lambda e: (e["event_time"], e["event_type"] != "fault_end")):
        ft = ev["fault_type"]
        if ft["Level"] != "Hardware Failure":
            continue
        key = (ev["node_id"], ft["Class"], ft["Desc"])
        if ev["event_type"] == "fault_start":
            open_faults[key].append(ev["event_time"])
        elif open_faults[key]:
            durations[(ft["Class"], ft["Desc"])].append(
                (ev["event_time"] - open_faults[key].pop(0)) * 86400.0
            )
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for cls, descs in stats["Hardware Failure"].items():
        if not isinstance(descs, dict):
            continue
        for desc, count in descs.items():
            if desc == "ClassTotal":
                continue
            d = durations.get((cls, desc), [])
            out[(cls, desc)] = {
                "count": int(count),
                "repair_median_s": float(statistics.median(d)) if d else None,
            }
    return out
