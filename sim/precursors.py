"""Failure physics: precursors that grow before a failure, the failure itself, benign noise.

Progress ``p`` runs from 0 at precursor onset to 1 at the failure (failure clock). Rates grow
geometrically from a start to an end rate, ``start * (end / start) ** p``, the shape of a
wear-out process whose damage feeds on itself (a weak HBM cell array spreads, a cracked
solder joint or a dirty optical connector gets worse with each thermal cycle).

- memory: corrected (single-bit) ECC errors at a rising rate; rows get remapped as weak cells
  are found (Xid 63) and a remap stays pending past ``remap_pending_from``; an ``ecc_storm``
  event once the rate passes ``storm_per_h``; the failure is a double-bit error (Xid 48, then
  94 contained or 95 uncontained).
- thermal: the thermal resistance grows (a fan slowing, a clogged heat sink, a coolant leak),
  so the die climbs towards shutdown under load, throttling on the way; neighbours in the air
  stream feel part of it; the failure is a thermal shutdown.
- nvlink: CRC flit errors, replays and, late, link recoveries; the failure is Xid 74 and a
  link down.
- pcie: replays, and often a retrain to fewer lanes; the failure is Xid 79 (fallen off the
  bus) and the GPU is lost.
- no warning (power_loss, gpu_lost, other): nothing before; the GPU or node just goes. With
  ``kinds.gpu_lost.collapse`` on, a share ``kinds.gpu_lost.precursor_prob`` of the GPUs that
  fall off the bus show telemetry collapse first (:func:`collapse`): samples go missing more
  and more often (gaps), and past half-way the readings a dying driver stops answering
  (power, memory temperature, memory clock and utilisation, memory used) vanish from the
  samples that still arrive; no counter rises.

Benign noise follows in ``apply``: isolated corrected errors, a lone row remap, NVLink and
PCIe retry bursts (retried in hardware, the job does not notice), and application Xids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sim.fleet import EventRow, FleetModel

__all__ = ["COLLAPSE_VANISH", "app_xids", "apply", "collapse", "terminal"]

MEMORY, THERMAL, NVLINK, PCIE, GPU_LOST = 0, 1, 2, 3, 5
COLLAPSE_VANISH = ("power_w", "temp_mem_c", "mem_clock_mhz", "util_mem_pct", "mem_used_mib")
"""The readings that vanish in a telemetry collapse (NVML calls a failing GPU stops
answering first)."""
_COLLAPSE_DROP = 0.9  # share of samples missing at the end of a collapse (grows as p^2)
_COLLAPSE_VANISH_FROM = 0.5  # progress after which COLLAPSE_VANISH are null
_BURST = 15.0  # corrected errors per cluster, memory shape "bursts"
# progress after which a remap stays pending / the PCIe link drops lanes, per shape
# (absent: the kind's own parameter; above 1: never)
_REMAP_FROM = {"early": 0.2, "late": 0.9, "never": 2.0}
_WIDTH_FROM = {"early": 0.2, "never": 2.0}

_XID_TEXT = {
    13: "Graphics Engine Exception",
    31: "GPU memory page fault (MMU fault)",
    43: "GPU stopped processing (reset channel)",
    48: "DBE (Double Bit Error) ECC Error",
    63: "ECC page retirement or row remapping recording event",
    74: "NVLink Error",
    79: "GPU has fallen off the bus",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    119: "GSP RPC timeout",
}


def _xid(ts_ms: int, n: int, i: int, xid: int) -> EventRow:
    text = _XID_TEXT.get(xid, "Xid")
    return (ts_ms, n, i, "xid", xid, f"NVRM: Xid {xid}, {text}", "kmsg")


def _geometric(start: float, end: float, p: np.ndarray) -> np.ndarray:
    return start * (end / start) ** p


def _bursts(rng: np.random.Generator, hit: np.ndarray, mean: float) -> np.ndarray:
    """Counts of a burst at each hit: 1 + Poisson(mean - 1)."""
    out = np.zeros(hit.size, dtype=np.int64)
    k = np.flatnonzero(hit)
    if k.size:
        out[k] = 1 + rng.poisson(max(mean - 1.0, 0.0), k.size)
    return out


def collapse(m: FleetModel, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Telemetry collapse before a GPU falls off the bus (``kinds.gpu_lost.collapse``):
    which GPUs' samples are missing this tick, and which report no :data:`COLLAPSE_VANISH`."""
    g = m.g
    drop, vanish = np.zeros(g, dtype=bool), np.zeros(g, dtype=bool)
    if not m.params["kinds"]["gpu_lost"].get("collapse", False):
        return drop, vanish
    idx = np.flatnonzero(live & m.has_prec & (m.tf >= m.onset_f) & (m.kind == GPU_LOST))
    if idx.size:
        span = np.maximum(m.fail_f[idx] - m.onset_f[idx], 1e-9)
        p = np.clip((m.tf - m.onset_f[idx]) / span, 0, 1)
        drop[idx] = m.rng.random(idx.size) < _COLLAPSE_DROP * p * p
        vanish[idx] = p >= _COLLAPSE_VANISH_FROM
    return drop, vanish


