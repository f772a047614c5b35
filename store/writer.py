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
import gc
import os
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Engine

from forewarn.errors import StoreUnavailable
from store import writes

__all__ = ["GroupWriter", "ProcessWriter", "WriterUnavailable"]


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
    charge: writes.Charge | None
    future: Future[tuple[int, int]]


class GroupWriter:
    """Serialises writes through one thread, committing each group of queued writes at once.

    Args:
        engine: the database.
        max_rows: stop adding queued writes to a transaction once it holds this many rows.
        lock_path: an ``flock`` file serialising writers of one SQLite file across processes.
        threads: writer threads, each committing its own groups. One for SQLite (one writer
            at a time); PostgreSQL takes two, so one group is sent while the other commits.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_rows: int = 50_000,
        lock_path: Path | None = None,
        threads: int = 1,
    ) -> None:
        self._engine = engine
        self._lock = _FileLock(lock_path) if lock_path else contextlib.nullcontext()
        self._max_rows = max_rows
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"store-writer-{i}", daemon=True)
            for i in range(threads)
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        samples: Any = (),
        events: Any = (),
        agent: tuple[str, dict[str, Any]] | None = None,
        charge: writes.Charge | None = None,
    ) -> Future[tuple[int, int]]:
        """Queue a write; the future resolves to (new samples, new events) once committed."""
        if self._closed:
            raise RuntimeError("writer is closed")
        future: Future[tuple[int, int]] = Future()
        self._queue.put(_Job(samples, events, agent, charge, future))
        return future

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop the thread."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
            for thread in self._threads:
                thread.join(timeout_s)

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
                stored = writes.insert_sample_groups(tx, [job.samples for job in group])
                for job, new in zip(group, stored, strict=True):
                    stored_events = writes.insert_events(tx, job.events)
                    writes.write_extras(tx, job.agent, job.charge)
                    results.append((new, stored_events))
        except BaseException as exc:  # every caller of the failed transaction learns why
            if isinstance(exc, Exception) and _error_kind(exc) == "unavailable":
                wrapped = WriterUnavailable(f"database write failed: {type(exc).__name__}: {exc}")
                wrapped.__cause__ = exc
                exc = wrapped
            for job in group:
                job.future.set_exception(exc)
            return
        for job, result in zip(group, results, strict=True):
            job.future.set_result(result)


# The writer process ---------------------------------------------------------------------------
#
# The service validates batches on its event loop; inserting them in the same interpreter would
# share one GIL with that loop, so at 50k rows/s the two halves would take turns instead of
# running on two cores. ``ProcessWriter`` hands each write to a child process that owns the
# database connection and group-commits like ``GroupWriter``. Frames on its stdin and stdout
# are a 4-byte little-endian length and a msgpack array:
#
#   request:  [id, samples, events, agent, charge]    (agent: [node, status] or nil)
#             samples: a list of rows, or {"c": SampleColumns.to_wire()} (columns)
#             charge: [token digest, [[node, gpu], ...], ms] or nil (writes.Charge)
#   reply:    [id, new samples, new events, error]    (error: nil or [kind, message])
#
# A reply is written only after its transaction commits, so an acknowledged batch is a stored
# batch even if the service is killed the next instant; a child whose parent died reads EOF,
# finishes what it had read, and exits.

_HEADER = struct.Struct("<I")


class WriterUnavailable(StoreUnavailable):
    """The database refused or timed out a write (locked, down, out of connections)."""


def _error_kind(exc: BaseException) -> str:
    """``unavailable`` for errors a retry may cure (locked, refused, dropped), else ``error``."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError, OperationalError

    if isinstance(exc, OperationalError | sqlite3.OperationalError | TimeoutError | OSError):
        return "unavailable"
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return "unavailable"
    try:
        import psycopg

        if isinstance(exc, psycopg.OperationalError):
            return "unavailable"
    except ImportError:  # pragma: no cover - psycopg is a server dependency
        pass
    return "error"


def _read_frames(buffer: bytearray) -> list[bytes]:
    frames = []
    offset = 0
    while len(buffer) - offset >= 4:
        (size,) = _HEADER.unpack_from(buffer, offset)
        if len(buffer) - offset - 4 < size:
            break
        frames.append(bytes(buffer[offset + 4 : offset + 4 + size]))
        offset += 4 + size
    del buffer[:offset]
    return frames


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def serve_writes(url: str, lock_path: str | None, max_rows: int, fd_in: int, fd_out: int) -> None:
    """The child's loop: read requests on ``fd_in``, commit them in groups, reply on ``fd_out``."""
    import select

    import msgspec

    from store.engine import make_engine

    engine = make_engine(url)
    lock = _FileLock(Path(lock_path)) if lock_path else contextlib.nullcontext()
    encode = msgspec.msgpack.encode
    from_wire = writes.SampleColumns.from_wire

    def decode(frame: bytes) -> Any:
        request = msgspec.msgpack.decode(frame)
        if isinstance(request[1], dict):
            request[1] = from_wire(request[1]["c"])
        return request

    gc.freeze()  # what is loaded now lives as long as the process: the collector skips it
    buffer = bytearray()
    pending: list[Any] = []
    eof = False
    while not (eof and not pending and not buffer):
        if not pending:
            chunk = os.read(fd_in, 1 << 22)
            if not chunk:
                eof = True
            buffer += chunk
            pending.extend(decode(f) for f in _read_frames(buffer))
            if eof and not pending:
                break
            if not pending:
                continue
        rows = sum(len(p[1]) for p in pending)
        while not eof and rows < max_rows and select.select([fd_in], [], [], 0)[0]:
            chunk = os.read(fd_in, 1 << 22)
            if not chunk:
                eof = True
                break
            buffer += chunk
            for frame in _read_frames(buffer):
                request = decode(frame)
                pending.append(request)
                rows += len(request[1])
        group, pending = pending, []
        replies = _commit_requests(engine, lock, group)
        _write_all(fd_out, b"".join(_HEADER.pack(len(r)) + r for r in map(encode, replies)))
    engine.dispose()


