"""Model routes: the models the service can score with, which one is in force, the history of
promotions, pins and rollbacks (``read``); pin, unpin, roll back, retrain (``admin``).

``POST /v1/models/retrain`` trains a candidate on the fleet's own history (the store's Parquet
history, ``FOREWARN_HISTORY_URL``) on top of the model in force, in a worker thread (never in
the event loop: ingest goes on), and lets the lifecycle judge it on the history's last
``holdout_days``; ``GET /v1/models/retrain`` says how the last one went. The same runs on a
schedule with ``FOREWARN_RETRAIN_EVERY_H`` (:mod:`api.retraining`).

A thin layer over :class:`predictor.lifecycle.ModelLifecycle` on ``FOREWARN_MODELS_DIR``; the
control loop follows the model in force at its next tick. With ``FOREWARN_MODEL`` set, that
card scores and the lifecycle does not decide: changes are refused (409).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from anyio import to_thread
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from api.deps import SettingsDep, require
from api.retraining import start_retraining
from api.state import app_state
from forewarn.errors import Conflict
from predictor.lifecycle import ModelLifecycle

__all__ = ["ModelsPublic", "PinRequest", "RetrainPublic", "RetrainRequest", "router"]

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
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake: 422

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
    loop = app_state(request.app).loop_status()
    return {
        "data": models,
        "count": len(models),
        "in_force": status["in_force"],
        "scoring": loop.get("model_id"),
        "pinned": status["pinned"],
        "replaced": status["replaced"],
        "history": status["history"],
    }


_CHANGES: dict[int | str, dict[str, Any]] = {
    409: {"description": "FOREWARN_MODEL names the model, or the lifecycle cannot do it now"}
}
"""What every route that changes the model in force can answer besides the common errors."""


@router.get(
    "/v1/models",
    response_model=ModelsPublic,
    dependencies=[require("read")],
    summary="The models, the one in force and the history of promotions, pins and rollbacks",
)
async def list_models(settings: SettingsDep, request: Request) -> dict[str, Any]:
    return await to_thread.run_sync(lambda: _public(_life(settings), request))


async def _change(
    settings: Any, request: Request, change: Callable[[ModelLifecycle], object]
) -> dict[str, Any]:
    """Apply an operator's ``change`` to the lifecycle off the event loop; the models after it."""

    def run() -> dict[str, Any]:
        life = _life(settings, changing=True)
        change(life)
        return _public(life, request)

    return await to_thread.run_sync(run)


@router.post(
    "/v1/models/pin",
    response_model=ModelsPublic,
    dependencies=[require("admin")],
    responses={**_CHANGES, 404: {"description": "No such model"}},
    summary="Put a model in force and keep it there (no promotion replaces it)",
)
async def pin_model(settings: SettingsDep, request: Request, body: PinRequest) -> dict[str, Any]:
    return await _change(settings, request, lambda life: life.pin(body.model_id))


@router.post(
    "/v1/models/unpin",
    response_model=ModelsPublic,
    dependencies=[require("admin")],
    responses=_CHANGES,
    summary="Let a better retrained model replace the one in force again",
)
async def unpin_model(settings: SettingsDep, request: Request) -> dict[str, Any]:
    return await _change(settings, request, ModelLifecycle.unpin)


@router.post(
    "/v1/models/rollback",
    response_model=ModelsPublic,
    dependencies=[require("admin")],
    responses=_CHANGES,
    summary="Put back the model the last promotion or pin replaced (409 when none)",
)
async def rollback_model(settings: SettingsDep, request: Request) -> dict[str, Any]:
    return await _change(settings, request, ModelLifecycle.rollback)


class RetrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake: 422

    holdout_days: StrictFloat = Field(default=1.0, gt=0, le=30)  # not true, not "1"
    """The history's last days, held out of training, on which the candidate and the model in
    force are judged."""


class RetrainPublic(BaseModel):
    state: Literal["idle", "running", "done", "failed"]
    trigger: Literal["request", "schedule"] | None = None
    """Who started the last one: the API or the schedule (``FOREWARN_RETRAIN_EVERY_H``)."""
    started_at: float | None = None
    """Seconds since the epoch."""
    finished_at: float | None = None
    decision: dict[str, Any] | None = None
    """The lifecycle's decision (``judged``: both judgements, promoted or not)."""
    error: str | None = None


@router.post(
    "/v1/models/retrain",
    response_model=RetrainPublic,
    status_code=202,
    dependencies=[require("admin")],
    responses=_CHANGES,
    summary="Retrain on the fleet's own history in a worker; the lifecycle judges the result "
    "(409 when one is running)",
)
async def retrain_model(
    settings: SettingsDep, request: Request, body: RetrainRequest | None = None
) -> dict[str, Any]:
    _life(settings, changing=True)
    state = app_state(request.app)
    days = (body or RetrainRequest()).holdout_days
    if not start_retraining(state, days, trigger="request"):
        raise Conflict("a retraining is running", details={"started_at": state.retrain.started_at})
    return state.retrain.public()


@router.get(
    "/v1/models/retrain",
    response_model=RetrainPublic,
    dependencies=[require("read")],
    summary="How the last retraining went",
)
async def retrain_status(request: Request) -> dict[str, Any]:
    return app_state(request.app).retrain.public()
