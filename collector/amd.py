"""AMD GPUs through AMD SMI (the ``amdsmi`` Python package of ROCm), imported lazily.

Per GPU and tick: ECC per block summed over the blocks (correctable, uncorrectable,
deferred; ``amdsmi_get_gpu_ecc_count`` with ``AmdSmiGpuBlock`` members, falling back to
``amdsmi_get_gpu_total_ecc_count``), bad pages (``amdsmi_get_gpu_bad_page_info``: retired and
pending), temperatures (edge; hotspot/junction; HBM/VRAM), power, clocks, activity, VRAM,
throttle status (``amdsmi_get_gpu_metrics_info``), PCIe replays and link, and the XGMI error
status. Events come from ``AmdSmiEventReader`` (VM faults, thermal throttling, GPU resets).

Mapping to the NVIDIA-shaped schema: ECC per block -> ``ecc_sbe_volatile`` (correctable),
``ecc_dbe_volatile`` (uncorrectable), ``ecc_deferred``; bad pages -> ``retired_pages_dbe``
and ``retired_pages_pending``. XGMI reports an error *status*, not a counter, so a status
other than NO_ERRORS becomes a ``link_down`` event rather than a fake NVLink count.
Unsupported calls (``AMDSMI_STATUS_NOT_SUPPORTED``) leave their field null; a GPU whose calls
fail with "not found", I/O or DRM errors is treated as lost until it answers again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from collector.base import Reading
from collector.nvml import normalise_bus_id
from forewarn.errors import SourceUnavailable
from forewarn.wire import Event, EventKind, GpuSample, Vendor

__all__ = ["AmdSource", "import_amdsmi"]

log = logging.getLogger("forewarn.collector.amd")

_LOST_CODES = ("ERR_NOT_FOUND", "FILE_ERROR", "DRM_ERROR", "ERR_IO", "NOT_INIT")
_EVENT_KINDS = ("VMFAULT", "THERMAL_THROTTLE", "GPU_PRE_RESET", "GPU_POST_RESET", "RING_HANG")


def import_amdsmi() -> ModuleType:
    try:
        import amdsmi  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except (ImportError, OSError) as exc:  # OSError: the package is there, libamd_smi.so not
        raise SourceUnavailable(
            f"the AMD source needs ROCm and amdsmi ({exc}): pip install 'forewarn[amd]'"
        ) from None
    return amdsmi  # type: ignore[no-any-return]


def _num(value: Any) -> float | None:
    """AMD SMI answers "N/A" (or a max-uint sentinel) for values it lacks."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if value in (0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF):
        return None
    return float(value)


class _Lost(Exception):
    pass


