"""NVIDIA GPUs through NVML (the ``pynvml`` module of ``nvidia-ml-py``), imported lazily.

Per GPU and tick, the counters come from one ``nvmlDeviceGetFieldValues`` call (ECC totals,
retired pages, row remapping, NVLink error totals, memory temperature, PCIe replays); the
rest from the classic getters. A field a GPU does not report (retired pages on Ampere and
newer, row remapping before Ampere, NVLink on a PCIe card) is ``None``, never a crash.
Drivers too old for field values fall back to the per-value getters.

Xid, ECC and retirement events come from ``nvmlEventSetWait_v2`` on a background thread.
``NVML_ERROR_GPU_IS_LOST`` on any call turns into one ``gpu_lost`` event; the GPU is probed
again every ``lost_probe_s`` and a ``gpu_recovered`` event follows if it answers. The other
GPUs keep being read.

The NVML module is a parameter (``nvml=``): tests pass the fake in ``tests/fakes``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from collector.base import Reading
from collector.xid import describe
from forewarn.errors import SourceUnavailable
from forewarn.wire import Event, EventKind, GpuSample, Vendor

__all__ = ["FIELDS", "NvmlSource", "import_pynvml", "normalise_bus_id"]

log = logging.getLogger("forewarn.collector.nvml")

# Sample field -> NVML field-value constant name (resolved on the module at start-up).
FIELDS: dict[str, str] = {
    "ecc_sbe_volatile": "NVML_FI_DEV_ECC_SBE_VOL_TOTAL",
    "ecc_dbe_volatile": "NVML_FI_DEV_ECC_DBE_VOL_TOTAL",
    "ecc_sbe_aggregate": "NVML_FI_DEV_ECC_SBE_AGG_TOTAL",
    "ecc_dbe_aggregate": "NVML_FI_DEV_ECC_DBE_AGG_TOTAL",
    "retired_pages_sbe": "NVML_FI_DEV_RETIRED_SBE",
    "retired_pages_dbe": "NVML_FI_DEV_RETIRED_DBE",
    "retired_pages_pending": "NVML_FI_DEV_RETIRED_PENDING",
    "remap_correctable": "NVML_FI_DEV_REMAPPED_COR",
    "remap_uncorrectable": "NVML_FI_DEV_REMAPPED_UNC",
    "remap_pending": "NVML_FI_DEV_REMAPPED_PENDING",
    "remap_failure": "NVML_FI_DEV_REMAPPED_FAILURE",
    "nvlink_crc_flit": "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "nvlink_crc_data": "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "nvlink_replay": "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "nvlink_recovery": "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    "temp_mem_c": "NVML_FI_DEV_MEMORY_TEMP",
    "pcie_replay": "NVML_FI_DEV_PCIE_REPLAY_COUNTER",
}
_BOOL_FIELDS = {"retired_pages_pending", "remap_pending", "remap_failure"}
_FLOAT_FIELDS = {"temp_mem_c"}
# Event types we ask for (those a GPU does not support are masked out), and how each maps.
_EVENT_TYPES = (
    "nvmlEventTypeXidCriticalError",
    "nvmlEventTypeDoubleBitEccError",
    "nvmlEventTypeSingleBitEccErrorStorm",
    "nvmlEventTypeDramRetirementEvent",
    "nvmlEventTypeDramRetirementFailure",
    "nvmlEventTypeGpuUnavailableError",
)
_EVENT_XID = {  # events the driver also reports as an Xid: label them with that Xid
    "nvmlEventTypeDoubleBitEccError": 48,
    "nvmlEventTypeDramRetirementEvent": 63,
    "nvmlEventTypeDramRetirementFailure": 64,
}
_DEDUP_S = 5.0


def import_pynvml() -> ModuleType:
    """The ``pynvml`` module, or :class:`SourceUnavailable` saying what to install."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise SourceUnavailable(
            "the NVML source needs nvidia-ml-py: pip install 'forewarn[nvidia]'"
        ) from None
    return pynvml  # type: ignore[no-any-return]


