"""``/v1/tokens``: create, list and revoke API tokens (``admin`` scope).

A created token's secret is in the answer to its ``POST`` and nowhere else, ever: the store
keeps its SHA-256 only (:mod:`store.tokens`). Revoking takes effect at once on this replica and
within :data:`api.deps.TOKEN_CACHE_S` on the others.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from api.deps import StoreDep, require, token_cache
from forewarn.errors import InvalidInput, NotFound
from store.tokens import create_token, list_tokens, revoke_token

__all__ = ["ApiTokenCreate", "ApiTokenPublic", "ApiTokenSecret", "ApiTokensPublic", "router"]

router = APIRouter(tags=["tokens"], dependencies=[require("admin")])

ScopeName = Literal["ingest", "read", "operate", "admin"]


class ApiTokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake: 422

    name: str = Field(min_length=1, max_length=128, description="Who or what uses it.")
    scopes: list[ScopeName] = Field(min_length=1, max_length=4)


class ApiTokenPublic(BaseModel):
    id: str
    name: str
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None


class ApiTokenSecret(ApiTokenPublic):
    token: str = Field(description="The bearer secret: shown in this answer only.")


class ApiTokensPublic(BaseModel):
    data: list[ApiTokenPublic]
    count: int


def _public(record: dict[str, Any]) -> dict[str, Any]:
    def at(ms: int | None) -> datetime | None:
        return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)

    return {
        "id": record["id"],
        "name": record["name"],
        "scopes": record["scopes"],
        "created_at": at(record["created_ms"]),
        "revoked_at": at(record["revoked_ms"]),
    }


@router.post("/v1/tokens", response_model=ApiTokenSecret, status_code=201, summary="Create a token")
async def create(body: ApiTokenCreate, store: StoreDep, request: Request) -> dict[str, Any]:
    def write() -> tuple[str, dict[str, Any]]:
        with store.begin() as tx:
            return create_token(
                tx, name=body.name, scopes=body.scopes, now_ms=int(time.time() * 1000)
            )

    try:
        secret, record = await to_thread.run_sync(write)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    token_cache(request.app).clear()
    return {**_public(record), "token": secret}


@router.get("/v1/tokens", response_model=ApiTokensPublic, summary="Every token (never a secret)")
async def list_all(store: StoreDep) -> dict[str, Any]:
    def read() -> list[dict[str, Any]]:
        with store.engine.connect() as connection:
            return list_tokens(connection)

    records = [_public(r) for r in await to_thread.run_sync(read)]
    return {"data": records, "count": len(records)}


@router.delete(
    "/v1/tokens/{token_id}",
    status_code=204,
    summary="Revoke a token",
    responses={404: {"description": "No such token"}},
)
async def revoke(
    token_id: Annotated[str, Path(max_length=32)], store: StoreDep, request: Request
) -> Response:
    def write() -> bool:
        with store.begin() as tx:
            return revoke_token(tx, token_id, now_ms=int(time.time() * 1000))

    if not await to_thread.run_sync(write):
        raise NotFound(f"no token '{token_id}'")
    token_cache(request.app).clear()
    return Response(status_code=204)
