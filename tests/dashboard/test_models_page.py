"""The dashboard's models page in a real browser against a real service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from predictor import registry
from tests.conftest import LiveService, start_service
from tests.dashboard.conftest import open_page
from tests.dashboard.test_pages import wait_js

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

OURS = "forewarn-risk-20261205T000000Z"  # a model of the operator's, newer than the shipped one


def test_the_models_page_shows_the_model_in_force(make_page: Any, service: LiveService) -> None:
    body = httpx.get(
        f"{service.url}/v1/models",
        headers={"Authorization": f"Bearer {service.read_token}"},
        timeout=10,
    ).json()
    p = make_page(service.read_token)
    p.go("/models")
    wait_js(p.page, "document.querySelector('#model-in-force')?.dataset.model?.length > 0")
    assert p.page.get_attribute("#model-in-force", "data-model") == body["in_force"]
    row = p.page.locator(f"[data-model-row='{body['in_force']}']")
    assert "in force" in row.inner_text()
    assert p.page.locator("[data-model-row]").count() == body["count"]
    assert p.page.locator("nav a[data-nav='models']").get_attribute("aria-current") is not None
    assert p.errors == []


@pytest.fixture
def models_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveService]:
    """A service of its own whose models directory holds one model beside the shipped one
    (the shared service's directory is the checkout's ``models/``: not a place to pin in)."""
    models = tmp_path / "models"
    registry.save(registry.load(registry.SHIPPED_DIR), models, stem=OURS)
    monkeypatch.setenv("FOREWARN_MODELS_DIR", str(models))
    monkeypatch.setenv("FOREWARN_CONTROL_ENABLED", "false")
    live = start_service(f"sqlite:///{tmp_path / 'models.db'}", tmp_path / "s.log", timeout_s=120)
    yield live
    live.stop()


def _in_force(page: Any, model_id: str, pinned: bool) -> None:
    wait_js(
        page,
        f"(() => {{ const e = document.querySelector('#model-in-force'); return e && "
        f"e.dataset.model === {model_id!r} && e.dataset.pinned === {str(pinned).lower()!r}; }})()",
    )


def _confirm(page: Any, selector: str) -> None:
    page.click(selector)
    page.click("#confirm-ok")


def test_an_admin_pins_unpins_and_rolls_back_from_the_page_a_reader_is_told_why_not(
    browser: Any, models_service: LiveService
) -> None:
    shipped = registry.list_models(registry.SHIPPED_DIR)[-1][1].name.removesuffix(".json")
    context, p = open_page(browser, models_service, models_service.admin_token)
    try:
        p.go("/models")
        _in_force(p.page, OURS, pinned=False)  # the newest in the directory
        assert p.page.locator("[data-scope-hint]").count() == 0
        _confirm(p.page, f"[data-model-action='pin'][data-model-id='{shipped}']")
        _in_force(p.page, shipped, pinned=True)
        assert p.page.locator("[data-result='pin']").count() == 1
        _confirm(p.page, "[data-model-action='unpin']")
        _in_force(p.page, shipped, pinned=False)
        _confirm(p.page, f"[data-model-action='rollback'][data-model-id='{OURS}']")
        _in_force(p.page, OURS, pinned=False)
        actions = [a["action"] for a in _models(models_service)["history"]]
        assert actions == ["pinned", "unpinned", "rolled_back"], actions
        assert p.errors == []
    finally:
        context.close()
    context, p = open_page(browser, models_service, models_service.read_token)
    try:
        p.go("/models")
        wait_js(p.page, "document.querySelector('[data-scope-hint=admin]') !== null")
        assert p.page.locator("[data-model-action]").count() == 0
    finally:
        context.close()


def _models(service: LiveService) -> Any:
    headers = {"Authorization": f"Bearer {service.read_token}"}
    return httpx.get(f"{service.url}/v1/models", headers=headers, timeout=10).json()
