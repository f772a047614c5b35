"""Request dependencies: the store, the settings and bearer-token scopes.

Routes declare what they need with the ``Annotated`` shorthands below and stay thin.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from api.settings import Settings
from forewarn.errors import Forbidden, Unauthorized
from store import Store

__all__ = ["SettingsDep", "StoreDep", "require"]


async def get_store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def _scopes_of(request: Request) -> frozenset[str]:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    for known, scopes in request.app.state.token_scopes.items():
        if hmac.compare_digest(known.encode(), token.strip().encode()):
            return scopes  # type: ignore[no-any-return]
    raise Unauthorized("unknown token")


def require(scope: str):  # type: ignore[no-untyped-def]
    """A dependency that lets the request through only with a token holding ``scope``."""

    async def check(request: Request) -> frozenset[str]:  # async: no thread hop per request
        scopes = _scopes_of(request)
        if scope not in scopes:
            raise Forbidden(f"this token lacks the '{scope}' scope")
        return scopes

    return Depends(check)
