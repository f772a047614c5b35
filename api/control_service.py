"""Wiring of the control loop into the app: its routes, its model and its background task.

``install_control(app, settings)`` includes the routes (risk, jobs, migrations, policy, audit,
drain); ``start_control(app)``, called from the app's lifespan, loads the model
(``FOREWARN_MODEL``, or the newest in ``models_dir``, else the model shipped in
``predictor/shipped/``) and starts :class:`control.loop.ControlLoop` as a task.
Every replica runs the task; only the leader acts (``control.leader``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI

from api.routes import audit, drain, failures, jobs, migrations, models, policy, risk
from api.settings import Settings
from api.state import AppState
from control.loop import ControlLoop
from forewarn import heap

__all__ = ["install_control", "load_model", "model_lifecycle", "start_control"]

log = logging.getLogger("forewarn.control")


def install_control(app: FastAPI) -> None:
    for module in (risk, jobs, migrations, policy, audit, drain, failures, models):
        app.include_router(module.router)


def load_model(settings: Settings) -> Any:
    """The risk model to score with, or None (logged) when there is none."""
    from forewarn.errors import ForewarnError
    from predictor import registry

    try:
        if settings.model is not None:
            return registry.load(settings.model)
        return model_lifecycle(settings).load_in_force()
    except ForewarnError as exc:
        log.warning("no risk model (%s): GPUs will not be scored", exc)
        return None


def model_lifecycle(settings: Settings) -> Any:
    """The lifecycle of ``models_dir`` (its model in force: pinned, promoted, else the newest,
    else the shipped one), or None when ``FOREWARN_MODEL`` names the model."""
    from predictor.lifecycle import ModelLifecycle

    return None if settings.model is not None else ModelLifecycle(settings.models_dir)


async def start_control(state: AppState) -> list[asyncio.Task[None]]:
    """Start the control loop if the settings enable it; returns its task (to cancel).

    The model loads inside the task, so the service answers (``/readyz``) while it loads;
    ``state.control`` is the loop once it runs.
    """
    settings = state.settings
    store = state.store
    if not settings.control_enabled or store is None:
        return []

    async def control() -> None:
        model = await asyncio.to_thread(load_model, settings)
        heap.settle()  # the model lives as long as the service
        loop = ControlLoop(
            store,
            model=model,
            defaults=settings.policy,
            tick_s=settings.control_tick_s,
            registry=state.metrics.registry,
            warm_window_s=settings.warm_window_s,
            history_interval_s=settings.risk_history_interval_s,
            history_days=settings.risk_history_days,
            ack_timeout_s=settings.ack_timeout_s,
            agent_timeout_s=settings.agent_timeout_s,
            lifecycle=model_lifecycle(settings),
        )
        state.control = loop
        await loop.run()

    return [asyncio.create_task(control(), name="control")]
