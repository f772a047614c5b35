"""Fleet-wide reads made once per control tick and served from memory to every reader.

The fleet's scores change once a tick (``control_tick_s``, 5 s by default), while the fleet
map polls every 2 s from every open dashboard and programs page through ``GET /v1/risk``:
re-reading 65,536 rows for each of them costs seconds of database and CPU time a minute for
the same answer. A :class:`TickCache` keeps each fleet-wide read ("product") keyed on the
scores' version, :func:`store.control.risk_version`: a primary-key row that every control
tick stamps in the transaction that writes its scores. A reader pays one lookup of that row;
the product is read again only when the version moved (a tick landed, on whichever replica
leads) or the product is older than ``max_age_s`` (the tick interval: the bound when no loop
runs, so that the parts read beside the scores, such as the GPUs' newest sample times and
their fatal events, still move).

The version is read before the product (statements of one connection, in order), so a product
is never older than the version it is filed under: a tick that lands during a read costs one
more read, never a tick of stale answers. Concurrent readers of a missing product wait for one
read instead of each making it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection

from store import control as control_db

__all__ = ["TickCache"]

T = TypeVar("T")


class TickCache:
    """Products (by name) of fleet-wide reads, each kept until the scores' version moves."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str | None, float, Any]] = {}
        self._building: dict[str, threading.Lock] = {}
        self.reads = 0
        """Products read from the database so far (a miss; the version lookups not counted)."""

    def get(
        self, engine: Any, name: str, read: Callable[[Connection], T], *, max_age_s: float
    ) -> T:
        """The product ``name``: from memory while the scores' version is the one it was read
        under and it is younger than ``max_age_s``, else ``read(connection)`` again."""
        with engine.connect() as connection:
            version = control_db.risk_version(connection)
        found, value = self._fresh(name, version, max_age_s)
        if found:
            return value  # type: ignore[no-any-return]
        with self._lock:
            building = self._building.setdefault(name, threading.Lock())
        with building:  # one reader reads; the others wait for its product
            with engine.connect() as connection:
                version = control_db.risk_version(connection)
                found, value = self._fresh(name, version, max_age_s)
                if found:
                    return value  # type: ignore[no-any-return]
                born = self._clock()
                value = read(connection)
            with self._lock:
                self._entries[name] = (version, born, value)
                self.reads += 1
        return value

    def _fresh(self, name: str, version: str | None, max_age_s: float) -> tuple[bool, Any]:
        with self._lock:
            entry = self._entries.get(name)
        if entry is None or entry[0] != version or self._clock() - entry[1] >= max_age_s:
            return False, None
        return True, entry[2]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