def apply(
    m: FleetModel, dt: float, dtf: float, live: np.ndarray, ts_ms: int, events: list[EventRow]
) -> tuple[np.ndarray, np.ndarray]:
    """Advance counters by one tick; returns the thermal-resistance factor and PCIe width."""
    rng, kinds, noise = m.rng, m.params["kinds"], m.params["noise"]
    counts, g = m.counters.counts, m.g
    deg = live & m.has_prec & (m.tf >= m.onset_f)
    r_factor = np.ones(g)
    width = np.where(m.x8, 8, int(m.params["fleet"]["pcie_link_width_max"])).astype(np.int64)

    # Benign noise, all GPUs at once (rates per wall-clock day, lemon nodes noisier).
    day = dt / 86400.0 * m.noise_mult
    u = rng.random((4, g))
    sbe = _bursts(rng, live & (u[0] < noise["sbe_rate_per_gpu_day"] * day), noise["sbe_burst_mean"])
    crc = _bursts(
        rng,
        live & (u[1] < noise["nvlink_crc_burst_rate_per_gpu_day"] * day),
        noise["nvlink_crc_burst_mean"],
    )
    replay = _bursts(
        rng,
        live & (u[2] < noise["pcie_replay_burst_rate_per_gpu_day"] * day),
        noise["pcie_replay_burst_mean"],
    )
    remap = (live & (u[3] < noise["benign_remap_rate_per_gpu_day"] * day)).astype(np.int64)
    recov = (crc > 0).astype(np.int64)
    m.counters.remap_pending |= remap > 0

    idx = np.flatnonzero(deg)
    if idx.size:
        p = np.clip(
            (m.tf - m.onset_f[idx]) / np.maximum(m.fail_f[idx] - m.onset_f[idx], 1e-9), 0, 1
        )
        k = m.kind[idx]
        shapes = m.params["shapes"]
        mem = k == MEMORY
        if mem.any():
            s = kinds["memory"]
            gi, pm = idx[mem], p[mem]
            rate_h = _geometric(s["sbe_start_per_h"], s["sbe_end_per_h"], pm)
            if shapes["memory"] == "bursts":
                # the same mean rate in clusters of ~BURST errors (self-exciting arrivals)
                n_burst = rng.poisson(rate_h / _BURST * dtf / 3600.0)
                n = rng.poisson(_BURST * n_burst)
            else:
                n = rng.poisson(rate_h * dtf / 3600.0)
            sbe[gi] += n
            rm = rng.binomial(n, 1.0 / max(s["remap_every_sbe"], 1.0))
            remap[gi] += rm
            pending_from = _REMAP_FROM.get(shapes["memory_remap"], s["remap_pending_from"])
            m.counters.remap_pending[gi] |= (rm > 0) & (pm >= pending_from)
            storm = (rate_h >= s["storm_per_h"]) & ~m.storm_sent[gi]
            for j in gi[storm].tolist():
                m.storm_sent[j] = True
                n_, i_ = int(m.node_of[j]), int(m.gpu_index[j])
                msg = "corrected ECC error rate above threshold"
                events.append((ts_ms, n_, i_, "ecc_storm", -1, msg, "nvml"))
        th = k == THERMAL
        if th.any():
            w = m.params["workload"]
            gi, pt = idx[th], p[th]
            full = w["load_rise_c"] * w["train_util_pct"] / 100.0
            base = w["ambient_c"] + m.workload.offset_c[gi]
            f_end = np.maximum((w["shutdown_c"] + 2.0 - base) / full, 1.2)
            if shapes["thermal"] == "time":
                grow = pt
            elif shapes["thermal"] == "step":  # a fan dies: nearly flat, then a jump
                grow = np.where(pt >= 0.8, 0.9 + 0.5 * (pt - 0.8), 0.05 * pt)
            else:
                grow = pt**2
            f = 1.0 + (f_end - 1.0) * grow
            r_factor[gi] = np.maximum(r_factor[gi], f)
            share = kinds["thermal"]["neighbour_share"]
            for j, fj in zip(gi.tolist(), f.tolist(), strict=True):
                for nb in (j - 1, j + 1):
                    if 0 <= nb < g and m.node_of[nb] == m.node_of[j]:
                        r_factor[nb] = max(r_factor[nb], 1.0 + share * (fj - 1.0))
        nv = k == NVLINK
        if nv.any():
            s = kinds["nvlink"]
            gi, pn = idx[nv], p[nv]
            if shapes["nvlink"] == "steps":
                pn = np.floor(pn * 4.0) / 4.0
            n = rng.poisson(_geometric(s["crc_start_per_min"], s["crc_end_per_min"], pn) * dtf / 60)
            crc[gi] += n
            rec = rng.poisson(s["recovery_per_min"] * dtf / 60.0 * (pn >= s["recovery_from"]))
            recov[gi] += rec
        pc = k == PCIE
        if pc.any():
            s = kinds["pcie"]
            gi, pp = idx[pc], p[pc]
            pr = np.floor(pp * 4.0) / 4.0 if shapes["pcie"] == "steps" else pp
            rate = _geometric(s["replay_start_per_min"], s["replay_end_per_min"], pr)
            replay[gi] += rng.poisson(rate * dtf / 60.0)
            drop_from = _WIDTH_FROM.get(shapes["pcie_width"], s["width_drop_from"])
            drop = m.width_drop[gi] & (pp >= drop_from)
            width[gi[drop]] = int(s["width_dropped"])

    s = kinds["nvlink"]
    if crc.any():
        counts["nvlink_crc_flit"] += crc
        counts["nvlink_replay"] += rng.binomial(crc, s["replay_per_crc"])
        counts["nvlink_crc_data"] += rng.binomial(crc, s["data_per_crc"])
    counts["nvlink_recovery"] += recov
    counts["pcie_replay"] += replay
    counts["ecc_sbe_volatile"] += sbe
    counts["ecc_sbe_aggregate"] += sbe
    if remap.any():
        counts["remap_correctable"] += remap
        for j in np.flatnonzero(remap).tolist():
            events.append(_xid(ts_ms, int(m.node_of[j]), int(m.gpu_index[j]), 63))
    return r_factor, width


