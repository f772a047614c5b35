"""Group commit: one writer thread for a database that allows one writer at a time (SQLite).

Concurrent ingest requests on separate SQLite connections fight over the database's write
lock, and SQLite's busy handler resolves that by sleeping — most of a loaded server's time.
Instead every write is queued to one thread, which takes whatever has queued up (up to
``max_rows``) and stores it in one transaction: one lock, one commit, no sleeping. Each caller
still learns how many of its own rows were new, and waits only until its transaction commits,
so an acknowledged batch is a stored batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Engine

from store import writes

__all__ = ["GroupWriter"]


class _FileLock:
    """An exclusive ``flock`` on a file, held for one transaction.

    Several service processes on one SQLite file (``forewarn serve --workers N``) would
    otherwise meet in SQLite's busy handler, which polls with sleeps of up to 100 ms; the
    kernel hands a released ``flock`` to the next waiter at once.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


class _Job(NamedTuple):
    samples: Any
    events: Any
    agent: tuple[str, dict[str, Any]] | None
    future: Future[tuple[int, int]]


class GroupWriter:
    """Serialises writes through one thread, committing each group of queued writes at once.

    Args:
        engine: the database.
        max_rows: stop adding queued writes to a transaction once it holds this many rows.
    """

    def __init__(
        self, engine: Engine, *, max_rows: int = 50_000, lock_path: Path | None = None
    ) -> None:
        self._engine = engine
        self._lock = _FileLock(lock_path) if lock_path else contextlib.nullcontext()
        self._max_rows = max_rows
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(
        self,
        samples: Any = (),
        events: Any = (),
        agent: tuple[str, dict[str, Any]] | None = None,
    ) -> Future[tuple[int, int]]:
        """Queue a write; the future resolves to (new samples, new events) once committed."""
        if self._closed:
            raise RuntimeError("writer is closed")
        future: Future[tuple[int, int]] = Future()
        self._queue.put(_Job(samples, events, agent, future))
        return future

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            group, rows, stop = [job], len(job.samples), False
            while rows < self._max_rows:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                group.append(more)
                rows += len(more.samples)
            self._commit(group)
            if stop:
                return

    def _commit(self, group: list[_Job]) -> None:
        try:
            results = []
            with self._lock, self._engine.begin() as tx:
                for job in group:
                    stored = writes.insert_samples(tx, job.samples)
                    stored_events = writes.insert_events(tx, job.events)
                    if job.agent is not None:
                        writes.upsert_agent(tx, node=job.agent[0], status=job.agent[1])
                    results.append((stored, stored_events))
        except BaseException as exc:  # every caller of the failed transaction learns why
            for job in group:
                job.future.set_exception(exc)
            return
        for job, result in zip(group, results, strict=True):
            job.future.set_result(result)
