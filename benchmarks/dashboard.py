"""Fleet view cost in headless Chromium at 1,024 and 16,384 GPUs.

For each fleet size, a real ``forewarn serve`` (SQLite) holds one fresh sample of every GPU
(8 to a node); Debian's Chromium (``/usr/bin/chromium``) opens the dashboard's fleet view
``--repeats`` times and measures, in the same run:

- time to first render: navigation start -> the fleet map drawn with every cell
  (``performance.mark("fleet-first-render")``), against the baseline of loading an empty
  page from the same server (``/healthz``);
- per update (the view polls every 2 s): main-thread time to parse the answers and to
  derive, lay out and draw the map and the text around it, against the baseline of one
  animation frame measured in the same browser (a ratio under 1 means an update fits in a
  frame: the page never freezes), and as a share of the 2 s interval; plus the wall time of
  the fetch (network + server + parse), the longest main-thread task seen
  (``PerformanceObserver`` long tasks) and the page's DOM element count.

Every figure is the median of the repeats with its min-max spread.

    .venv/bin/python benchmarks/dashboard.py [--sizes 1024,16384] [--repeats 5] [--updates 8]
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
from _common import Service

CHROMIUM = "/usr/bin/chromium"
REFRESH_MS = 2000


def ingest_fleet(service: Service, gpus: int) -> None:
    """One fresh sample for every GPU, one batch per node, gzip'd as collectors send them."""
    ts = datetime.now(UTC).isoformat()
    headers = {
        "Authorization": f"Bearer {service.token}",
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
    }
    with httpx.Client(base_url=service.url, timeout=60) as client:
        for n in range(gpus // 8):
            node = f"gpu-node-{n:05d}"
            samples = [
                {
                    "node": node,
                    "gpu": g,
                    "ts": ts,
                    "temp_gpu_c": 60.0 + g,
                    "power_w": 400.0,
                    "ecc_sbe_volatile": n % 7,
                    "pcie_link_width": 16,
                }
                for g in range(8)
            ]
            body = gzip.compress(orjson.dumps({"node": node, "samples": samples}))
            for _ in range(20):  # 503 (database busy) is retryable, as collectors do
                response = client.post("/v1/ingest", content=body, headers=headers)
                if response.status_code != 503:
                    break
                time.sleep(float(response.headers.get("Retry-After", "0.5")))
            response.raise_for_status()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f}  [{min(values):.1f}-{max(values):.1f}]"


INIT = """
window.__longTasks = [];
try {
  new PerformanceObserver((list) => {
    for (const e of list.getEntries()) window.__longTasks.push(e.duration);
  }).observe({ type: "longtask", buffered: true });
} catch (e) {}
"""

# Navigation start -> load event end of the current page, by the browser's own clock.
NAV_LOAD = """() => new Promise((resolve) => {
  const done = () => { const n = performance.getEntriesByType("navigation")[0];
    if (n && n.loadEventEnd > 0) resolve(n.loadEventEnd); else setTimeout(done, 10); };
  done();
})"""

FRAME = """() => new Promise((resolve) => {
  const t = [];
  const step = (now) => { t.push(now); if (t.length < 61) requestAnimationFrame(step);
    else resolve((t[60] - t[0]) / 60); };
  requestAnimationFrame(step);
})"""


def measure(browser: Any, service: Service, gpus: int, updates: int) -> dict[str, float]:
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    context.add_init_script(f"sessionStorage.setItem('forewarn.token', {service.token!r})")
    context.add_init_script(INIT)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{service.url}/healthz", wait_until="load")
        empty_ms = page.evaluate(NAV_LOAD)
        page.goto(f"{service.url}/#/", wait_until="commit")
        page.wait_for_function(
            f"() => document.querySelector('#fleet-map')?.dataset.cells === '{gpus}'",
            timeout=120_000,
        )
        first_ms = page.evaluate(
            "() => performance.getEntriesByName('fleet-first-render')[0].startTime"
        )
        frame_ms = page.evaluate(FRAME)
        per: list[dict[str, float]] = []
        seen = page.evaluate("() => window.__forewarn.stats.fleet.updates")
        page.evaluate("() => { window.__longTasks = []; }")
        for _ in range(updates):
            page.wait_for_function(
                f"() => window.__forewarn.stats.fleet.updates > {seen}", timeout=120_000
            )
            stats = page.evaluate("() => window.__forewarn.stats.fleet")
            seen = stats["updates"]
            per.append(stats)
        long_tasks = page.evaluate("() => window.__longTasks")
        dom = page.evaluate("() => document.getElementsByTagName('*').length")
        if errors:
            raise RuntimeError(f"page errors: {errors}")
        main = [p["parseMs"] + p["renderMs"] for p in per]
        return {
            "empty_ms": empty_ms,
            "first_ms": first_ms,
            "frame_ms": frame_ms,
            "update_main_ms": statistics.median(main),
            "parse_ms": statistics.median(p["parseMs"] for p in per),
            "render_ms": statistics.median(p["renderMs"] for p in per),
            "fetch_ms": statistics.median(p["fetchMs"] for p in per),
            "longest_task_ms": max(long_tasks, default=0.0),
            "dom": dom,
        }
    finally:
        context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--updates", type=int, default=8)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    from playwright.sync_api import sync_playwright

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        for gpus in sizes:
            service = Service(f"sqlite:///{tmp}/dash-{gpus}.db", Path(tmp) / f"{gpus}.log")
            try:
                ingest_fleet(service, gpus)
                runs = [measure(browser, service, gpus, args.updates) for _ in range(args.repeats)]
            finally:
                service.stop()
            col = {k: [r[k] for r in runs] for k in runs[0]}
            first_ratio = [r["first_ms"] / r["empty_ms"] for r in runs]
            frame_ratio = [r["update_main_ms"] / r["frame_ms"] for r in runs]
            share = [r["update_main_ms"] / REFRESH_MS * 100 for r in runs]
            print(
                f"\n== fleet view, {gpus:,} GPUs ({args.repeats} page loads, "
                f"{args.updates} updates each; median [min-max])"
            )
            print(f"baseline: empty page load, ms    {spread(col['empty_ms'])}")
            print(f"baseline: one animation frame, ms{spread(col['frame_ms'])}")
            print(f"first render, ms                 {spread(col['first_ms'])}")
            print(f"  ratio to the empty page        {spread(first_ratio)}")
            print(f"update, main thread, ms          {spread(col['update_main_ms'])}")
            print(f"  of which JSON parse, ms        {spread(col['parse_ms'])}")
            print(f"  of which map + text, ms        {spread(col['render_ms'])}")
            print(f"  ratio to one frame             {spread(frame_ratio)}")
            print(f"  share of the 2 s interval, %   {spread(share)}")
            print(f"update fetch wall time, ms       {spread(col['fetch_ms'])}")
            print(f"longest main-thread task, ms     {spread(col['longest_task_ms'])}")
            print(f"DOM elements on the page         {spread(col['dom'])}")
        browser.close()


if __name__ == "__main__":
    main()
