"""Stragglers: GPUs that compute slower for a while without failing.

A GPU that throttles its clocks, or whose PCIe link retrained to fewer lanes, slows every rank
of a synchronous job and never fails: no failure is recorded, no Xid or other event is sent.
What a collector sees is only the telemetry:

- ``thermal``: the die held above the software slowdown point (``workload.slowdown_c``),
  SM clock well under the application clock (``workload.sm_clock_max_mhz``), clocks-event bit
  ``SwThermalSlowdown`` (0x20), power down with the clock.
- ``power_cap``: power at the board limit (``workload.power_max_w``), bit ``SwPowerCap``
  (0x4), clock down.
- ``power_brake``: an external power brake asserted (a supply or chassis signal): bits
  ``HwSlowdown`` | ``HwPowerBrakeSlowdown`` (0x8 | 0x80), the clock halved, power down,
  temperature normal.
- ``pcie``: ``pcie_link_width`` below ``pcie_link_width_max`` and ``pcie_link_gen`` dropped;
  clocks, bits and counters as on a healthy GPU (no replays, no Xid).

The bits are NVML's ``nvmlClocksEventReason*`` (formerly ``nvmlClocksThrottleReason*``).
Throttle telemetry shows while the GPU runs a job (utilisation 5 % or more); an idle GPU sits at
its idle clock whatever its state. A PCIe downtraining shows whatever the load.

Each episode has a ``factor``: how much longer the GPU's share of a step takes, so a rank on it
runs at ``1 / factor`` speed and a synchronous job with it at the speed of its slowest rank.
For a throttle it is the clock ratio (``1 / clock_frac``: a compute-bound step scales with the
clock); for a PCIe downtraining it is a parameter (``slowdowns.pcie.factor``, assumed: how
much a rank's traffic over PCIe holds its step up depends on the job).

Episodes start at ``slowdowns.rate_per_gpu_day`` (wall clock; 0 by default, so a fleet without
them draws exactly what it drew before), their kind drawn by ``weight`` and their length
lognormal around ``duration_median_s``; or one is forced with :meth:`Slowdowns.start`
(``FleetModel.slow``, ``forewarn simulate --slow``). Ground truth: :attr:`Slowdowns.records`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from sim.config import Params

__all__ = ["SLOWDOWN_KINDS", "Slowdowns"]

SLOWDOWN_KINDS: tuple[str, ...] = ("thermal", "power_cap", "power_brake", "pcie")
"""The kinds of straggler the simulator makes (``[slowdowns.<kind>]`` in ``defaults.toml``)."""

BITS = {"thermal": 0x20, "power_cap": 0x4, "power_brake": 0x8 | 0x80, "pcie": 0}
"""The NVML clocks-event reasons each kind shows while the GPU runs a job."""

THERMAL, POWER_CAP, POWER_BRAKE, PCIE = range(4)
_RUNNING_PCT = 5.0  # utilisation under which a GPU counts as idle (as the workload's idle bit)


def factor_of(slowdowns: Params, kind: str) -> float:
    """The default slowdown factor of ``kind`` from the ``[slowdowns]`` parameters."""
    spec = slowdowns[kind]
    return float(spec["factor"]) if kind == "pcie" else 1.0 / float(spec["clock_frac"])


class Slowdowns:
    """The straggler state of every GPU of a fleet (``g`` GPUs), in wall-clock seconds."""

    def __init__(self, params: Params, g: int) -> None:
        self.p = params["slowdowns"]
        self.w = params["workload"]
        self.g = g
        self.kind = np.full(g, -1, dtype=np.int8)
        self.until = np.full(g, -np.inf)
        self.factor = np.ones(g)
        """Per GPU, how much longer its share of a step takes now (1.0: not slowed)."""
        self.row = np.full(g, -1, dtype=np.int64)  # index into records
        self.records: list[dict[str, Any]] = []
        self.width_max = int(params["fleet"]["pcie_link_width_max"])
        self.gen = int(params["fleet"]["pcie_link_gen"])

    def start(
        self,
        gi: int,
        kind: str,
        duration_s: float,
        factor: float,
        t: float,
        ts_ms: int,
        where: tuple[str, int, str],
        injected: bool,
    ) -> dict[str, Any]:
        """GPU ``gi`` runs ``factor`` times slower for ``duration_s`` wall seconds from ``t``.

        ``where``: (node name, GPU index on the node, UUID) for the record. An episode already
        running on the GPU ends now.
        """
        self.stop(gi, ts_ms)
        k = SLOWDOWN_KINDS.index(kind)
        self.kind[gi], self.until[gi], self.factor[gi] = k, t + duration_s, factor
        self.row[gi] = len(self.records)
        node, gpu, uuid = where
        rec = {
            "ts_ms": int(ts_ms),
            "end_ts_ms": int(ts_ms + round(duration_s * 1000.0)),
            "node": node,
            "gpu": int(gpu),
            "uuid": uuid,
            "kind": kind,
            "factor": float(factor),
            "throttle_reasons": BITS[kind],
            "injected": bool(injected),
        }
        self.records.append(rec)
        return rec

    def stop(self, gi: int, ts_ms: int) -> None:
        """End GPU ``gi``'s episode now, if it has one (a failure, a new episode)."""
        if self.kind[gi] < 0:
            return
        rec = self.records[int(self.row[gi])]
        rec["end_ts_ms"] = min(int(rec["end_ts_ms"]), int(ts_ms))
        self.kind[gi], self.until[gi], self.factor[gi], self.row[gi] = -1, -np.inf, 1.0, -1

    def step(
        self,
        t: float,
        dt: float,
        ts_ms: int,
        live: np.ndarray,
        rng: np.random.Generator,
        where: Callable[[int], tuple[str, int, str]],
    ) -> None:
        """End the episodes that are over at wall time ``t``; start new ones at the rate.

        ``where(gi)`` gives (node name, GPU index, UUID) of GPU ``gi``. Nothing is drawn from
        ``rng`` when the rate is 0.
        """
        ended = np.flatnonzero((self.kind >= 0) & (t >= self.until))
        for gi in ended.tolist():
            self.stop(gi, int(ts_ms - (t - self.until[gi]) * 1000.0))
        rate = float(self.p["rate_per_gpu_day"])
        if rate <= 0 or dt <= 0:
            return
        new = np.flatnonzero(live & (self.kind < 0) & (rng.random(self.g) < rate * dt / 86400.0))
        if new.size == 0:
            return
        w = np.array([float(self.p[k]["weight"]) for k in SLOWDOWN_KINDS])
        kinds = rng.choice(len(SLOWDOWN_KINDS), new.size, p=w / w.sum())
        dur = self.draw_durations(rng, new.size)
        for gi, k, d in zip(new.tolist(), kinds.tolist(), dur.tolist(), strict=True):
            kind = SLOWDOWN_KINDS[k]
            factor = factor_of(self.p, kind)
            self.start(gi, kind, d, factor, t, ts_ms, where(gi), injected=False)

    def draw_durations(self, rng: np.random.Generator, n: int) -> np.ndarray:
        med = max(float(self.p["duration_median_s"]), 1.0)
        return rng.lognormal(math.log(med), float(self.p["duration_sigma"]), n)

    def apply(self, cols: dict[str, np.ndarray]) -> None:
        """Show each slowed GPU's episode in this tick's readings (in place)."""
        cols["pcie_link_gen"] = np.full(self.g, self.gen, dtype=np.int64)
        idx = np.flatnonzero(self.kind >= 0)
        if idx.size == 0:
            return
        k = self.kind[idx]
        pc = idx[k == PCIE]
        if pc.size:
            spec = self.p["pcie"]
            cols["pcie_link_width"][pc] = np.minimum(cols["pcie_link_width"][pc], spec["width"])
            cols["pcie_link_gen"][pc] = min(int(spec["gen"]), self.gen)
        running = cols["util_gpu_pct"][idx] >= _RUNNING_PCT
        th = idx[running & (k != PCIE)]
        if th.size == 0:
            return
        w = self.w
        kinds = self.kind[th]
        frac = 1.0 / self.factor[th]
        cols["sm_clock_mhz"][th] = np.round(w["sm_clock_max_mhz"] * frac)
        bits = np.array([BITS[n] for n in SLOWDOWN_KINDS], dtype=np.int64)[kinds]
        cols["throttle_reasons"][th] |= bits
        idle_w = float(w["power_idle_w"])
        power = cols["power_w"][th]
        slowed_power = np.round(idle_w + (power - idle_w) * frac, 2)
        cols["power_w"][th] = np.where(
            kinds == POWER_CAP, float(w["power_max_w"]), np.maximum(slowed_power, idle_w)
        )
        hot = th[kinds == THERMAL]
        if hot.size:
            temp = float(self.p["thermal"]["temp_c"])
            cols["temp_gpu_c"][hot] = np.maximum(cols["temp_gpu_c"][hot], temp)
            hbm = temp + float(w["hbm_offset_c"])
            cols["temp_mem_c"][hot] = np.maximum(cols["temp_mem_c"][hot], hbm)

    def active(self) -> np.ndarray:
        """Indices of the GPUs slowed now."""
        return np.flatnonzero(self.kind >= 0)
