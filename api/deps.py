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
import time
from typing import Annotated, Any

from anyio import to_thread
from fastapi import Depends, Request

from api.settings import DEV_TOKEN, Settings
from forewarn.errors import Forbidden, Unauthorized
from store import Store
from store.tokens import digest, token_scopes

__all__ = [
    "TOKEN_CACHE_S",
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


async def get_store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


class TokenCache:
    """Stored-token lookups by secret digest, each kept ``ttl_s``; bounded in size."""

    def __init__(self, ttl_s: float = TOKEN_CACHE_S, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, frozenset[str] | None]] = {}

    def get(self, key: str) -> tuple[bool, frozenset[str] | None]:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return False, None
        return True, entry[1]

    def put(self, key: str, scopes: frozenset[str] | None) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # a flood of unknown tokens must not grow memory
        self._entries[key] = (time.monotonic() + self.ttl_s, scopes)

    def clear(self) -> None:
        """Forget every lookup (after a token is created or revoked here)."""
        self._entries.clear()


def token_cache(app: Any) -> TokenCache:
    cache = getattr(app.state, "token_cache", None)
    if cache is None:
        cache = app.state.token_cache = TokenCache()
    return cache  # type: ignore[no-any-return]


def _presented(request: Request) -> tuple[str, frozenset[str] | None]:
    """The bearer secret and, when known without the database, its scopes."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    presented = token.encode()
    for known, scopes in request.app.state.token_scopes.items():
        if hmac.compare_digest(known.encode(), presented):
            if known == DEV_TOKEN and not _local(request):
                raise Unauthorized("the development token is accepted from this machine only")
            return token, scopes
    if len(token) > 256:
        raise Unauthorized("unknown token")
    found, scopes = token_cache(request.app).get(digest(token))
    if found and scopes is None:
        raise Unauthorized("unknown token")
    return token, scopes


def _lookup(request: Request, token: str) -> frozenset[str]:
    store: Store = request.app.state.store
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
