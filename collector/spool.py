"""The bounded spool: batches the service could not take yet, kept until it can.

A spool holds encoded batches in arrival order and hands them back oldest first. Two kinds
share one small interface:

- :class:`DiskSpool` — one gzip file per batch in a directory, written atomically (temporary
  file, fsync, rename), so it survives the agent's own restart and a power cut mid-write leaves
  no half batch behind. The sequence number and the row count are in the file name, so the
  spool is reopened and counted without reading a single file.
- :class:`MemorySpool` — the same in a deque, for callers that do not want files (the
  simulator's live mode, tests).

Both are bounded. When a new batch would pass the bound, the *oldest* batches are dropped and
their rows counted as dropped: during a long outage the newest telemetry is the most useful
for scoring, and the bound keeps a full disk from taking the node down with the agent.

Spools are not thread-safe on their own; :class:`collector.push.BatchingPusher` holds its lock
around every call.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any, Protocol

__all__ = ["DiskSpool", "MemorySpool", "Spool", "SpoolEntry"]

log = logging.getLogger("forewarn.collector.spool")

SpoolEntry = tuple[str, dict[str, Any], int]
"""(key, batch body as a JSON object, row count)."""


class Spool(Protocol):
    rows: int
    """Rows held now."""

    def put(self, body: dict[str, Any], rows: int) -> int:
        """Keep ``body``; returns how many rows of older batches were dropped to make room."""
        ...

    def oldest(self) -> SpoolEntry | None: ...

    def head(self, limit: int) -> list[SpoolEntry]:
        """Up to ``limit`` oldest batches, oldest first."""
        ...

    def remove(self, key: str) -> None: ...

    def __len__(self) -> int: ...


class MemorySpool:
    """A spool in memory, bounded by ``max_rows`` rows."""

    def __init__(self, *, max_rows: int = 1_000_000) -> None:
        if max_rows <= 0:
            raise ValueError("max_rows must be positive")
        self.max_rows = max_rows
        self.rows = 0
        self._items: deque[SpoolEntry] = deque()
        self._seq = 0

    def put(self, body: dict[str, Any], rows: int) -> int:
        dropped = 0
        while self._items and self.rows + rows > self.max_rows:
            _, _, n = self._items.popleft()
            self.rows -= n
            dropped += n
        if rows > self.max_rows:  # a single batch larger than the whole spool
            return dropped + rows
        self._seq += 1
        self._items.append((str(self._seq), body, rows))
        self.rows += rows
        return dropped

    def head(self, limit: int) -> list[SpoolEntry]:
        return list(self._items)[:limit]

    def oldest(self) -> SpoolEntry | None:
        return self._items[0] if self._items else None

    def remove(self, key: str) -> None:
        if self._items and self._items[0][0] == key:
            self.rows -= self._items.popleft()[2]
            return
        for item in list(self._items):
            if item[0] == key:
                self._items.remove(item)
                self.rows -= item[2]
                return

    def __len__(self) -> int:
        return len(self._items)


class DiskSpool:
    """A spool of gzip files in ``directory``, bounded by ``max_bytes`` on disk.

    Files are named ``<seq:012d>-<rows>.json.gz``; sorting the names sorts by arrival.
    Leftover ``*.tmp`` files (a write interrupted by a crash) are removed on open.

    Example::

        spool = DiskSpool("/var/lib/forewarn/spool", max_bytes=256 * 2**20)
        spool.put({"node": "n1", "samples": [...], "events": []}, rows=8)
        key, body, rows = spool.oldest()
        spool.remove(key)
    """

    SUFFIX = ".json.gz"

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int = 256 * 2**20) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._files: deque[tuple[str, int, int]] = deque()  # (name, rows, bytes)
        self.rows = 0
        self.bytes = 0
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        for path in sorted(self.directory.glob("*" + self.SUFFIX)):
            parsed = self._parse(path.name)
            if parsed is None:
                continue
            size = path.stat().st_size
            self._files.append((path.name, parsed[1], size))
            self.rows += parsed[1]
            self.bytes += size
        self._seq = self._parse(self._files[-1][0])[0] if self._files else 0  # type: ignore[index]
        if self._files:
            log.info("spool %s: %d batch(es), %d row(s) to replay", directory, len(self), self.rows)

    @classmethod
    def _parse(cls, name: str) -> tuple[int, int] | None:
        stem = name[: -len(cls.SUFFIX)] if name.endswith(cls.SUFFIX) else ""
        seq, _, rows = stem.partition("-")
        if not (seq.isdigit() and rows.isdigit()):
            return None
        return int(seq), int(rows)

    def put(self, body: dict[str, Any], rows: int) -> int:
        """Keep ``body``; returns rows dropped. Raises OSError when the file cannot be written."""
        data = gzip.compress(json.dumps(body, separators=(",", ":")).encode(), compresslevel=5)
        dropped = 0
        while self._files and self.bytes + len(data) > self.max_bytes:
            dropped += self._drop_oldest()
        if len(data) > self.max_bytes:
            log.error("a batch of %d bytes is larger than the whole spool; dropped", len(data))
            return dropped + rows
        self._seq += 1
        name = f"{self._seq:012d}-{rows}{self.SUFFIX}"
        tmp = self.directory / (name + ".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.directory / name)
        except OSError:  # disk full, read-only, gone: leave no half file taking space
            tmp.unlink(missing_ok=True)
            raise
        self._files.append((name, rows, len(data)))
        self.rows += rows
        self.bytes += len(data)
        return dropped

    def _drop_oldest(self) -> int:
        name, rows, size = self._files.popleft()
        (self.directory / name).unlink(missing_ok=True)
        self.rows -= rows
        self.bytes -= size
        log.warning(
            "spool full (%d bytes): dropped the oldest batch, %d row(s)", self.max_bytes, rows
        )
        return rows

    def head(self, limit: int) -> list[SpoolEntry]:
        """Up to ``limit`` oldest batches, oldest first (unreadable files are set aside)."""
        out: list[SpoolEntry] = []
        for name, rows, _size in list(self._files)[:limit]:
            path = self.directory / name
            try:
                body = json.loads(gzip.decompress(path.read_bytes()))
            except (OSError, EOFError, ValueError) as exc:
                # A file we cannot read will never become readable: set it aside, go on.
                log.error("spool file %s unreadable (%s); moved aside as .bad", name, exc)
                if path.exists():
                    path.rename(path.with_name(name + ".bad"))
                self.remove(name)
                continue
            out.append((name, body, rows))
        return out

    def oldest(self) -> SpoolEntry | None:
        while self._files:
            entries = self.head(1)
            if entries:
                return entries[0]
        return None

    def remove(self, key: str) -> None:
        for i, (name, rows, size) in enumerate(self._files):
            if name == key:
                del self._files[i]
                (self.directory / name).unlink(missing_ok=True)
                self.rows -= rows
                self.bytes -= size
                return

    def __len__(self) -> int:
        return len(self._files)
