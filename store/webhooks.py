"""Webhook subscriptions and their deliveries: the dispatcher's persisted state.

``webhooks`` holds one row per subscription: target, filters, signing secret (and the previous
one during a rotation's grace period), the run of consecutive failed attempts, the outbox
cursor up to which events were fanned out to it, and a lease (``lease_owner`` until
``lease_until_ms``) naming the one dispatcher replica that may deliver to it. Every replica,
on SQLite or PostgreSQL, takes a lease with one conditional ``UPDATE`` (see
:func:`claim_webhooks`), so a subscription is served by exactly one replica at a time and its
events leave in outbox order.

``webhook_deliveries`` holds one row per (subscription, event): ``pending`` until the receiver
answers 2xx (``succeeded``) or the retry horizon passes (``failed``). The row outlives a
restart, so an attempt interrupted by a crash is made again with the same event id.

Every write transaction here starts with a write statement (never a read then a write), so
SQLite takes its write lock up front and waits in its busy handler instead of failing on a
stale snapshot.

This module holds tables and queries only. What a subscription wants, when failures disable
it, its id and the clock are the dispatcher's and the routes' (:mod:`api.webhooks.rules`):
every function that stamps a time takes it as ``now_ms``.
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

import orjson
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    Connection,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    update,
)

from store.schema import metadata, outbox

__all__ = [
    "ATTEMPT_LOG_SIZE",
    "AttemptOutcome",
    "Delivery",
    "DueDelivery",
    "OutboxEvent",
    "Success",
    "Webhook",
    "claim_webhooks",
    "claimable",
    "create_webhook",
    "delete_webhook",
    "disable_webhook",
    "due_deliveries",
    "events_by_seq",
    "events_to_fan_out",
    "get_webhook",
    "held_webhooks",
    "list_deliveries",
    "list_webhooks",
    "max_outbox_seq",
    "outbox_seqs_after",
    "queue_deliveries",
    "queue_late",
    "record_attempt",
    "record_successes",
    "release_webhooks",
    "rotate_secret",
    "update_webhook",
    "webhook_deliveries",
    "webhooks",
]

ATTEMPT_LOG_SIZE = 20
"""How many of a delivery's most recent attempts its row keeps."""

webhooks = Table(
    "webhooks",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("url", Text, nullable=False),
    Column("event_types", Text, nullable=False),  # JSON list; ["*"] for every type
    Column("job_id", String(253)),
    Column("node", String(253)),
    Column("description", Text, nullable=False, default=""),
    Column("secret", String(128), nullable=False),
    Column("previous_secret", String(128)),
    Column("previous_secret_until_ms", BigInteger),
    Column("enabled", Boolean, nullable=False, default=True),
    Column("disabled_reason", Text),
    Column("consecutive_failures", Integer, nullable=False, default=0),
    Column("cursor_seq", BigInteger, nullable=False, default=0),
    Column("lease_owner", String(64)),
    Column("lease_until_ms", BigInteger),
    Column("created_ms", BigInteger, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
)
"""One row per subscription (``wh_...``)."""

webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("webhook_id", String(40), ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False),
    Column("event_id", String(48), nullable=False),
    Column("event_seq", BigInteger, nullable=False),
    Column("event_type", String(64), nullable=False),
    Column("status", String(16), nullable=False, default="pending"),
    Column("attempts", Integer, nullable=False, default=0),
    Column("created_ms", BigInteger, nullable=False),
    Column("next_attempt_ms", BigInteger, nullable=False),
    Column("last_attempt_ms", BigInteger),
    Column("last_status_code", Integer),
    Column("last_error", Text),
    Column("last_latency_ms", Integer),
    Column("delivered_ms", BigInteger),
    Column("attempt_log", Text, nullable=False, default="[]"),
    UniqueConstraint("webhook_id", "event_id", name="uq_webhook_deliveries_event"),
    Index("ix_webhook_deliveries_queue", "webhook_id", "status", "event_seq"),
)
"""One row per (subscription, event); ``status`` is pending, succeeded or failed."""


