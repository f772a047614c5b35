"""The audit log (``read``) and what a token may do (any valid token)."""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from api.deps import StoreDep, _scopes_of, require
from api.routes._common import Since, aware, iso
from api.routes.migrations import AuditPublic
from forewarn.wire import to_ms
from store import control as db

__all__ = ["router"]

router = APIRouter(tags=["audit"])


class AuditsPublic(BaseModel):
    data: list[AuditPublic]
    count: int


class TokenPublic(BaseModel):
    scopes: list[str]


@router.get(
    "/v1/audit",
    response_model=AuditsPublic,
    dependencies=[require("read")],
    summary="Every decision of the control loop and operator action, oldest first",
)
async def list_audit(
    store: StoreDep,
    since: Since = None,
    kind: Annotated[str | None, Query(description="migration, policy or failure")] = None,
    migration: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    def read() -> list[dict[str, Any]]:
        with store.engine.connect() as c:
            return db.read_audit(
                c,
                since_ms=to_ms(aware(since)) if since else None,
                kind=kind,
                migration_id=migration,
                limit=limit,
            )

    rows = []
    for row in await to_thread.run_sync(read):
        row["at"] = iso(row.pop("ts_ms"))
        rows.append(row)
    return {"data": rows, "count": len(rows)}


@router.get("/v1/token", response_model=TokenPublic, summary="The scopes of the calling token")
async def token(request: Request) -> dict[str, Any]:
    return {"scopes": sorted(_scopes_of(request))}
