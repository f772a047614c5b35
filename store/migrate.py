"""Schema migrations (Alembic), run in-process: ``upgrade(engine)`` brings a database to head.

The service calls it at start-up, so a fresh SQLite file or an empty PostgreSQL database is
usable at once and an older one is brought forward. Revisions live in ``store/migrations``.

Each room that owns tables (the control loop, webhooks, storage tiers) keeps its own branch of
revisions off ``0002``; ``upgrade`` brings every branch to its head, and the schema is current
when the database stands at every head.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

__all__ = ["alembic_config", "current_heads", "head_revisions", "upgrade"]

_SCRIPTS = Path(__file__).with_name("migrations")


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(_SCRIPTS))
    return config


def upgrade(engine: Engine, revision: str = "heads") -> None:
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def head_revisions() -> frozenset[str]:
    """The newest revision of every branch."""
    return frozenset(ScriptDirectory.from_config(alembic_config()).get_heads())


def current_heads(engine: Engine) -> frozenset[str]:
    """The revisions the database stands at (one per branch)."""
    with engine.connect() as connection:
        return frozenset(MigrationContext.configure(connection).get_current_heads())
