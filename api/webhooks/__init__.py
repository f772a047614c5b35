"""Webhook subscriptions: routes, Standard Webhooks signing, the target guard, the dispatcher.

:func:`install_webhooks` adds the routes and the guard to an app;
:func:`webhook_dispatcher` builds the background dispatcher the app's lifespan runs.
"""

from __future__ import annotations

from fastapi import FastAPI

from api.settings import Settings
from api.webhooks.dispatcher import DispatchConfig, Dispatcher
from api.webhooks.guard import TargetGuard, TargetRefused
from api.webhooks.routes import router
from api.webhooks.sender import Sender
from store import Store

__all__ = [
    "DispatchConfig",
    "Dispatcher",
    "TargetGuard",
    "TargetRefused",
    "guard_for",
    "install_webhooks",
    "router",
    "webhook_dispatcher",
]


def guard_for(settings: Settings) -> TargetGuard:
    return TargetGuard(settings.webhook_allow, require_https=settings.environment == "production")


def install_webhooks(app: FastAPI) -> None:
    """Add the ``/v1/webhooks`` routes (the target guard is the app state's)."""
    app.include_router(router)


def webhook_dispatcher(settings: Settings, store: Store) -> Dispatcher:
    config = DispatchConfig.from_settings(settings)
    sender = Sender(
        guard_for(settings),
        timeout_s=config.timeout_s,
        max_response_bytes=config.max_response_bytes,
    )
    return Dispatcher(store.engine, sender, config)
