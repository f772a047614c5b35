"""Failure schedules for one training job: drawn from the fleet model or replayed from a trace.

A schedule is the list of interruptions a job of ``gpus`` GPUs meets during ``horizon_s``
seconds: when, which failure kind (the simulator's kinds: memory, thermal, nvlink, pcie,
power_loss, gpu_lost, other) and its scope (one GPU, or the whole node).

- ``fleet_schedule``: the fleet model's calibration (``sim.calibration``): every GPU fails at
  the per-GPU rate that gives a job MTTF of 7.9 h at 1,024 GPUs, node-scope classes take a
  node at once and count once; the class (and so the kind) is drawn in the StepFun trace's
  proportions. Arrivals are Poisson.
- ``trace_schedule``: the StepFun trace's own arrivals. A job on ``n`` nodes runs on ``n`` of
  the trace's 400 servers, drawn at random; beyond 400 nodes the trace is laid side by side
  with itself, each further copy shifted in time by a random offset (circularly within the
  349 days), and a horizon longer than the trace repeats it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from goodput.trace import TRACE_DAYS, TRACE_GPUS_PER_NODE, TRACE_NODES, Fault
from sim.calibration import Calibration, per_gpu_hazard_per_h
from sim.config import Params, default_params

__all__ = ["Failure", "fleet_schedule", "job_mttf_h", "trace_classes", "trace_schedule"]

DAY_S = 86400.0


@dataclass(frozen=True)
class Failure:
    """One interruption of the job: wall-clock second, failure kind and scope."""

    t_s: float
    kind: str
    scope: str


def job_mttf_h(gpus: int, params: Params | None = None) -> float:
    """The fleet model's mean time between interruptions of a job on ``gpus`` GPUs (hours)."""
    return 1.0 / (per_gpu_hazard_per_h(params or default_params()) * gpus)


def fleet_schedule(
    gpus: int, horizon_s: float, rng: np.random.Generator, params: Params | None = None
) -> list[Failure]:
    """Poisson interruptions at the fleet model's calibrated rate, kinds in the trace's mix."""
    cal = Calibration(params or default_params())
    rate_per_s = cal.gpu_rate_per_s * gpus  # node-scope classes: a node's 8 GPUs count once
    n = int(rng.poisson(rate_per_s * horizon_s))
    times = np.sort(rng.uniform(0.0, horizon_s, size=n))
    weights = np.array([c.weight for c in cal.classes], dtype=float)
    picks = rng.choice(len(cal.classes), size=n, p=weights / weights.sum())
    return [
        Failure(float(t), cal.classes[i].kind, cal.classes[i].scope)
        for t, i in zip(times, picks, strict=True)
    ]


def trace_classes(params: Params | None = None) -> dict[tuple[str, str], tuple[str, str]]:
    """(class, desc) of the trace's job-stopping hardware faults -> (kind, scope)."""
    params = params or default_params()
    return {
        (e["class"], e["desc"]): (e["kind"], e["scope"])
        for e in params["trace_classes"]
        if e["kills_job"]
    }


def trace_schedule(
    faults: list[Fault],
    gpus: int,
    horizon_s: float,
    rng: np.random.Generator,
    params: Params | None = None,
) -> list[Failure]:
    """The trace's job-stopping hardware faults on the job's share of (copies of) the trace."""
    classes = trace_classes(params)
    nodes = math.ceil(gpus / TRACE_GPUS_PER_NODE)
    copies = math.ceil(nodes / TRACE_NODES)
    trace_s = TRACE_DAYS * DAY_S
    offsets = [0.0] + [float(rng.uniform(0.0, trace_s)) for _ in range(copies - 1)]
    chosen = set(rng.choice(copies * TRACE_NODES, size=nodes, replace=False).tolist())
    cycles = math.ceil(horizon_s / trace_s)
    out = []
    for f in faults:
        mapped = classes.get((f.cls, f.desc)) if f.level == "Hardware Failure" else None
        if mapped is None:
            continue
        for copy, offset in enumerate(offsets):
            if copy * TRACE_NODES + f.node not in chosen:
                continue
            t0 = (f.start_day * DAY_S + offset) % trace_s
            for cycle in range(cycles):
                t = t0 + cycle * trace_s
                if t < horizon_s:
                    out.append(Failure(t, *mapped))
    out.sort(key=lambda x: x.t_s)
    return out
