"""Database engines: the embedded SQLite default and PostgreSQL.

SQLite runs in WAL mode with ``synchronous=NORMAL`` (durable across process crashes, at most
the last transaction lost on power loss) and a busy timeout, so readers never block the
ingest writer. PostgreSQL gets a small connection pool. Both are created from one URL.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

__all__ = ["default_data_dir", "default_database_url", "is_sqlite", "make_engine"]


def default_data_dir() -> Path:
    """``FOREWARN_DATA_DIR``, else ``./var`` (the checkout's own data directory)."""
    return Path(os.environ.get("FOREWARN_DATA_DIR") or "var").resolve()


def default_database_url(data_dir: Path | None = None) -> str:
    directory = data_dir or default_data_dir()
    return f"sqlite:///{directory / 'forewarn.db'}"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cursor = dbapi_connection.cursor()
    # Takes effect on a new file (before its first table); store.tiers converts older files.
    cursor.execute("PRAGMA auto_vacuum=INCREMENTAL")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA cache_size=-65536")  # 64 MiB page cache
    cursor.execute("PRAGMA temp_store=MEMORY")
    cursor.close()


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for ``url``; creates the SQLite file's directory if needed.

    Raises:
        sqlalchemy.exc.ArgumentError: the URL is not a database URL.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.drivername == "postgresql":
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, echo=echo, pool_size=5, max_overflow=5, pool_pre_ping=True)
