"""The time-series store: GPU samples, events and collector heartbeats.

SQLite (WAL, one file in the data directory) is the default; PostgreSQL is one URL away
(``FOREWARN_DATABASE_URL``). The same code and the same tests run on both.

Example::

    store = Store.open("sqlite:///var/forewarn.db")   # creates the schema if needed
    with store.begin() as tx:
        writes.insert_samples(tx, rows)
    frame = store.fleet_window(since_ms=now_ms - 3_600_000)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd
from sqlalchemy import Connection, Engine, text

from store import reads, writes
from store.engine import default_database_url, make_engine
from store.migrate import current_revision, head_revision, upgrade

__all__ = ["Store", "default_database_url"]


class Store:
    """One database: the engine plus the store's reads and writes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def open(cls, url: str, *, migrate: bool = True) -> Store:
        store = cls(make_engine(url))
        if migrate:
            store.migrate()
        return store

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def migrate(self) -> None:
        """Bring the schema to the newest revision (idempotent)."""
        upgrade(self.engine)

    def schema_is_current(self) -> bool:
        return current_revision(self.engine) == head_revision()

    def ping(self) -> None:
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        with self.engine.begin() as connection:
            yield connection

    def close(self) -> None:
        self.engine.dispose()

    # Writes -------------------------------------------------------------------------------

    def write(
        self,
        *,
        samples: Sequence[writes.SampleRow] = (),
        events: Sequence[writes.EventRow] = (),
        agent: tuple[str, dict[str, Any]] | None = None,
    ) -> tuple[int, int]:
        """Store samples, events and a heartbeat in one transaction.

        Returns:
            (new samples, new events); the rest were already stored.
        """
        with self.engine.begin() as tx:
            stored_samples = writes.insert_samples(tx, samples)
            stored_events = writes.insert_events(tx, events)
            if agent is not None:
                writes.upsert_agent(tx, node=agent[0], status=agent[1])
        return stored_samples, stored_events

    def delete_before(self, cutoff_ms: int) -> dict[str, int]:
        with self.engine.begin() as tx:
            return writes.delete_before(tx, cutoff_ms)

    # Reads --------------------------------------------------------------------------------

    def gpu_window(self, **kwargs: Any) -> pd.DataFrame:
        with self.engine.connect() as c:
            return reads.gpu_window(c, **kwargs)

    def fleet_window(self, **kwargs: Any) -> pd.DataFrame:
        with self.engine.connect() as c:
            return reads.fleet_window(c, **kwargs)

    def latest_samples(self, **kwargs: Any) -> pd.DataFrame:
        with self.engine.connect() as c:
            return reads.latest_samples(c, **kwargs)

    def events(self, **kwargs: Any) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            return reads.read_events(c, **kwargs)

    def nodes(self) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            return reads.nodes(c)
