"""The event outbox: every event Forewarn announces, written in the transaction that causes it.

The control loop (a migration changes state, a GPU crosses the threshold, a node is drained)
calls :func:`emit_event` on the same connection as the state change, so an event exists if and
only if its cause was committed. The webhook dispatcher reads the outbox in ``seq`` order (the
arrival cursor) and delivers each event to the subscriptions that want it; a delivery retried
after a restart carries the same ``id``, which receivers use to de-duplicate.

A row is the public event record, the same shape receivers get::

    {"type": "migration.requested", "timestamp": "2026-12-03T06:20:00.123Z", "data": {...}}

with the ``id`` (``msg_...``) in the ``webhook-id`` header.
"""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import Connection, insert, select

from store.schema import outbox

__all__ = [
    "EVENT_TYPES",
    "OutboxEvent",
    "emit_event",
    "event_payload",
    "events_after",
    "new_event_id",
]

EVENT_TYPES: dict[str, str] = {
    "risk.threshold_crossed": "A GPU's risk crossed the alarm threshold (after hysteresis).",
    "risk.cleared": "A GPU's risk fell back below the threshold.",
    "migration.requested": "A migration was requested (preventive, planned, unplanned, manual or "
    "straggler).",
    "migration.acknowledged": "The job agent accepted a migration command.",
    "migration.transferring": "The source rank is sending its state to the spare.",
    "migration.completed": "The spare took over the rank; training continued.",
    "migration.failed": "A migration did not complete; the error says why.",
    "migration.cancelled": "A migration was cancelled before it moved state.",
    "rank.straggling": "A rank's compute stayed above its peers' for the policy's window: a "
    "straggler, named from its GPU's telemetry.",
    "rank.recovered": "A straggler episode ended: the rank's compute is back among its peers', "
    "or the rank moved to another GPU; with the episode's span.",
    "gpu.failed": "A GPU was lost or reported a fatal Xid.",
    "gpu.stale": "A GPU's collector stopped reporting; its risk is unknown.",
    "node.drained": "A node was drained: no new placements, its ranks moved off.",
    "node.undrained": "A drained node was returned to service.",
    "policy.breaker_tripped": "Too many GPUs alarmed at once; automatic action stopped.",
    "webhook.disabled": "A subscription was disabled after a run of failed deliveries.",
    "webhook.test": "A test delivery asked for by an operator.",
}
"""Every event type, with the sentence the docs and ``GET /v1/webhooks/event-types`` show."""

OutboxEvent = dict[str, Any]
"""A row of the outbox: seq, id, type, ts_ms, job_id, node, data (decoded)."""


def new_event_id() -> str:
    """A stable, sortable event id: ``msg_`` + milliseconds (hex) + 64 random bits."""
    return f"msg_{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


def emit_event(
    connection: Connection,
    type: str,
    data: dict[str, Any],
    *,
    job_id: str | None = None,
    node: str | None = None,
    ts_ms: int | None = None,
) -> str:
    """Write one event on ``connection`` (inside the caller's transaction); returns its id."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type!r}")
    event_id = new_event_id()
    connection.execute(
        insert(outbox).values(
            id=event_id,
            type=type,
            ts_ms=ts_ms if ts_ms is not None else int(time.time() * 1000),
            job_id=job_id,
            node=node,
            data=orjson.dumps(data).decode(),
        )
    )
    return event_id


def events_after(connection: Connection, seq: int, *, limit: int = 500) -> list[OutboxEvent]:
    """Events with ``seq`` greater than the cursor, oldest first."""
    rows = connection.execute(
        select(outbox).where(outbox.c.seq > seq).order_by(outbox.c.seq).limit(limit)
    ).mappings()
    return [{**row, "data": orjson.loads(row["data"])} for row in rows]


def event_payload(event: OutboxEvent) -> dict[str, Any]:
    """The body receivers get: ``{"type", "timestamp", "data"}`` (RFC 3339, UTC, ms)."""
    ts = datetime.fromtimestamp(event["ts_ms"] / 1000, UTC)
    return {
        "type": event["type"],
        "timestamp": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "data": event["data"],
    }
