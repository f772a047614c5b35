"""Kernel-log, dcgm-exporter and AMD SMI sources against recorded text and the fake amdsmi."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collector.amd import AmdSource
from collector.dcgm_exporter import DcgmExporterSource, parse_metrics, to_readings
from collector.kernel_log import KernelLogSource, parse_line
from forewarn.errors import SourceUnavailable
from forewarn.wire import Event, EventKind, GpuSample
from tests.fakes.amdsmi import AmdSmiMemoryPageStatus, FakeAmdGpu, FakeAmdSmi

DATA = Path(__file__).resolve().parents[1] / "data"
NOW = datetime(2026, 12, 2, 18, 0, tzinfo=UTC)


# -- kernel log ------------------------------------------------------------------------------
def test_every_xid_line_of_the_recorded_log_parses() -> None:
    lines = (DATA / "kernel-log-xid.txt").read_text().splitlines()
    parsed = [p for p in map(parse_line, lines) if p is not None]
    assert [p.code for p in parsed] == [13, 13, 31, 48, 63, 74, 94, 119, 79, 45, 43]
    assert parsed[3].bus_id == "0000:38:00" and parsed[3].boot_usec == 9021004455
    assert parsed[8].bus_id == "0000:78:00" and "fallen off the bus" in parsed[8].detail
    assert parse_line("NVRM: GPU 0000:78:00.0: GPU has fallen off the bus.") is None


def test_kernel_log_follows_a_file_maps_bus_ids_and_survives_rotation(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old line before the agent started\n")
    src = KernelLogSource("n1", log, bus_ids={"00000000:78:00.0": 3})
    try:
        follow_and_rotate(src, log, tmp_path)
    finally:
        src.close()


def follow_and_rotate(src: KernelLogSource, log: Path, tmp_path: Path) -> None:
    assert src.read(NOW) == []
    lines = (DATA / "kernel-log-xid.txt").read_text().splitlines()
    with log.open("a") as fh:
        fh.write(lines[9] + "\n" + lines[4][: len(lines[4]) // 2])  # second line unfinished
    events = src.read(NOW)
    assert [(e.gpu, e.xid) for e in events] == [(3, 79)]
    assert events[0].kind is EventKind.XID and events[0].source == "kmsg"
    with log.open("a") as fh:
        fh.write(lines[4][len(lines[4]) // 2 :] + "\n")
    (e,) = src.read(NOW)
    assert e.xid == 48 and e.gpu is None and "PCI 0000:38:00" in (e.message or "")
    log.rename(tmp_path / "kern.log.1")  # logrotate
    log.write_text(lines[12] + "\n")
    assert [e.xid for e in src.read(NOW)] == [43]


def test_kernel_log_that_cannot_be_opened_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailable, match="CAP_SYSLOG"):
        KernelLogSource("n1", tmp_path / "missing.log")


# -- dcgm-exporter ---------------------------------------------------------------------------
def test_dcgm_exporter_text_maps_to_samples() -> None:
    text = (DATA / "dcgm-exporter-h100.txt").read_text()
    last: dict = {}
    readings = to_readings(parse_metrics(text), node="gpu-node-17", now=NOW, last_xid=last)
    by = {r.gpu: r for r in readings if isinstance(r, GpuSample)}
    assert sorted(by) == list(range(8)) and not [r for r in readings if isinstance(r, Event)]
    g3, g6 = by[3], by[6]
    assert g3.uuid == "GPU-72ad4d20-cfed-f08d-c894-f620962ca3e4"
    assert (g3.ecc_sbe_volatile, g3.ecc_sbe_aggregate, g3.remap_correctable) == (12, 141, 1)
    assert g3.remap_pending is True and g3.remap_failure is False
    assert g6.throttle_reasons == 32 and g6.util_gpu_pct == 97
    assert g3.mem_total_mib == 78900 + 2171 + 488 and g3.power_w == pytest.approx(621.637)
    assert by[4].nvlink_replay == 7 and by[5].pcie_replay == 3
    assert last[("gpu-node-17", 2)] == 13  # first scrape: recorded, not reported


def test_dcgm_exporter_reports_a_new_last_xid_over_http() -> None:
    text = (DATA / "dcgm-exporter-h100.txt").read_text()
    pages = [text, text.replace('"} 13\n', '"} 79\n')]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=pages.pop(0)) if pages else httpx.Response(503)

    src = DcgmExporterSource(
        "http://exporter/metrics", node=None, transport=httpx.MockTransport(handler)
    )
    src.read(NOW)
    events = [r for r in src.read(NOW) if isinstance(r, Event)]
    assert [(e.node, e.gpu, e.xid) for e in events] == [("gpu-node-17", 2, 79)]
    assert src.bus_ids()["0000:3a:00"] == 2
    with pytest.raises(SourceUnavailable):
        src.read(NOW)
    src.close()


@given(st.text(max_size=400))
def test_parser_never_raises_on_garbage(text: str) -> None:
    for _name, _labels, value in parse_metrics(text, wanted=None):
        assert value == value  # finite numbers only


# -- AMD SMI ---------------------------------------------------------------------------------
def test_amd_source_reads_ecc_per_block_bad_pages_and_temperatures() -> None:
    gpu = FakeAmdGpu(
        ecc={"UMC": (4, 1, 2), "SDMA": (1, 0, 0)},
        bad_pages=[
            (0x1000, AmdSmiMemoryPageStatus.RESERVED),
            (0x2000, AmdSmiMemoryPageStatus.PENDING),
        ],
        pcie_replay=9,
        throttle_status=1,
    )
    smi = FakeAmdSmi(
        [gpu, FakeAmdGpu(hbm_c=None, unsupported={"amdsmi_get_gpu_pci_replay_counter"})]
    )
    src = AmdSource("n1", amdsmi=smi, events=False)
    by = {r.gpu: r for r in src.read(NOW) if isinstance(r, GpuSample)}
    src.close()
    a, b = by[0], by[1]
    assert (a.ecc_sbe_volatile, a.ecc_dbe_volatile, a.ecc_deferred) == (5, 1, 2)
    assert a.retired_pages_dbe == 1 and a.retired_pages_pending is True
    assert (a.temp_gpu_c, a.temp_mem_c, a.power_w, a.vendor.value) == (58, 55, 650, "amd")
    assert a.pcie_replay == 9 and a.throttle_reasons == 1 and a.pcie_link_gen == 5
    assert b.temp_mem_c is None and b.pcie_replay == 0  # falls back to the metrics table


def test_amd_lost_gpu_xgmi_error_and_reset_events() -> None:
    smi = FakeAmdSmi([FakeAmdGpu(), FakeAmdGpu(xgmi=1)])
    src = AmdSource("n1", amdsmi=smi)
    smi.gpus[0].lost = True
    smi.inject_event(1, smi.AmdSmiEvtNotificationType.GPU_PRE_RESET, "reset")
    import time

    events: list[Event] = []
    for _ in range(40):
        events += [r for r in src.read(NOW) if isinstance(r, Event)]
        if any(e.kind is EventKind.GPU_LOST and e.gpu == 1 for e in events):
            break
        time.sleep(0.05)
    src.close()
    kinds = {(e.gpu, e.kind) for e in events}
    assert (0, EventKind.GPU_LOST) in kinds and (1, EventKind.LINK_DOWN) in kinds
    assert (1, EventKind.GPU_LOST) in kinds  # the pre-reset event
    assert [e.kind for e in events].count(EventKind.LINK_DOWN) == 1  # not one per tick


def test_amd_library_missing_is_source_unavailable() -> None:
    with pytest.raises(SourceUnavailable, match="AMD SMI cannot start"):
        AmdSource("n1", amdsmi=FakeAmdSmi(library_missing=True))
