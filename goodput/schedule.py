"""Failure schedules for one training job: drawn from the fleet model or replayed from a trace.

A schedule is the list of interruptions a job of ``gpus`` GPUs meets during ``horizon_s``
seconds: when, which failure kind (the simulator's kinds: memory, thermal, nvlink, pcie,
power_loss, gpu_lost, other) and its scope (one GPU, or the whole node).

- ``fleet_schedule``: the job MTTF Meta FAIR published for its fleet (HPCA 2025, arXiv
  2410.21680: 7.9 h at 1,024 GPUs, 1.8 h at 16,384, about 14 min at 131,072;
  ``PUBLISHED_MTTF_H``), interpolated between those sizes as a power law in GPUs (straight
  on log-log axes; beyond the ends, the nearest segment's slope), not the linear
  extrapolation of a constant per-GPU rate (which gives 0.49 h at 16,384 GPUs); the class
  (and so the kind) is drawn in the StepFun trace's proportions. Arrivals are Poisson.
- ``trace_schedule``: the StepFun trace's own arrivals. A job on ``n`` nodes runs on ``n`` of
  the trace's 400 servers, drawn at random; beyond 400 nodes the trace is laid side by side
  with itself, each further copy shifted in time by a random offset (circularly within the
  349 days), and a horizon longer than the trace repeats it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from goodput.trace import TRACE_DAYS, TRACE_GPUS_PER_NODE, TRACE_NODES, TraceFault
from sim.calibration import Calibration
from sim.config import Params, default_params

__all__ = [
    "PUBLISHED_MTTF_H",
    "Failure",
    "fleet_schedule",
    "job_mttf_h",
    "trace_classes",
    "trace_schedule",
]

DAY_S = 86400.0

PUBLISHED_MTTF_H: tuple[tuple[int, float], ...] = ((1024, 7.9), (16384, 1.8), (131072, 14 / 60))
"""Meta FAIR's projected job MTTF (GPUs, hours): HPCA 2025, arXiv 2410.21680."""


@dataclass(frozen=True)
class Failure:
    """One interruption of the job: wall-clock second, failure kind and scope."""

    t_s: float
    kind: str
    scope: str


def job_mttf_h(gpus: int) -> float:
    """The fleet model's mean time between interruptions of a job on ``gpus`` GPUs (hours):
    Meta's published figures, a power law in GPUs between them (see the module docstring)."""
    points = PUBLISHED_MTTF_H
    i = next((k for k in range(1, len(points) - 1) if gpus <= points[k][0]), len(points) - 1)
    (g0, m0), (g1, m1) = points[i - 1], points[i]
    slope = math.log(m1 / m0) / math.log(g1 / g0)
    return m0 * (gpus / g0) ** slope


def fleet_schedule(
    gpus: int, horizon_s: float, rng: np.random.Generator, params: Params | None = None
) -> list[Failure]:
    """Poisson interruptions at the published job MTTF (:func:`job_mttf_h`), kinds in the
    trace's mix (the fleet model's classes)."""
    cal = Calibration(params or default_params())
    rate_per_s = 1.0 / (job_mttf_h(gpus) * 3600.0)
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
    faults: list[TraceFault],
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