class Webhook(TypedDict):
    """A row of ``webhooks``, ``event_types`` decoded."""

    id: str
    url: str
    event_types: list[str]
    job_id: str | None
    node: str | None
    description: str
    secret: str
    previous_secret: str | None
    previous_secret_until_ms: int | None
    enabled: bool
    disabled_reason: str | None
    consecutive_failures: int
    cursor_seq: int
    lease_owner: str | None
    lease_until_ms: int | None
    created_ms: int
    updated_ms: int


class OutboxEvent(TypedDict):
    """A row of the outbox (``data`` as stored: JSON text)."""

    seq: int
    id: str
    type: str
    ts_ms: int
    job_id: str | None
    node: str | None
    data: str


class Delivery(TypedDict):
    """A row of ``webhook_deliveries`` (``attempt_log`` decoded only by
    :func:`list_deliveries`)."""

    id: int
    webhook_id: str
    event_id: str
    event_seq: int
    event_type: str
    status: str
    attempts: int
    created_ms: int
    next_attempt_ms: int
    last_attempt_ms: int | None
    last_status_code: int | None
    last_error: str | None
    last_latency_ms: int | None
    delivered_ms: int | None
    attempt_log: Any


class DueDelivery(Delivery):
    """A pending delivery with its event's time and data (:func:`due_deliveries`)."""

    event_ts_ms: int
    event_data: str


class Success(DueDelivery):
    """An accepted attempt of a due delivery, for :func:`record_successes`."""

    attempt_ms: int
    latency_ms: int
    status_code: int | None


class AttemptOutcome(TypedDict):
    """What :func:`record_attempt` wrote: ``held`` is False when the lease had moved to
    another replica (nothing written); ``failures`` is the subscription's run of consecutive
    failed attempts after this one."""

    held: bool
    failures: int


def _decode(row: Any) -> Webhook:
    out = dict(row)
    out["event_types"] = orjson.loads(out["event_types"])
    return cast(Webhook, out)


def max_outbox_seq(connection: Connection) -> int:
    """The newest event's ``seq`` (0 when the outbox is empty)."""
    return int(connection.execute(select(func.coalesce(func.max(outbox.c.seq), 0))).scalar_one())


def outbox_seqs_after(connection: Connection, seq: int, *, limit: int = 10_000) -> list[int]:
    """The committed ``seq`` values above ``seq``, ascending (for finding gaps)."""
    rows = connection.execute(
        select(outbox.c.seq).where(outbox.c.seq > seq).order_by(outbox.c.seq).limit(limit)
    )
    return [int(r[0]) for r in rows]


# Subscriptions ------------------------------------------------------------------------------


def create_webhook(
    connection: Connection,
    *,
    webhook_id: str,
    now_ms: int,
    url: str,
    event_types: list[str],
    secret: str,
    job_id: str | None = None,
    node: str | None = None,
    description: str = "",
) -> Webhook:
    """A new, enabled subscription that receives events written from now on."""
    # The cursor is taken in the insert itself, so no event between a read and the write is
    # ever delivered to a subscription created after it.
    cursor = select(func.coalesce(func.max(outbox.c.seq), 0)).scalar_subquery()
    connection.execute(
        insert(webhooks).values(
            id=webhook_id,
            url=url,
            event_types=orjson.dumps(event_types).decode(),
            job_id=job_id,
            node=node,
            description=description,
            secret=secret,
            enabled=True,
            consecutive_failures=0,
            cursor_seq=cursor,
            created_ms=now_ms,
            updated_ms=now_ms,
        )
    )
    found = get_webhook(connection, webhook_id)
    assert found is not None
    return found


