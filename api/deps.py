"""Request dependencies: the store, the settings and bearer-token scopes.

Routes declare what they need with the ``Annotated`` shorthands below and stay thin. Every
route that is not deliberately open declares its scope with :func:`require` (a test walks the
OpenAPI spec and fails for a route that does not).

Tokens come from two places: the configured ones (``FOREWARN_TOKENS`` and the shorthands in
:class:`~api.settings.Settings`), compared in constant time, and the ones created at run time
(``forewarn token create``, ``POST /v1/tokens``), stored hashed (:mod:`store.tokens`) and kept
in a small cache for ``TOKEN_CACHE_S`` so that a request costs no database round trip.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Annotated, Any

from anyio import to_thread
from fastapi import Depends, Request

from api.settings import DEV_TOKEN, Settings
from api.state import AppState, TokenCache, app_state
from forewarn.errors import Forbidden, StoreUnavailable, Unauthorized
from store import Store
from store.tokens import digest, token_scopes

__all__ = [
    "TOKEN_CACHE_S",
    "AppStateDep",
    "SettingsDep",
    "StoreDep",
    "TokenCache",
    "authorize",
    "require",
    "scope_of",
]

TOKEN_CACHE_S = 5.0
"""How long a stored token's lookup (found or not) is reused: the longest a revocation takes
to reach another replica."""


async def get_app_state(request: Request) -> AppState:
    return app_state(request.app)


async def get_store(request: Request) -> Store:
    store = app_state(request.app).store
    if store is None:  # only between create_app and its lifespan's start
        raise StoreUnavailable("the store is not open yet")
    return store


async def get_settings(request: Request) -> Settings:
    return app_state(request.app).settings


AppStateDep = Annotated[AppState, Depends(get_app_state)]
StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def token_cache(app: Any) -> TokenCache:
    return app_state(app).token_cache


def _presented(request: Request) -> tuple[str, frozenset[str] | None]:
    """The bearer secret and, when known without the database, its scopes."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    presented = token.encode()
    for known, configured in app_state(request.app).token_scopes.items():
        if hmac.compare_digest(known.encode(), presented):
            if known == DEV_TOKEN and not _local(request):
                raise Unauthorized("the development token is accepted from this machine only")
            return token, configured
    if len(token) > 256:
        raise Unauthorized("unknown token")
    found, cached = token_cache(request.app).get(digest(token))
    if found and cached is None:
        raise Unauthorized("unknown token")
    return token, cached


def _lookup(request: Request, token: str) -> frozenset[str]:
    store = app_state(request.app).store
    if store is None:
        raise StoreUnavailable("the store is not open yet")
    with store.engine.connect() as connection:
        scopes = token_scopes(connection, token)
    token_cache(request.app).put(digest(token), scopes)
    if scopes is None:
        raise Unauthorized("unknown token")
    return scopes


def _scopes_of(request: Request) -> frozenset[str]:
    """The scopes of the request's token (a stored token not yet cached: one indexed query)."""
    token, scopes = _presented(request)
    return scopes if scopes is not None else _lookup(request, token)


async def _scopes_of_async(request: Request) -> frozenset[str]:
    token, scopes = _presented(request)
    if scopes is not None:
        return scopes
    return await to_thread.run_sync(_lookup, request, token)


def _local(request: Request) -> bool:
    host = request.client.host if request.client else ""
    if host in ("testclient", "localhost"):  # Starlette's in-process test client
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def authorize(request: Request, scope: str) -> frozenset[str]:
    """The request's token's scopes; Unauthorized (401) or Forbidden (403) without ``scope``."""
    scopes = await _scopes_of_async(request)
    if scope not in scopes:
        raise Forbidden(f"this token lacks the '{scope}' scope")
    return scopes


def require(scope: str):  # type: ignore[no-untyped-def]
    """A dependency that lets the request through only with a token holding ``scope``.

    The request guard (:mod:`api.guard`) checks the same before the body is read; this
    check stays for routes mounted without the guard (tests build bare routers).
    """

    async def check(request: Request) -> frozenset[str]:  # async: no thread hop per request
        return await authorize(request, scope)

    check.scope = scope  # type: ignore[attr-defined]
    return Depends(check)


def scope_of(call: Any) -> str | None:
    """The scope a dependency made by :func:`require` asks for (None for any other callable)."""
    return getattr(call, "scope", None)
