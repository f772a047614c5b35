"""Fixtures of the dashboard tests: headless Chromium, and a real service fed by the simulator.

Chromium is Debian's (``/usr/bin/chromium``; ``.ci/run`` installs it): Playwright drives it
with ``executable_path``. Without it the tests skip, except under ``CI=true``, where they fail.

The service is a real ``forewarn serve`` (uvicorn) on SQLite. A simulated fleet's last
20 minutes are posted through ``/v1/ingest`` before the tests, one GPU wearing out its memory
(rising corrected ECC, then an Xid), and a feeder keeps posting one tick a second while the
service runs, as collectors would.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from forewarn.wire import to_ms
from sim.config import load_params
from sim.fleet import FleetModel
from sim.source import tick_rows
from tests.conftest import IN_CI, LiveService, start_service

CHROMIUM = "/usr/bin/chromium"
OPERATE_TOKEN = "test-operate-token"  # read + operate, not admin
HISTORY_S = 20 * 60
HISTORY_STEP_S = 10.0
FLEET_GPUS = 32
WORN = ("sim-node-0001", 3)  # the GPU whose memory wears out
ARTIFACTS = Path(os.environ.get("FOREWARN_TEST_ARTIFACTS", "var/artifacts/dashboard"))


def post_rows(
    client: httpx.Client, token: str, samples: list[dict[str, Any]], events: list[dict[str, Any]]
) -> None:
    """Post rows as collectors do: one batch per node."""
    by_node: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: {"samples": [], "events": []}
    )
    for s in samples:
        by_node[s["node"]]["samples"].append(s)
    for e in events:
        by_node[e["node"]]["events"].append(e)
    for node, rows in by_node.items():
        body = {
            "schema_version": 1,
            "node": node,
            **rows,
            "agent": {"agent_id": f"{node}/simulated", "source": "simulated", "interval_s": 1.0},
        }
        response = client.post(
            "/v1/ingest", json=body, headers={"Authorization": f"Bearer {token}"}
        )
        assert response.status_code == 200, response.text


@dataclass
class SimFeed:
    """A simulated fleet posted to a service: history first, then one tick a second."""

    service: LiveService
    gpus: int = FLEET_GPUS
    model: FleetModel = field(init=False)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slowed: list[tuple[int, int, str, float]] = field(default_factory=list)
    """Slowdowns asked for, started by the feed thread (which owns the model) at its next tick."""

    def __post_init__(self) -> None:
        self.model = FleetModel(self.gpus, load_params(), seed=7, speed=1.0)

    def history(self) -> None:
        node = self.model.node_names.index(WORN[0])
        self.model.inject(node, WORN[1], "memory", lead_s=HISTORY_S * 3)
        now_ms = to_ms(datetime.now(UTC))
        start = now_ms - HISTORY_S * 1000
        with httpx.Client(base_url=self.service.url, timeout=30) as client:
            ts = start
            while ts <= now_ms:
                samples, events = tick_rows(self.model, self.model.step(HISTORY_STEP_S, ts))
                post_rows(client, self.service.ingest_token, samples, events)
                ts += int(HISTORY_STEP_S * 1000)
            xid = {
                "node": WORN[0],
                "gpu": WORN[1],
                "ts": (now_ms - 120_000) / 1000,
                "kind": "xid",
                "xid": 63,
                "message": "ECC page retirement or row remapping",
                "source": "kmsg",
            }
            post_rows(client, self.service.ingest_token, [], [xid])

    def _run(self) -> None:
        with httpx.Client(base_url=self.service.url, timeout=10) as client:
            last = datetime.now(UTC)
            while not self.stop.wait(1.0):
                now = datetime.now(UTC)
                with self.lock:
                    slowed, self.slowed = self.slowed, []
                for node, gpu, kind, duration_s in slowed:
                    self.model.slow(node, gpu, kind, duration_s=duration_s)
                tick = self.model.step((now - last).total_seconds(), to_ms(now))
                last = now
                try:
                    post_rows(client, self.service.ingest_token, *tick_rows(self.model, tick))
                except (httpx.HTTPError, AssertionError) as exc:
                    self.errors.append(str(exc))

    def slow(self, node: str, gpu: int, kind: str, duration_s: float) -> None:
        """Make a GPU of the fleet a straggler of ``kind`` (``sim.slowdowns``) at the next tick."""
        with self.lock:
            self.slowed.append((self.model.node_names.index(node), gpu, kind, duration_s))

    def start(self) -> SimFeed:
        self.thread = threading.Thread(target=self._run, name="sim-feed", daemon=True)
        self.thread.start()
        return self

    def wait_scored(self, timeout_s: float = 120.0) -> None:
        """Wait until the control loop scored every GPU on live samples.

        The history's first nodes are minutes old when its last ones are posted, so the
        loop's tick during the upload marks them stale; a stale spare is not free and a
        manual migration onto it is refused (409) until the next tick sees the live feed.
        """
        deadline = time.monotonic() + timeout_s
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            response = httpx.get(
                f"{self.service.url}/v1/risk",
                params={"limit": 1000},
                headers={"Authorization": f"Bearer {self.service.read_token}"},
            )
            rows = response.json()["data"] if response.status_code == 200 else []
            if len(rows) == self.gpus and not any(r["stale"] for r in rows):
                return
            time.sleep(0.5)
        stale = [f"{r['node']}/{r['gpu']}" for r in rows if r["stale"]]
        raise AssertionError(
            f"the service had not scored the live fleet after {timeout_s:g} s: {len(rows)} "
            f"GPUs scored, stale: {stale}\n{self.service.log()}"
        )

    def close(self) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join(timeout=10)


@pytest.fixture(scope="package")
def chromium_path() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        if IN_CI:
            pytest.fail(f"CI needs Chromium at {CHROMIUM} (.ci/run installs it)")
        pytest.skip(f"Chromium is not installed at {CHROMIUM}")
    return CHROMIUM


@pytest.fixture(scope="package")
def browser(chromium_path: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_path, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="package")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    """One service for every dashboard test (it starts in 10-30 s on a busy machine)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOREWARN_TOKENS", f'{{"{OPERATE_TOKEN}": ["read", "operate"]}}')
        mp.setenv("FOREWARN_WEBHOOK_ALLOW", "127.0.0.1")  # the tests' receiver
        live = start_service(f"sqlite:///{tmp / 'dash.db'}", tmp / "service.log", timeout_s=120)
    yield live
    live.stop()


@pytest.fixture(scope="package")
def feed(service: LiveService) -> Iterator[SimFeed]:
    sim = SimFeed(service)
    sim.history()
    sim.start()
    sim.wait_scored()
    yield sim
    sim.close()


@dataclass
class Page:
    """A browser page signed in with one token, recording console errors and page errors."""

    page: Any
    errors: list[str]
    base: str

    def go(self, hash_path: str) -> None:
        self.page.goto(f"{self.base}/#{hash_path}")

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path


def open_page(
    browser: Any, service: LiveService, token: str | None, viewport: dict[str, int] | None = None
) -> tuple[Any, Page]:
    context = browser.new_context(viewport=viewport or {"width": 1440, "height": 900})
    if token is not None:
        context.add_init_script(f"sessionStorage.setItem('forewarn.token', {token!r})")
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on(
        "console",
        lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    return context, Page(page, errors, service.url)


@pytest.fixture
def make_page(browser: Any, service: LiveService) -> Iterator[Any]:
    contexts: list[Any] = []

    def make(token: str | None, **kw: Any) -> Page:
        context, page = open_page(browser, service, token, **kw)
        contexts.append(context)
        return page

    yield make
    for c in contexts:
        c.close()
