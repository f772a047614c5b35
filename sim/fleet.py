"""The vectorised fleet model: every GPU's state, stepped one tick at a time with numpy.

One model serves both the live source and the dataset writer: ``step(dt_s, ts_ms)`` advances
the fleet and returns the readings of that tick as column arrays (one entry per GPU, with a
``present`` mask for the samples that reach the collector) and the events since the previous
tick. Ground-truth failures accumulate in ``failures``.

Two clocks run: the wall clock (workload, benign noise, sampling) and the failure clock
(hazard, precursor growth, repair), which runs ``speed`` times faster so that a live demo
shows a failure's whole story in minutes while its samples keep real timestamps.

Failure plan: each GPU holds its next gpu-scope failure (time, trace class, whether it shows
precursors and from when); each node holds its next node-scope incident. Times are drawn from
exponentials at the calibrated rates (``calibration.py``), per GPU-hour in service; lemon
nodes' rates are multiplied and every rate scaled so that the fleet mean stays calibrated.
After a repair the GPU's plan is drawn again, its precursor window clipped to the time since
it came back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from forewarn.errors import Conflict
from sim import precursors
from sim.calibration import Calibration
from sim.config import FAILURE_KINDS, Params
from sim.slowdowns import SLOWDOWN_KINDS, Slowdowns, factor_of
from sim.workload import Workload

__all__ = ["CounterState", "FleetModel", "Tick"]

VOLATILE = (
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "nvlink_crc_flit",
    "nvlink_crc_data",
    "nvlink_replay",
    "nvlink_recovery",
    "pcie_replay",
)
PERSISTENT = ("ecc_sbe_aggregate", "ecc_dbe_aggregate", "remap_correctable", "remap_uncorrectable")

MEMORY, THERMAL, NVLINK, PCIE, POWER_LOSS, GPU_LOST, OTHER = range(7)

# An event row: ts_ms, node index, gpu index (-1: whole node), kind, xid (-1: none), message,
# source.
EventRow = tuple[int, int, int, str, int, str, str]


@dataclass
class CounterState:
    """Cumulative hardware counters and flags of every GPU."""

    g: int
    counts: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = {k: np.zeros(self.g, dtype=np.int64) for k in VOLATILE + PERSISTENT}
        self.remap_pending = np.zeros(self.g, dtype=bool)
        self.remap_failure = np.zeros(self.g, dtype=bool)

    def reset(self, idx: np.ndarray) -> None:
        """A GPU reset or reboot: volatile counters go to zero, pending remaps are applied."""
        for k in VOLATILE:
            self.counts[k][idx] = 0
        self.remap_pending[idx] = False


@dataclass
class Tick:
    ts_ms: int
    present: np.ndarray
    columns: dict[str, np.ndarray]
    events: list[EventRow]


class FleetModel:
    """A fleet of ``gpus`` GPUs, ``gpus_per_node`` to a node, driven from one seed.

    Args:
        gpus: fleet size (rounded up to whole nodes).
        params: a parameter set (``config.load_params()``).
        seed: everything random is drawn from it, so the same seed gives the same fleet.
        speed: failure-clock multiplier (live demos); 1.0 for datasets.
    """

    def __init__(self, gpus: int, params: Params, seed: int, speed: float = 1.0) -> None:
        self.params = params
        self.cal = Calibration(params)
        gpn = self.cal.gpus_per_node
        self.gpn = gpn
        self.nodes = max(1, math.ceil(gpus / gpn))
        self.g = self.nodes * gpn
        self.speed = float(speed)
        self.rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xF1EE7]))
        rng = self.rng
        width = max(4, len(str(self.nodes - 1)))
        prefix = params["fleet"]["node_prefix"]
        self.node_names = [f"{prefix}-{i:0{width}d}" for i in range(self.nodes)]
        self.node_of = np.repeat(np.arange(self.nodes), gpn)
        self.gpu_index = np.tile(np.arange(gpn), self.nodes)
        raw = rng.integers(0, 2**63, size=(self.g, 2), dtype=np.int64)
        self.uuids = [f"GPU-{a:016x}{b:016x}"[:40] for a, b in raw.tolist()]
        self.uuids = [f"{u[:12]}-{u[12:16]}-{u[16:20]}-{u[20:24]}-{u[24:36]}" for u in self.uuids]

        fleet = params["fleet"]
        self.lemon = rng.random(self.nodes) < fleet["lemon_node_fraction"]
        # Normalised over the lemons actually drawn, so that every fleet's mean hazard is the
        # calibrated one whatever its number of lemons.
        raw_mult = np.where(self.lemon, float(fleet["lemon_hazard_multiplier"]), 1.0)
        self.node_mult = raw_mult / raw_mult.mean()
        self.gpu_mult = np.repeat(self.node_mult, gpn)
        self.noise_mult = np.repeat(np.where(self.lemon, fleet["lemon_noise_multiplier"], 1.0), gpn)
        self.x8 = rng.random(self.g) < params["noise"]["x8_link_fraction"]

        self.t = 0.0  # wall seconds since start
        self._last_ts_ms = 0  # timestamp of the last tick
        self.tf = 0.0  # failure-clock seconds since start
        self.counters = CounterState(self.g)
        self.workload = Workload(params, self.nodes, gpn, rng)
        self.up = np.ones(self.g, dtype=bool)
        self.recover_f = np.full(self.g, np.inf)
        self.down_row = np.full(self.g, -1, dtype=np.int64)  # index into failures
        # GPU plans.
        self.fail_f = np.full(self.g, np.inf)
        self.onset_f = np.full(self.g, np.inf)
        self.cls = np.zeros(self.g, dtype=np.int64)
        self.kind = np.zeros(self.g, dtype=np.int8)
        self.has_prec = np.zeros(self.g, dtype=bool)
        self.width_drop = np.zeros(self.g, dtype=bool)
        self.storm_sent = np.zeros(self.g, dtype=bool)
        self.injected = np.zeros(self.g, dtype=bool)
        self.plan_gpus(np.arange(self.g), 0.0, initial=True)
        # Node plans (node-scope incidents) and node-level benign states.
        self.node_fail_f = np.full(self.nodes, np.inf)
        self.node_cls = np.zeros(self.nodes, dtype=np.int64)
        self.node_injected = np.zeros(self.nodes, dtype=bool)
        self.plan_nodes(np.arange(self.nodes), 0.0)
        self.offline_until = np.full(self.nodes, -1.0)  # benign reboot
        self.stall_until = np.full(self.nodes, -1.0)
        self.failures: list[dict[str, Any]] = []
        self._incidents = 0
        self.slowdowns = Slowdowns(params, self.g)

    # -- planning ---------------------------------------------------------------------------

    def _lead(self, kinds: np.ndarray) -> np.ndarray:
        spec = self.params["kinds"]
        med = np.array([spec[k]["lead_median_s"] for k in FAILURE_KINDS])[kinds]
        sig = np.array([spec[k]["lead_sigma"] for k in FAILURE_KINDS])[kinds]
        return np.where(
            med > 0,
            np.exp(np.log(np.maximum(med, 1e-9)) + sig * self.rng.standard_normal(kinds.size)),
            0.0,
        )

    def plan_gpus(self, idx: np.ndarray, from_f: float, initial: bool = False) -> None:
        """Draw the next gpu-scope failure of the GPUs ``idx``, from failure-clock ``from_f``."""
        if idx.size == 0:
            return
        cal, rng = self.cal, self.rng
        rate = cal.gpu_rate_per_s * cal.gpu_share * self.gpu_mult[idx]
        fail = from_f + rng.exponential(1.0, idx.size) / rate
        cls = cal.gpu_class_ids[rng.choice(cal.gpu_class_ids.size, idx.size, p=cal.gpu_class_p)]
        kind = cal.class_kind[cls]
        prec_p = np.array([self.params["kinds"][k]["precursor_prob"] for k in FAILURE_KINDS])
        has = rng.random(idx.size) < prec_p[kind]
        if not self.params["kinds"]["gpu_lost"].get("collapse", False):  # no sign of it at all
            has &= kind != GPU_LOST
        lead = self._lead(kind)
        onset = fail - lead
        if not initial:
            onset = np.maximum(onset, from_f)
        has &= onset < fail
        self.fail_f[idx], self.cls[idx], self.kind[idx] = fail, cls, kind
        self.has_prec[idx] = has
        self.onset_f[idx] = np.where(has, onset, np.inf)
        drop_p = self.params["kinds"]["pcie"]["width_drop_prob"]
        self.width_drop[idx] = rng.random(idx.size) < drop_p
        self.storm_sent[idx] = False
        self.injected[idx] = False

    def plan_nodes(self, idx: np.ndarray, from_f: float) -> None:
        cal = self.cal
        if idx.size == 0 or cal.node_class_ids.size == 0:
            return
        rate = cal.gpu_rate_per_s * cal.node_share * self.gpn * self.node_mult[idx]
        self.node_fail_f[idx] = from_f + self.rng.exponential(1.0, idx.size) / rate
        pick = self.rng.choice(cal.node_class_ids.size, idx.size, p=cal.node_class_p)
        self.node_cls[idx] = cal.node_class_ids[pick]
        self.node_injected[idx] = False

    def inject(self, node: int, gpu: int, kind: str, lead_s: float | None = None) -> float:
        """Make GPU ``gpu`` of node ``node`` fail with ``kind``; returns wall seconds to failure.

        ``lead_s``: wall seconds from now to the failure, with precursors over that whole span
        for the kinds that have them; None draws it from the kind's lead-time distribution
        (none at all for the kinds without warning). Node-scope kinds (power_loss) take the
        whole node.

        Raises:
            Conflict: the GPU (for power_loss: every GPU of the node) is out of service.
        """
        k = FAILURE_KINDS.index(kind)
        cls = self.cal.first_class_of(kind)
        on_node = slice(node * self.gpn, (node + 1) * self.gpn)
        target = (
            self.up[on_node].any()
            if self.cal.classes[cls].scope == "node"
            else self.up[node * self.gpn + gpu]
        )
        if not target:
            raise Conflict(
                f"{self.node_names[node]} GPU {gpu} is out of service (failed, under repair)",
                details={"node": self.node_names[node], "gpu": gpu},
            )
        spec = self.params["kinds"][kind]
        if lead_s is None:
            lead_f = float(self._lead(np.array([k]))[0]) if spec["precursor_prob"] > 0 else 0.0
        else:
            lead_f = float(lead_s) * self.speed
        if self.cal.classes[cls].scope == "node":
            self.node_fail_f[node] = self.tf + lead_f
            self.node_cls[node] = cls
            self.node_injected[node] = True
            return lead_f / self.speed
        g = node * self.gpn + gpu
        self.fail_f[g], self.cls[g], self.kind[g] = self.tf + lead_f, cls, k
        collapse = kind == "gpu_lost" and bool(spec.get("collapse", False))
        self.has_prec[g] = lead_f > 0 and (
            kind in ("memory", "thermal", "nvlink", "pcie") or collapse
        )
        self.onset_f[g] = self.tf if self.has_prec[g] else np.inf
        self.width_drop[g] = True
        self.storm_sent[g] = False
        self.injected[g] = True
        return lead_f / self.speed

    def slow(
        self,
        node: int,
        gpu: int,
        kind: str,
        duration_s: float | None = None,
        factor: float | None = None,
        ts_ms: int | None = None,
    ) -> dict[str, Any]:
        """Make GPU ``gpu`` of node ``node`` a straggler of ``kind`` from now (not a failure).

        ``duration_s``: wall seconds it lasts (None: drawn, lognormal around
        ``slowdowns.duration_median_s``); ``factor``: how much longer its share of a step
        takes (None: the kind's, ``sim.slowdowns.factor_of``; for a throttle the SM clock is
        the application clock / factor). ``ts_ms``: the time of the record (None: the time of
        the last tick). Returns the ground-truth record (``sim.slowdowns.Slowdowns.records``).

        Raises:
            Conflict: the GPU is out of service.
        """
        if kind not in SLOWDOWN_KINDS:
            raise ValueError(f"unknown slowdown kind {kind!r}")
        g = node * self.gpn + gpu
        if not self.up[g]:
            raise Conflict(
                f"{self.node_names[node]} GPU {gpu} is out of service (failed, under repair)",
                details={"node": self.node_names[node], "gpu": gpu},
            )
        if duration_s is None:
            duration_s = float(self.slowdowns.draw_durations(self.rng, 1)[0])
        f = factor_of(self.params["slowdowns"], kind) if factor is None else float(factor)
        when = self._last_ts_ms if ts_ms is None else int(ts_ms)
        return self.slowdowns.start(
            g, kind, float(duration_s), f, self.t, when, self._where(g), injected=True
        )

    def _where(self, g: int) -> tuple[str, int, str]:
        return self.node_names[self.node_of[g]], int(self.gpu_index[g]), self.uuids[g]

    # -- one tick ---------------------------------------------------------------------------

    def step(self, dt_s: float, ts_ms: int) -> Tick:
        """Advance wall time by ``dt_s`` (failure time by ``dt_s * speed``) and read the fleet."""
        self.t += dt_s
        self.tf += dt_s * self.speed
        self._last_ts_ms = int(ts_ms)
        events: list[EventRow] = []
        self._recoveries(ts_ms, events)
        self._node_incidents(ts_ms, events)
        self._gpu_failures(ts_ms, events)
        self._node_benign(dt_s, ts_ms, events)
        offline = np.repeat(self.t < self.offline_until, self.gpn)
        live = self.up & ~offline
        r_factor, width = precursors.apply(self, dt_s, dt_s * self.speed, live, ts_ms, events)
        self.slowdowns.step(self.t, dt_s, ts_ms, live, self.rng, self._where)
        cols = self.workload.step(self.t, dt_s, ts_ms / 1000.0, r_factor)
        c = self.counters
        for k, v in c.counts.items():
            cols[k] = v.copy()
        cols["remap_pending"] = c.remap_pending.copy()
        cols["remap_failure"] = c.remap_failure.copy()
        cols["pcie_link_width"] = width
        self.slowdowns.apply(cols)
        stalled = np.repeat(self.t < self.stall_until, self.gpn)
        missing = self.rng.random(self.g) < self.params["sampling"]["missing_sample_prob"]
        dropped, vanished = precursors.collapse(self, live)
        if vanished.any():
            for k in precursors.COLLAPSE_VANISH:
                cols[k] = np.where(vanished, np.nan, cols[k].astype(np.float64))
        present = live & ~stalled & ~missing & ~dropped
        return Tick(ts_ms, present, cols, events)

    def _record(self, g: int, ts_ms: int, cls: int, incident: int, injected: bool) -> None:
        c = self.cal.classes[cls]
        has = bool(self.has_prec[g]) and c.scope == "gpu"
        onset_ms = None
        if has:
            onset_ms = int(ts_ms - (self.tf - self.onset_f[g]) / self.speed * 1000.0)
        repair = self.rng.lognormal(
            math.log(c.repair_median_s * self.params["hazard"]["repair_time_scale"]),
            self.params["hazard"]["repair_sigma"],
        )
        repair = float(
            np.clip(
                repair, self.params["hazard"]["repair_min_s"], self.params["hazard"]["repair_max_s"]
            )
        )
        self.up[g] = False
        self.slowdowns.stop(g, ts_ms)
        self.recover_f[g] = self.tf + repair
        self.fail_f[g] = np.inf
        self.onset_f[g] = np.inf
        self.down_row[g] = len(self.failures)
        self.failures.append(
            {
                "ts_ms": int(ts_ms),
                "node": self.node_names[self.node_of[g]],
                "gpu": int(self.gpu_index[g]),
                "kind": c.kind,
                "has_precursors": has,
                "recovered_ts_ms": int(ts_ms + repair / self.speed * 1000.0),
                "trace_class": c.name,
                "scope": c.scope,
                "incident_id": incident,
                "precursor_onset_ts_ms": onset_ms,
                "injected": bool(injected),
                "uuid": self.uuids[g],
            }
        )

    def _gpu_failures(self, ts_ms: int, events: list[EventRow]) -> None:
        for g in np.flatnonzero(self.up & (self.fail_f <= self.tf)).tolist():
            kind, cls = int(self.kind[g]), int(self.cls[g])
            precursors.terminal(self, g, kind, int(self.cal.class_xid[cls]), ts_ms, events)
            self._incidents += 1
            self._record(g, ts_ms, cls, self._incidents, bool(self.injected[g]))

    def _node_incidents(self, ts_ms: int, events: list[EventRow]) -> None:
        for n in np.flatnonzero(self.node_fail_f <= self.tf).tolist():
            cls = int(self.node_cls[n])
            c = self.cal.classes[cls]
            gpus = [g for g in range(n * self.gpn, (n + 1) * self.gpn) if self.up[g]]
            if c.kind == "power_loss":
                events.append((ts_ms, n, -1, "power_loss", -1, "node lost power", "bmc"))
            self._incidents += 1
            for g in gpus:
                self._record(g, ts_ms, cls, self._incidents, bool(self.node_injected[n]))
            later = self.recover_f[n * self.gpn : (n + 1) * self.gpn]
            back = float(np.max(later[np.isfinite(later)])) if np.isfinite(later).any() else self.tf
            self.node_fail_f[n] = np.inf
            self.plan_nodes(np.array([n]), max(back, self.tf))

    def _recoveries(self, ts_ms: int, events: list[EventRow]) -> None:
        idx = np.flatnonzero(~self.up & (self.recover_f <= self.tf))
        if idx.size == 0:
            return
        self.up[idx] = True
        self.recover_f[idx] = np.inf
        self.counters.reset(idx)
        self.counters.remap_failure[idx] = False
        for g in idx.tolist():
            n, i = int(self.node_of[g]), int(self.gpu_index[g])
            events.append((ts_ms, n, i, "gpu_recovered", -1, "GPU back in service", "nvml"))
            events.append((ts_ms, n, i, "counter_reset", -1, "counters reset (GPU reset)", "nvml"))
        self.plan_gpus(idx, self.tf)

    def _node_benign(self, dt: float, ts_ms: int, events: list[EventRow]) -> None:
        rng, noise, sampling = self.rng, self.params["noise"], self.params["sampling"]
        u = rng.random((3, self.nodes))
        # A reboot ends: counters of the GPUs that are up start again from zero.
        ending = np.flatnonzero((self.offline_until > 0) & (self.t >= self.offline_until))
        for n in ending.tolist():
            self.offline_until[n] = -1.0
            gs = np.arange(n * self.gpn, (n + 1) * self.gpn)
            gs = gs[self.up[gs]]
            self.counters.reset(gs)
            for g in gs.tolist():
                msg = "counters reset (node reboot)"
                events.append((ts_ms, n, int(self.gpu_index[g]), "counter_reset", -1, msg, "nvml"))
        idle = self.offline_until < 0
        start = np.flatnonzero(idle & (u[0] < noise["reboot_rate_per_node_day"] * dt / 86400))
        if start.size:
            med = max(noise["reboot_median_s"], 1.0)
            self.offline_until[start] = self.t + rng.lognormal(math.log(med), 0.3, start.size)
        ending = np.flatnonzero((self.stall_until > 0) & (self.t >= self.stall_until))
        for n in ending.tolist():
            self.stall_until[n] = -1.0
            msg = "collector loop stalled; samples missed"
            events.append((ts_ms, n, -1, "telemetry_stalled", -1, msg, "agent"))
        free = self.stall_until < 0
        start = np.flatnonzero(free & (u[1] < sampling["stall_rate_per_node_day"] * dt / 86400))
        if start.size:
            med = max(sampling["stall_median_s"], 1.0)
            dur = rng.lognormal(math.log(med), sampling["stall_sigma"], start.size)
            self.stall_until[start] = self.t + np.maximum(dur, dt * 1.01)
        crash = np.flatnonzero(u[2] < noise["app_xid_rate_per_node_day"] * dt / 86400)
        if crash.size:
            precursors.app_xids(self, crash, ts_ms, events)
            self.workload.crash(crash, self.t)
