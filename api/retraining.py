"""Retraining the risk model on the fleet's own history: on demand and on a schedule.

``POST /v1/models/retrain`` and the schedule (``FOREWARN_RETRAIN_EVERY_H``) both call
:func:`start_retraining`: one retraining at a time, in a worker thread (training takes minutes
and must never stall ingest or the control loop), judged by the models directory's
:class:`~predictor.lifecycle.ModelLifecycle`, which promotes the candidate only if it beats the
model in force on the history's last days. ``GET /v1/models/retrain`` reads how it went
(:class:`api.state.RetrainJob`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from api.settings import Settings
from api.state import AppState, RetrainJob
from forewarn.errors import Conflict, ForewarnError

__all__ = ["retrain_on_schedule", "start_retraining"]

log = logging.getLogger("forewarn.retrain")


def start_retraining(state: AppState, holdout_days: float, *, trigger: str) -> bool:
    """Start a retraining in a worker thread; False (nothing started) when one is running.

    ``trigger`` says who asked: ``request`` or ``schedule``.
    """
    job = state.retrain
    with job.lock:
        if job.state == "running":
            return False
        job.state, job.trigger = "running", trigger
        job.started_at, job.finished_at = time.time(), None
        job.decision, job.error = None, None
    threading.Thread(
        target=_retrain, args=(state.settings, job, holdout_days), name="model-retrain", daemon=True
    ).start()
    return True


def _retrain(settings: Settings, job: RetrainJob, holdout_days: float) -> None:
    from predictor.dataset import load_dataset
    from predictor.lifecycle import ModelLifecycle

    try:
        url = settings.tier_policy().history_url
        if url is None:
            raise Conflict("the service keeps no history (FOREWARN_HISTORY_URL=none)")
        history = load_dataset(url)
        life = ModelLifecycle(settings.models_dir)
        decision = life.retrain_on_history(history, holdout_days=holdout_days)
        job.state, job.decision = "done", decision
    except ForewarnError as exc:
        job.state, job.error = "failed", exc.message
    except Exception as exc:  # a worker thread must report, not die silently
        job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        job.finished_at = time.time()
    log.info("retraining (%s) %s: %s", job.trigger, job.state, job.error or job.decision)


async def retrain_on_schedule(state: AppState) -> None:
    """Every ``retrain_every_h``, start a retraining on the replica that leads the control loop
    (or on this one when it runs no control loop); skip a turn while one is still running."""
    settings = state.settings
    every_h = settings.retrain_every_h
    if every_h is None:
        return
    if settings.model is not None:
        log.warning(
            "FOREWARN_RETRAIN_EVERY_H is ignored: FOREWARN_MODEL names the model to score with"
        )
        return
    while True:
        await asyncio.sleep(every_h * 3600)
        if settings.control_enabled and not state.leads(await asyncio.to_thread(state.loop_status)):
            continue  # the leader retrains; the others would train the same model again
        if not start_retraining(state, settings.retrain_holdout_days, trigger="schedule"):
            log.info("scheduled retraining skipped: the last one is still running")