def get_webhook(connection: Connection, webhook_id: str) -> Webhook | None:
    row = connection.execute(select(webhooks).where(webhooks.c.id == webhook_id)).mappings().first()
    return _decode(row) if row is not None else None


def list_webhooks(connection: Connection) -> list[Webhook]:
    rows = connection.execute(select(webhooks).order_by(webhooks.c.created_ms, webhooks.c.id))
    return [_decode(r) for r in rows.mappings()]


def update_webhook(
    connection: Connection, webhook_id: str, *, now_ms: int, **changes: Any
) -> Webhook | None:
    """Change url, event_types, job_id, node, description or enabled; None if unknown.

    Enabling a subscription clears its failure run and its disabled reason.
    """
    values: dict[str, Any] = {"updated_ms": now_ms}
    for key, value in changes.items():
        if key == "event_types":
            values[key] = orjson.dumps(value).decode()
        elif key in ("url", "job_id", "node", "description", "enabled"):
            values[key] = value
        else:
            raise ValueError(f"cannot change {key!r}")
    if changes.get("enabled") is True:
        values.update(consecutive_failures=0, disabled_reason=None)
    result = connection.execute(update(webhooks).where(webhooks.c.id == webhook_id).values(values))
    return get_webhook(connection, webhook_id) if result.rowcount else None


def delete_webhook(connection: Connection, webhook_id: str) -> bool:
    connection.execute(
        delete(webhook_deliveries).where(webhook_deliveries.c.webhook_id == webhook_id)
    )
    return bool(connection.execute(delete(webhooks).where(webhooks.c.id == webhook_id)).rowcount)


def rotate_secret(
    connection: Connection, webhook_id: str, *, secret: str, grace_ms: int, now_ms: int
) -> Webhook | None:
    """Sign with ``secret`` from ``now_ms`` on; the old one also signs for ``grace_ms``."""
    result = connection.execute(
        update(webhooks)
        .where(webhooks.c.id == webhook_id)
        .values(
            previous_secret=webhooks.c.secret,
            previous_secret_until_ms=now_ms + grace_ms,
            secret=secret,
            updated_ms=now_ms,
        )
    )
    return get_webhook(connection, webhook_id) if result.rowcount else None


# The dispatcher's side ----------------------------------------------------------------------


def claim_webhooks(
    connection: Connection, *, owner: str, lease_ms: int, now_ms: int
) -> list[Webhook]:
    """Take or renew the lease on every enabled subscription nobody else holds.

    One ``UPDATE ... WHERE lease free or expired or ours`` is atomic on both backends
    (PostgreSQL re-checks the condition on the row it locked), so two replicas never hold the
    same subscription. Returns the subscriptions ``owner`` now holds.
    """
    connection.execute(
        update(webhooks)
        .where(
            webhooks.c.enabled.is_(True),
            or_(
                webhooks.c.lease_owner.is_(None),
                webhooks.c.lease_owner == owner,
                webhooks.c.lease_until_ms < now_ms,
            ),
        )
        .values(lease_owner=owner, lease_until_ms=now_ms + lease_ms)
    )
    rows = connection.execute(
        select(webhooks).where(webhooks.c.lease_owner == owner, webhooks.c.enabled.is_(True))
    )
    return [_decode(r) for r in rows.mappings()]


def held_webhooks(connection: Connection, *, owner: str) -> list[Webhook]:
    """The enabled subscriptions ``owner`` holds (a read: no lease is taken or renewed)."""
    rows = connection.execute(
        select(webhooks).where(webhooks.c.lease_owner == owner, webhooks.c.enabled.is_(True))
    )
    return [_decode(r) for r in rows.mappings()]


def claimable(connection: Connection, *, now_ms: int) -> bool:
    """Whether an enabled subscription is free or its lease has expired."""
    found = connection.execute(
        select(webhooks.c.id)
        .where(
            webhooks.c.enabled.is_(True),
            or_(webhooks.c.lease_owner.is_(None), webhooks.c.lease_until_ms < now_ms),
        )
        .limit(1)
    ).first()
    return found is not None


