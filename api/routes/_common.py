"""Helpers shared by the control loop's route modules."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import Query

from forewarn.errors import InvalidInput
from forewarn.wire import to_ms

Since = Annotated[datetime | None, Query(description="ISO 8601 or Unix seconds (inclusive).")]
Until = Annotated[datetime | None, Query(description="ISO 8601 or Unix seconds (exclusive).")]


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
    start = aware(since) if since else end - timedelta(seconds=default_s)
    if start > end:
        raise InvalidInput("since must not be after until")
    return to_ms(start), to_ms(end)


def stamp(row: dict[str, Any], *names: str) -> dict[str, Any]:
    """Replace ``<x>_ms`` columns by ISO 8601 ``<x>_at`` fields."""
    for name in names:
        row[name.removesuffix("_ms") + "_at"] = iso(row.pop(name))
    return row
