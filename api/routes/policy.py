"""Policy routes: read it (``read``), replace it (``admin``), reset the breaker (``admin``)."""

from __future__ import annotations

from typing import Any, Literal

from anyio import to_thread
from fastapi import APIRouter
from pydantic import BaseModel

from api.deps import SettingsDep, StoreDep, require
from api.routes._common import iso, now_ms
from control.policy import Policy
from store import control as db

__all__ = ["PolicyPublic", "router"]

router = APIRouter(tags=["policy"])


class PolicyPublic(BaseModel):
    policy: Policy
    source: Literal["settings", "operator"]
    """``operator``: set by ``PUT /v1/policy``; ``settings``: the service's defaults."""
    model_threshold: float | None
    """The loaded model card's threshold (used when ``policy.threshold`` and
    ``policy.alarm_budget`` are null)."""
    threshold_in_force: float | None
    """The threshold the control loop applied at its last tick (null on a replica that does
    not lead, or before the first tick)."""
    alarm_budget: dict[str, Any] | None
    """With ``policy.alarm_budget``: what its threshold stands on (``warm``: confirmed healthy
    GPU-time only; otherwise provisional or the card's)."""
    floor_budget: dict[str, Any] | None
    """With ``policy.alarm_budget``: the floor's rules that are not a floor on this fleet
    (``demoted``: each rule, its false alarms per 1,000 GPU-days over confirmed healthy time,
    the GPUs it tripped on in the hours not yet confirmed), because their own alarms on healthy
    GPUs exceed the budget; their GPUs are alarmed by the model alone."""
    breaker_tripped_at: str | None
    updated_at: str | None


def _read(store: Any, settings: Any) -> dict[str, Any]:
    with store.engine.connect() as c:
        stored = db.read_policy(c)
        tripped = db.get_state(c, "breaker_tripped_ms") or ""
        updated = c.execute(db.policy.select().where(db.policy.c.id == 1)).mappings().first()
        loop = db.read_status(c) or {}  # what the leading control loop's last tick published
    return {
        "policy": Policy.model_validate(stored) if stored is not None else settings.policy,
        "source": "operator" if stored is not None else "settings",
        "model_threshold": loop.get("model_threshold"),
        "threshold_in_force": loop.get("threshold_in_force"),
        "alarm_budget": loop.get("alarm_budget"),
        "floor_budget": loop.get("floor_budget"),
        "breaker_tripped_at": iso(int(tripped)) if tripped else None,
        "updated_at": iso(updated["updated_ms"]) if updated else None,
    }


@router.get(
    "/v1/policy",
    response_model=PolicyPublic,
    dependencies=[require("read")],
    summary="The policy in force and the breaker's state",
)
async def get_policy(store: StoreDep, settings: SettingsDep) -> dict[str, Any]:
    return await to_thread.run_sync(_read, store, settings)


@router.put(
    "/v1/policy",
    response_model=PolicyPublic,
    dependencies=[require("admin")],
    summary="Replace the policy (every field; omitted ones take their defaults)",
)
async def put_policy(store: StoreDep, settings: SettingsDep, body: Policy) -> dict[str, Any]:
    def write() -> None:
        ts = now_ms()
        with store.begin() as c:
            before = db.read_policy(c)
            db.write_policy(c, data=body.model_dump(), ts_ms=ts)
            db.write_audit(
                c,
                ts_ms=ts,
                kind="policy",
                action="updated",
                reason="policy replaced by an operator",
                data={"before": before, "after": body.model_dump()},
            )

    await to_thread.run_sync(write)
    return await to_thread.run_sync(_read, store, settings)


@router.post(
    "/v1/policy/breaker/reset",
    response_model=PolicyPublic,
    dependencies=[require("admin")],
    summary="Re-arm automatic action after the breaker tripped",
)
async def reset_breaker(store: StoreDep, settings: SettingsDep) -> dict[str, Any]:
    def write() -> None:
        ts = now_ms()
        with store.begin() as c:
            db.reset_breaker(c, ts_ms=ts)  # the loop's next tick forgets the crossings until ts
            db.write_audit(
                c, ts_ms=ts, kind="policy", action="breaker_reset", reason="reset by an operator"
            )

    await to_thread.run_sync(write)
    return await to_thread.run_sync(_read, store, settings)