def release_webhooks(connection: Connection, *, owner: str) -> None:
    """Give up every lease ``owner`` holds (a clean shutdown; a crash lets them expire)."""
    connection.execute(
        update(webhooks)
        .where(webhooks.c.lease_owner == owner)
        .values(lease_owner=None, lease_until_ms=None)
    )


def _held(webhook_id: str, owner: str) -> Any:
    return and_(webhooks.c.id == webhook_id, webhooks.c.lease_owner == owner)


def events_to_fan_out(
    connection: Connection, webhook: Webhook, *, up_to_seq: int, limit: int = 500
) -> tuple[list[OutboxEvent], int]:
    """The events in (cursor, ``up_to_seq``] that ``webhook``'s filters select (its types,
    job and node; every ``webhook.test``), and the cursor after them.

    The dispatcher keeps of these the ones the subscription wants
    (:func:`api.webhooks.rules.wants`: a test only for its own subscription). Events beyond
    ``up_to_seq`` may still have uncommitted predecessors, so they wait. The events read are
    committed and never change, so this read needs no transaction with
    :func:`queue_deliveries`.
    """
    cursor = int(webhook["cursor_seq"])
    if up_to_seq <= cursor:
        return [], cursor
    filters: list[ColumnElement[bool]] = []
    types = webhook["event_types"]
    if "*" not in types:
        filters.append(outbox.c.type.in_(types))
    if webhook["job_id"] is not None:
        filters.append(outbox.c.job_id == webhook["job_id"])
    if webhook["node"] is not None:
        filters.append(outbox.c.node == webhook["node"])
    query = select(outbox).where(outbox.c.seq > cursor, outbox.c.seq <= up_to_seq)
    if filters:  # a test delivery reaches its subscription whatever the filters
        query = query.where(or_(and_(*filters), outbox.c.type == "webhook.test"))
    rows = connection.execute(query.order_by(outbox.c.seq).limit(limit)).mappings()
    events = [cast(OutboxEvent, dict(r)) for r in rows]
    new_cursor = int(events[-1]["seq"]) if len(events) == limit else up_to_seq
    return events, new_cursor


def events_by_seq(connection: Connection, seqs: list[int]) -> list[OutboxEvent]:
    """The committed events among ``seqs``, oldest first."""
    if not seqs:
        return []
    rows = connection.execute(select(outbox).where(outbox.c.seq.in_(seqs)).order_by(outbox.c.seq))
    return [cast(OutboxEvent, dict(r)) for r in rows.mappings()]


def queue_late(
    connection: Connection,
    webhook: Webhook,
    events: list[OutboxEvent],
    *,
    owner: str,
    now_ms: int,
) -> int:
    """Queue events that committed after the cursor had passed their ``seq`` (PostgreSQL
    assigns ``seq`` before commit, so a slow transaction can land behind the cursor).

    ``events``: those the subscription wants (the dispatcher's choice); of them, the ones at
    or below its cursor and not already queued are queued.
    """
    cursor = int(webhook["cursor_seq"])
    late = [e for e in events if e["seq"] <= cursor]
    held = connection.execute(
        update(webhooks).where(_held(webhook["id"], owner)).values(updated_ms=webhooks.c.updated_ms)
    )
    if not late or not held.rowcount:
        return 0
    queued = set(
        connection.execute(
            select(webhook_deliveries.c.event_id).where(
                webhook_deliveries.c.webhook_id == webhook["id"],
                webhook_deliveries.c.event_id.in_([e["id"] for e in late]),
            )
        ).scalars()
    )
    fresh = [e for e in late if e["id"] not in queued]
    if fresh:
        connection.execute(
            insert(webhook_deliveries),
            [
                {
                    "webhook_id": webhook["id"],
                    "event_id": e["id"],
                    "event_seq": e["seq"],
                    "event_type": e["type"],
                    "status": "pending",
                    "attempts": 0,
                    "created_ms": now_ms,
                    "next_attempt_ms": now_ms,
                    "attempt_log": "[]",
                }
                for e in fresh
            ],
        )
    return len(fresh)


