"""The application's state: one typed object, built in ``create_app``, that routes read.

Everything a request needs beyond its own input lives here, made before the first request:
no route adds to the app as it runs. Routes take it as :data:`api.deps.AppStateDep` (or
:func:`app_state` where a dependency would cost too much, as on ingest).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.fleetcaps import CapCounts
from api.metrics import Metrics
from api.settings import Settings
from api.tickcache import TickCache
from store import Store

if TYPE_CHECKING:  # both import the routes' dependencies, which import this module
    from api.webhooks.guard import TargetGuard
    from control.loop import ControlLoop

__all__ = ["AppState", "RetrainJob", "TokenCache", "app_state"]


class TokenCache:
    """Stored-token lookups by secret digest, each kept ``ttl_s``; bounded in size."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, frozenset[str] | None]] = {}

    def get(self, key: str) -> tuple[bool, frozenset[str] | None]:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return False, None
        return True, entry[1]

    def put(self, key: str, scopes: frozenset[str] | None) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # a flood of unknown tokens must not grow memory
        self._entries[key] = (time.monotonic() + self.ttl_s, scopes)

    def clear(self) -> None:
        """Forget every lookup (after a token is created or revoked here)."""
        self._entries.clear()


@dataclass
class RetrainJob:
    """The last retraining, on demand or on the schedule (one at a time: :mod:`api.retraining`)."""

    state: str = "idle"
    """idle, running, done or failed."""
    trigger: str | None = None
    """Who started it: ``request`` (the API) or ``schedule`` (``FOREWARN_RETRAIN_EVERY_H``)."""
    started_at: float | None = None
    finished_at: float | None = None
    decision: dict[str, Any] | None = None
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def public(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "trigger": self.trigger,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "decision": self.decision,
            "error": self.error,
        }


@dataclass
class AppState:
    """What the service's routes and background tasks share, one per app."""

    settings: Settings
    store: Store | None
    """The database; None until the lifespan has opened it (when ``create_app`` got none)."""
    metrics: Metrics
    token_scopes: dict[str, frozenset[str]]
    """The configured tokens (settings) and their scopes."""
    token_cache: TokenCache
    """Lookups of stored tokens (:mod:`store.tokens`)."""
    webhook_guard: TargetGuard
    """Where webhook subscriptions may point."""
    control: ControlLoop | None = None
    """The control loop when it runs in a thread of this process, once the lifespan has
    started it (None when disabled or in a process of its own: what the service shows of it
    is the status it publishes in the store, :func:`store.control.read_status`)."""
    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """This service replica, as the control loop it runs names itself in its status."""
    known_gpus: set[tuple[str, int]] | None = None
    """Every GPU this process knows stored, read from the database at the first batch: a
    batch of known GPUs needs no database round trip for the fleet caps."""
    cap_counts: CapCounts = field(default_factory=CapCounts)
    """The counts a batch of new GPUs is judged against (:class:`api.fleetcaps.CapCounts`)."""
    retrain: RetrainJob = field(default_factory=RetrainJob)
    fleet_reads: TickCache = field(default_factory=TickCache)
    """Fleet-wide reads (risk, the fleet map) kept from one control tick to the next."""

    def loop_status(self) -> dict[str, Any]:
        """What the leading control loop published at its last tick, wherever it runs ({}
        before its first tick, or without a store). Call from a worker thread."""
        if self.store is None:
            return {}
        from store import control as control_db

        with self.store.engine.connect() as connection:
            return control_db.read_status(connection) or {}

    def leads(self, status: dict[str, Any]) -> bool:
        """Whether ``status`` (:meth:`loop_status`) is this replica's loop's, and recent: the
        loop ticked within three of its intervals."""
        if not status or status.get("replica") != self.replica_id:
            return False
        tick_s = float(status.get("tick_s") or self.settings.control_tick_s)
        return time.time() * 1000 - float(status.get("tick_ms") or 0) <= 3000 * tick_s + 5000


def app_state(app: Any) -> AppState:
    """The :class:`AppState` of a FastAPI app (``request.app``)."""
    state: AppState = app.state.forewarn
    return state
