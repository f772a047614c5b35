"""Drain routes (``operate``): take a node out of service and bring it back.

Draining marks the node: no spare there is used, and the control loop requests a ``planned``
migration for every active rank on it, as fast as the in-flight limits allow.
"""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from api.deps import StoreDep, require
from api.routes._common import iso, now_ms
from store import control as db
from store.outbox import emit_event

__all__ = ["router"]

router = APIRouter(tags=["drain"])


NodeName = Annotated[str, Path(max_length=253, description="The node (as its collector names it).")]


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=2000)


class DrainPublic(BaseModel):
    node: str
    drained: bool
    changed_at: str | None
    reason: str | None
    ranks_to_move: int
    """Active ranks still on the node (each gets a planned migration)."""


class DrainsPublic(BaseModel):
    data: list[DrainPublic]
    count: int


def _set(store: Any, node: str, drained: bool, reason: str | None) -> dict[str, Any]:
    ts = now_ms()
    with store.begin() as c:
        was = node in db.drained_nodes(c)
        db.set_drain(c, node=node, drained=drained, ts_ms=ts, reason=reason)
        on_node = [r for r in db.placements(c) if r["node"] == node and r["role"] == "active"]
        if was != drained:
            kind = "node.drained" if drained else "node.undrained"
            data = {
                "node": node,
                "reason": reason,
                "ranks": [{"job_id": r["job_id"], "rank": r["rank"]} for r in on_node],
            }
            emit_event(c, kind, data, node=node)
            db.write_audit(
                c,
                ts_ms=ts,
                kind="drain",
                action="drained" if drained else "undrained",
                reason=reason or ("drained by an operator" if drained else "returned to service"),
                node=node,
                data=data,
            )
    return {
        "node": node,
        "drained": drained,
        "changed_at": iso(ts),
        "reason": reason,
        "ranks_to_move": len(on_node) if drained else 0,
    }


@router.post(
    "/v1/nodes/{node}/drain",
    response_model=DrainPublic,
    dependencies=[require("operate")],
    summary="Drain a node: move its ranks off (planned), use no spare there",
)
async def drain(
    store: StoreDep, node: NodeName, body: DrainRequest | None = None
) -> dict[str, Any]:
    reason = body.reason if body else None
    return await to_thread.run_sync(_set, store, node, True, reason)


@router.post(
    "/v1/nodes/{node}/undrain",
    response_model=DrainPublic,
    dependencies=[require("operate")],
    summary="Return a drained node to service",
)
async def undrain(store: StoreDep, node: NodeName) -> dict[str, Any]:
    return await to_thread.run_sync(_set, store, node, False, None)


@router.get(
    "/v1/drains",
    response_model=DrainsPublic,
    dependencies=[require("read")],
    summary="Nodes that are drained",
)
async def list_drains(store: StoreDep) -> dict[str, Any]:
    def read() -> list[dict[str, Any]]:
        with store.engine.connect() as c:
            rows = c.execute(db.node_drain.select().order_by(db.node_drain.c.node)).mappings()
            active = [r for r in db.placements(c) if r["role"] == "active"]
            return [
                {
                    "node": r["node"],
                    "drained": r["drained"],
                    "changed_at": iso(r["changed_ms"]),
                    "reason": r["reason"],
                    "ranks_to_move": sum(1 for a in active if a["node"] == r["node"])
                    if r["drained"]
                    else 0,
                }
                for r in rows
                if r["drained"]
            ]

    rows = await to_thread.run_sync(read)
    return {"data": rows, "count": len(rows)}
