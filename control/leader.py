"""Which service replica runs the control loop: exactly one at a time.

PostgreSQL: a session-level advisory lock held on a connection of its own. The lock is the
database's, so it is released the moment the holder's connection ends — the process died, the
network went — and the next replica that asks takes it over. The holder checks its connection
every tick; if the check fails it stops acting at once (it may already have lost the lock).

SQLite (one machine; ``forewarn serve --workers N`` shares one file): an exclusive ``flock`` on
``<database>.leader-lock``, released by the kernel when the holder exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

__all__ = ["LEADER_LOCK_KEY", "Leadership"]

log = logging.getLogger("forewarn.control")

LEADER_LOCK_KEY = 0x466F7265  # "Fore"
"""The advisory lock key of the control loop on PostgreSQL."""


class Leadership:
    """Try to become the control-loop leader, and know whether this replica still is."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._connection: Any = None
        self._fd: int | None = None
        self.is_leader = False

    def acquire(self) -> bool:
        """Take the lock if it is free; True if this replica leads (now or already)."""
        if self.is_leader:
            return self.check()
        if self.engine.dialect.name == "postgresql":
            connection = self.engine.connect()
            try:
                got = connection.execute(
                    text("SELECT pg_try_advisory_lock(:k)"), {"k": LEADER_LOCK_KEY}
                ).scalar_one()
                connection.commit()
            except Exception:
                connection.close()
                raise
            if got:
                self._connection = connection
            else:
                connection.close()
            self.is_leader = bool(got)
        else:
            database = self.engine.url.database
            if not database or database == ":memory:":
                self.is_leader = True
                return True
            fd = os.open(Path(f"{database}.leader-lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._fd = fd
            self.is_leader = True
        if self.is_leader:
            log.info("this replica leads the control loop")
        return self.is_leader

    def check(self) -> bool:
        """Whether the lock is still held (PostgreSQL: its connection still answers)."""
        if not self.is_leader:
            return False
        if self._connection is not None:
            try:
                self._connection.execute(text("SELECT 1"))
                self._connection.commit()
            except Exception:
                log.warning("lost the control-loop lock's connection; stepping down")
                self.release()
                return False
        return True

    def release(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.execute(
                    text("SELECT pg_advisory_unlock(:k)"), {"k": LEADER_LOCK_KEY}
                )
                self._connection.commit()
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        self.is_leader = False
