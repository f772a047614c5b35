"""The simulated fleet as a dcgm-exporter: its current readings in the Prometheus text format.

``forewarn simulate --serve-dcgm-exporter PORT`` serves ``/metrics`` the way NVIDIA's
dcgm-exporter does on a GPU node, so that a real Prometheus can scrape a simulated fleet and
everything downstream (Prometheus' storage, ``forewarn import prometheus``, the collector's
``dcgm-exporter`` source) sees the series it would see on real hardware:

- the ``DCGM_FI_DEV_*`` names of dcgm-exporter's counters CSV, one series per GPU and field,
  with its labels ``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName`` and
  ``Hostname``; counters typed ``counter``, the rest ``gauge``;
- memory as ``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE`` (MiB), as the default CSV has
  it (the total is their sum);
- ``DCGM_FI_DEV_XID_ERRORS``: the last Xid seen on the GPU (0 before any);
- a field the GPU does not report (pre-Ampere retired pages on a simulated H100) is absent;
  a GPU with no sample this tick (lost, failed, a collector gap) has no series at all, so
  Prometheus marks its series stale.

:class:`DcgmExposition` turns readings into the text; :class:`ExporterServer` serves the latest
text from a thread (stdlib ``http.server``). It binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from forewarn.localhttp import BackgroundServer
from forewarn.wire import Event, EventKind, GpuSample

if TYPE_CHECKING:
    from sim.source import NodeBatch

__all__ = ["EXPORTED", "MODEL_NAME", "DcgmExposition", "ExporterServer", "render"]

MODEL_NAME = "NVIDIA H100 80GB HBM3"
"""The ``modelName`` label of every simulated GPU."""

# dcgm-exporter series -> (sample field, Prometheus type, help text as dcgm-exporter words it).
EXPORTED: dict[str, tuple[str, str, str]] = {
    "DCGM_FI_DEV_GPU_TEMP": ("temp_gpu_c", "gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_MEMORY_TEMP": ("temp_mem_c", "gauge", "Memory temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", "gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", "gauge", "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_MEM_CLOCK": ("mem_clock_mhz", "gauge", "Memory clock frequency (in MHz)."),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": (
        "throttle_reasons",
        "gauge",
        "Current clock event reasons (bitmask).",
    ),
    "DCGM_FI_DEV_GPU_UTIL": ("util_gpu_pct", "gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("util_mem_pct", "gauge", "Memory utilization (in %)."),
    "DCGM_FI_DEV_FB_USED": ("mem_used_mib", "gauge", "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("ecc_sbe_volatile", "counter", "Total SBE (volatile)."),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc_dbe_volatile", "counter", "Total DBE (volatile)."),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": ("ecc_sbe_aggregate", "counter", "Total SBE (aggregate)."),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("ecc_dbe_aggregate", "counter", "Total DBE (aggregate)."),
    "DCGM_FI_DEV_RETIRED_SBE": ("retired_pages_sbe", "counter", "Pages retired (SBE)."),
    "DCGM_FI_DEV_RETIRED_DBE": ("retired_pages_dbe", "counter", "Pages retired (DBE)."),
    "DCGM_FI_DEV_RETIRED_PENDING": ("retired_pages_pending", "gauge", "Pages pending retire."),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": (
        "remap_correctable",
        "counter",
        "Number of remapped rows for correctable errors.",
    ),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (
        "remap_uncorrectable",
        "counter",
        "Number of remapped rows for uncorrectable errors.",
    ),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("remap_pending", "gauge", "Row remap pending."),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("remap_failure", "gauge", "Row remap failed."),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": (
        "nvlink_crc_flit",
        "counter",
        "Total number of NVLink flow-control CRC errors.",
    ),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": (
        "nvlink_crc_data",
        "counter",
        "Total number of NVLink data CRC errors.",
    ),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": (
        "nvlink_replay",
        "counter",
        "Total number of NVLink retries.",
    ),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": (
        "nvlink_recovery",
        "counter",
        "Total number of NVLink recovery errors.",
    ),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replay", "counter", "Total number of PCIe retries."),
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": ("pcie_link_width", "gauge", "PCIe link width (lanes)."),
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": ("pcie_link_width_max", "gauge", "PCIe max link width."),
    "DCGM_FI_DEV_PCIE_LINK_GEN": ("pcie_link_gen", "gauge", "PCIe link generation."),
}
_FB_FREE = ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).")
_XID = ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")


class _Row:
    """A sample read from columns, with the attributes ``render`` reads (None: not reported)."""

    __slots__ = ("_values", "node")

    def __init__(self, node: str, values: dict[str, Any]) -> None:
        self.node = node
        self._values = values

    def __getattr__(self, name: str) -> Any:
        return self._values.get(name)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float | int | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def _labels(s: GpuSample, model_name: str) -> str:
    bus = f"00000000:{(0x18 + 0x10 * s.gpu) % 256:02X}:00.0"
    pairs = (
        ("gpu", str(s.gpu)),
        ("UUID", s.uuid or ""),
        ("pci_bus_id", bus),
        ("device", f"nvidia{s.gpu}"),
        ("modelName", model_name),
        ("Hostname", s.node),
    )
    return ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)


def render(
    samples: Iterable[Any], last_xid: dict[tuple[str, int], int], model_name: str = MODEL_NAME
) -> str:
    """The ``/metrics`` text for these samples (one per GPU) and the last Xid of each GPU.

    A sample is a :class:`GpuSample` or anything with its attributes (a row read from columns).
    """
    rows = sorted(samples, key=lambda s: (s.node, s.gpu))
    labels = [_labels(s, model_name) for s in rows]
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, values: list[tuple[str, str]]) -> None:
        if not values:
            return
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{lab}}} {v}" for lab, v in values)

    for name, (field, kind, help_text) in EXPORTED.items():
        values = []
        for s, lab in zip(rows, labels, strict=True):
            v = getattr(s, field)
            if v is not None:
                values.append((lab, _number(v)))
        family(name, kind, help_text, values)
        if field == "mem_used_mib":
            free = [
                (lab, _number(s.mem_total_mib - s.mem_used_mib))
                for s, lab in zip(rows, labels, strict=True)
                if s.mem_total_mib is not None and s.mem_used_mib is not None
            ]
            family(*_FB_FREE, free)
    xids = [
        (lab, str(last_xid.get((s.node, s.gpu), 0))) for s, lab in zip(rows, labels, strict=True)
    ]
    family(*_XID, xids)
    return "\n".join(lines) + "\n"


class DcgmExposition:
    """The latest ``/metrics`` text of a fleet, updated tick by tick (thread-safe).

    Args:
        model_name: the ``modelName`` label.
    """

    def __init__(self, model_name: str = MODEL_NAME) -> None:
        self.model_name = model_name
        self._last_xid: dict[tuple[str, int], int] = {}
        self._text = ""
        self._lock = threading.Lock()

    def update(self, readings: Iterable[GpuSample | Event]) -> None:
        """Replace the served text with this tick's samples; Xid events update the last Xid."""
        readings = list(readings)
        self._update(
            [r for r in readings if isinstance(r, GpuSample)],
            [r for r in readings if isinstance(r, Event)],
        )

    def update_batches(self, batches: Iterable[NodeBatch]) -> None:
        """:meth:`update` from the columnar batches of ``SimulatedSource.read_batches``."""
        samples: list[Any] = []
        events: list[Event] = []
        for batch in batches:
            cols = batch.columns
            names = list(cols)
            for values in zip(*cols.values(), strict=True):
                samples.append(_Row(batch.node, dict(zip(names, values, strict=True))))
            events.extend(batch.events)
        self._update(samples, events)

    def _update(self, samples: list[Any], events: Iterable[Event]) -> None:
        for r in events:
            if r.kind == EventKind.XID and r.gpu is not None and r.xid is not None:
                self._last_xid[(r.node, r.gpu)] = int(r.xid)
        text = render(samples, self._last_xid, self.model_name)
        with self._lock:
            self._text = text

    def text(self) -> str:
        with self._lock:
            return self._text


class ExporterServer(BackgroundServer):
    """Serves ``exposition`` on ``http://host:port/metrics`` (port 0: any free port)."""

    thread_name = "forewarn-sim-dcgm-exporter"

    def __init__(self, exposition: DcgmExposition, host: str = "127.0.0.1", port: int = 0) -> None:
        self.exposition = exposition
        super().__init__(_handler(exposition), host, port)

    @property
    def url(self) -> str:
        return f"{self.base_url}/metrics"


def _handler(exposition: DcgmExposition) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "forewarn-sim-dcgm-exporter"

        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")
                return
            body = exposition.text().encode()
            self._send(200, "text/plain; version=0.0.4; charset=utf-8", body)

        def _send(self, status: int, ctype: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # one line per scrape would drown the simulator's own output

    return Handler
