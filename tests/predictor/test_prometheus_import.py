"""``forewarn import prometheus`` against a real Prometheus that scrapes a simulated fleet.

The whole path is real: ``forewarn simulate --serve-dcgm-exporter`` serves 16 GPUs in
dcgm-exporter's text format, Debian's ``/usr/bin/prometheus`` (started here on a free port,
its own config and storage in a temporary directory) scrapes it every second, and the
importer reads the series back over Prometheus' HTTP API. Under ``CI=true`` a missing
Prometheus fails the test instead of skipping it (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pandas as pd
import pytest

from collector.dcgm_exporter import parse_metrics
from forewarn.datasets import FAILURE_COLUMNS, SAMPLE_COLUMNS, sample_dtypes
from predictor.dataset import load_dataset
from predictor.registry import SHIPPED_DIR
from tests.sim.exporter import served_exporter, stop

PROMETHEUS = Path("/usr/bin/prometheus")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
LOST = ("sim-node-0001", 3)  # the GPU the simulator is told to lose a few seconds in

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forewarn(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "forewarn", *args], capture_output=True, text=True, timeout=timeout
    )


class Served:
    """Polls the simulated exporter and keeps every value it served, per GPU and series."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.values: dict[tuple[str, int, str], set[float]] = defaultdict(set)
        self.uuids: dict[tuple[str, int], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=2.0) as http:
            while not self._stop.is_set():
                try:
                    text = http.get(self.url).text
                except httpx.HTTPError:
                    text = ""
                for name, labels, value in parse_metrics(text, wanted=None):
                    key = (labels["Hostname"], int(labels["gpu"]))
                    self.values[(*key, name)].add(value)
                    self.uuids[key] = labels["UUID"]
                self._stop.wait(0.05)

    def __enter__(self) -> Served:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)


@pytest.fixture
def control_url() -> str:
    return f"http://127.0.0.1:{_free_port()}"


@pytest.fixture
def simulated_exporter(control_url: str) -> Iterator[str]:
    port = control_url.rsplit(":", 1)[1]
    args = ("--gpus", "16", "--seed", "5", "--speed", "60", "--interval", "1")
    with served_exporter(*args, "--control-port", port, "--duration", "90") as url:
        yield url