def queue_deliveries(
    connection: Connection,
    webhook: Webhook,
    events: list[OutboxEvent],
    *,
    owner: str,
    new_cursor: int,
    now_ms: int,
) -> int:
    """Queue ``events`` for ``webhook`` and move its cursor, if the lease and cursor still hold.

    Returns how many deliveries were queued (0 when another replica moved first).
    """
    cursor = int(webhook["cursor_seq"])
    moved = connection.execute(
        update(webhooks)
        .where(_held(webhook["id"], owner), webhooks.c.cursor_seq == cursor)
        .values(cursor_seq=new_cursor)
    )
    if not moved.rowcount:
        return 0
    webhook["cursor_seq"] = new_cursor
    rows = [
        {
            "webhook_id": webhook["id"],
            "event_id": event["id"],
            "event_seq": event["seq"],
            "event_type": event["type"],
            "status": "pending",
            "attempts": 0,
            "created_ms": now_ms,
            "next_attempt_ms": now_ms,
            "attempt_log": "[]",
        }
        for event in events
    ]
    if rows:
        connection.execute(insert(webhook_deliveries), rows)
    return len(rows)


def due_deliveries(
    connection: Connection, webhook_id: str, *, limit: int = 100
) -> list[DueDelivery]:
    """The subscription's pending deliveries in event order, each with its event.

    Only the head of the queue may be waiting for a retry; callers deliver in this order and
    stop at the first that is not due or that fails, which keeps per-subscription order.
    """
    query = (
        select(
            webhook_deliveries,
            outbox.c.ts_ms.label("event_ts_ms"),
            outbox.c.data.label("event_data"),
        )
        .join(outbox, outbox.c.id == webhook_deliveries.c.event_id)
        .where(
            webhook_deliveries.c.webhook_id == webhook_id,
            webhook_deliveries.c.status == "pending",
        )
        .order_by(webhook_deliveries.c.event_seq)
        .limit(limit)
    )
    return [cast(DueDelivery, dict(r)) for r in connection.execute(query).mappings()]


def record_attempt(
    connection: Connection,
    delivery: Delivery,
    *,
    owner: str,
    ok: bool,
    status_code: int | None,
    error: str | None,
    latency_ms: int,
    attempt_ms: int,
    next_attempt_ms: int | None,
) -> AttemptOutcome:
    """Store one attempt's outcome, in one transaction with the subscription's failure run.

    Args:
        ok: the receiver answered 2xx.
        next_attempt_ms: when to try again; None gives the delivery up (``failed``).

    Returns:
        whether the lease still held (nothing is written when it had moved to another
        replica), and the run of consecutive failed attempts after this one; whether that
        run disables the subscription is the caller's rule (:func:`disable_webhook`).
    """
    webhook_id = delivery["webhook_id"]
    if ok:
        counted = connection.execute(
            update(webhooks).where(_held(webhook_id, owner)).values(consecutive_failures=0)
        )
    else:
        counted = connection.execute(
            update(webhooks)
            .where(_held(webhook_id, owner))
            .values(consecutive_failures=webhooks.c.consecutive_failures + 1)
        )
    if not counted.rowcount:
        return {"held": False, "failures": 0}
    log = orjson.loads(delivery["attempt_log"])
    log.append(
        {"at_ms": attempt_ms, "status_code": status_code, "error": error, "latency_ms": latency_ms}
    )
    delivery["attempt_log"] = orjson.dumps(log[-ATTEMPT_LOG_SIZE:]).decode()
    values: dict[str, Any] = {
        "attempts": webhook_deliveries.c.attempts + 1,
        "last_attempt_ms": attempt_ms,
        "last_status_code": status_code,
        "last_error": error,
        "last_latency_ms": latency_ms,
        "attempt_log": delivery["attempt_log"],
    }
    if ok:
        values.update(status="succeeded", delivered_ms=attempt_ms + latency_ms)
    elif next_attempt_ms is None:
        values.update(status="failed")
    else:
        values.update(next_attempt_ms=next_attempt_ms)
    connection.execute(
        update(webhook_deliveries).where(webhook_deliveries.c.id == delivery["id"]).values(values)
    )
    failures = int(
        connection.execute(
            select(webhooks.c.consecutive_failures).where(webhooks.c.id == webhook_id)
        ).scalar_one()
    )
    return {"held": True, "failures": failures}