def _commit_requests(engine: Engine, lock: Any, group: list[Any]) -> list[list[Any]]:
    try:
        with lock, engine.begin() as tx:
            stored = writes.insert_sample_groups(tx, [request[1] for request in group])
            stored_events = [writes.insert_events(tx, request[2]) for request in group]
            for request in group:
                writes.write_extras(tx, request[3], request[4])
    except Exception as exc:  # every caller of the failed transaction learns why
        error = [_error_kind(exc), f"{type(exc).__name__}: {exc}"[:500]]
        return [[request[0], 0, 0, error] for request in group]
    return [
        [request[0], s, e, None] for request, s, e in zip(group, stored, stored_events, strict=True)
    ]


class _Child(NamedTuple):
    process: subprocess.Popen[bytes]
    outbox: queue.SimpleQueue[tuple[int, Any] | None]
    pending: dict[int, Future[tuple[int, int]]]


class ProcessWriter:
    """Writes through a child process that owns the database connection (see above).

    Same contract as :class:`GroupWriter`: ``submit`` returns a future that resolves to
    (new samples, new events) once committed. If the child dies, the writes in flight fail
    with :class:`~forewarn.errors.StoreUnavailable` and the next write starts a new child.

    Args:
        url: the database URL (the child opens its own engine).
        lock_path: an ``flock`` file serialising writers of one SQLite file across processes.
        max_rows: stop adding queued writes to a transaction once it holds this many rows.
    """

    def __init__(self, url: str, *, lock_path: Path | None = None, max_rows: int = 50_000) -> None:
        import msgspec

        self._url = url
        self._lock_path = lock_path
        self._max_rows = max_rows
        self._encode = msgspec.msgpack.encode
        self._decode = msgspec.msgpack.decode
        self._mutex = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._child: _Child | None = None
        self._start()

    @property
    def pid(self) -> int | None:
        """The child's process id (tests kill it)."""
        return self._child.process.pid if self._child else None

    def _start(self) -> _Child:
        args = [self._url, str(self._lock_path or ""), str(self._max_rows)]
        code = "import sys; from store.writer import _child_main; _child_main(sys.argv[1:])"
        # The child keeps the parent's working directory, so that a relative SQLite URL names
        # the same file; the package's parent goes on its path, so ``store`` imports from a
        # source tree too.
        paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        path = os.pathsep.join(p for p in paths if p)
        process = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env={**os.environ, "PYTHONPATH": path},
        )
        self._child = child = _Child(process, queue.SimpleQueue(), {})
        threading.Thread(
            target=self._send, args=(child,), name="store-writer-send", daemon=True
        ).start()
        threading.Thread(
            target=self._receive, args=(child,), name="store-writer-recv", daemon=True
        ).start()
        return child

    def submit(
        self,
        samples: Any = (),
        events: Any = (),
        agent: tuple[str, dict[str, Any]] | None = None,
        charge: writes.Charge | None = None,
    ) -> Future[tuple[int, int]]:
        """Queue a write; the future resolves to (new samples, new events) once committed."""
        future: Future[tuple[int, int]] = Future()
        with self._mutex:
            if self._closed:
                raise RuntimeError("writer is closed")
            child = self._child
            if child is None or child.process.poll() is not None:
                child = self._start()
            self._next_id += 1
            child.pending[self._next_id] = future
            child.outbox.put((self._next_id, (samples, events, agent, charge)))
        return future

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop the child."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            child = self._child
        if child is not None:
            child.outbox.put(None)
            try:
                child.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(5)

    def _send(self, child: _Child) -> None:
        process = child.process
        assert process.stdin is not None
        fd = process.stdin.fileno()
        try:
            while (item := child.outbox.get()) is not None:
                job_id, (samples, events, agent, charge) = item
                if isinstance(samples, writes.SampleColumns):
                    samples = {"c": samples.to_wire()}
                body = self._encode([job_id, samples, events, agent, charge])
                _write_all(fd, _HEADER.pack(len(body)) + body)
        except OSError:
            pass  # the child is gone: the receiver fails what is in flight
        finally:
            process.stdin.close()

    def _receive(self, child: _Child) -> None:
        process = child.process
        assert process.stdout is not None
        fd = process.stdout.fileno()
        buffer = bytearray()
        while chunk := os.read(fd, 1 << 16):
            buffer += chunk
            for frame in _read_frames(buffer):
                job_id, stored, stored_events, error = self._decode(frame)
                with self._mutex:
                    future = child.pending.pop(job_id, None)
                if future is None:
                    continue
                if error is None:
                    future.set_result((stored, stored_events))
                elif error[0] == "unavailable":
                    future.set_exception(WriterUnavailable(f"database write failed: {error[1]}"))
                else:
                    future.set_exception(RuntimeError(f"database write failed: {error[1]}"))
        process.stdout.close()
        process.wait()
        with self._mutex:
            if self._child is child:
                self._child = None
            lost = dict(child.pending)
            child.pending.clear()
        for future in lost.values():
            future.set_exception(WriterUnavailable("the writer process exited"))


def _child_main(argv: list[str]) -> None:
    url, lock_path, max_rows = argv
    fd_in, fd_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # nothing printed by a library may corrupt the reply stream
    serve_writes(url, lock_path or None, int(max_rows), fd_in, fd_out)
