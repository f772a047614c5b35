"""``/docs``: Swagger UI served by the app itself, so the API's documentation works offline.

FastAPI's default page loads Swagger UI from a CDN, which an air-gapped cluster cannot reach.
The assets are vendored from the ``swagger-ui-dist`` npm package (``api/static/swagger``,
version and licence beside them) and served under ``/docs/assets``. ReDoc, which has no
offline build here, is not served.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

__all__ = ["ASSETS", "install_docs"]

ASSETS = Path(__file__).resolve().parent / "static" / "swagger"


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and its assets (the app must be built with ``docs_url=None``)."""
    app.mount("/docs/assets", StaticFiles(directory=ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon-32x32.png",
        )