def disable_webhook(connection: Connection, webhook_id: str, *, reason: str, now_ms: int) -> None:
    """Disable a subscription and give up its lease (enabling it again clears ``reason``)."""
    connection.execute(
        update(webhooks)
        .where(webhooks.c.id == webhook_id)
        .values(
            enabled=False,
            disabled_reason=reason,
            lease_owner=None,
            lease_until_ms=None,
            updated_ms=now_ms,
        )
    )


def record_successes(connection: Connection, deliveries: list[Success], *, owner: str) -> bool:
    """Mark several accepted deliveries ``succeeded`` in one transaction.

    Each dict carries the delivery's ``id``, ``attempt_log``, and this attempt's
    ``attempt_ms``, ``latency_ms`` and ``status_code``. Returns False (nothing written) when
    the lease moved to another replica meanwhile.
    """
    if not deliveries:
        return True
    webhook_id = deliveries[0]["webhook_id"]
    held = connection.execute(
        update(webhooks).where(_held(webhook_id, owner)).values(consecutive_failures=0)
    )
    if not held.rowcount:
        return False
    rows = []
    for d in deliveries:
        log = orjson.loads(d["attempt_log"])
        log.append(
            {
                "at_ms": d["attempt_ms"],
                "status_code": d["status_code"],
                "error": None,
                "latency_ms": d["latency_ms"],
            }
        )
        rows.append(
            {
                "b_id": d["id"],
                "b_attempts": d["attempts"] + 1,
                "b_at": d["attempt_ms"],
                "b_code": d["status_code"],
                "b_latency": d["latency_ms"],
                "b_done": d["attempt_ms"] + d["latency_ms"],
                "b_log": orjson.dumps(log[-ATTEMPT_LOG_SIZE:]).decode(),
            }
        )
    connection.execute(
        update(webhook_deliveries)
        .where(webhook_deliveries.c.id == bindparam("b_id"))
        .values(
            status="succeeded",
            attempts=bindparam("b_attempts"),
            last_attempt_ms=bindparam("b_at"),
            last_status_code=bindparam("b_code"),
            last_error=None,
            last_latency_ms=bindparam("b_latency"),
            delivered_ms=bindparam("b_done"),
            attempt_log=bindparam("b_log"),
        ),
        rows,
    )
    return True


def list_deliveries(
    connection: Connection,
    webhook_id: str,
    *,
    status: str | None = None,
    limit: int = 100,
    before_id: int | None = None,
) -> list[Delivery]:
    """A subscription's deliveries, newest first (``before_id`` pages back)."""
    query = select(webhook_deliveries).where(webhook_deliveries.c.webhook_id == webhook_id)
    if status is not None:
        query = query.where(webhook_deliveries.c.status == status)
    if before_id is not None:
        query = query.where(webhook_deliveries.c.id < before_id)
    rows = connection.execute(query.order_by(webhook_deliveries.c.id.desc()).limit(limit))
    out = []
    for row in rows.mappings():
        item = dict(row)
        item["attempt_log"] = orjson.loads(item["attempt_log"])
        out.append(cast(Delivery, item))
    return out
