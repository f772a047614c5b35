"""The FastAPI application: ``create_app(settings)`` builds one, with no state at import.

Each app owns its store (migrated to head at start-up), its metrics registry and its
background tasks (retention now; the control loop joins them later). Routes live in one module
per concern and stay thin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from starlette.responses import JSONResponse, PlainTextResponse, Response

from api import dashboard, ingest, tokens
from api.control_service import install_control, start_control
from api.deps import TOKEN_CACHE_S, authorize
from api.docs import install_docs
from api.errors import CatchAll, document_errors, error_body, install_error_handlers
from api.guard import RequestGuard, document_guard
from api.metrics import Metrics, MetricsView, TimingMiddleware, control_families
from api.retraining import retrain_on_schedule
from api.routes import fleet
from api.routes import risk as risk_routes
from api.settings import DEV_TOKEN, Settings
from api.state import AppState, TokenCache
from api.webhooks import guard_for, install_webhooks, webhook_dispatcher
from forewarn import __version__, heap
from forewarn.threads import to_thread_to_end
from store import Store

__all__ = ["create_app"]

log = logging.getLogger("forewarn.api")


async def _retention(settings: Settings, store: Store) -> None:
    """The storage tiers (``store.tiers``): roll closed hours up, archive them as Parquet,
    drop what has left every tier."""
    policy = settings.tier_policy()
    while True:
        try:
            now_ms = int(time.time() * 1000)
            report = await to_thread_to_end(store.maintain_tiers, policy, now_ms=now_ms)
            if report:
                log.info("storage tiers: %s", report)
        except Exception:  # a failed pass is retried next interval; the service stays up
            log.exception("storage tier maintenance failed")
        await asyncio.sleep(settings.retention_interval_s)


def create_app(settings: Settings | None = None, *, store: Store | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: configuration; default read from ``FOREWARN_*`` environment variables.
        store: an already open store (tests share one); default opened from the settings.
    """
    settings = settings or Settings()

    metrics = Metrics()
    state = AppState(
        settings=settings,
        store=store,
        metrics=metrics,
        token_scopes=settings.token_scopes(),
        token_cache=TokenCache(ttl_s=TOKEN_CACHE_S),
        webhook_guard=guard_for(settings),
    )
    if settings.replica_id:
        state.replica_id = settings.replica_id

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owns_store = state.store is None
        if state.store is None:
            state.store = await asyncio.to_thread(
                Store.open, settings.resolved_database_url(), writer_process=settings.writer_process
            )
        opened = state.store
        if DEV_TOKEN in state.token_scopes:
            log.warning("no tokens configured: development token '%s' has every scope", DEV_TOKEN)
        tasks = [asyncio.create_task(_retention(settings, opened), name="retention")]
        if not settings.control_by_serve:  # else one for all workers: forewarn serve's
            tasks += await start_control(state, own_process=owns_store and settings.control_process)
        if settings.retrain_every_h is not None:
            tasks.append(asyncio.create_task(retrain_on_schedule(state), name="retrain"))
        if settings.webhook_dispatch:
            dispatcher = webhook_dispatcher(settings, opened)
            tasks.append(asyncio.create_task(dispatcher.run(), name="webhooks"))
        heap.settle()  # everything loaded to serve stays: keep the collector off it
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if owns_store:
                opened.close()

    app = FastAPI(
        title="Forewarn",
        version=__version__,
        description="GPU failure prediction and live migration of training ranks.",
        lifespan=lifespan,
        docs_url=None,  # served from the app's own assets: api.docs
        redoc_url=None,
    )
    app.state.forewarn = state  # the one attribute: every route reads api.state.AppState
    install_error_handlers(app)
    app.add_middleware(
        RequestGuard, router=app.router, max_body_bytes=settings.max_request_body_bytes
    )
    app.add_middleware(CatchAll)
    app.add_middleware(TimingMiddleware, metrics=metrics)
    app.include_router(ingest.router)
    app.include_router(fleet.router)
    app.include_router(tokens.router)
    install_docs(app)
    install_control(app)
    install_webhooks(app)
    app.include_router(dashboard.router)
    document_errors(app)
    document_guard(app)

    @app.get("/healthz", tags=["ops"], summary="The process is up")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/readyz", tags=["ops"], summary="The database answers and its schema is current")
    async def readyz() -> Response:
        store = state.store
        try:
            if store is None:
                raise RuntimeError("store not open yet")
            await asyncio.to_thread(store.ping)
            current = await asyncio.to_thread(store.schema_is_current)
        except Exception as exc:  # the details (host, port, driver) go to the log, not out
            log.warning("not ready: %s: %s", type(exc).__name__, exc)
            body = error_body("not_ready", "database unavailable", retryable=True)
            return JSONResponse(body, 503, headers={"Retry-After": "5"})
        if not current:
            return JSONResponse(error_body("not_ready", "schema is not at head"), 503)
        return JSONResponse({"status": "ready", "database": store.dialect})

    def _control_metrics(per_gpu: bool) -> list[Metric]:
        status = state.loop_status()
        leads = state.leads(status)
        risks: list[tuple[str, int, float]] = []
        if leads and per_gpu and state.store is not None:
            snap = risk_routes.snapshot(state, state.store)
            risks = [(r["node"], r["gpu"], r["risk"]) for r in snap.rows]
        return control_families(status, leads=leads, risks=risks)

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics (per-GPU series with a read token only)",
        response_class=PlainTextResponse,
        responses={200: {"description": "The Prometheus text exposition format"},
                   401: {"description": "A token was sent (or is required) and is unknown"},
                   403: {"description": "The token lacks the read scope"}},
    )  # fmt: skip
    async def prometheus(request: Request) -> Response:
        per_gpu = settings.metrics_require_token or "authorization" in request.headers
        if per_gpu:
            await authorize(request, "read")
        store = state.store
        if store is not None:
            with contextlib.suppress(Exception):
                metrics.gpus.set(await asyncio.to_thread(store.gpu_count))
        extra = (
            await asyncio.to_thread(_control_metrics, per_gpu) if settings.control_enabled else []
        )
        view = MetricsView(
            metrics.registry,
            per_gpu=per_gpu,
            max_gpu_series=settings.metrics_max_gpu_series,
            extra=extra,
        )
        return Response(generate_latest(view), media_type=CONTENT_TYPE_LATEST)

    return app