class AmdSource:
    """Reads every AMD GPU of this node.

    Args:
        node: this node's name.
        amdsmi: the ``amdsmi`` module (default: imported now).
        events: start the event reader thread.

    Raises:
        SourceUnavailable: the library is missing, cannot initialise, or finds no GPU.
    """

    name = "amdsmi"

    def __init__(self, node: str, *, amdsmi: Any = None, events: bool = True) -> None:
        self.node = node
        self.smi = smi = amdsmi if amdsmi is not None else import_amdsmi()
        try:
            smi.amdsmi_init()
            self.handles = list(smi.amdsmi_get_processor_handles())
        except smi.AmdSmiException as exc:
            raise SourceUnavailable(f"AMD SMI cannot start: {exc}") from None
        if not self.handles:
            smi.amdsmi_shut_down()
            raise SourceUnavailable("AMD SMI found no GPU on this node")
        self.uuids = [self._call(smi.amdsmi_get_gpu_device_uuid, h) for h in self.handles]
        self.bdfs = [self._call(smi.amdsmi_get_gpu_device_bdf, h) for h in self.handles]
        self.lost = [False] * len(self.handles)
        self._xgmi_bad = [False] * len(self.handles)
        self._pending: deque[Event] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        if events:
            self._start_events()

    def bus_ids(self) -> dict[str, int]:
        return {normalise_bus_id(b): i for i, b in enumerate(self.bdfs) if b}

    def _code(self, exc: Exception) -> int | None:
        return getattr(exc, "err_code", None)

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; None when unsupported; :class:`_Lost` when the GPU is gone."""
        smi = self.smi
        try:
            return fn(*args)
        except smi.AmdSmiLibraryException as exc:
            codes = {int(getattr(smi.AmdSmiRetCode, c)) for c in _LOST_CODES}
            if self._code(exc) in codes:
                raise _Lost(str(exc)) from None
            return None
        except smi.AmdSmiException:
            return None

    def read(self, now: datetime) -> list[Reading]:
        out: list[Reading] = []
        for i, h in enumerate(self.handles):
            try:
                sample = self._sample(i, h, now)
            except _Lost as exc:
                if not self.lost[i]:
                    self.lost[i] = True
                    out.append(self._event(i, now, EventKind.GPU_LOST, f"AMD SMI: {exc}"))
                continue
            if self.lost[i]:
                self.lost[i] = False
                out.append(self._event(i, now, EventKind.GPU_RECOVERED, "AMD SMI: GPU answers"))
            out.append(sample)
        with self._lock:
            out.extend(self._pending)
            self._pending.clear()
        return out

    def _event(self, gpu: int, now: datetime, kind: EventKind, msg: str) -> Event:
        return Event(
            node=self.node, gpu=gpu, ts=now, kind=kind, message=msg[:2000], source="amdsmi"
        )

    def _ecc(self, h: Any) -> tuple[int | None, int | None, int | None]:
        smi, c = self.smi, self._call
        total: list[int] | None = None
        for block in smi.AmdSmiGpuBlock:
            if block.name in ("INVALID", "RESERVED"):
                continue
            counts = c(smi.amdsmi_get_gpu_ecc_count, h, block)
            if not isinstance(counts, dict):
                continue
            total = total or [0, 0, 0]
            for k, key in enumerate(("correctable_count", "uncorrectable_count", "deferred_count")):
                total[k] += int(_num(counts.get(key)) or 0)
        if total is None:
            counts = c(smi.amdsmi_get_gpu_total_ecc_count, h)
            if not isinstance(counts, dict):
                return None, None, None
            vals = [
                _num(counts.get(k))
                for k in ("correctable_count", "uncorrectable_count", "deferred_count")
            ]
            return tuple(int(v) if v is not None else None for v in vals)  # type: ignore[return-value]
        return total[0], total[1], total[2]

    def _sample(self, i: int, h: Any, now: datetime) -> GpuSample:
        smi, c = self.smi, self._call
        temp_t, metric = smi.AmdSmiTemperatureType, smi.AmdSmiTemperatureMetric.CURRENT
        activity = c(smi.amdsmi_get_gpu_activity, h) or {}
        vram = c(smi.amdsmi_get_gpu_vram_usage, h) or {}
        power = c(smi.amdsmi_get_power_info, h) or {}
        metrics = c(smi.amdsmi_get_gpu_metrics_info, h) or {}
        pcie = c(smi.amdsmi_get_pcie_info, h) or {}
        edge = c(smi.amdsmi_get_temp_metric, h, temp_t.EDGE, metric)
        hotspot = c(smi.amdsmi_get_temp_metric, h, temp_t.HOTSPOT, metric)
        hbm = c(smi.amdsmi_get_temp_metric, h, temp_t.VRAM, metric)
        if hbm is None:
            hbm = c(smi.amdsmi_get_temp_metric, h, temp_t.HBM_0, metric)
        sbe, dbe, deferred = self._ecc(h)
        pages = c(smi.amdsmi_get_gpu_bad_page_info, h)
        retired = pending = None
        if isinstance(pages, list):
            status = smi.AmdSmiMemoryPageStatus
            retired = sum(1 for p in pages if p.get("status") == status.RESERVED)
            pending = any(p.get("status") == status.PENDING for p in pages)
        elif pages is not None:  # older releases answer "No bad pages found."
            retired, pending = 0, False
        replay = c(smi.amdsmi_get_gpu_pci_replay_counter, h)
        if replay is None:
            replay = _num(metrics.get("pcie_replay_count_acc"))
        gfx = c(smi.amdsmi_get_clock_info, h, smi.AmdSmiClkType.GFX) or {}
        mem = c(smi.amdsmi_get_clock_info, h, smi.AmdSmiClkType.MEM) or {}
        width = _num(pcie.get("pcie_metric", {}).get("pcie_width")) or _num(
            metrics.get("pcie_link_width")
        )
        width_max = _num(pcie.get("pcie_static", {}).get("max_pcie_width"))
        gen = _num(pcie.get("pcie_static", {}).get("pcie_interface_version"))
        throttle = _num(metrics.get("throttle_status"))
        if throttle is None:
            throttle = _num(metrics.get("indep_throttle_status"))
        watts = _num(power.get("socket_power")) or _num(power.get("current_socket_power"))
        if watts is None:
            watts = _num(power.get("average_socket_power"))
        xgmi = c(smi.amdsmi_gpu_xgmi_error_status, h)
        bad = xgmi is not None and int(xgmi) != int(smi.AmdSmiXgmiStatus.NO_ERRORS)
        # The status stays set until reset: one event when it turns bad, not one per tick.
        if bad and not self._xgmi_bad[i]:
            with self._lock:
                self._pending.append(
                    self._event(
                        i, now, EventKind.LINK_DOWN, f"AMD SMI: XGMI error status {int(xgmi)}"
                    )
                )
        self._xgmi_bad[i] = bad
        used, total = _num(vram.get("vram_used")), _num(vram.get("vram_total"))
        return GpuSample(
            node=self.node,
            gpu=i,
            ts=now,
            uuid=self.uuids[i],
            vendor=Vendor.AMD,
            temp_gpu_c=_num(hotspot) if hotspot is not None else _num(edge),
            temp_mem_c=_num(hbm),
            power_w=watts,
            sm_clock_mhz=_num(gfx.get("clk", gfx.get("cur_clk"))),
            mem_clock_mhz=_num(mem.get("clk", mem.get("cur_clk"))),
            throttle_reasons=int(throttle) if throttle is not None else None,
            util_gpu_pct=_num(activity.get("gfx_activity")),
            util_mem_pct=_num(activity.get("umc_activity")),
            mem_used_mib=used,
            mem_total_mib=total,
            ecc_sbe_volatile=sbe,
            ecc_dbe_volatile=dbe,
            ecc_deferred=deferred,
            retired_pages_dbe=retired,
            retired_pages_pending=pending,
            pcie_replay=int(replay) if replay is not None else None,
            pcie_link_width=int(width) if width is not None else None,
            pcie_link_width_max=int(width_max) if width_max is not None else None,
            pcie_link_gen=int(gen) if gen is not None else None,
        )

    # -- events ----------------------------------------------------------------------------

    def _start_events(self) -> None:
        smi = self.smi
        kinds = [
            getattr(smi.AmdSmiEvtNotificationType, k)
            for k in _EVENT_KINDS
            if hasattr(smi.AmdSmiEvtNotificationType, k)
        ]
        for i, h in enumerate(self.handles):
            try:
                reader = smi.AmdSmiEventReader(h, kinds)
            except smi.AmdSmiException as exc:
                log.info("GPU %d: AMD SMI events unavailable (%s)", i, exc)
                continue
            t = threading.Thread(
                target=self._event_loop,
                args=(i, reader),
                daemon=True,
                name=f"forewarn-amd-events-{i}",
            )
            t.start()
            self._threads.append(t)

    def _event_loop(self, i: int, reader: Any) -> None:
        smi = self.smi
        try:
            while not self._stop.is_set():
                try:
                    events = reader.read(200)
                except smi.AmdSmiException:
                    self._stop.wait(0.2)  # a timeout (no event) or a transient error
                    continue
                for ev in events or ():
                    name = getattr(ev.get("event"), "name", str(ev.get("event")))
                    kind = None  # throttling is in the samples; VM faults are the job's
                    if name == "GPU_PRE_RESET":
                        kind = EventKind.GPU_LOST
                    elif name == "GPU_POST_RESET":
                        kind = EventKind.GPU_RECOVERED
                    if kind is None:
                        continue
                    msg = f"AMD SMI event {name}: {ev.get('message', '')}"
                    with self._lock:
                        self._pending.append(self._event(i, datetime.now(UTC), kind, msg))
        finally:
            with contextlib.suppress(smi.AmdSmiException):
                reader.stop()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with contextlib.suppress(self.smi.AmdSmiException):
            self.smi.amdsmi_shut_down()
