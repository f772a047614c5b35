"""Helpers shared by the control loop's route modules."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import Query
from pydantic import AfterValidator, WithJsonSchema

from forewarn.errors import InvalidInput
from forewarn.wire import to_ms

_FIRST = datetime(1970, 1, 1, tzinfo=UTC)
_LAST = datetime(9999, 12, 30, tzinfo=UTC)  # a day short of the end: a window may follow it


def in_range(ts: datetime) -> datetime:
    """``ts`` if this service can store it: 1970 to 9999 (naive times read as UTC)."""
    try:
        inside = _FIRST <= aware(ts) <= _LAST
    except OverflowError:  # 0001-01-01T00:00:00+14:00 is before year 1 in UTC
        inside = False
    if not inside:
        raise ValueError("must be between 1970-01-01 and 9999-12-30 (UTC)")
    return ts


# What in_range lets through, as the OpenAPI document says it: an ISO 8601 time of 1970-01-01
# (UTC; no later day of 1970-01-01 ahead of UTC) to 9998, or a Unix time (pydantic reads a
# number past 2e10 as milliseconds), up to 9999-12-30.
_ISO_IN_RANGE = (
    r"^(?:(?:197[1-9]|19[89][0-9]|[2-8][0-9]{3}|9[0-8][0-9]{2}|99[0-8][0-9]|999[0-8])-"
    r"|1970-(?:0[2-9]|1[0-2])-|1970-01-(?:0[2-9]|[12][0-9]|3[01])[Tt ]"
    r"|1970-01-01[Tt ][0-9:.]+(?:[Zz]|[+-]00:00|-[0-9]{2}:[0-9]{2})$)"
)
_TIMESTAMP_SCHEMA = {
    "anyOf": [
        {"type": "string", "format": "date-time", "pattern": _ISO_IN_RANGE},
        {"type": "number", "minimum": 0, "maximum": to_ms(_LAST)},
    ]
}

Timestamp = Annotated[datetime, AfterValidator(in_range), WithJsonSchema(_TIMESTAMP_SCHEMA)]
"""A time this service can store (a body field or a query parameter)."""
Since = Annotated[Timestamp | None, Query(description="ISO 8601 or Unix seconds (inclusive).")]
Until = Annotated[Timestamp | None, Query(description="ISO 8601 or Unix seconds (exclusive).")]


def now_ms() -> int:
    return int(time.time() * 1000)


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def aware(ts: datetime) -> datetime:
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts


def window(since: datetime | None, until: datetime | None, default_s: float) -> tuple[int, int]:
    end = aware(until or datetime.now(UTC))
    start = aware(since) if since else max(end - timedelta(seconds=default_s), _FIRST)
    if start > end:
        raise InvalidInput("since must not be after until")
    return to_ms(start), to_ms(end)


def stamp(row: dict[str, Any], *names: str) -> dict[str, Any]:
    """Replace ``<x>_ms`` columns by ISO 8601 ``<x>_at`` fields."""
    for name in names:
        row[name.removesuffix("_ms") + "_at"] = iso(row.pop(name))
    return row
