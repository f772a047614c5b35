"""``forewarn token``: create, list and revoke the service's API tokens in its database.

    forewarn token create --name collectors --scope ingest
    forewarn token list
    forewarn token revoke tok_0123456789abcdef

The database is the service's (``FOREWARN_DATABASE_URL`` or ``--database-url``, else the
SQLite file in the data directory). A created token's secret is printed once; only its hash is
kept. The running service sees a new token at once and a revoked one within a few seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime

__all__ = ["configure", "run"]

_SCOPES = ("ingest", "read", "operate", "admin")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy URL (default: the service's)")
    parser.add_argument("--data-dir", help="data directory (default: FOREWARN_DATA_DIR or ./var)")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a token and print its secret once")
    create.add_argument("--name", required=True, help="who or what uses it")
    create.add_argument(
        "--scope",
        action="append",
        required=True,
        choices=_SCOPES,
        help="a scope it holds (repeat for several; admin implies all)",
    )
    listing = actions.add_parser("list", help="every token, never a secret")
    listing.add_argument("--all", action="store_true", help="include revoked tokens")
    revoke = actions.add_parser("revoke", help="revoke a token by its id")
    revoke.add_argument("token_id")


def _iso(ms: int | None) -> str:
    return (
        "-" if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")
    )


def run(args: argparse.Namespace) -> int:
    from store import Store
    from store.engine import default_database_url
    from store.tokens import create_token, list_tokens, revoke_token

    if args.data_dir:
        os.environ["FOREWARN_DATA_DIR"] = args.data_dir
    url = args.database_url or os.environ.get("FOREWARN_DATABASE_URL") or default_database_url()
    store = Store.open(url)
    now_ms = int(time.time() * 1000)
    try:
        if args.action == "create":
            with store.begin() as tx:
                try:
                    secret, record = create_token(
                        tx, name=args.name, scopes=args.scope, now_ms=now_ms
                    )
                except ValueError as exc:
                    print(f"forewarn token: {exc}", file=sys.stderr)
                    return 2
            print(f"created {record['id']} ({','.join(record['scopes'])}); the secret, shown once:")
            print(secret)
            return 0
        if args.action == "list":
            with store.engine.connect() as connection:
                records = list_tokens(connection, include_revoked=args.all)
            print(f"{'id':<21} {'scopes':<24} {'created':<26} {'revoked':<26} name")
            for r in records:
                print(
                    f"{r['id']:<21} {','.join(r['scopes']):<24} {_iso(r['created_ms']):<26} "
                    f"{_iso(r['revoked_ms']):<26} {r['name']}"
                )
            return 0
        with store.begin() as tx:
            if not revoke_token(tx, args.token_id, now_ms=now_ms):
                print(f"forewarn token: no token '{args.token_id}'", file=sys.stderr)
                return 1
        print(f"revoked {args.token_id}")
        return 0
    finally:
        store.close()
