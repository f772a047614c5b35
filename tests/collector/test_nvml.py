"""The NVML source against the fake pynvml: fields per architecture, lost GPUs, events."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from collector.nvml import NvmlSource, normalise_bus_id
from forewarn.errors import SourceUnavailable
from forewarn.wire import Event, EventKind, GpuSample
from tests.fakes.pynvml import FakeGpu, FakeNvml

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def samples(readings: list) -> dict[int, GpuSample]:
    return {r.gpu: r for r in readings if isinstance(r, GpuSample)}


def test_hopper_reports_row_remapping_and_volta_retired_pages() -> None:
    nv = FakeNvml(
        [
            FakeGpu(
                remap=(3, 1, 1, 0), ecc={"sbe_vol": 5, "dbe_vol": 1, "sbe_agg": 9, "dbe_agg": 2}
            ),
            FakeGpu(arch="volta", has_nvlink=False, retired_sbe=2, retired_pending=1),
        ]
    )
    src = NvmlSource("n1", nvml=nv, events=False)
    try:
        by = samples(src.read(NOW))
    finally:
        src.close()
    h, v = by[0], by[1]
    assert (h.remap_correctable, h.remap_uncorrectable, h.remap_pending, h.remap_failure) == (
        3,
        1,
        True,
        False,
    )
    assert h.retired_pages_sbe is None and h.retired_pages_pending is None
    assert (h.ecc_sbe_volatile, h.ecc_dbe_volatile, h.ecc_sbe_aggregate, h.ecc_dbe_aggregate) == (
        5,
        1,
        9,
        2,
    )
    assert h.nvlink_crc_flit == 0 and h.power_w == 300.0 and h.mem_total_mib == 80 * 1024
    assert v.retired_pages_sbe == 2 and v.retired_pages_pending is True
    assert v.remap_correctable is None and v.nvlink_replay is None
    assert h.uuid != v.uuid and src.bus_ids() == {"0000:18:00": 0, "0000:28:00": 1}


def test_legacy_getters_give_the_same_sample_as_field_values() -> None:
    gpus = [FakeGpu(remap=(2, 0, 1, 0), pcie_replay=4), FakeGpu(arch="volta", retired_dbe=1)]
    new = NvmlSource("n1", nvml=FakeNvml(gpus), events=False)
    old = NvmlSource("n1", nvml=FakeNvml(gpus, field_values_supported=False), events=False)
    try:
        a, b = samples(new.read(NOW)), samples(old.read(NOW))
    finally:
        new.close(), old.close()
    for gpu in (0, 1):
        for name in (
            "ecc_sbe_volatile",
            "remap_correctable",
            "remap_pending",
            "pcie_replay",
            "retired_pages_dbe",
            "retired_pages_pending",
        ):
            assert getattr(a[gpu], name) == getattr(b[gpu], name), (gpu, name)


def test_unsupported_getter_is_null_not_a_crash() -> None:
    nv = FakeNvml(
        [FakeGpu(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetUtilizationRates"})]
    )
    src = NvmlSource("n1", nvml=nv, events=False)
    s = samples(src.read(NOW))[0]
    src.close()
    assert s.power_w is None and s.util_gpu_pct is None and s.temp_gpu_c == 45.0


def test_lost_gpu_becomes_one_event_the_others_keep_reporting_and_recovery_is_seen() -> None:
    clock = [0.0]
    nv = FakeNvml([FakeGpu(), FakeGpu(), FakeGpu()])
    src = NvmlSource("n1", nvml=nv, events=False, lost_probe_s=10, clock=lambda: clock[0])
    nv.gpus[1].lost = True
    first = src.read(NOW)
    second = src.read(NOW)
    assert sorted(samples(first)) == [0, 2] and sorted(samples(second)) == [0, 2]
    lost = [r for r in first + second if isinstance(r, Event)]
    assert [(e.gpu, e.kind) for e in lost] == [(1, EventKind.GPU_LOST)]
    nv.gpus[1].lost = False
    clock[0] = 11.0
    third = src.read(NOW)
    src.close()
    assert [(e.gpu, e.kind) for e in third if isinstance(e, Event)] == [
        (1, EventKind.GPU_RECOVERED)
    ]


def test_every_gpu_lost_is_source_unavailable_after_the_events() -> None:
    nv = FakeNvml([FakeGpu()])
    src = NvmlSource("n1", nvml=nv, events=False)
    nv.gpus[0].lost = True
    assert [e.kind for e in src.read(NOW)] == [EventKind.GPU_LOST]
    with pytest.raises(SourceUnavailable):
        src.read(NOW)
    src.close()


def test_a_gpu_lost_before_the_agent_starts_is_reported_and_the_others_sampled() -> None:
    clock = [0.0]
    nv = FakeNvml([FakeGpu(), FakeGpu(lost=True), FakeGpu()])
    src = NvmlSource("n1", nvml=nv, event_wait_ms=20, lost_probe_s=10, clock=lambda: clock[0])
    try:
        first, second = src.read(NOW), src.read(NOW)
        assert sorted(samples(first)) == [0, 2] and sorted(samples(second)) == [0, 2]
        events = [(e.gpu, e.kind) for e in first + second if isinstance(e, Event)]
        assert events == [(1, EventKind.GPU_LOST)]
        assert src.bus_ids() == {"0000:18:00": 0, "0000:38:00": 2}
        nv.gpus[1].lost = False
        clock[0] = 11.0
        third = src.read(NOW)
        assert [(e.gpu, e.kind) for e in third if isinstance(e, Event)] == [
            (1, EventKind.GPU_RECOVERED)
        ]
        assert src.bus_ids()["0000:28:00"] == 1 and samples(src.read(NOW))[1].uuid
    finally:
        src.close()


def test_library_not_found_says_so() -> None:
    with pytest.raises(SourceUnavailable, match="NVML cannot start"):
        NvmlSource("n1", nvml=FakeNvml(library_missing=True))


def test_xid_and_dbe_events_arrive_labelled_and_deduplicated() -> None:
    nv = FakeNvml([FakeGpu(), FakeGpu()])
    src = NvmlSource("n1", nvml=nv, event_wait_ms=20)
    nv.inject_xid(1, 48)
    nv.inject_event(1, nv.nvmlEventTypeDoubleBitEccError)  # the same DBE, seen as an ECC event
    nv.inject_event(0, nv.nvmlEventTypeSingleBitEccErrorStorm)
    events: list[Event] = []
    deadline = time.monotonic() + 5
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        events += [r for r in src.read(NOW) if isinstance(r, Event)]
    time.sleep(0.1)
    events += [r for r in src.read(NOW) if isinstance(r, Event)]
    src.close()
    got = sorted((e.gpu, e.kind, e.xid) for e in events)
    assert got == [(0, EventKind.ECC_STORM, None), (1, EventKind.XID, 48)]
    xid = next(e for e in events if e.xid == 48)
    assert xid.message and "memory" in xid.message and "fatal" in xid.message


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),
        ("0000:3b:00", "0000:3b:00"),
        (b"0000:1A:00.0", "0000:1a:00"),
        ("3b:00.0", "0000:3b:00"),
    ],
)
def test_bus_ids_normalise(raw: str | bytes, want: str) -> None:
    assert normalise_bus_id(raw) == want
