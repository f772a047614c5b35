"""The dashboard in a real browser against a real service fed by the simulator."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import LiveService
from tests.dashboard.conftest import FLEET_GPUS, WORN, SimFeed

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


def wait_js(page: Any, condition: str, timeout_ms: float = 15_000) -> None:
    """Wait until a JavaScript expression is true (as a function: the page's CSP forbids eval).

    An expression that throws counts as not yet true: the element it reads may not be on
    the page yet (a GPU page still building its charts)."""
    page.wait_for_function(
        f"() => {{ try {{ return {condition}; }} catch (e) {{ return false; }} }}",
        timeout=timeout_ms,
    )


def wait_cells(page: Any, n: int) -> None:
    wait_js(page, f"document.querySelector('#fleet-map')?.dataset.cells === '{n}'")


def fleet_cells(page: Any) -> list[str]:
    return page.evaluate("window.__forewarnFleetCells()")  # type: ignore[no-any-return]


def test_shell_and_assets_are_served_offline(service: LiveService) -> None:
    html = httpx.get(f"{service.url}/", timeout=10)
    assert html.status_code == 200
    assert "default-src 'self'" in html.headers["content-security-policy"]
    for asset in (
        "/ui/app.css",
        "/ui/js/app.js",
        "/ui/vendor/uPlot.esm.js",
        "/ui/vendor/uPlot.min.css",
    ):
        response = httpx.get(f"{service.url}{asset}", timeout=10)
        assert response.status_code == 200, asset
    assert "http" not in html.text.replace("http-equiv", "")  # nothing from elsewhere
    assert httpx.get(f"{service.url}/ui/../app.py", timeout=10).status_code == 404
    paths = httpx.get(f"{service.url}/openapi.json", timeout=10).json()["paths"]
    assert "/" not in paths and not any(p.startswith("/ui") for p in paths)


def test_token_is_asked_once_and_kept_out_of_urls(
    make_page: Any, service: LiveService, feed: SimFeed
) -> None:
    p = make_page(None)
    p.go("/")
    dialog = p.page.locator("#token-dialog")
    dialog.wait_for(state="visible")
    p.page.fill("#token-input", "not-a-token")
    p.page.click("#token-submit")
    p.page.locator("#token-error").filter(has_text="does not know").wait_for()
    p.page.fill("#token-input", service.read_token)
    p.page.click("#token-submit")
    dialog.wait_for(state="hidden")
    wait_cells(p.page, FLEET_GPUS)
    assert service.read_token not in p.page.url
    assert p.page.evaluate("sessionStorage.getItem('forewarn.token')") == service.read_token
    assert p.page.evaluate("localStorage.getItem('forewarn.token')") is None
    p.page.reload()  # same tab: no second prompt
    wait_cells(p.page, FLEET_GPUS)
    assert not p.page.locator("#token-dialog").is_visible()
    # the one wrong token gave one 401 from the browser's network log; nothing else
    assert [e for e in p.errors if "401" not in e] == []


def test_fleet_has_one_cell_per_gpu_and_updates_live(
    make_page: Any, service: LiveService, feed: SimFeed
) -> None:
    p = make_page(service.read_token)
    p.go("/")
    wait_cells(p.page, FLEET_GPUS)
    cells = fleet_cells(p.page)
    gpus = httpx.get(
        f"{service.url}/v1/gpus", headers={"Authorization": f"Bearer {service.read_token}"}
    ).json()
    assert len(cells) == len(set(cells)) == FLEET_GPUS
    assert set(cells) == {f"{g['node']}/{g['gpu']}" for g in gpus["data"]}
    first = p.page.evaluate("window.__forewarn.stats.fleet.updates")
    wait_js(p.page, f"window.__forewarn.stats.fleet.updates >= {first + 2}", 10_000)
    # filters: by node, then by state
    p.page.fill("#f-node", WORN[0])
    wait_cells(p.page, 8)
    assert all(c.startswith(f"{WORN[0]}/") for c in fleet_cells(p.page))
    p.page.fill("#f-node", "")
    p.page.select_option("#f-state", "drained")
    wait_cells(p.page, 0)
    p.page.select_option("#f-state", "all")
    p.shot("fleet")
    assert p.errors == []


def test_keyboard_opens_a_gpu(make_page: Any, service: LiveService, feed: SimFeed) -> None:
    p = make_page(service.read_token)
    p.go("/")
    wait_cells(p.page, FLEET_GPUS)
    p.page.focus("#fleet-map")
    p.page.keyboard.press("ArrowRight")
    p.page.keyboard.press("ArrowRight")
    assert "GPU 1" in p.page.inner_text("#fleet-focus")
    p.page.keyboard.press("Enter")
    p.page.wait_for_url("**/#/gpu/*/1")
    assert p.errors == []


def test_clicking_a_gpu_opens_its_page_with_charts(
    make_page: Any, service: LiveService, feed: SimFeed
) -> None:
    p = make_page(service.read_token)
    p.go(f"/?node={WORN[0]}")
    wait_cells(p.page, 8)
    box = p.page.evaluate(
        """() => { const c = document.querySelector('#fleet-map').getBoundingClientRect();
                   return {x: c.x, y: c.y}; }"""
    )
    # find the worn GPU's cell by asking the page's own hit test through the pointer
    for dx in range(2, 400, 3):
        p.page.mouse.move(box["x"] + dx, box["y"] + 20)
        text = p.page.inner_text("#fleet-tip") if p.page.is_visible("#fleet-tip") else ""
        if text.startswith(f"{WORN[0]} GPU {WORN[1]} "):
            p.page.mouse.click(box["x"] + dx, box["y"] + 20)
            break
    else:
        pytest.fail("no cell of the worn GPU under the pointer")
    p.page.wait_for_url(f"**/#/gpu/{WORN[0]}/{WORN[1]}")
    for chart in ("temps", "power", "clocks", "ecc", "remap", "nvlink", "pcie"):
        wait_js(p.page, f"Number(document.querySelector('#chart-{chart}').dataset.points) > 0")
    # the control loop scores every few seconds: the risk chart fills from the history
    wait_js(p.page, "Number(document.querySelector('#chart-risk').dataset.points) > 0", 30_000)
    assert "63" in p.page.inner_text("#gpu-events")  # the Xid, also marked on the time axis
    ecc_points = int(p.page.get_attribute("#chart-ecc", "data-points") or 0)
    p.page.click("[data-window='900']")  # a shorter window re-reads fewer samples
    wait_js(p.page, f"Number(document.querySelector('#chart-ecc').dataset.points) < {ecc_points}")
    p.shot("gpu")
    assert p.errors == []


def test_every_page_renders_without_console_errors(
    make_page: Any, service: LiveService, feed: SimFeed
) -> None:
    p = make_page(service.admin_token)
    pages = [
        "/",
        f"/gpu/{WORN[0]}/{WORN[1]}",
        f"/node/{WORN[0]}",
        "/jobs",
        "/migrations",
        "/audit",
        "/webhooks",
    ]
    for path in pages:
        p.go(path)
        wait_js(p.page, "document.getElementById('live').textContent.startsWith('live')")
        p.page.wait_for_timeout(300)
        assert p.page.inner_text("main").strip(), path
        p.shot("page-" + (path.strip("/").split("/")[0] or "fleet"))
    assert p.errors == []


def test_pages_fit_a_laptop_screen(make_page: Any, service: LiveService, feed: SimFeed) -> None:
    """At 1366 x 768 nothing scrolls sideways; the map and the first charts are in view."""
    p = make_page(service.read_token, viewport={"width": 1366, "height": 768})
    for path in ("/", f"/gpu/{WORN[0]}/{WORN[1]}", "/migrations", "/jobs"):
        p.go(path)
        wait_js(p.page, "document.getElementById('live').textContent.startsWith('live')")
        overflow = p.page.evaluate(
            "() => document.scrollingElement.scrollWidth - window.innerWidth"
        )
        assert overflow <= 0, (path, overflow)
    p.go("/")
    wait_cells(p.page, FLEET_GPUS)
    box = p.page.locator("#fleet-map").bounding_box()
    assert box is not None and box["y"] + box["height"] <= 768
    p.shot("fleet-1366x768")
    assert p.errors == []