def terminal(
    m: FleetModel, g: int, kind: int, xid: int, ts_ms: int, events: list[EventRow]
) -> None:
    """The failure itself: the last counter moves and the events the GPU's death shows."""
    n, i = int(m.node_of[g]), int(m.gpu_index[g])
    counts = m.counters.counts
    if kind == MEMORY:
        dbe = 1 + int(m.rng.poisson(0.5))
        for k in ("ecc_dbe_volatile", "ecc_dbe_aggregate"):
            counts[k][g] += dbe
        counts["remap_uncorrectable"][g] += 1
        m.counters.remap_pending[g] = True
        events.append(_xid(ts_ms, n, i, 48))
        unc = m.rng.random() < m.params["kinds"]["memory"]["uncontained_prob"]
        events.append(_xid(ts_ms, n, i, 95 if unc else 94))
    elif kind == THERMAL:
        msg = "GPU shut down: temperature above the hardware limit"
        events.append((ts_ms, n, i, "thermal_shutdown", -1, msg, "nvml"))
    elif kind == NVLINK:
        events.append(_xid(ts_ms, n, i, 74))
        events.append((ts_ms, n, i, "link_down", -1, "NVLink link down", "nvml"))
    elif kind == PCIE:
        events.append(_xid(ts_ms, n, i, 79))
        events.append((ts_ms, n, i, "gpu_lost", -1, "GPU fell off the PCIe bus", "nvml"))
    else:
        if xid:
            events.append(_xid(ts_ms, n, i, xid))
        if xid == 79:
            events.append((ts_ms, n, i, "gpu_lost", -1, "GPU not reachable", "nvml"))


def app_xids(m: FleetModel, nodes: np.ndarray, ts_ms: int, events: list[EventRow]) -> None:
    """An application crash on each node: the same Xid on every GPU of its job."""
    mix = m.params["noise"]["app_xid_mix"]
    pairs = sorted((int(k), float(v)) for k, v in mix.items())  # key order must not matter
    codes = np.array([c for c, _ in pairs])
    w = np.array([v for _, v in pairs])
    picks = codes[m.rng.choice(codes.size, nodes.size, p=w / w.sum())]
    for n, xid in zip(nodes.tolist(), picks.tolist(), strict=True):
        for g in range(n * m.gpn, (n + 1) * m.gpn):
            if m.up[g]:
                events.append(_xid(ts_ms, n, int(m.gpu_index[g]), int(xid)))
