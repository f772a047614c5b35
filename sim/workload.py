"""The healthy side of a GPU: what a training workload does to load, heat, power and clocks.

Every node runs one job. A job trains (utilisation ~95 %), pauses now and then for a
checkpoint or an evaluation (utilisation 10-30 % for a couple of minutes), and ends now and
then, leaving the node idle until the next job lands. Die temperature follows the heat put in
with a first-order lag (the heat sink's time constant), on top of the inlet air (a day/night
swing, and benign "hot aisle" episodes where a node's inlet warms for half an hour) and of the
GPU's own cooling position in the chassis. Cooling loss, modelled in ``fleet.py``, multiplies
the thermal resistance: the same power then gives a higher rise above inlet.

The clock-event bits follow NVML's ``nvmlClocksEventReasons``: 0x1 GPU idle, 0x4 software
power cap, 0x8 hardware slowdown, 0x20 software thermal slowdown, 0x40 hardware thermal
slowdown.
"""

from __future__ import annotations

import math

import numpy as np

from sim.config import Params

__all__ = ["THROTTLE", "Workload"]

THROTTLE = {
    "gpu_idle": 0x1,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
}

TRAIN, CHECKPOINT, IDLE = 0, 1, 2


class Workload:
    """Node job phases and per-GPU thermals, power and clocks, stepped in wall-clock time."""

    def __init__(self, params: Params, nodes: int, gpn: int, rng: np.random.Generator) -> None:
        self.p = params["workload"]
        self.mem_total = float(params["fleet"]["mem_total_mib"])
        self.rng = rng
        self.nodes, self.gpn = nodes, gpn
        g = nodes * gpn
        self.offset_c = rng.normal(0.0, self.p["gpu_offset_sd_c"], g)
        self.phase = np.full(nodes, TRAIN, dtype=np.int8)
        self.phase_until = rng.exponential(self.p["checkpoint_every_median_s"], nodes)
        self.hot_until = np.zeros(nodes)
        self.hot_rise = np.zeros(nodes)
        self.slow_until = np.zeros(nodes)
        self.temp = None  # set on the first step, at the steady state of the first load

    def crash(self, nodes: np.ndarray, t: float) -> None:
        """An application crash: the node idles while the job restarts."""
        self.phase[nodes] = IDLE
        med = 0.5 * self.p["idle_duration_median_s"]
        self.phase_until[nodes] = t + self.rng.lognormal(math.log(med), 0.5, nodes.size)

    def _phases(self, t: float, dt: float) -> None:
        p, rng = self.p, self.rng
        due = np.flatnonzero(t >= self.phase_until)
        if due.size:
            was_train = self.phase[due] == TRAIN
            q_idle = min(1.0, p["idle_rate_per_node_day"] * p["checkpoint_every_median_s"] / 86400)
            to_idle = was_train & (rng.random(due.size) < q_idle)
            new = np.where(was_train, np.where(to_idle, IDLE, CHECKPOINT), TRAIN).astype(np.int8)
            dur = np.where(
                new == TRAIN,
                rng.exponential(p["checkpoint_every_median_s"], due.size),
                np.where(
                    new == IDLE,
                    rng.lognormal(math.log(max(p["idle_duration_median_s"], 1.0)), 0.7, due.size),
                    rng.lognormal(
                        math.log(max(p["checkpoint_duration_median_s"], 1.0)), 0.3, due.size
                    ),
                ),
            )
            self.phase[due] = new
            self.phase_until[due] = t + dur
        hot = rng.random(self.nodes) < p["hot_aisle_rate_per_node_day"] * dt / 86400.0
        hot &= t >= self.hot_until
        if hot.any():
            idx = np.flatnonzero(hot)
            med = max(p["hot_aisle_median_s"], 1.0)
            self.hot_until[idx] = t + rng.lognormal(math.log(med), 0.5, idx.size)
            self.hot_rise[idx] = p["hot_aisle_rise_c"] * rng.uniform(0.6, 1.4, idx.size)
        self.hot_rise[t >= self.hot_until] = 0.0
        rate = p.get("node_slowdown_rate_per_node_day", 0.0)
        if rate > 0:
            slow = (rng.random(self.nodes) < rate * dt / 86400.0) & (t >= self.slow_until)
            if slow.any():
                idx = np.flatnonzero(slow)
                med = max(p.get("node_slowdown_median_s", 900.0), 1.0)
                self.slow_until[idx] = t + rng.lognormal(math.log(med), 0.7, idx.size)

    def step(self, t: float, dt: float, ts_s: float, r_factor: np.ndarray) -> dict[str, np.ndarray]:
        """Advance by ``dt`` seconds; ``r_factor``: thermal resistance multiplier per GPU."""
        p, rng, gpn = self.p, self.rng, self.gpn
        g = self.nodes * gpn
        self._phases(t, dt)
        phase = np.repeat(self.phase, gpn)
        base = np.choose(phase, [p["train_util_pct"], 20.0, 0.0])
        util = np.clip(base + rng.normal(0.0, 1.5, g) * (phase != IDLE), 0.0, 100.0)
        util = np.where(phase == CHECKPOINT, util + rng.uniform(-10.0, 10.0, g), util)
        util = np.clip(np.round(util), 0.0, 100.0)
        day = 2.0 * math.pi * ((ts_s % 86400.0) / 86400.0 - 0.375)
        inlet = p["ambient_c"] + p["ambient_diurnal_c"] * math.sin(day)
        target = (
            inlet
            + np.repeat(self.hot_rise, gpn)
            + self.offset_c
            + p["load_rise_c"] * (util / 100.0) * r_factor
        )
        if self.temp is None:
            self.temp = target.copy()
        else:
            alpha = 1.0 - math.exp(-dt / max(p["thermal_tau_s"], 1e-3))
            self.temp += (target - self.temp) * alpha
        noise = rng.normal(0.0, p["temp_noise_c"], (2, g))
        temp_gpu = np.clip(np.round(self.temp + noise[0]), 5.0, 130.0)
        temp_mem = np.clip(np.round(self.temp + p["hbm_offset_c"] + noise[1]), 5.0, 130.0)

        throttle = np.zeros(g, dtype=np.int64)
        clock_f = np.ones(g)
        sw_th = temp_gpu >= p["slowdown_c"]
        hw_th = temp_gpu >= p["shutdown_c"] - 1.0
        throttle |= np.where(sw_th, THROTTLE["sw_thermal"], 0)
        throttle |= np.where(hw_th, THROTTLE["hw_thermal"] | THROTTLE["hw_slowdown"], 0)
        clock_f = np.where(sw_th, 0.8, clock_f)
        clock_f = np.where(hw_th, 0.5, clock_f)
        slow = np.repeat(t < self.slow_until, gpn)  # benign node-wide board slowdown
        throttle |= np.where(slow, THROTTLE["hw_slowdown"], 0)
        clock_f = np.where(slow, np.minimum(clock_f, 0.6), clock_f)
        dyn = (p["power_max_w"] - p["power_idle_w"]) * (util / 100.0) ** 1.2 * clock_f
        power = p["power_idle_w"] + dyn + rng.normal(0.0, 4.0, g)
        capped = power >= 0.97 * p["power_max_w"]
        power = np.clip(power, 0.8 * p["power_idle_w"], p["power_max_w"])
        throttle |= np.where(capped, THROTTLE["sw_power_cap"], 0)
        idle = util < 5.0
        throttle |= np.where(idle, THROTTLE["gpu_idle"], 0)
        sm = np.where(idle, 345.0, p["sm_clock_max_mhz"] * clock_f * np.where(capped, 0.93, 1.0))
        running = phase != IDLE
        mem_used = np.where(
            running, self.mem_total * p["mem_used_frac"] + rng.normal(0.0, 200.0, g), 512.0
        )
        return {
            "temp_gpu_c": temp_gpu,
            "temp_mem_c": temp_mem,
            "power_w": np.round(power, 2),
            "sm_clock_mhz": np.round(sm),
            "mem_clock_mhz": np.full(g, p["mem_clock_mhz"]),
            "throttle_reasons": throttle,
            "util_gpu_pct": util,
            "util_mem_pct": np.clip(np.round(util * 0.6 + rng.normal(0.0, 2.0, g)), 0.0, 100.0),
            "mem_used_mib": np.clip(np.round(mem_used), 0.0, self.mem_total),
        }
