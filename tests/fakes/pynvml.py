"""A fake of ``pynvml`` (nvidia-ml-py) for machines without an NVIDIA driver.

Built from the real module's names, constant values, return shapes and error classes:
``NVMLError(value)`` returns the subclass for its code (``NVMLError_GpuIsLost``,
``NVMLError_NotSupported``, ``NVMLError_LibraryNotFound``, ``NVMLError_Timeout``, …) exactly as
``_extractNVMLErrorsAsClasses`` builds them; ``nvmlDeviceGetFieldValues`` returns records with
``fieldId``, ``scopeId``, ``timestamp``, ``latencyUsec``, ``valueType``, ``nvmlReturn`` and a
``value`` union (``dVal``, ``uiVal``, ``ulVal``, ``ullVal``, ``sllVal``, ``siVal``);
``nvmlEventSetWait_v2`` raises ``NVMLError_Timeout`` when nothing happened and returns an
event record (``device``, ``eventType``, ``eventData``, ``gpuInstanceId``,
``computeInstanceId``); power in mW, memory in bytes, PCI bus ids as ``00000000:3B:00.0``.

A :class:`FakeNvml` instance stands in for the module::

    nv = FakeNvml([FakeGpu(), FakeGpu(arch="volta")])
    source = NvmlSource("node-1", nvml=nv)
    nv.gpus[0].lost = True          # every call on GPU 0 now raises NVMLError_GpuIsLost
    nv.inject_xid(1, 79)            # the event thread receives Xid 79 on GPU 1
"""

from __future__ import annotations

import string
import sys
from dataclasses import dataclass, field
from queue import Empty, Queue
from types import SimpleNamespace
from typing import Any

# -- constants (values as in nvidia-ml-py) ---------------------------------------------------
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
NVML_NVLINK_MAX_LINKS = 18
NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
NVML_VALUE_TYPE_SIGNED_INT = 5

NVML_FI_DEV_ECC_SBE_VOL_TOTAL = 3
NVML_FI_DEV_ECC_DBE_VOL_TOTAL = 4
NVML_FI_DEV_ECC_SBE_AGG_TOTAL = 5
NVML_FI_DEV_ECC_DBE_AGG_TOTAL = 6
NVML_FI_DEV_RETIRED_SBE = 29
NVML_FI_DEV_RETIRED_DBE = 30
NVML_FI_DEV_RETIRED_PENDING = 31
NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 45
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_FI_DEV_PCIE_REPLAY_COUNTER = 94
NVML_FI_DEV_REMAPPED_COR = 142
NVML_FI_DEV_REMAPPED_UNC = 143
NVML_FI_DEV_REMAPPED_PENDING = 144
NVML_FI_DEV_REMAPPED_FAILURE = 145

nvmlEventTypeSingleBitEccError = 0x0001
nvmlEventTypeDoubleBitEccError = 0x0002
nvmlEventTypeXidCriticalError = 0x0008
nvmlEventTypeSingleBitEccErrorStorm = 0x0200
nvmlEventTypeDramRetirementEvent = 0x0400
nvmlEventTypeDramRetirementFailure = 0x0800
nvmlEventTypeGpuUnavailableError = 0x4000

nvmlClocksEventReasonSwPowerCap = 0x04
nvmlClocksEventReasonHwSlowdown = 0x08
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40


# -- errors, built the way nvidia-ml-py builds them ------------------------------------------
class NVMLError(Exception):
    _valClassMapping: dict[int, type[NVMLError]] = {}  # noqa: RUF012

    def __new__(cls, value: int) -> NVMLError:  # type: ignore[misc]
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value  # type: ignore[attr-defined]
        return obj

    def __init__(self, value: int | None = None) -> None:
        super().__init__(self.value)  # type: ignore[attr-defined]

    def __str__(self) -> str:
        return f"NVML Error with code {self.value}"  # type: ignore[attr-defined]


def _make_error_classes() -> None:
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        cls_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace(
            "_", ""
        )
        code = getattr(module, name)

        def gen_new(val: int) -> Any:
            def new(typ: type, *args: Any) -> NVMLError:
                return NVMLError.__new__(typ, val)

            return new

        cls = type(cls_name, (NVMLError,), {"__new__": gen_new(code)})
        cls.__module__ = __name__
        setattr(module, cls_name, cls)
        NVMLError._valClassMapping[code] = cls


_make_error_classes()
NVMLError_GpuIsLost: type[NVMLError] = NVMLError._valClassMapping[NVML_ERROR_GPU_IS_LOST]
NVMLError_NotSupported: type[NVMLError] = NVMLError._valClassMapping[NVML_ERROR_NOT_SUPPORTED]
NVMLError_Timeout: type[NVMLError] = NVMLError._valClassMapping[NVML_ERROR_TIMEOUT]
NVMLError_FunctionNotFound: type[NVMLError] = NVMLError._valClassMapping[
    NVML_ERROR_FUNCTION_NOT_FOUND
]
NVMLError_LibraryNotFound: type[NVMLError] = NVMLError._valClassMapping[
    NVML_ERROR_LIBRARY_NOT_FOUND
]
NVMLError_Uninitialized: type[NVMLError] = NVMLError._valClassMapping[NVML_ERROR_UNINITIALIZED]


