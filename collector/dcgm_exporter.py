"""Scraping an existing dcgm-exporter: its ``/metrics`` text mapped to the sample schema.

Clusters that already run NVIDIA's dcgm-exporter need no new agent on their GPUs: this source
fetches the Prometheus text every tick and turns each GPU's ``DCGM_FI_*`` series into one
:class:`~forewarn.wire.GpuSample`. Which series exist depends on the exporter's counters CSV;
a missing series leaves its field null. ``DCGM_FI_DEV_XID_ERRORS`` holds the *last* Xid seen:
a change to a non-zero value becomes an ``xid`` event (the first scrape only records the
value, since when it happened is unknown; the same Xid twice in a row shows no change — run
the kernel-log source beside it where Xids matter). The mapping is in ``docs/telemetry.md``.

dcgm-exporter refreshes its values every 30 s by default (``-c`` collect interval): sampling
faster repeats the same readings under new timestamps.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx

from collector.base import Reading
from collector.nvml import normalise_bus_id
from collector.xid import describe
from forewarn.errors import SourceUnavailable
from forewarn.wire import Event, EventKind, GpuSample, Vendor

__all__ = ["DCGM_FIELDS", "DcgmExporterSource", "parse_metrics", "to_readings"]

# DCGM series -> (sample field, converter). Two names for one field: the first present wins.
_int, _float, _bool = int, float, (lambda v: v != 0)
DCGM_FIELDS: dict[str, tuple[str, Callable[[float], Any]]] = {
    "DCGM_FI_DEV_GPU_TEMP": ("temp_gpu_c", _float),
    "DCGM_FI_DEV_MEMORY_TEMP": ("temp_mem_c", _float),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", _float),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", _float),
    "DCGM_FI_DEV_MEM_CLOCK": ("mem_clock_mhz", _float),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("throttle_reasons", _int),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("throttle_reasons", _int),
    "DCGM_FI_DEV_GPU_UTIL": ("util_gpu_pct", _float),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("util_mem_pct", _float),
    "DCGM_FI_DEV_FB_USED": ("mem_used_mib", _float),
    "DCGM_FI_DEV_FB_TOTAL": ("mem_total_mib", _float),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("ecc_sbe_volatile", _int),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc_dbe_volatile", _int),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": ("ecc_sbe_aggregate", _int),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("ecc_dbe_aggregate", _int),
    "DCGM_FI_DEV_RETIRED_SBE": ("retired_pages_sbe", _int),
    "DCGM_FI_DEV_RETIRED_DBE": ("retired_pages_dbe", _int),
    "DCGM_FI_DEV_RETIRED_PENDING": ("retired_pages_pending", _bool),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("remap_correctable", _int),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("remap_uncorrectable", _int),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("remap_pending", _bool),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("remap_failure", _bool),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": ("nvlink_crc_flit", _int),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": ("nvlink_crc_data", _int),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": ("nvlink_replay", _int),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": ("nvlink_recovery", _int),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replay", _int),
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": ("pcie_link_width", _int),
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": ("pcie_link_width_max", _int),
    "DCGM_FI_DEV_PCIE_LINK_GEN": ("pcie_link_gen", _int),
}
_EXTRA = {"DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_XID_ERRORS"}
_WANTED = set(DCGM_FIELDS) | _EXTRA

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Series = tuple[str, dict[str, str], float]


def parse_metrics(text: str, wanted: set[str] | None = _WANTED) -> list[Series]:
    """Parse Prometheus text exposition into (name, labels, value); bad lines are skipped."""
    out: list[Series] = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if wanted is not None:
            name_end = line.find("{")
            name = line[: name_end if name_end >= 0 else line.find(" ")]
            if name not in wanted:
                continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        labels = dict(_LABEL.findall(m[2])) if m[2] else {}
        out.append((m[1], labels, value))
    return out


def _gpu_index(labels: dict[str, str]) -> int | None:
    raw = labels.get("gpu", "")
    return int(raw) if raw.isdigit() and int(raw) <= 255 else None


def to_readings(
    series: list[Series],
    *,
    node: str | None,
    now: datetime,
    last_xid: dict[tuple[str, int], int],
) -> list[Reading]:
    """Samples (one per GPU) and Xid events from parsed series.

    ``node=None`` takes each GPU's node from its ``Hostname`` label (a central scraper).
    ``last_xid`` carries the last ``DCGM_FI_DEV_XID_ERRORS`` per GPU between calls.
    """
    per_gpu: dict[tuple[str, int], dict[str, Any]] = {}
    extra: dict[tuple[str, int], dict[str, float]] = {}
    for name, labels, value in series:
        gpu = _gpu_index(labels)
        host = node or labels.get("Hostname")
        if gpu is None or not host:
            continue
        key = (host, gpu)
        row = per_gpu.setdefault(key, {"uuid": labels.get("UUID") or None})
        if name in _EXTRA:
            extra.setdefault(key, {})[name] = value
            continue
        field, conv = DCGM_FIELDS[name]
        row.setdefault(field, conv(value))
    out: list[Reading] = []
    for (host, gpu), row in per_gpu.items():
        more = extra.get((host, gpu), {})
        if "mem_total_mib" not in row and "mem_used_mib" in row and "DCGM_FI_DEV_FB_FREE" in more:
            row["mem_total_mib"] = (
                row["mem_used_mib"]
                + more["DCGM_FI_DEV_FB_FREE"]
                + more.get("DCGM_FI_DEV_FB_RESERVED", 0.0)
            )
        out.append(GpuSample(node=host, gpu=gpu, ts=now, vendor=Vendor.NVIDIA, **row))
        xid = more.get("DCGM_FI_DEV_XID_ERRORS")
        if xid is None:
            continue
        code, previous = int(xid), last_xid.get((host, gpu))
        last_xid[(host, gpu)] = code
        if previous is not None and code != previous and 0 < code <= 1023:
            out.append(
                Event(
                    node=host,
                    gpu=gpu,
                    ts=now,
                    kind=EventKind.XID,
                    xid=code,
                    message=describe(code, "dcgm-exporter DCGM_FI_DEV_XID_ERRORS"),
                    source="dcgm",
                )
            )
    return out


class DcgmExporterSource:
    """Scrapes ``url`` (e.g. ``http://localhost:9400/metrics``) each tick.

    Args:
        url: the exporter's metrics URL.
        node: name stamped on the rows (None: each GPU's ``Hostname`` label).
        timeout_s: limit for one scrape, seconds (keep it under the sampling interval).
        transport: an httpx transport (tests); default: the network.

    ``read`` raises :class:`SourceUnavailable` when the scrape fails or holds no GPU.
    """

    name = "dcgm-exporter"

    def __init__(
        self,
        url: str,
        *,
        node: str | None,
        timeout_s: float = 2.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url
        self.node = node
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s), transport=transport)
        self._last_xid: dict[tuple[str, int], int] = {}
        self._bus_ids: dict[str, int] = {}

    def bus_ids(self) -> dict[str, int]:
        """PCI bus id -> GPU index from the ``pci_bus_id`` labels seen (for the kernel log)."""
        return dict(self._bus_ids)

    def read(self, now: datetime) -> list[Reading]:
        try:
            response = self._http.get(self.url)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise SourceUnavailable(f"dcgm-exporter {self.url}: {exc}") from None
        series = parse_metrics(response.text)
        for _, labels, _ in series:
            bus, gpu = labels.get("pci_bus_id"), _gpu_index(labels)
            if bus and gpu is not None and bus not in self._bus_ids:
                with contextlib.suppress(ValueError, IndexError):
                    self._bus_ids[normalise_bus_id(bus)] = gpu
        readings = to_readings(series, node=self.node, now=now, last_xid=self._last_xid)
        if not readings:
            raise SourceUnavailable(f"dcgm-exporter {self.url}: no DCGM_FI_* GPU series")
        return readings

    def close(self) -> None:
        self._http.close()
