"""The webhook rules the store does not hold: which events a subscription wants, when its
failures disable it, and how a subscription is named.

:mod:`store.webhooks` keeps the tables and their queries (its fan-out query selects by a
subscription's types, job and node); the choices made on what those queries return are here,
used by the dispatcher and the routes.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["disable_reason", "new_webhook_id", "wants"]

_ABOUT_ONE = ("webhook.test", "webhook.disabled")


def new_webhook_id() -> str:
    """A new subscription's id: ``wh_`` and 24 random hex digits."""
    return f"wh_{secrets.token_hex(12)}"


def wants(webhook: Mapping[str, Any], event: Mapping[str, Any]) -> bool:
    """Whether ``webhook`` takes ``event``: its types (``*`` for all), job and node filters;
    a ``webhook.test`` goes to the one subscription it names whatever its filters, and a
    subscription never hears of its own disabling (it is disabled)."""
    if event["type"] in _ABOUT_ONE:
        about = orjson.loads(event["data"]).get("webhook_id")
        if (event["type"] == "webhook.test") != (about == webhook["id"]):
            return False
        if event["type"] == "webhook.test":
            return True
    types = webhook["event_types"]
    return (
        ("*" in types or event["type"] in types)
        and (webhook["job_id"] is None or event["job_id"] == webhook["job_id"])
        and (webhook["node"] is None or event["node"] == webhook["node"])
    )


def disable_reason(*, ok: bool, failures: int, disable_after: int, error: str | None) -> str | None:
    """Why the subscription is disabled after this attempt, or None while it stays enabled:
    ``disable_after`` consecutive failed attempts disable it."""
    if ok or failures < disable_after:
        return None
    return f"{failures} consecutive failed attempts; last: {error}"
