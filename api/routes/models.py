"""Model routes: the models the service can score with, which one is in force, the history of
promotions, pins and rollbacks (``read``); pin, unpin, roll back (``admin``).

A thin layer over :class:`predictor.lifecycle.ModelLifecycle` on ``FOREWARN_MODELS_DIR``; the
control loop follows the model in force at its next tick. With ``FOREWARN_MODEL`` set, that
card scores and the lifecycle does not decide: changes are refused (409).
"""

from __future__ import annotations

from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from api.deps import SettingsDep, require
from forewarn.errors import Conflict
from predictor.lifecycle import ModelLifecycle

__all__ = ["ModelsPublic", "PinRequest", "router"]

router = APIRouter(tags=["models"])


class ModelPublic(BaseModel):
    id: str
    """The card's stem in the models directory (or the shipped model's)."""
    created_at: str
    in_force: bool


class ModelsPublic(BaseModel):
    data: list[ModelPublic]
    count: int
    in_force: str
    """The model the lifecycle puts in force."""
    scoring: str | None
    """The model the control loop scored with at its last tick (null on a replica that does
    not lead, or before the first tick)."""
    pinned: bool
    replaced: list[str]
    """Models replaced by promotions and pins, oldest first: a rollback restores the last."""
    history: list[dict[str, Any]]
    """Every decision, oldest first: ``judged`` (a candidate against the model in force, with
    both judgements and whether it was promoted), ``pinned``, ``unpinned``, ``rolled_back``."""


class PinRequest(BaseModel):
    model_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _life(settings: Any, *, changing: bool = False) -> ModelLifecycle:
    if changing and settings.model is not None:
        raise Conflict(
            "FOREWARN_MODEL names the model to score with; the models directory's lifecycle "
            "does not decide",
            details={"model": str(settings.model)},
        )
    return ModelLifecycle(settings.models_dir)


def _public(life: ModelLifecycle, request: Request) -> dict[str, Any]:
    status = life.status()
    models = life.models()
    loop = getattr(request.app.state, "control", None)
    return {
        "data": models,
        "count": len(models),
        "in_force": status["in_force"],
        "scoring": getattr(loop, "model_id", None),
        "pinned": status["pinned"],
        "replaced": status["replaced"],
        "history": status["history"],
    }


@router.get(
    "/v1/models",
    response_model=ModelsPublic,
    dependencies=[require("read")],
    summary="The models, the one in force and the history of promotions, pins and rollbacks",
)
async def list_models(settings: SettingsDep, request: Request) -> dict[str, Any]:
    return await to_thread.run_sync(lambda: _public(_life(settings), request))


@router.post(
    "/v1/models/pin",
    response_model=ModelsPublic,
    dependencies=[require("admin")],
    summary="Put a model in force and keep it there (no promotion replaces it)",
)
async def pin_model(settings: SettingsDep, request: Request, body: PinRequest) -> dict[str, Any]:
    def run() -> dict[str, Any]:
        life = _life(settings, changing=True)
        life.pin(body.model_id)
        return _public(life, request)

    return await to_thread.run_sync(run)


@router.post(
    "/v1/models/unpin",
    response_model=ModelsPublic,
    dependencies=[require("admin")],
    summary="Let a better retrained model replace the one in force again",
)
async def unpin_model(settings: SettingsDep, request: Request) -> dict[str, Any]:
    def run() -> dict[str, Any]:
        life = _life(settings, changing=True)
        life.unpin()
        return _public(life, request)

    return await to_thread.run_sync(run)


@router.post(
    "/v1/models/rollback",
    response_model=ModelsPublic,
    dependencies=[require("admin")],
    summary="Put back the model the last promotion or pin replaced (409 when none)",
)
async def rollback_model(settings: SettingsDep, request: Request) -> dict[str, Any]:
    def run() -> dict[str, Any]:
        life = _life(settings, changing=True)
        life.rollback()
        return _public(life, request)

    return await to_thread.run_sync(run)
