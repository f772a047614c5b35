"""The dashboard's models page in a real browser against a real service."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import LiveService
from tests.dashboard.test_pages import wait_js

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


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