# -- the simulated hardware ----------------------------------------------------------------
@dataclass
class FakeGpu:
    """One GPU's state. ``arch`` "ampere"/"hopper" has row remapping, "volta" retired pages."""

    arch: str = "hopper"
    uuid: str = ""
    bus: int = 0
    temp_c: int = 45
    mem_temp_c: int = 50
    power_mw: int = 300_000
    sm_mhz: int = 1980
    mem_mhz: int = 2619
    throttle: int = 0
    util_gpu: int = 90
    util_mem: int = 40
    mem_total: int = 80 * 2**30
    mem_used: int = 60 * 2**30
    ecc: dict[str, int] = field(
        default_factory=lambda: {"sbe_vol": 0, "dbe_vol": 0, "sbe_agg": 0, "dbe_agg": 0}
    )
    retired_sbe: int = 0
    retired_dbe: int = 0
    retired_pending: int = 0
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)
    nvlink: dict[str, int] = field(
        default_factory=lambda: {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}
    )
    has_nvlink: bool = True
    pcie_replay: int = 0
    pcie_width: int = 16
    pcie_width_max: int = 16
    pcie_gen: int = 5
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    """Names of getters (e.g. "nvmlDeviceGetPowerUsage") this GPU answers NOT_SUPPORTED."""


class _Handle:
    """A device handle. Like pynvml's ``c_nvmlDevice_t`` (a ctypes pointer), every call hands
    out a new object and two handles of one GPU do not compare equal: match GPUs by
    ``nvmlDeviceGetIndex`` or UUID, never by handle."""

    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    """The ``pynvml`` module API over a list of :class:`FakeGpu`."""

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        library_missing: bool = False,
        field_values_supported: bool = True,
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu() for _ in range(8)]
        for i, g in enumerate(self.gpus):
            g.uuid = g.uuid or f"GPU-{i:08x}-fake-0000-0000-{i:012x}"
            g.bus = g.bus or 0x18 + 0x10 * i
        self.library_missing = library_missing
        self.field_values_supported = field_values_supported
        self.initialised = 0
        self.calls = 0
        self._events: Queue[Any] = Queue()
        self._handles = [_Handle(i) for i in range(len(self.gpus))]
        module = sys.modules[__name__]
        for name in dir(module):
            if name.startswith(("NVML_", "nvmlEventType", "nvmlClocksEvent", "NVMLError")):
                setattr(self, name, getattr(module, name))

    # -- control ---------------------------------------------------------------------------
    def inject_xid(self, index: int, code: int) -> None:
        self._push(index, nvmlEventTypeXidCriticalError, code)

    def inject_event(self, index: int, event_type: int, data: int = 0) -> None:
        self._push(index, event_type, data)

    def _push(self, index: int, etype: int, data: int) -> None:
        self._events.put(
            SimpleNamespace(
                device=_Handle(index),
                eventType=etype,
                eventData=data,
                gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF,
            )
        )

    # -- library ---------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.library_missing:
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        if self.initialised <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        self.initialised -= 1

    def _gpu(self, handle: _Handle, getter: str) -> FakeGpu:
        self.calls += 1
        if self.initialised <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if getter in gpu.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlDeviceGetCount(self) -> int:
        if self.initialised <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(self._handles[index], "nvmlDeviceGetHandleByIndex")
        return _Handle(index)

    def nvmlDeviceGetIndex(self, h: _Handle) -> int:
        self._gpu(h, "nvmlDeviceGetIndex")
        return h.index

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> Any:
        g = self._gpu(h, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(
            busIdLegacy=f"0000:{g.bus:02X}:00.0",
            domain=0,
            bus=g.bus,
            device=0,
            pciDeviceId=0x233010DE,
            pciSubSystemId=0x16C110DE,
            busId=f"00000000:{g.bus:02X}:00.0",
        )

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTemperature").temp_c

    def nvmlDeviceGetPowerUsage(self, h: _Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetClockInfo(self, h: _Handle, clock: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetClockInfo")
        return g.mem_mhz if clock == NVML_CLOCK_MEM else g.sm_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").throttle

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: _Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksThrottleReasons").throttle

    def nvmlDeviceGetUtilizationRates(self, h: _Handle) -> Any:
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> Any:
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=g.mem_total, free=g.mem_total - g.mem_used, used=g.mem_used)

    def nvmlDeviceGetTotalEccErrors(self, h: _Handle, error_type: int, counter: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        kind = "sbe" if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED else "dbe"
        return g.ecc[f"{kind}_{'vol' if counter == NVML_VOLATILE_ECC else 'agg'}"]

    def nvmlDeviceGetRemappedRows(self, h: _Handle) -> tuple[int, int, int, int]:
        g = self._gpu(h, "nvmlDeviceGetRemappedRows")
        if g.arch == "volta":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.remap

    def nvmlDeviceGetRetiredPages(self, h: _Handle, cause: int) -> list[int]:
        g = self._gpu(h, "nvmlDeviceGetRetiredPages")
        if g.arch != "volta":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        n = (
            g.retired_sbe
            if cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            else g.retired_dbe
        )
        return [0x1000 * (i + 1) for i in range(n)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: _Handle) -> int:
        g = self._gpu(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        if g.arch != "volta":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.retired_pending

    def nvmlDeviceGetPcieReplayCounter(self, h: _Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetPcieReplayCounter").pcie_replay

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: _Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrPcieLinkWidth").pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: _Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetMaxPcieLinkWidth").pcie_width_max

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: _Handle) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrPcieLinkGeneration").pcie_gen

    # -- field values ----------------------------------------------------------------------
    def _field(self, g: FakeGpu, fid: int) -> tuple[int, int, float | int]:
        """(nvmlReturn, valueType, value) of one field on ``g``."""
        ull, ui, dbl = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, NVML_VALUE_TYPE_UNSIGNED_INT, 0
        ns = NVML_ERROR_NOT_SUPPORTED
        table: dict[int, tuple[int, int, float | int]] = {
            NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (0, ull, g.ecc["sbe_vol"]),
            NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (0, ull, g.ecc["dbe_vol"]),
            NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (0, ull, g.ecc["sbe_agg"]),
            NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (0, ull, g.ecc["dbe_agg"]),
            NVML_FI_DEV_MEMORY_TEMP: (0, ui, g.mem_temp_c),
            NVML_FI_DEV_PCIE_REPLAY_COUNTER: (0, ull, g.pcie_replay),
        }
        volta = g.arch == "volta"
        for fid_, val in (
            (NVML_FI_DEV_RETIRED_SBE, g.retired_sbe),
            (NVML_FI_DEV_RETIRED_DBE, g.retired_dbe),
            (NVML_FI_DEV_RETIRED_PENDING, g.retired_pending),
        ):
            table[fid_] = (0, ull, val) if volta else (ns, dbl, 0)
        for fid_, val in zip(
            (
                NVML_FI_DEV_REMAPPED_COR,
                NVML_FI_DEV_REMAPPED_UNC,
                NVML_FI_DEV_REMAPPED_PENDING,
                NVML_FI_DEV_REMAPPED_FAILURE,
            ),
            g.remap,
            strict=True,
        ):
            table[fid_] = (ns, dbl, 0) if volta else (0, ui, val)
        for fid_, key in (
            (NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, "crc_flit"),
            (NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, "crc_data"),
            (NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, "replay"),
            (NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, "recovery"),
        ):
            table[fid_] = (0, ull, g.nvlink[key]) if g.has_nvlink else (ns, dbl, 0)
        return table.get(fid, (NVML_ERROR_INVALID_ARGUMENT, dbl, 0))

    def nvmlDeviceGetFieldValues(self, h: _Handle, field_ids: list[int]) -> list[Any]:
        g = self._gpu(h, "nvmlDeviceGetFieldValues")
        if not self.field_values_supported:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        out = []
        for fid in field_ids:
            ret, vtype, val = self._field(g, fid)
            value = SimpleNamespace(dVal=0.0, uiVal=0, ulVal=0, ullVal=0, sllVal=0, siVal=0)
            attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}[vtype]
            setattr(value, attr, val)
            out.append(
                SimpleNamespace(
                    fieldId=fid,
                    scopeId=0,
                    timestamp=0,
                    latencyUsec=0,
                    valueType=vtype,
                    nvmlReturn=ret,
                    value=value,
                )
            )
        return out

    # -- events ----------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceGetSupportedEventTypes(self, h: _Handle) -> int:
        self._gpu(h, "nvmlDeviceGetSupportedEventTypes")
        return (
            nvmlEventTypeSingleBitEccError
            | nvmlEventTypeDoubleBitEccError
            | nvmlEventTypeXidCriticalError
            | nvmlEventTypeSingleBitEccErrorStorm
            | nvmlEventTypeDramRetirementEvent
            | nvmlEventTypeDramRetirementFailure
        )

    def nvmlDeviceRegisterEvents(self, h: _Handle, event_types: int, event_set: object) -> None:
        self._gpu(h, "nvmlDeviceRegisterEvents")

    def nvmlEventSetWait_v2(self, event_set: object, timeoutms: int) -> Any:
        try:
            return self._events.get(timeout=timeoutms / 1000)
        except Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetWait(self, event_set: object, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(event_set, timeoutms)

    def nvmlEventSetFree(self, event_set: object) -> None:
        return None
