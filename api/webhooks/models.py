"""The shapes of the webhook routes (``XCreate``, ``XUpdate``, ``XPublic``, ``XsPublic``)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from store.outbox import EVENT_TYPES

__all__ = [
    "AttemptPublic",
    "DeliveriesPublic",
    "DeliveryPublic",
    "EventTypePublic",
    "EventTypesPublic",
    "SecretRotate",
    "WebhookCreate",
    "WebhookCreated",
    "WebhookPublic",
    "WebhookTestQueued",
    "WebhookUpdate",
    "WebhooksPublic",
    "iso_ms",
]


def iso_ms(ms: int | None) -> str | None:
    if ms is None:
        return None
    ts = datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
    return ts.replace("+00:00", "Z")


def _check_types(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    if not value:
        raise ValueError("give at least one event type, or '*' for all")
    unknown = sorted(set(value) - set(EVENT_TYPES) - {"*"})
    if unknown:
        raise ValueError(f"unknown event types {unknown}; see GET /v1/webhooks/event-types")
    return ["*"] if "*" in value else sorted(set(value))


EventTypes = Annotated[
    list[str],
    WithJsonSchema(  # what _check_types takes, as the OpenAPI document says it
        {"type": "array", "items": {"type": "string", "enum": ["*", *EVENT_TYPES]}, "minItems": 1}
    ),
]


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake: 422

    url: str = Field(max_length=2048, examples=["https://hooks.example.com/forewarn"])
    """Where events are POSTed (https; internal addresses only when allow-listed)."""
    event_types: EventTypes = Field(default_factory=lambda: ["*"])
    """Event types to receive; ``["*"]`` for every type."""
    job_id: str | None = Field(default=None, max_length=253)
    """Only events about this job."""
    node: str | None = Field(default=None, max_length=253)
    """Only events about this node."""
    description: str = Field(default="", max_length=1000)

    _types = field_validator("event_types")(_check_types)


class WebhookUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake: 422

    url: str | None = Field(default=None, max_length=2048)
    event_types: EventTypes | None = None
    job_id: str | None = Field(default=None, max_length=253)
    node: str | None = Field(default=None, max_length=253)
    description: str | None = Field(default=None, max_length=1000)
    enabled: bool | None = None
    """``true`` re-enables a disabled subscription (its failure run starts again from 0)."""

    _types = field_validator("event_types")(_check_types)


class WebhookPublic(BaseModel):
    id: str
    url: str
    event_types: list[str]
    job_id: str | None
    node: str | None
    description: str
    enabled: bool
    disabled_reason: str | None
    consecutive_failures: int
    previous_secret_until: str | None
    """While set, deliveries are signed with the previous secret too."""
    created_at: str
    updated_at: str

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> WebhookPublic:
        now_ms = datetime.now(UTC).timestamp() * 1000
        until = row["previous_secret_until_ms"]
        return cls(
            id=row["id"],
            url=row["url"],
            event_types=row["event_types"],
            job_id=row["job_id"],
            node=row["node"],
            description=row["description"],
            enabled=row["enabled"],
            disabled_reason=row["disabled_reason"],
            consecutive_failures=row["consecutive_failures"],
            previous_secret_until=iso_ms(until) if until and until > now_ms else None,
            created_at=iso_ms(row["created_ms"]) or "",
            updated_at=iso_ms(row["updated_ms"]) or "",
        )


class WebhookCreated(WebhookPublic):
    secret: str
    """The signing secret (``whsec_...``); shown only in this response."""

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> WebhookCreated:
        return cls(**WebhookPublic.of(row).model_dump(), secret=row["secret"])


class WebhooksPublic(BaseModel):
    data: list[WebhookPublic]
    count: int


class SecretRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake: 422

    grace_s: float | None = Field(default=None, ge=0, le=7 * 86400)
    """How long the old secret keeps signing (default ``FOREWARN_WEBHOOK_SECRET_GRACE_S``)."""


class WebhookTestQueued(BaseModel):
    event_id: str
    """The ``webhook.test`` event queued for this subscription; see its deliveries."""


class AttemptPublic(BaseModel):
    at: str | None
    status_code: int | None
    error: str | None
    latency_ms: int


class DeliveryPublic(BaseModel):
    id: int
    event_id: str
    event_type: str
    status: str
    """``pending`` (being retried), ``succeeded`` or ``failed`` (given up at the horizon)."""
    attempts: int
    created_at: str | None
    next_attempt_at: str | None
    last_attempt_at: str | None
    last_status_code: int | None
    last_error: str | None
    last_latency_ms: int | None
    delivered_at: str | None
    attempt_log: list[AttemptPublic]
    """The most recent attempts, oldest first."""

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> DeliveryPublic:
        return cls(
            id=row["id"],
            event_id=row["event_id"],
            event_type=row["event_type"],
            status=row["status"],
            attempts=row["attempts"],
            created_at=iso_ms(row["created_ms"]),
            next_attempt_at=iso_ms(row["next_attempt_ms"]) if row["status"] == "pending" else None,
            last_attempt_at=iso_ms(row["last_attempt_ms"]),
            last_status_code=row["last_status_code"],
            last_error=row["last_error"],
            last_latency_ms=row["last_latency_ms"],
            delivered_at=iso_ms(row["delivered_ms"]),
            attempt_log=[
                AttemptPublic(
                    at=iso_ms(a["at_ms"]),
                    status_code=a["status_code"],
                    error=a["error"],
                    latency_ms=a["latency_ms"],
                )
                for a in row["attempt_log"]
            ],
        )


class DeliveriesPublic(BaseModel):
    data: list[DeliveryPublic]
    count: int


class EventTypePublic(BaseModel):
    type: str
    description: str


class EventTypesPublic(BaseModel):
    data: list[EventTypePublic]
    count: int
