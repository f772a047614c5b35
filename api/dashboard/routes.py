"""Serve the dashboard: one HTML shell at ``/`` and its static assets under ``/ui/``.

The shell and the assets hold no data, so they need no token; every figure the dashboard
shows comes from the ``/v1`` API, called by the browser with the operator's bearer token
(entered once, kept in the browser's session or local storage, never put in a URL). Every
script, style and chart library is served from here: the dashboard works offline.

The pages are excluded from the OpenAPI document: they are not part of the API.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

__all__ = ["STATIC_DIR", "router"]

STATIC_DIR = Path(__file__).with_name("static")

# Scripts, styles and data only from this origin; no inline script, no framing, no referrer
# (a page URL never holds the token, but it can hold node names).
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
        "form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

router = APIRouter(include_in_schema=False)


@lru_cache(maxsize=1)
def _assets() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)


@router.get("/", response_class=HTMLResponse)
async def shell() -> Response:
    """The single page; the client-side router (``#/...``) picks the view."""
    html = (STATIC_DIR / "index.html").read_bytes()
    return Response(
        html,
        media_type="text/html; charset=utf-8",
        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )


@router.get("/ui/{path:path}")
async def asset(path: str, request: Request) -> Response:
    """A static file (``StaticFiles`` refuses paths outside the folder, answers 304)."""
    response = await _assets().get_response(path, request.scope)
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
