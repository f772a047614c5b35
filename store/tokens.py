"""API tokens, stored hashed: create, list, revoke, and look a presented secret up.

A token is a random secret (``fw_`` and 43 URL-safe characters, 256 bits) shown once, when it
is created; the store keeps only its SHA-256, so a copy of the database does not give anyone
access. A secret of 256 random bits needs no slow password hash: nobody can guess it, and a
fast hash lets every request be checked with one indexed lookup. Revoking keeps the row (who
had access, and when it ended) and stops the token at once on this replica, within the
service's token cache time on the others.

Example::

    with store.begin() as tx:
        secret, record = create_token(tx, name="collectors", scopes=["ingest"], now_ms=now)
    with store.engine.connect() as c:
        assert token_scopes(c, secret) == frozenset({"ingest"})
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    UniqueConstraint,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from store.schema import metadata

__all__ = [
    "TOKEN_SCOPES",
    "api_tokens",
    "charge_gpus",
    "create_token",
    "digest",
    "gpus_charged",
    "list_tokens",
    "revoke_token",
    "token_gpus",
    "token_scopes",
]

TOKEN_SCOPES = ("ingest", "read", "operate", "admin")
"""Every scope a token may hold; ``admin`` implies the others."""

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(128), nullable=False),
    Column("secret_sha256", String(64), nullable=False),
    Column("scopes", String(64), nullable=False),
    Column("created_ms", BigInteger, nullable=False),
    Column("revoked_ms", BigInteger),
    UniqueConstraint("secret_sha256", name="uq_api_tokens_secret"),
)

token_gpus = Table(
    "token_gpus",
    metadata,
    Column("node", String(253), nullable=False),
    Column("gpu", SmallInteger, nullable=False),
    Column("token_sha256", String(64), nullable=False),
    Column("added_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("node", "gpu", name="pk_token_gpus"),
)
"""Which token's batch first stored each GPU: the per-token GPU cap's count, shared by every
replica on the database."""


def digest(secret: str) -> str:
    """The stored form of a secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _record(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "scopes": row.scopes.split(",") if row.scopes else [],
        "created_ms": row.created_ms,
        "revoked_ms": row.revoked_ms,
    }


def create_token(
    connection: Connection, *, name: str, scopes: Iterable[str], now_ms: int
) -> tuple[str, dict[str, Any]]:
    """Create a token; returns (its secret, shown only now; its record).

    Raises:
        ValueError: an unknown scope, no scope, or a name that is empty or too long.
    """
    wanted = (
        sorted(set(scopes), key=TOKEN_SCOPES.index) if set(scopes) <= set(TOKEN_SCOPES) else None
    )
    if not wanted:
        raise ValueError(f"scopes must be one or more of {', '.join(TOKEN_SCOPES)}")
    if not name or len(name) > 128:
        raise ValueError("a token needs a name of 1 to 128 characters")
    secret = "fw_" + secrets.token_urlsafe(32)
    token_id = "tok_" + secrets.token_hex(8)
    values = {
        "id": token_id,
        "name": name,
        "secret_sha256": digest(secret),
        "scopes": ",".join(wanted),
        "created_ms": now_ms,
        "revoked_ms": None,
    }
    connection.execute(api_tokens.insert().values(values))
    return secret, _record(type("Row", (), values))


def list_tokens(connection: Connection, *, include_revoked: bool = True) -> list[dict[str, Any]]:
    """Every token's record (never a secret), oldest first."""
    query = select(api_tokens).order_by(api_tokens.c.created_ms, api_tokens.c.id)
    if not include_revoked:
        query = query.where(api_tokens.c.revoked_ms.is_(None))
    return [_record(row) for row in connection.execute(query)]


def revoke_token(connection: Connection, token_id: str, *, now_ms: int) -> bool:
    """Revoke a token; False if there is no such token (revoking twice is not an error)."""
    found = connection.execute(
        select(api_tokens.c.revoked_ms).where(api_tokens.c.id == token_id)
    ).first()
    if found is None:
        return False
    if found.revoked_ms is None:
        connection.execute(
            api_tokens.update().where(api_tokens.c.id == token_id).values(revoked_ms=now_ms)
        )
    return True


def token_scopes(connection: Connection, secret: str) -> frozenset[str] | None:
    """The scopes of a live token with this secret (``admin`` expanded), or None."""
    row = connection.execute(
        select(api_tokens.c.scopes).where(
            api_tokens.c.secret_sha256 == digest(secret), api_tokens.c.revoked_ms.is_(None)
        )
    ).first()
    if row is None:
        return None
    scopes = frozenset(row.scopes.split(","))
    return frozenset(TOKEN_SCOPES) if "admin" in scopes else scopes


def gpus_charged(connection: Connection, token_sha256: str) -> int:
    """How many GPUs batches sent with this token have added to the fleet."""
    query = select(func.count()).where(token_gpus.c.token_sha256 == token_sha256)
    return int(connection.execute(query).scalar_one())


def charge_gpus(
    connection: Connection, token_sha256: str, gpus: Iterable[tuple[str, int]], *, now_ms: int
) -> None:
    """Charge GPUs to the token whose batch stored them (after that batch committed).

    A GPU is charged once, to the first token charged for it: charging again (a batch sent
    twice, a GPU another token added) changes nothing.
    """
    rows = [
        {"node": node, "gpu": gpu, "token_sha256": token_sha256, "added_ms": now_ms}
        for node, gpu in sorted(gpus)
    ]
    if not rows:
        return
    insert = sqlite_insert if connection.dialect.name == "sqlite" else pg_insert
    # One statement with many parameter sets: compiled once and cached (a VALUES list of the
    # batch's length was compiled afresh for every batch of new GPUs).
    connection.execute(insert(token_gpus).on_conflict_do_nothing(), rows)