@pytest.fixture
def prometheus(tmp_path: Path, simulated_exporter: str) -> Iterator[str]:
    if not PROMETHEUS.exists():
        if IN_CI:
            pytest.fail("CI needs /usr/bin/prometheus (Debian's prometheus package)")
        pytest.skip("/usr/bin/prometheus is missing: apt-get install prometheus")
    target = simulated_exporter.split("//")[1].split("/")[0]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: dcgm\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        with httpx.Client(timeout=1.0) as http:
            while True:
                try:
                    if http.get(f"{url}/-/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "Prometheus did not become ready"
                time.sleep(0.2)
        yield url
    finally:
        stop(proc)
        log.close()


def _instant(url: str, query: str) -> float:
    """The value of a one-series instant ``query`` (0 when it has no result)."""
    with httpx.Client(timeout=2.0) as http:
        r = http.get(f"{url}/api/v1/query", params={"query": query})
    result = r.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def _scraped(url: str) -> int:
    return int(_instant(url, "count(DCGM_FI_DEV_GPU_TEMP)"))


def _scraped_until(url: str) -> float:
    """The newest scrape Prometheus holds of the simulator (seconds since the epoch; 0: none)."""
    return _instant(url, "max(timestamp(DCGM_FI_DEV_GPU_TEMP))")


def _wait_scraped_until(url: str, t: float, timeout_s: float = 60) -> None:
    """Wait until Prometheus scraped the simulator at ``t`` or later: on a loaded machine
    scrapes come late, and a fixed sleep would leave the window short of samples."""
    deadline = time.monotonic() + timeout_s
    while _scraped_until(url) < t:
        assert time.monotonic() < deadline, f"no scrape at or after {t:.3f} within {timeout_s} s"
        time.sleep(0.5)


@pytest.mark.slow
def test_import_from_a_real_prometheus(
    prometheus: str, simulated_exporter: str, control_url: str, tmp_path: Path
) -> None:
    with Served(simulated_exporter) as served:
        deadline = time.monotonic() + 20
        while _scraped(prometheus) == 0:
            assert time.monotonic() < deadline, "Prometheus never scraped the simulator"
            time.sleep(0.5)
        since = time.time()
        _wait_scraped_until(prometheus, since + 4)
        body = {"node": LOST[0], "gpu": LOST[1], "kind": "gpu_lost"}
        lost_at = time.time()
        assert httpx.post(f"{control_url}/inject", json=body, timeout=5.0).status_code == 200
        _wait_scraped_until(prometheus, lost_at + 12)
        until = time.time()
    out = tmp_path / "fleet"
    done = _forewarn(
        "import", "prometheus", "--url", prometheus, "--since", f"{since:.3f}",
        "--until", f"{until:.3f}", "--step", "1s", "--lost-after", "4s", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "16 GPUs on 2 nodes" in done.stdout

    s = pd.read_parquet(out / "samples")
    assert tuple(s.columns) == SAMPLE_COLUMNS
    assert {c: str(t) for c, t in s.dtypes.items()} == sample_dtypes()
    gpus = set(zip(s["node"], s["gpu"], strict=True))
    assert gpus == set(served.uuids) and len(gpus) == 16
    assert len(s) >= 16 * 10
    assert s["ts_ms"].between(since * 1000 - 1, until * 1000 + 1).all()
    # every value is one the exporter served (Prometheus holds the scrape, not a blend)
    checks = {
        "temp_gpu_c": "DCGM_FI_DEV_GPU_TEMP",
        "power_w": "DCGM_FI_DEV_POWER_USAGE",
        "ecc_sbe_volatile": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "nvlink_replay": "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "pcie_link_width": "DCGM_FI_DEV_PCIE_LINK_WIDTH",
        "mem_used_mib": "DCGM_FI_DEV_FB_USED",
    }
    for row in s.itertuples(index=False):
        for field, series in checks.items():
            value = getattr(row, field)
            assert float(value) in served.values[(row.node, row.gpu, series)], (row, field)
    assert (s["mem_total_mib"] == 81559.0).all()
    assert s["retired_pages_sbe"].isna().all()  # a simulated H100 does not export it
    uuids = s.drop_duplicates(["node", "gpu"]).set_index(["node", "gpu"])["uuid"].to_dict()
    assert uuids == served.uuids

    # the lost GPU stops, the rest go on: the heuristic labels it
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["labels"]["source"] == "heuristic"
    f = pd.read_parquet(out / "failures.parquet")
    assert tuple(f.columns) == FAILURE_COLUMNS
    lost = f[(f["node"] == LOST[0]) & (f["gpu"] == LOST[1])]
    assert list(lost["kind"]) == ["gpu_lost"], f
    assert list(lost["trace_class"]) == ["series_stopped"]
    last_seen = s[(s["node"] == LOST[0]) & (s["gpu"] == LOST[1])]["ts_ms"].max()
    assert last_seen < lost["ts_ms"].iloc[0] <= last_seen + 1000

    ds = load_dataset(out)
    assert ds.samples.ts_ms.size == len(s)
    ev = _forewarn(
        "evaluate", "--data", str(out), "--model", str(SHIPPED_DIR), "--json", "--plot", "",
        "--no-progress",
    )  # fmt: skip
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["model"] is not None


@pytest.mark.slow
def test_unreachable_prometheus_exits_2(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    done = _forewarn(
        "import", "prometheus", "--url", url, "--since", "now-1h", "--out", str(tmp_path / "x")
    )
    assert done.returncode == 2
    assert "cannot reach Prometheus" in done.stderr
