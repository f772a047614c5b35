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
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from api.routes import audit, drain, failures, jobs, migrations, models, policy, risk
from api.settings import Settings
from api.state import AppState
from control.loop import ControlLoop
from forewarn import heap

__all__ = [
    "ControlProcess",
    "install_control",
    "load_model",
    "model_lifecycle",
    "start_control",
    "start_control_beside",
]

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
        partitioned=partitioned(settings, store),
    )


def partitioned(settings: Settings, store: Any) -> bool:
    """Whether the loop shares the scoring: asked for, on PostgreSQL (logged when not)."""
    if not settings.partitioned_scoring:
        return False
    if store.engine.dialect.name != "postgresql":
        log.warning("partitioned scoring needs PostgreSQL; this loop scores the whole fleet")
        return False
    return True


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
        child = ControlProcess.of(settings, state.replica_id, status=state.loop_status)
        return [asyncio.create_task(child.run(), name="control")]

    async def control() -> None:
        loop = await asyncio.to_thread(build_loop, settings, store, state.replica_id)
        heap.settle()  # the model lives as long as the service
        state.control = loop
        await loop.run()

    return [asyncio.create_task(control(), name="control")]


def start_control_beside(settings: Settings, replica: str) -> Callable[[], None]:
    """Run the service's one :class:`ControlProcess` from a thread of this process (``forewarn
    serve --workers N``: its workers start none, ``control_by_serve``); returns the function
    that stops it. Its watchdog reads the status the loop publishes from the store, as a
    worker's would."""
    from store import Store
    from store import control as control_db

    store = Store.open(settings.resolved_database_url(), migrate=False)

    def status() -> dict[str, Any]:
        with store.engine.connect() as connection:
            return control_db.read_status(connection) or {}

    child = ControlProcess.of(settings, replica, status=status)
    loop = asyncio.new_event_loop()
    task = loop.create_task(child.run(), name="control")

    def run() -> None:
        asyncio.set_event_loop(loop)
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)
        loop.close()

    # The child is forked from this thread and dies with it (PR_SET_PDEATHSIG is the
    # thread's), so the thread lives until stop() has stopped the child.
    thread = threading.Thread(target=run, name="control", daemon=True)
    thread.start()

    def stop() -> None:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=ControlProcess.STOP_TIMEOUT_S + 5)
        store.close()

    return stop


class ControlProcess:
    """``forewarn control`` as this service's child, started again whenever it ends.

    A child that exits (a crash, an operator's ``kill``) is started again after 1 s, a pause
    that doubles up to :attr:`MAX_BACKOFF_S` while it keeps dying within a minute. Cancelling
    :meth:`run` stops it: SIGTERM (its loop releases the leadership), SIGKILL after
    :attr:`STOP_TIMEOUT_S`. The child dies with this process (see :mod:`api.control_cli`).
    The database URL reaches it in its environment, not on its command line (``ps`` shows
    every user the command line, and a PostgreSQL URL may hold a password).

    A child that leads but stopped ticking (stopped, wedged: it may hold the database's write
    lock or the leadership) is killed and started again: once its status (``status()``, read
    every few seconds) names it and its last tick is older than ``stalled_after_s``. A child
    that follows publishes nothing and is left alone.
    """

    MAX_BACKOFF_S = 30.0
    STOP_TIMEOUT_S = 10.0

    def __init__(
        self,
        database_url: str,
        replica: str,
        *,
        status: Callable[[], dict[str, Any]] | None = None,
        stalled_after_s: float = 60.0,
    ) -> None:
        self.database_url = database_url
        self.replica = replica
        self.status = status
        self.stalled_after_s = stalled_after_s
        self.process: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.killed_stalled = 0

    @classmethod
    def of(
        cls, settings: Settings, replica: str, *, status: Callable[[], dict[str, Any]]
    ) -> ControlProcess:
        """The service's control process under ``settings``: stalled after 10 ticks, and at
        least 10 s."""
        return cls(
            settings.resolved_database_url(),
            replica,
            status=status,
            stalled_after_s=max(10.0, 10 * settings.control_tick_s),
        )

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "forewarn",
            "control",
            "--replica",
            self.replica,
            "--parent",
            str(os.getpid()),
        ]

    async def run(self) -> None:
        env = {**os.environ, "FOREWARN_DATABASE_URL": self.database_url}
        backoff = 0.5
        try:
            while True:
                started = time.monotonic()
                self.process = await asyncio.create_subprocess_exec(*self.command(), env=env)
                self.starts += 1
                log.info("control loop started in process %d", self.process.pid)
                code = await self._watch(self.process)
                lived = time.monotonic() - started
                backoff = 1.0 if lived > 60 else min(backoff * 2, self.MAX_BACKOFF_S)
                # Exit 0: it was asked to stop (a signal to the whole terminal's group, say).
                log.log(
                    logging.WARNING if code == 0 else logging.ERROR,
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

    async def _watch(self, process: asyncio.subprocess.Process) -> int:
        """Wait for ``process`` to end; kill it first if it leads and stopped ticking."""
        check_s = min(5.0, self.stalled_after_s / 2)
        while True:
            try:
                return await asyncio.wait_for(process.wait(), check_s)
            except TimeoutError:
                pass
            if self.status is None:
                continue
            try:
                status = await asyncio.to_thread(self.status)
            except Exception:  # the database is away: nothing to judge the child by
                continue
            if status.get("pid") != process.pid or status.get("replica") != self.replica:
                continue
            age_s = time.time() - float(status.get("tick_ms") or 0) / 1000
            if age_s > self.stalled_after_s:
                log.error(
                    "the control loop's process %d leads and has not ticked for %.0f s; killing it",
                    process.pid,
                    age_s,
                )
                self.killed_stalled += 1
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                return await process.wait()

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
