"""The Prometheus importer against a fake Prometheus (``httpx.MockTransport``): chunking under
the points limit, the join into the dataset schema, the label heuristic, errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest

from forewarn.cli import main
from forewarn.datasets import FAILURE_COLUMNS, SAMPLE_COLUMNS, sample_dtypes
from forewarn.errors import InvalidInput, NotFound, SourceUnavailable
from predictor.dataset import load_dataset
from predictor.heuristic_labels import HeuristicRules
from predictor.import_cli import parse_time_ms
from predictor.prometheus_import import SERIES, chunks, import_prometheus

T0 = 1_767_225_600  # 2026-01-01T00:00:00Z, seconds
HOUR = 3600
Value = Callable[[float], float | None]  # t (s since T0) -> value, None: no sample


class FakePrometheus:
    """query_range over series given as functions of time; checks the points limit."""

    def __init__(self, series: dict[str, dict[tuple[str, int], Value]], max_points: int) -> None:
        self.series = series
        self.max_points = max_points
        self.requests: list[dict[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query_range"
        q = dict(request.url.params)
        self.requests.append(q)
        start, end = float(q["start"]), float(q["end"])
        step = float(q["step"].rstrip("s"))
        n = int((end - start) / step + 1e-9) + 1
        if n > self.max_points:
            return httpx.Response(
                400, json={"status": "error", "errorType": "bad_data", "error": "exceeded 11,000"}
            )
        result = []
        for (node, gpu), fn in self.series.get(q["query"], {}).items():
            points = []
            for k in range(n):
                t = start + k * step
                v = fn(t - T0)
                if v is not None:
                    points.append([t, repr(float(v))])
            if points:
                labels = {
                    "__name__": q["query"],
                    "gpu": str(gpu),
                    "UUID": f"GPU-{node}-{gpu}",
                    "Hostname": node,
                    "instance": "10.0.0.1:9400",
                    "job": "dcgm",
                }
                result.append({"metric": labels, "values": points})
        body = {"status": "success", "data": {"resultType": "matrix", "result": result}}
        return httpx.Response(200, json=body)


GPUS = [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 1)]


def _alive(key: tuple[str, int]) -> Callable[[float], bool]:
    if key == ("n1", 1):
        return lambda t: t < 1800  # lost at 30 min, never back
    return lambda t: True


def _const(value: float) -> dict[tuple[str, int], Value]:
    return {k: (lambda t, a=_alive(k): value if a(t) else None) for k in GPUS}


def fleet() -> dict[str, dict[tuple[str, int], Value]]:
    def temp(k: tuple[str, int]) -> Value:
        a = _alive(k)
        return lambda t: 50 + k[1] + t / 600 if a(t) else None

    def sbe(k: tuple[str, int]) -> Value:
        a = _alive(k)
        if k == ("n0", 1):  # memory wear from 10 min, Xid 48 at 20 min
            return lambda t: max(0, int((t - 600) / 60)) if a(t) else None
        return lambda t: 3 if a(t) else None

    def xid(k: tuple[str, int]) -> Value:
        a = _alive(k)
        if k == ("n0", 1):
            return lambda t: (48 if t >= 1200 else 0) if a(t) else None
        if k == ("n0", 0):
            return lambda t: (13 if t >= 300 else 0) if a(t) else None
        return lambda t: 0 if a(t) else None

    return {
        "DCGM_FI_DEV_GPU_TEMP": {k: temp(k) for k in GPUS},
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": {k: sbe(k) for k in GPUS},
        "DCGM_FI_DEV_FB_USED": _const(1000.0),
        "DCGM_FI_DEV_FB_FREE": _const(80000.0),
        "DCGM_FI_DEV_FB_RESERVED": _const(559.0),
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": _const(4),
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": _const(8),  # older name: the newer one wins
        "DCGM_FI_DEV_ROW_REMAP_PENDING": _const(0),
        "DCGM_FI_DEV_XID_ERRORS": {k: xid(k) for k in GPUS},
    }


def _import(tmp_path: Path, fake: FakePrometheus, **kw: Any) -> Any:
    return import_prometheus(
        "http://prom:9090",
        tmp_path / "ds",
        since_ms=T0 * 1000,
        until_ms=(T0 + HOUR) * 1000,
        transport=httpx.MockTransport(fake),
        **kw,
    )


def test_chunks_stay_under_the_limit_and_cover_every_step_once() -> None:
    step = 15_000
    for until in (0, step * 10, step * 10 + 7, step * 10_999, step * 11_000, step * 50_000 + 3):
        got = list(chunks(0, until, step, lambda: 11_000))
        points = []
        for start, end in got:
            n = (end - start) // step + 1
            assert n <= 11_000 and (end - start) / step <= 10_999
            points.extend(range(start, end + 1, step))
        assert points == list(range(0, until + 1, step))
    assert len(list(chunks(0, step * 11_000, step, lambda: 11_000))) == 2
    sizes = iter([3, 1, 5, 100])  # each request may hold another number of steps
    assert list(chunks(0, 9 * step, step, lambda: next(sizes))) == [
        (0, 2 * step),
        (3 * step, 3 * step),
        (4 * step, 8 * step),
        (9 * step, 9 * step),
    ]


def test_requests_shrink_to_the_row_budget(tmp_path: Path) -> None:
    fake = FakePrometheus(fleet(), max_points=11_000)
    result = _import(tmp_path, fake, step_s=15.0, rows_per_chunk=40)
    steps = [
        round((float(r["end"]) - float(r["start"])) / 15) + 1
        for r in fake.requests
        if r["query"] == "DCGM_FI_DEV_GPU_TEMP"
    ]
    assert steps[0] == 100 and set(steps[1:-1]) == {10}  # 40 rows / 4 GPUs
    assert sum(steps) == 241 and result.samples == 3 * 241 + 120


def test_import_joins_series_into_the_dataset_schema(tmp_path: Path) -> None:
    fake = FakePrometheus(fleet(), max_points=50)
    result = _import(tmp_path, fake, step_s=15.0, max_points=50)
    n_chunks = len(list(chunks(T0 * 1000, (T0 + HOUR) * 1000, 15_000, lambda: 50)))
    assert n_chunks > 1 and len(fake.requests) == n_chunks * len(SERIES)
    assert {r["step"] for r in fake.requests} == {"15s"}

    s = pd.read_parquet(tmp_path / "ds" / "samples")
    assert tuple(s.columns) == SAMPLE_COLUMNS
    assert {c: str(t) for c, t in s.dtypes.items()} == sample_dtypes()
    assert len(s) == 3 * 241 + 120 == result.samples
    assert (s["mem_total_mib"] == 81559.0).all()  # used + free + reserved
    assert (s["throttle_reasons"] == 4).all()
    assert s["remap_pending"].eq(False).all() and s["power_w"].isna().all()
    row = s[(s["node"] == "n0") & (s["gpu"] == 1)].iloc[-1]
    assert row["ecc_sbe_volatile"] == 50 and row["uuid"] == "GPU-n0-1"
    assert row["temp_gpu_c"] == pytest.approx(51 + 3600 / 600)

    ev = pd.read_parquet(tmp_path / "ds" / "events.parquet")
    assert sorted(zip(ev["node"], ev["gpu"], ev["xid"], strict=True)) == [
        ("n0", 0, 13),
        ("n0", 1, 48),
    ]
    assert ev.loc[ev["xid"] == 48, "ts_ms"].item() == (T0 + 1200) * 1000

    f = pd.read_parquet(tmp_path / "ds" / "failures.parquet")
    assert tuple(f.columns) == FAILURE_COLUMNS
    f = f.set_index(["node", "gpu"])
    assert set(f.index) == {("n0", 1), ("n1", 1)}  # Xid 13 is the application's
    mem = f.loc[("n0", 1)]
    assert (mem["kind"], mem["trace_class"]) == ("memory", "fatal_xid")
    assert mem["has_precursors"] and mem["precursor_onset_ts_ms"] == (T0 + 660) * 1000
    lost = f.loc[("n1", 1)]
    assert (lost["kind"], lost["trace_class"], lost["has_precursors"]) == (
        "gpu_lost",
        "series_stopped",
        False,
    )
    assert lost["ts_ms"] == (T0 + 1800) * 1000 and pd.isna(lost["recovered_ts_ms"])

    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["labels"]["source"] == "heuristic"
    assert manifest["gpus"] == 4 and manifest["gpus_per_node"] == 2
    assert manifest["source"]["requests"] == len(fake.requests)
    ds = load_dataset(tmp_path / "ds")
    assert len(ds.samples.ts_ms) == len(s)


def test_a_fleet_wide_gap_is_not_a_lost_gpu(tmp_path: Path) -> None:
    def gap(t: float) -> float | None:
        return None if 1200 <= t < 2400 else 60.0

    series = {"DCGM_FI_DEV_GPU_TEMP": {k: gap for k in GPUS}}
    result = _import(tmp_path, FakePrometheus(series, 11_000), step_s=30.0)
    assert result.failures == 0 and result.samples == 4 * (121 - 40)


def test_a_gpu_back_after_a_gap_recovers(tmp_path: Path) -> None:
    def back(t: float) -> float | None:
        return None if 1200 <= t < 2400 else 60.0

    def steady(t: float) -> float:
        return 60.0

    series = {"DCGM_FI_DEV_GPU_TEMP": {k: back if k == ("n1", 0) else steady for k in GPUS}}
    _import(tmp_path, FakePrometheus(series, 11_000), step_s=60.0)
    f = pd.read_parquet(tmp_path / "ds" / "failures.parquet")
    assert len(f) == 1 and f["ts_ms"].item() == (T0 + 1200) * 1000
    assert f["recovered_ts_ms"].item() == (T0 + 2400) * 1000


def test_labels_from_a_csv(tmp_path: Path) -> None:
    csv = tmp_path / "failures.csv"
    csv.write_text(
        "node,gpu,ts,kind\nn0,1,2026-01-01T00:20:00Z,memory\nzz,0,2026-01-01T00:30:00Z,pcie\n"
    )
    result = _import(tmp_path, FakePrometheus(fleet(), 11_000), labels_csv=csv)
    f = pd.read_parquet(tmp_path / "ds" / "failures.parquet")
    assert list(zip(f["node"], f["gpu"], f["kind"], strict=True)) == [
        ("n0", 1, "memory"),
        ("zz", 0, "pcie"),
    ]
    assert list(f["uuid"]) == ["GPU-n0-1", ""]
    assert result.manifest["labels"] == {"source": "csv", "path": str(csv), "unknown_gpus": 1}


def test_lost_after_is_a_knob(tmp_path: Path) -> None:
    rules = HeuristicRules(lost_after_s=2 * HOUR)
    result = _import(tmp_path, FakePrometheus(fleet(), 11_000), rules=rules)
    assert result.failures == 1  # the fatal Xid only: 30 min of silence is not 2 h


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no DCGM_FI_DEV_"):
        _import(tmp_path, FakePrometheus({}, 11_000))

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"status": "error", "error": "parse error at char 3"})

    with pytest.raises(InvalidInput, match="parse error"):
        _import(tmp_path, refuse)  # type: ignore[arg-type]

    def not_prometheus(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>hello</html>")

    with pytest.raises(InvalidInput, match="without Prometheus JSON"):
        _import(tmp_path, not_prometheus)  # type: ignore[arg-type]

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(SourceUnavailable, match="cannot reach Prometheus"):
        _import(tmp_path, down)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="after"):
        import_prometheus("http://x", tmp_path, since_ms=2, until_ms=1)


def test_times() -> None:
    now = 1_767_225_600.0
    assert parse_time_ms("2026-01-01T00:00:00Z") == 1_767_225_600_000
    assert parse_time_ms("2026-01-01T01:00:00+01:00") == 1_767_225_600_000
    assert parse_time_ms("2026-01-01 00:00:00") == 1_767_225_600_000  # no zone: UTC
    assert parse_time_ms("1767225600.5") == 1_767_225_600_500
    assert parse_time_ms("now", now_s=now) == 1_767_225_600_000
    assert parse_time_ms("now-2h", now_s=now) == 1_767_225_600_000 - 7_200_000


def test_cli_bad_time_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["import", "prometheus", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)]
    assert main([*argv, "--since", "yesterday"]) == 2
    assert "not a time" in capsys.readouterr().err
    assert main([*argv, "--since", "now-1h", "--step", "fast"]) == 2
    assert "not a duration" in capsys.readouterr().err
    assert main([*argv, "--since", "now", "--until", "now-1h"]) == 2
    assert "--until must be after --since" in capsys.readouterr().err
