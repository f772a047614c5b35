"""``/v1/webhooks``: subscriptions (admin scope), their deliveries, and the event types (read)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from api.deps import SettingsDep, StoreDep, require
from api.routes._common import now_ms
from api.state import app_state
from api.webhooks.guard import TargetGuard
from api.webhooks.models import (
    DeliveriesPublic,
    DeliveryPublic,
    EventTypePublic,
    EventTypesPublic,
    SecretRotate,
    WebhookCreate,
    WebhookCreated,
    WebhookPublic,
    WebhooksPublic,
    WebhookTestQueued,
    WebhookUpdate,
)
from api.webhooks.rules import new_webhook_id
from api.webhooks.signing import generate_secret
from forewarn.errors import NotFound
from store import Store
from store import webhooks as wstore
from store.outbox import EVENT_TYPES, emit_event

__all__ = ["router"]

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

ADMIN = [require("admin")]


def _guard(request: Request) -> TargetGuard:
    return app_state(request.app).webhook_guard


async def _in_tx(store: Store, fn: Any, *args: Any, **kwargs: Any) -> Any:
    def run() -> Any:
        with store.begin() as connection:
            return fn(connection, *args, **kwargs)

    return await asyncio.to_thread(run)


def _found(row: wstore.Webhook | None, webhook_id: str) -> wstore.Webhook:
    if row is None:
        raise NotFound(f"no webhook {webhook_id!r}")
    return row


@router.get(
    "/event-types",
    response_model=EventTypesPublic,
    dependencies=[require("read")],
    summary="Every event type a subscription can receive",
)
async def event_types() -> EventTypesPublic:
    data = [EventTypePublic(type=t, description=d) for t, d in EVENT_TYPES.items()]
    return EventTypesPublic(data=data, count=len(data))


@router.post(
    "",
    response_model=WebhookCreated,
    status_code=201,
    dependencies=ADMIN,
    summary="Subscribe a URL to events (the response shows the signing secret once)",
)
async def create(body: WebhookCreate, request: Request, store: StoreDep) -> WebhookCreated:
    await _guard(request).resolve(body.url)
    row = await _in_tx(
        store,
        wstore.create_webhook,
        webhook_id=new_webhook_id(),
        now_ms=now_ms(),
        url=body.url,
        event_types=body.event_types,
        secret=generate_secret(),
        job_id=body.job_id,
        node=body.node,
        description=body.description,
    )
    return WebhookCreated.of(row)


@router.get("", response_model=WebhooksPublic, dependencies=ADMIN, summary="Every subscription")
async def list_all(store: StoreDep) -> WebhooksPublic:
    rows = await _in_tx(store, wstore.list_webhooks)
    return WebhooksPublic(data=[WebhookPublic.of(r) for r in rows], count=len(rows))


@router.get("/{webhook_id}", response_model=WebhookPublic, dependencies=ADMIN)
async def get_one(webhook_id: str, store: StoreDep) -> WebhookPublic:
    return WebhookPublic.of(_found(await _in_tx(store, wstore.get_webhook, webhook_id), webhook_id))


@router.patch(
    "/{webhook_id}",
    response_model=WebhookPublic,
    dependencies=ADMIN,
    summary="Change the URL, filters or description, or enable/disable",
)
async def patch(
    webhook_id: str, body: WebhookUpdate, request: Request, store: StoreDep
) -> WebhookPublic:
    changes = body.model_dump(exclude_unset=True)
    if changes.get("url") is not None:
        await _guard(request).resolve(changes["url"])
    changes = {k: v for k, v in changes.items() if v is not None or k in ("job_id", "node")}
    row = await _in_tx(store, wstore.update_webhook, webhook_id, now_ms=now_ms(), **changes)
    return WebhookPublic.of(_found(row, webhook_id))


@router.delete("/{webhook_id}", status_code=204, dependencies=ADMIN)
async def remove(webhook_id: str, store: StoreDep) -> None:
    if not await _in_tx(store, wstore.delete_webhook, webhook_id):
        raise NotFound(f"no webhook {webhook_id!r}")


@router.post(
    "/{webhook_id}/rotate-secret",
    response_model=WebhookCreated,
    dependencies=ADMIN,
    summary="A new signing secret; the old one also signs during the grace period",
)
async def rotate(
    webhook_id: str, store: StoreDep, settings: SettingsDep, body: SecretRotate | None = None
) -> WebhookCreated:
    grace_s = body.grace_s if body and body.grace_s is not None else settings.webhook_secret_grace_s
    row = await _in_tx(
        store,
        wstore.rotate_secret,
        webhook_id,
        secret=generate_secret(),
        grace_ms=int(grace_s * 1000),
        now_ms=now_ms(),
    )
    return WebhookCreated.of(_found(row, webhook_id))


@router.post(
    "/{webhook_id}/test",
    response_model=WebhookTestQueued,
    status_code=202,
    dependencies=ADMIN,
    summary="Queue a webhook.test event for this subscription only",
)
async def test(webhook_id: str, store: StoreDep) -> WebhookTestQueued:
    def queue(connection: Any) -> str:
        row = _found(wstore.get_webhook(connection, webhook_id), webhook_id)
        return emit_event(
            connection,
            "webhook.test",
            {"webhook_id": webhook_id, "url": row["url"], "message": "test delivery"},
        )

    return WebhookTestQueued(event_id=await _in_tx(store, queue))


@router.get(
    "/{webhook_id}/deliveries",
    response_model=DeliveriesPublic,
    dependencies=ADMIN,
    summary="Deliveries, newest first: attempts, status codes, latency, next retry",
)
async def deliveries(
    webhook_id: str,
    store: StoreDep,
    status: Literal["pending", "succeeded", "failed"] | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before_id: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
) -> DeliveriesPublic:
    def read(connection: Any) -> list[wstore.Delivery]:
        _found(wstore.get_webhook(connection, webhook_id), webhook_id)
        return wstore.list_deliveries(
            connection, webhook_id, status=status, limit=limit, before_id=before_id
        )

    rows = await _in_tx(store, read)
    return DeliveriesPublic(data=[DeliveryPublic.of(r) for r in rows], count=len(rows))
