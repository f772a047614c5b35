"""Builders of wire rows for tests: plausible healthy readings unless told otherwise."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from forewarn.wire import GpuSample

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def sample_dict(node: str = "node-0", gpu: int = 0, ts: datetime | None = None, **fields: Any):  # type: ignore[no-untyped-def]
    """A sample as JSON-ready dict (what a collector posts)."""
    ts = ts or T0
    base: dict[str, Any] = {
        "node": node,
        "gpu": gpu,
        "ts": ts.isoformat(),
        "uuid": f"GPU-{node}-{gpu}",
        "vendor": "nvidia",
        "temp_gpu_c": 55.0 + gpu,
        "temp_mem_c": 60.0,
        "power_w": 410.5,
        "sm_clock_mhz": 1980.0,
        "throttle_reasons": 0,
        "util_gpu_pct": 97.0,
        "mem_used_mib": 70000.0,
        "mem_total_mib": 81559.0,
        "ecc_sbe_volatile": 2,
        "ecc_dbe_volatile": 0,
        "remap_correctable": 0,
        "remap_uncorrectable": 0,
        "remap_pending": False,
        "remap_failure": False,
        "nvlink_crc_flit": 10,
        "pcie_replay": 1,
        "pcie_link_width": 16,
        "pcie_link_gen": 5,
    }
    base.update(fields)
    return base


def fleet_dicts(nodes: int, gpus: int, ticks: int, start: datetime, step_s: float = 1.0):  # type: ignore[no-untyped-def]
    return [
        sample_dict(f"node-{n}", g, start + timedelta(seconds=t * step_s), ecc_sbe_volatile=t)
        for t in range(ticks)
        for n in range(nodes)
        for g in range(gpus)
    ]


def sample(**kwargs: Any) -> GpuSample:
    return GpuSample.model_validate(sample_dict(**kwargs))
