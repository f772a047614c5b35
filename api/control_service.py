"""Wiring of the control loop into the app: its routes, its model and its background task.

``install_control(app, settings)`` includes the routes (risk, jobs, migrations, policy, audit,
drain); ``start_control(app)``, called from the app's lifespan, starts the control loop:
by default in a process of its own (``forewarn control``, :class:`ControlProcess`), else in a
thread of the service. Either way it loads the model (``FOREWARN_MODEL``, or the model in
force in ``models_dir``, else the model shipped in ``predictor/shipped/``) and runs
:class:`control.loop.ControlLoop`. Every replica runs one; only the leader acts
(``control.leader``). The service shows the loop from the status it publishes in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
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


def build_loop(settings: Settings, store: Any, replica: str) -> ControlLoop:
    """The control loop of ``settings`` on ``store``, its model loaded (slow: call from a
    worker thread)."""
    return ControlLoop(
        store,
        model=load_model(settings),
        defaults=settings.policy,
        tick_s=settings.control_tick_s,
        replica=replica,
        warm_window_s=settings.warm_window_s,
        history_interval_s=settings.risk_history_interval_s,
        history_days=settings.risk_history_days,
        ack_timeout_s=settings.ack_timeout_s,
        agent_timeout_s=settings.agent_timeout_s,
        lifecycle=model_lifecycle(settings),
    )


async def start_control(state: AppState, *, own_process: bool) -> list[asyncio.Task[None]]:
    """Start the control loop if the settings enable it; returns its task (to cancel).

    ``own_process``: in a child process (``forewarn control``, kept running by
    :class:`ControlProcess`); else in a thread of this one (a service handed an open store,
    as tests do, or ``FOREWARN_CONTROL_PROCESS=false``), where the model loads inside the
    task so that the service answers (``/readyz``) while it loads, and ``state.control`` is
    the loop once it runs.
    """
    settings = state.settings
    store = state.store
    if not settings.control_enabled or store is None:
        return []
    if own_process:
        child = ControlProcess(settings.resolved_database_url(), state.replica_id)
        return [asyncio.create_task(child.run(), name="control")]

    async def control() -> None:
        loop = await asyncio.to_thread(build_loop, settings, store, state.replica_id)
        heap.settle()  # the model lives as long as the service
        state.control = loop
        await loop.run()

    return [asyncio.create_task(control(), name="control")]


class ControlProcess:
    """``forewarn control`` as this service's child, started again whenever it ends.

    A child that exits (a crash, an operator's ``kill``) is started again after a pause that
    doubles up to :attr:`MAX_BACKOFF_S` while it keeps dying young. Cancelling :meth:`run`
    stops it: SIGTERM (its loop releases the leadership), SIGKILL after
    :attr:`STOP_TIMEOUT_S`. The child dies with this process (see :mod:`api.control_cli`).
    """

    MAX_BACKOFF_S = 30.0
    STOP_TIMEOUT_S = 10.0

    def __init__(self, database_url: str, replica: str) -> None:
        self.database_url = database_url
        self.replica = replica
        self.process: asyncio.subprocess.Process | None = None
        self.starts = 0

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "forewarn",
            "control",
            "--database-url",
            self.database_url,
            "--replica",
            self.replica,
            "--parent",
            str(os.getpid()),
        ]

    async def run(self) -> None:
        backoff = 1.0
        try:
            while True:
                started = time.monotonic()
                self.process = await asyncio.create_subprocess_exec(*self.command())
                self.starts += 1
                log.info("control loop started in process %d", self.process.pid)
                code = await self.process.wait()
                lived = time.monotonic() - started
                backoff = 1.0 if lived > 60 else min(backoff * 2, self.MAX_BACKOFF_S)
                log.error(
                    "the control loop's process %d ended (exit %s) after %.0f s; "
                    "starting it again in %.0f s",
                    self.process.pid,
                    code,
                    lived,
                    backoff,
                )
                await asyncio.sleep(backoff)
        finally:
            await asyncio.shield(self._stop())

    async def _stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), self.STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
