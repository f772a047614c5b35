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
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import Connection, Engine, text

from forewarn.errors import StoreUnavailable
from store import reads, tiering, tiers, writes
from store.engine import default_database_url, make_engine
from store.migrate import current_heads, head_revisions, upgrade
from store.writer import GroupWriter, ProcessWriter

__all__ = ["Store", "default_database_url"]


class Store:
    """One database: the engine plus the store's reads and writes."""

    def __init__(self, engine: Engine, *, writer_process: bool = False) -> None:
        self.engine = engine
        # Writes are group-committed: whatever has queued up while a transaction commits goes
        # into the next one, so concurrent callers share commits (and PostgreSQL's WAL
        # flushes) instead of paying one each. SQLite allows one writer at a time: one
        # thread. PostgreSQL: two, so that one group is sent while the other commits.
        # With ``writer_process`` (the service), writes go through a child process instead,
        # which inserts on its own core while this interpreter validates the next batches.
        self._writer: GroupWriter | ProcessWriter
        database = engine.url.database
        sqlite = engine.dialect.name == "sqlite"
        on_file = not sqlite or bool(database and database != ":memory:")
        lock = Path(f"{database}.write-lock") if sqlite and on_file else None
        if writer_process and on_file:
            url = engine.url.render_as_string(hide_password=False)
            self._writer = ProcessWriter(url, lock_path=lock)
        else:
            self._writer = GroupWriter(engine, lock_path=lock, threads=1 if sqlite else 2)

    @classmethod
    def open(cls, url: str, *, migrate: bool = True, writer_process: bool = False) -> Store:
        """Open (and by default migrate) the database at ``url``.

        Args:
            writer_process: insert through a child process (:class:`store.writer.ProcessWriter`).
        """
        store = cls(make_engine(url), writer_process=writer_process)
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
        return current_heads(self.engine) == head_revisions()

    def ping(self) -> None:
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        with self.engine.begin() as connection:
            yield connection

    def close(self) -> None:
        self._writer.close()
        self.engine.dispose()

    # Writes -------------------------------------------------------------------------------

    def submit(
        self,
        *,
        samples: Sequence[writes.SampleRow] | writes.SampleColumns = (),
        events: Sequence[writes.EventRow] = (),
        agent: tuple[str, dict[str, Any]] | None = None,
        charge: writes.Charge | None = None,
    ) -> Future[tuple[int, int]]:
        """Queue samples, events, a heartbeat and the GPUs they add charged to the token that
        sent them (``charge``, :func:`store.tokens.charge_gpus`) for one transaction; don't
        wait for it.

        The future resolves to (new samples, new events) once committed — the rest were
        already stored — or raises what the database raised.
        """
        return self._writer.submit(samples, events, agent, charge)

    def write(
        self,
        *,
        samples: Sequence[writes.SampleRow] | writes.SampleColumns = (),
        events: Sequence[writes.EventRow] = (),
        agent: tuple[str, dict[str, Any]] | None = None,
        timeout_s: float = 60.0,
    ) -> tuple[int, int]:
        """Store samples, events and a heartbeat in one transaction, and wait for it.

        Returns:
            (new samples, new events); the rest were already stored.

        Raises:
            StoreUnavailable: the database did not commit within ``timeout_s``.
        """
        future = self.submit(samples=samples, events=events, agent=agent)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise StoreUnavailable(f"database write not committed in {timeout_s} s") from None

    def delete_before(self, cutoff_ms: int) -> dict[str, int]:
        with self.engine.begin() as tx:
            return writes.delete_before(tx, cutoff_ms)

    # Reads --------------------------------------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        """A connection for the sample reads. On PostgreSQL each statement commits on its own
        (they read committed rows statement by statement anyway), so a read of several tables
        holds no table's lock while it waits for the next: the tiering task's partition drops
        and creations then wait for a statement, never meet a read in a lock cycle."""
        with self.engine.connect() as connection:
            if self.dialect == "postgresql":
                connection = connection.execution_options(isolation_level="AUTOCOMMIT")
            yield connection

    def gpu_window(self, **kwargs: Any) -> pd.DataFrame:
        with self._reading() as c:
            return reads.gpu_window(c, **kwargs)

    def fleet_window(self, **kwargs: Any) -> pd.DataFrame:
        with self._reading() as c:
            return reads.fleet_window(c, **kwargs)

    def gpu_series(self, **kwargs: Any) -> tuple[pd.DataFrame, tiers.Resolution]:
        """One GPU's window from the tier that holds it (see :func:`store.tiers.gpu_series`)."""
        with self._reading() as c:
            return tiers.gpu_series(c, **kwargs)

    def tiered_window(self, **kwargs: Any) -> pd.DataFrame:
        """Every GPU's window: raw where held, per minute before it (see
        :func:`store.tiers.tiered_window`)."""
        with self._reading() as c:
            return tiers.tiered_window(c, **kwargs)

    def maintain_tiers(self, policy: tiers.TierPolicy, *, now_ms: int) -> tiers.TierReport:
        """Roll closed hours up, archive them, drop what left every tier (idempotent)."""
        return tiering.maintain(self.engine, policy, now_ms=now_ms)

    def latest_samples(self, **kwargs: Any) -> pd.DataFrame:
        with self._reading() as c:
            return reads.latest_samples(c, **kwargs)

    def events(self, **kwargs: Any) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            return reads.read_events(c, **kwargs)

    def gpu_count(self) -> int:
        with self.engine.connect() as c:
            return reads.gpu_count(c)

    def has_gpu(self, *, node: str, gpu: int) -> bool:
        with self.engine.connect() as c:
            return reads.has_gpu(c, node=node, gpu=gpu)

    def nodes(self) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            return reads.nodes(c)
