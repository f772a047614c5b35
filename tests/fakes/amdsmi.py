"""A fake of ROCm's ``amdsmi`` Python package for machines without an AMD GPU.

Built from the real package's names and shapes: ``AmdSmiException`` and
``AmdSmiLibraryException(err_code)`` with ``err_code`` from ``AmdSmiRetCode``
(``ERR_NOT_SUPPORTED``, ``ERR_NOT_FOUND``, ``FILE_ERROR``, …); IntEnums ``AmdSmiGpuBlock``,
``AmdSmiTemperatureType``, ``AmdSmiTemperatureMetric``, ``AmdSmiClkType``,
``AmdSmiMemoryPageStatus``, ``AmdSmiXgmiStatus``, ``AmdSmiEvtNotificationType``; dict returns
(``amdsmi_get_gpu_ecc_count`` -> ``correctable_count``/``uncorrectable_count``/
``deferred_count``; ``amdsmi_get_power_info`` -> ``current_socket_power``, ``"N/A"`` where a
value is missing; ``amdsmi_get_pcie_info`` -> ``pcie_static``/``pcie_metric``), and
``AmdSmiEventReader(handle, [types]).read(timeout_ms)`` returning a list of event dicts.

``FakeAmdSmi(gpus)`` stands in for the module; ``library_missing=True`` makes ``amdsmi_init``
fail as it does without the ROCm library; ``gpu.lost = True`` makes its calls fail with
``ERR_NOT_FOUND`` as a GPU that left the bus does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from queue import Empty, Queue
from typing import Any


class AmdSmiRetCode(IntEnum):
    # Member names as in amdsmi_exception.py, values as AMDSMI_STATUS_* in amdsmi.h.
    SUCCESS = 0
    ERR_INVAL = 1
    ERR_NOT_SUPPORTED = 2
    NOT_IMPLEMENTED = 3
    FAIL_LOAD_MODULE = 4
    FAIL_LOAD_SYMBOL = 5
    DRM_ERROR = 6
    API_FAILED = 7
    TIMEOUT = 8
    RETRY = 9
    ERR_NO_PERM = 10
    INTERRUPT = 11
    ERR_IO = 12
    FAULT = 13
    FILE_ERROR = 14
    ERR_OUT_OF_RESOURCES = 15
    INTERNAL_EXCEPTION = 16
    INPUT_OUT_OF_BOUNDS = 17
    INIT_ERROR = 18
    REFCOUNT_OVERFLOW = 19
    ERR_BUSY = 30
    ERR_NOT_FOUND = 31
    NOT_INIT = 32
    NO_SLOT = 33
    NO_DATA = 40
    INSUFFICIENT_SIZE = 41
    UNEXPECTED_SIZE = 42
    UNEXPECTED_DATA = 43
    UNKNOWN_ERROR = 0xFFFFFFFF


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = (
            AmdSmiRetCode(err_code).name if err_code in AmdSmiRetCode._value2member_map_ else "?"
        )

    def __str__(self) -> str:
        return f"An error occured with code: {self.err_code}({self.err_info})"

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AmdSmiRetCode.TIMEOUT)


class AmdSmiGpuBlock(IntEnum):
    INVALID = 0
    UMC = 1
    SDMA = 2
    GFX = 4
    MMHUB = 8
    ATHUB = 16
    PCIE_BIF = 32
    HDP = 64
    XGMI_WAFL = 128
    DF = 256
    SMN = 512
    SEM = 1024
    MP0 = 2048
    MP1 = 4096
    FUSE = 8192
    MCA = 16384
    VCN = 32768
    JPEG = 65536
    IH = 131072
    MPIO = 262144


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2
    HBM_0 = 3
    HBM_1 = 4
    HBM_2 = 5
    HBM_3 = 6
    PLX = 7


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2
    CRITICAL = 5


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5


class AmdSmiMemoryPageStatus(IntEnum):
    RESERVED = 0
    PENDING = 1
    UNRESERVABLE = 2


class AmdSmiXgmiStatus(IntEnum):
    NO_ERRORS = 0
    ERROR = 1
    MULTIPLE_ERRORS = 2


class AmdSmiEvtNotificationType(IntEnum):
    NONE = 0
    VMFAULT = 1
    THERMAL_THROTTLE = 2
    GPU_PRE_RESET = 3
    GPU_POST_RESET = 4
    RING_HANG = 5


NA = "N/A"


@dataclass
class FakeAmdGpu:
    uuid: str = ""
    bdf: str = ""
    edge_c: int = 41
    hotspot_c: int = 58
    hbm_c: int | None = 55
    power_w: int = 650
    gfx_mhz: int = 2100
    mem_mhz: int = 1300
    gfx_activity: int = 95
    umc_activity: int = 30
    vram_total_mb: int = 196_592
    vram_used_mb: int = 150_000
    ecc: dict[str, tuple[int, int, int]] = field(default_factory=lambda: {"UMC": (0, 0, 0)})
    bad_pages: list[tuple[int, int]] = field(default_factory=list)  # (address, status)
    pcie_replay: int = 0
    pcie_width: int = 16
    throttle_status: int = 0
    xgmi: int = 0
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


class FakeAmdSmi:
    """The ``amdsmi`` module API over a list of :class:`FakeAmdGpu`."""

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiTimeoutException = AmdSmiTimeoutException
    AmdSmiRetCode = AmdSmiRetCode
    AmdSmiGpuBlock = AmdSmiGpuBlock
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric
    AmdSmiClkType = AmdSmiClkType
    AmdSmiMemoryPageStatus = AmdSmiMemoryPageStatus
    AmdSmiXgmiStatus = AmdSmiXgmiStatus
    AmdSmiEvtNotificationType = AmdSmiEvtNotificationType

    def __init__(self, gpus: list[FakeAmdGpu] | None = None, *, library_missing: bool = False):
        self.gpus = gpus if gpus is not None else [FakeAmdGpu() for _ in range(8)]
        for i, g in enumerate(self.gpus):
            g.uuid = g.uuid or f"{i:02x}ff74a1-0000-1000-80a3-{i:012x}"
            g.bdf = g.bdf or f"0000:{0x05 + 0x20 * i:02x}:00.0"
        self.library_missing = library_missing
        self.initialised = False
        self.events: dict[int, Queue[dict[str, Any]]] = {i: Queue() for i in range(len(self.gpus))}
        self._handles = [_Handle(i) for i in range(len(self.gpus))]
        fake = self

        class AmdSmiEventReader:
            def __init__(self, processor_handle: _Handle, event_types: list[Any]) -> None:
                fake._gpu(processor_handle, "AmdSmiEventReader")
                self.handle = processor_handle

            def read(self, timestamp: int, num_elem: int = 10) -> list[dict[str, Any]]:
                q = fake.events[self.handle.index]
                try:
                    first = q.get(timeout=timestamp / 1000)
                except Empty:
                    raise AmdSmiTimeoutException() from None
                return [first]

            def stop(self) -> None:
                return None

        self.AmdSmiEventReader = AmdSmiEventReader

    def inject_event(self, index: int, kind: AmdSmiEvtNotificationType, message: str = "") -> None:
        # The real reader hands back the event type's *name* ("GPU_PRE_RESET"), not the enum.
        self.events[index].put(
            {"processor_handle": self._handles[index], "event": kind.name, "message": message}
        )

    def _gpu(self, h: _Handle, name: str) -> FakeAmdGpu:
        if not self.initialised:
            raise AmdSmiLibraryException(AmdSmiRetCode.NOT_INIT)
        g = self.gpus[h.index]
        if g.lost:
            raise AmdSmiLibraryException(AmdSmiRetCode.ERR_NOT_FOUND)
        if name in g.unsupported:
            raise AmdSmiLibraryException(AmdSmiRetCode.ERR_NOT_SUPPORTED)
        return g

    def amdsmi_init(self, flag: int = 2) -> None:
        if self.library_missing:
            raise AmdSmiLibraryException(AmdSmiRetCode.FAIL_LOAD_MODULE)
        self.initialised = True

    def amdsmi_shut_down(self) -> None:
        self.initialised = False

    def amdsmi_get_processor_handles(self) -> list[_Handle]:
        if not self.initialised:
            raise AmdSmiLibraryException(AmdSmiRetCode.NOT_INIT)
        return list(self._handles)

    def amdsmi_get_gpu_device_uuid(self, h: _Handle) -> str:
        return self._gpu(h, "amdsmi_get_gpu_device_uuid").uuid

    def amdsmi_get_gpu_device_bdf(self, h: _Handle) -> str:
        return self._gpu(h, "amdsmi_get_gpu_device_bdf").bdf

    def amdsmi_get_gpu_activity(self, h: _Handle) -> dict[str, Any]:
        g = self._gpu(h, "amdsmi_get_gpu_activity")
        return {"gfx_activity": g.gfx_activity, "umc_activity": g.umc_activity, "mm_activity": NA}

    def amdsmi_get_gpu_vram_usage(self, h: _Handle) -> dict[str, int]:
        g = self._gpu(h, "amdsmi_get_gpu_vram_usage")
        return {"vram_total": g.vram_total_mb, "vram_used": g.vram_used_mb}

    def amdsmi_get_power_info(self, h: _Handle) -> dict[str, Any]:
        g = self._gpu(h, "amdsmi_get_power_info")
        return {
            "current_socket_power": g.power_w,
            "average_socket_power": NA,
            "gfx_voltage": NA,
            "soc_voltage": NA,
            "mem_voltage": NA,
            "power_limit": 750_000_000,
        }

    def amdsmi_get_temp_metric(self, h: _Handle, sensor: Any, metric: Any) -> int:
        g = self._gpu(h, "amdsmi_get_temp_metric")
        if not isinstance(sensor, AmdSmiTemperatureType) or not isinstance(
            metric, AmdSmiTemperatureMetric
        ):
            raise AmdSmiException("Invalid parameter")
        value = {0: g.edge_c, 1: g.hotspot_c, 2: g.hbm_c}.get(int(sensor))
        if value is None:
            raise AmdSmiLibraryException(AmdSmiRetCode.ERR_NOT_SUPPORTED)
        return value

    def amdsmi_get_clock_info(self, h: _Handle, clk: AmdSmiClkType) -> dict[str, Any]:
        g = self._gpu(h, "amdsmi_get_clock_info")
        mhz = g.mem_mhz if clk == AmdSmiClkType.MEM else g.gfx_mhz
        return {
            "clk": mhz,
            "min_clk": 500,
            "max_clk": mhz + 100,
            "clk_locked": NA,
            "clk_deep_sleep": NA,
        }

    def amdsmi_get_gpu_ecc_count(self, h: _Handle, block: AmdSmiGpuBlock) -> dict[str, int]:
        g = self._gpu(h, "amdsmi_get_gpu_ecc_count")
        if block.name not in g.ecc:
            raise AmdSmiLibraryException(AmdSmiRetCode.ERR_NOT_SUPPORTED)
        c, u, d = g.ecc[block.name]
        return {"correctable_count": c, "uncorrectable_count": u, "deferred_count": d}

    def amdsmi_get_gpu_total_ecc_count(self, h: _Handle) -> dict[str, int]:
        g = self._gpu(h, "amdsmi_get_gpu_total_ecc_count")
        c, u, d = (sum(v[k] for v in g.ecc.values()) for k in range(3))
        return {"correctable_count": c, "uncorrectable_count": u, "deferred_count": d}

    def amdsmi_get_gpu_bad_page_info(self, h: _Handle) -> list[dict[str, Any]]:
        g = self._gpu(h, "amdsmi_get_gpu_bad_page_info")
        return [
            {
                "value": i,
                "page_address": addr,
                "page_size": 4096,
                "status": int(st),  # the record's raw enum value, as the real package gives
            }
            for i, (addr, st) in enumerate(g.bad_pages)
        ]

    def amdsmi_get_gpu_pci_replay_counter(self, h: _Handle) -> int:
        return self._gpu(h, "amdsmi_get_gpu_pci_replay_counter").pcie_replay

    def amdsmi_get_pcie_info(self, h: _Handle) -> dict[str, Any]:
        g = self._gpu(h, "amdsmi_get_pcie_info")
        return {
            "pcie_static": {
                "max_pcie_width": 16,
                "max_pcie_speed": 32000,
                "pcie_interface_version": 5,
                "slot_type": "OAM",
            },
            "pcie_metric": {
                "pcie_width": g.pcie_width,
                "pcie_speed": 32000,
                "pcie_bandwidth": NA,
                "pcie_replay_count": g.pcie_replay,
                "pcie_l0_to_recovery_count": 0,
            },
        }

    def amdsmi_get_gpu_metrics_info(self, h: _Handle) -> dict[str, Any]:
        g = self._gpu(h, "amdsmi_get_gpu_metrics_info")
        return {
            "temperature_edge": g.edge_c,
            "temperature_hotspot": g.hotspot_c,
            "throttle_status": g.throttle_status,
            "indep_throttle_status": NA,
            "pcie_link_width": g.pcie_width,
            "pcie_replay_count_acc": g.pcie_replay,
            "average_gfx_activity": g.gfx_activity,
            "current_socket_power": g.power_w,
        }

    def amdsmi_gpu_xgmi_error_status(self, h: _Handle) -> AmdSmiXgmiStatus:
        return AmdSmiXgmiStatus(self._gpu(h, "amdsmi_gpu_xgmi_error_status").xgmi)