def normalise_bus_id(bus_id: str | bytes) -> str:
    """``00000000:3B:00.0`` / ``0000:3b:00`` -> ``0000:3b:00`` (domain:bus:device, lower case)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:  # bus:device[.fn] without a domain
        parts = ["0000", *parts]
    domain, bus, dev = parts[-3], parts[-2], parts[-1].split(".")[0]
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Gpu:
    __slots__ = ("bus_id", "handle", "index", "lost_at", "uuid")

    def __init__(self, index: int, handle: Any, uuid: str | None, bus_id: str | None) -> None:
        self.index, self.handle, self.uuid, self.bus_id = index, handle, uuid, bus_id
        self.lost_at: float | None = None


class NvmlSource:
    """Reads every NVIDIA GPU of this node.

    Args:
        node: this node's name, stamped on every row.
        nvml: the ``pynvml`` module (default: imported now; :class:`SourceUnavailable` if
            absent or if the driver is not loaded).
        events: start the event thread (Xid, ECC, retirement).
        event_wait_ms: how long one ``nvmlEventSetWait_v2`` call blocks.
        lost_probe_s: how often a lost GPU is probed for recovery.

    Raises:
        SourceUnavailable: NVML cannot be loaded or initialised, or there is no GPU.
    """

    name = "nvml"

    def __init__(
        self,
        node: str,
        *,
        nvml: Any = None,
        events: bool = True,
        event_wait_ms: int = 200,
        lost_probe_s: float = 30.0,
        clock: Any = time.monotonic,
    ) -> None:
        self.node = node
        self.nv = nvml if nvml is not None else import_pynvml()
        self.lost_probe_s = lost_probe_s
        self.clock = clock
        nv = self.nv
        try:
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            raise SourceUnavailable(f"NVML cannot start: {exc}") from None
        if count == 0:
            nv.nvmlShutdown()
            raise SourceUnavailable("NVML found no GPU on this node")
        self._lost_at_start: list[int] = []
        self.gpus = [self._open(i) for i in range(count)]
        self._field_ids = [(name, getattr(nv, const)) for name, const in FIELDS.items()]
        self._fields_ok = True
        self._pending: deque[Event] = deque()
        self._recent: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if events:
            self._start_events(event_wait_ms)

    def _open(self, index: int) -> _Gpu:
        """GPU ``index``; one already lost (or refusing a handle) starts out lost."""
        nv = self.nv
        gpu = _Gpu(index, None, None, None)
        try:
            gpu.handle = nv.nvmlDeviceGetHandleByIndex(index)
            self._identify(gpu)
        except nv.NVMLError as exc:
            log.error("GPU %d does not answer NVML at start (%s); reported lost", index, exc)
            gpu.lost_at = self.clock()
            self._lost_at_start.append(index)
        return gpu

    def _identify(self, gpu: _Gpu) -> None:
        nv, handle = self.nv, gpu.handle
        gpu.uuid = self._try(lambda: _text(nv.nvmlDeviceGetUUID(handle))) or gpu.uuid
        pci = self._try(lambda: nv.nvmlDeviceGetPciInfo(handle))
        if pci is not None:
            gpu.bus_id = normalise_bus_id(pci.busId)

    def bus_ids(self) -> dict[str, int]:
        """PCI bus id (``0000:3b:00``) -> GPU index, for the kernel-log source."""
        return {g.bus_id: g.index for g in self.gpus if g.bus_id}

    # -- calls that may not be supported ---------------------------------------------------

    def _try(self, fn: Any) -> Any:
        """``fn()``, or None when this GPU does not support it. GPU lost propagates."""
        try:
            return fn()
        except self.nv.NVMLError_GpuIsLost:
            raise
        except self.nv.NVMLError:
            return None

    # -- reading ---------------------------------------------------------------------------

    def read(self, now: datetime) -> list[Reading]:
        out: list[Reading] = []
        for index in self._lost_at_start:
            out.append(self._event(index, now, EventKind.GPU_LOST, "NVML: GPU lost at start"))
        self._lost_at_start.clear()
        for gpu in self.gpus:
            if gpu.lost_at is not None:
                self._probe(gpu, now, out)
                continue
            try:
                out.append(self._sample(gpu, now))
            except self.nv.NVMLError_GpuIsLost:
                gpu.lost_at = self.clock()
                out.append(self._event(gpu.index, now, EventKind.GPU_LOST, "NVML: GPU is lost"))
            except self.nv.NVMLError as exc:  # anything else unexpected: skip this tick
                log.warning("GPU %d: NVML error %s; sample skipped", gpu.index, exc)
        if all(g.lost_at is not None for g in self.gpus) and not out:
            raise SourceUnavailable("NVML: every GPU is lost")
        with self._lock:
            out.extend(self._pending)
            self._pending.clear()
        return out

    def _probe(self, gpu: _Gpu, now: datetime, out: list[Reading]) -> None:
        if gpu.lost_at is None or self.clock() - gpu.lost_at < self.lost_probe_s:
            return
        nv = self.nv
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(gpu.index)
            nv.nvmlDeviceGetUUID(handle)
        except nv.NVMLError:
            gpu.lost_at = self.clock()
            return
        gpu.handle, gpu.lost_at = handle, None
        with contextlib.suppress(nv.NVMLError):
            self._identify(gpu)  # a GPU lost since the start has no UUID or bus id yet
        out.append(self._event(gpu.index, now, EventKind.GPU_RECOVERED, "NVML: GPU answers"))

    def _event(self, gpu: int | None, now: datetime, kind: EventKind, msg: str) -> Event:
        return Event(node=self.node, gpu=gpu, ts=now, kind=kind, message=msg, source="nvml")

    def _sample(self, gpu: _Gpu, now: datetime) -> GpuSample:
        nv, h, t = self.nv, gpu.handle, self._try
        values = self._fields(gpu)
        util = t(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = t(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power_mw = t(lambda: nv.nvmlDeviceGetPowerUsage(h))
        reasons = t(lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        if reasons is None:  # drivers before 535 name it "throttle reasons"
            reasons = t(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        return GpuSample(
            node=self.node,
            gpu=gpu.index,
            ts=now,
            uuid=gpu.uuid,
            vendor=Vendor.NVIDIA,
            temp_gpu_c=t(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            sm_clock_mhz=t(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            mem_clock_mhz=t(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
            throttle_reasons=reasons,
            util_gpu_pct=util.gpu if util is not None else None,
            util_mem_pct=util.memory if util is not None else None,
            mem_used_mib=mem.used / 2**20 if mem is not None else None,
            mem_total_mib=mem.total / 2**20 if mem is not None else None,
            pcie_link_width=t(lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
            pcie_link_width_max=t(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
            pcie_link_gen=t(lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            **values,
        )

    def _fields(self, gpu: _Gpu) -> dict[str, Any]:
        nv = self.nv
        if self._fields_ok:
            try:
                result = nv.nvmlDeviceGetFieldValues(gpu.handle, [f for _, f in self._field_ids])
            except nv.NVMLError_GpuIsLost:
                raise
            except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
                self._fields_ok = False  # driver too old: per-value getters from now on
            else:
                return self._decode_fields(result)
        return self._legacy_fields(gpu)

    def _decode_fields(self, result: Any) -> dict[str, Any]:
        nv = self.nv
        out: dict[str, Any] = {}
        for (name, _), fv in zip(self._field_ids, result, strict=True):
            if fv.nvmlReturn == nv.NVML_ERROR_GPU_IS_LOST:
                raise nv.NVMLError(nv.NVML_ERROR_GPU_IS_LOST)
            if fv.nvmlReturn != nv.NVML_SUCCESS:
                continue  # not supported on this GPU: leave the field null
            value = _field_value(nv, fv)
            if name in _BOOL_FIELDS:
                out[name] = bool(value)
            elif name in _FLOAT_FIELDS:
                out[name] = float(value)
            else:
                out[name] = int(value)
        return out

    def _legacy_fields(self, gpu: _Gpu) -> dict[str, Any]:
        nv, h, t = self.nv, gpu.handle, self._try
        out: dict[str, Any] = {}
        for name, err, counter in (
            ("ecc_sbe_volatile", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_dbe_volatile", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_sbe_aggregate", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            ("ecc_dbe_aggregate", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
        ):
            out[name] = t(lambda e=err, c=counter: nv.nvmlDeviceGetTotalEccErrors(h, e, c))
        rows = t(lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            cor, unc, pending, failure = rows
            out.update(remap_correctable=cor, remap_uncorrectable=unc)
            out.update(remap_pending=bool(pending), remap_failure=bool(failure))
        else:
            sbe = nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            dbe = nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            pages_sbe = t(lambda: nv.nvmlDeviceGetRetiredPages(h, sbe))
            pages_dbe = t(lambda: nv.nvmlDeviceGetRetiredPages(h, dbe))
            pending_status = t(lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
            out["retired_pages_sbe"] = len(pages_sbe) if pages_sbe is not None else None
            out["retired_pages_dbe"] = len(pages_dbe) if pages_dbe is not None else None
            out["retired_pages_pending"] = (
                bool(pending_status) if pending_status is not None else None
            )
        out["pcie_replay"] = t(lambda: nv.nvmlDeviceGetPcieReplayCounter(h))
        return {k: v for k, v in out.items() if v is not None}

    # -- events ----------------------------------------------------------------------------

    def _start_events(self, wait_ms: int) -> None:
        nv = self.nv
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("NVML events unavailable (%s); Xids come only from the kernel log", exc)
            return
        wanted = 0
        for name in _EVENT_TYPES:
            wanted |= getattr(nv, name, 0)
        for gpu in self.gpus:
            if gpu.lost_at is not None:
                continue
            try:
                supported = self._try(lambda g=gpu: nv.nvmlDeviceGetSupportedEventTypes(g.handle))
                mask = wanted & (supported if supported is not None else wanted)
                # Registration may fail on one GPU (or be refused in a container): it still
                # samples. A GPU lost here is found lost by the next read.
                self._try(lambda g=gpu, m=mask: nv.nvmlDeviceRegisterEvents(g.handle, m, event_set))
            except nv.NVMLError as exc:
                log.warning("GPU %d: NVML events not registered (%s)", gpu.index, exc)
        self._thread = threading.Thread(
            target=self._event_loop,
            args=(event_set, wait_ms),
            name="forewarn-nvml-events",
            daemon=True,
        )
        self._thread.start()

    def _index_of(self, handle: Any) -> int | None:
        # The event's handle is a new ctypes pointer, never equal to ours: ask NVML.
        try:
            index = int(self.nv.nvmlDeviceGetIndex(handle))
        except self.nv.NVMLError:
            index = -1
        if 0 <= index < len(self.gpus):
            return index
        for gpu in self.gpus:
            if gpu.handle is handle:
                return gpu.index
        return None

    def _event_loop(self, event_set: Any, wait_ms: int) -> None:
        nv = self.nv
        try:
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, wait_ms)
                except nv.NVMLError_Timeout:
                    continue
                except nv.NVMLError as exc:
                    log.warning("NVML event wait failed (%s); retrying", exc)
                    self._stop.wait(1.0)
                    continue
                self._on_event(data)
        finally:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(event_set)

    def _on_event(self, data: Any) -> None:
        nv, now = self.nv, datetime.now(UTC)
        gpu = self._index_of(data.device)
        etype = int(data.eventType)
        if etype & getattr(nv, "nvmlEventTypeXidCriticalError", 0):
            ev = self._xid_event(gpu, now, int(data.eventData), "NVML Xid event")
        elif etype & getattr(nv, "nvmlEventTypeSingleBitEccErrorStorm", 0):
            ev = self._event(gpu, now, EventKind.ECC_STORM, "NVML: single-bit ECC error storm")
        elif etype & getattr(nv, "nvmlEventTypeGpuUnavailableError", 0):
            ev = self._event(gpu, now, EventKind.GPU_LOST, "NVML: GPU unavailable")
        else:
            code = next((x for n, x in _EVENT_XID.items() if etype & getattr(nv, n, 0)), None)
            if code is None:
                return
            ev = self._xid_event(gpu, now, code, f"NVML event 0x{etype:x}")
        if ev is not None:
            with self._lock:
                self._pending.append(ev)

    def _xid_event(self, gpu: int | None, now: datetime, code: int, detail: str) -> Event | None:
        # A DBE is reported both as an ECC event and as Xid 48: keep one.
        key, t = (gpu if gpu is not None else -1, code), self.clock()
        with self._lock:
            last = self._recent.get(key)
            self._recent[key] = t
        if last is not None and t - last < _DEDUP_S:
            return None
        return Event(
            node=self.node,
            gpu=gpu,
            ts=now,
            kind=EventKind.XID,
            xid=code,
            message=describe(code, detail),
            source="nvml",
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(self.nv.NVMLError):
            self.nv.nvmlShutdown()


def _field_value(nv: Any, fv: Any) -> float | int:
    vt, v = fv.valueType, fv.value
    if vt == nv.NVML_VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    if vt == nv.NVML_VALUE_TYPE_UNSIGNED_INT:
        return int(v.uiVal)
    if vt == nv.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(v.ulVal)
    if vt == nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return int(v.ullVal)
    if vt == nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(v.sllVal)
    return int(v.siVal)
