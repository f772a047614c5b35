"""``forewarn serve``: run the service under uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import uuid
from typing import Any

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8765, help="port (default %(default)s)")
    parser.add_argument(
        "--database-url",
        help="SQLAlchemy URL (default: FOREWARN_DATABASE_URL, else SQLite in the data dir)",
    )
    parser.add_argument("--data-dir", help="data directory (default: FOREWARN_DATA_DIR or ./var)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="service processes (default 1); they share the database, SQLite included",
    )
    parser.add_argument("--log-level", default="info")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _stored_tokens(settings: Any) -> bool:
    """Whether the database holds a live token (created with ``forewarn token create``)."""
    from store import Store
    from store.tokens import list_tokens

    store = Store.open(settings.resolved_database_url())
    try:
        with store.engine.connect() as connection:
            return bool(list_tokens(connection, include_revoked=False))
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from api.app import create_app
    from api.control_service import start_control_beside
    from api.settings import Settings
    from store import Store

    if args.database_url:
        os.environ["FOREWARN_DATABASE_URL"] = args.database_url
    if args.data_dir:
        os.environ["FOREWARN_DATA_DIR"] = args.data_dir
    if not _is_loopback(args.host):  # the development token is never accepted from a network
        os.environ["FOREWARN_DEVELOPMENT_TOKEN"] = "false"
    try:
        settings = Settings()  # refuses unsafe production settings before anything starts
    except ValidationError as exc:
        print("forewarn serve: invalid settings:", file=sys.stderr)
        for error in exc.errors(include_url=False):
            where = ".".join(str(p) for p in error["loc"])
            field = f"FOREWARN_{where.upper()}: " if where else ""
            print(f"  {field}{error['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    public = not _is_loopback(args.host)
    if public and not settings.token_scopes() and not _stored_tokens(settings):
        print(
            f"forewarn serve: refusing to listen on {args.host} with no tokens (the "
            "development token is not accepted from a network). Configure FOREWARN_TOKENS (or "
            "FOREWARN_INGEST_TOKEN / _READ_TOKEN / _ADMIN_TOKEN), or create one with "
            "'forewarn token create', or bind to 127.0.0.1 (where the development token "
            "works).",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    options = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": False,
        # The client's address is the socket's: no header may make a request "local".
        "proxy_headers": False,
    }
    if args.workers > 1:
        # Each worker process builds its own app from the same FOREWARN_* environment: one
        # replica (one name), and the control loop started here once, not once a worker.
        Store.open(settings.resolved_database_url()).close()  # migrate once, before the fork
        replica = settings.replica_id or uuid.uuid4().hex[:12]
        os.environ["FOREWARN_REPLICA_ID"] = replica
        stop = None
        if settings.control_enabled:
            os.environ["FOREWARN_CONTROL_BY_SERVE"] = "true"
            stop = start_control_beside(settings, replica)
        try:
            uvicorn.run("api.app:create_app", factory=True, workers=args.workers, **options)
        finally:
            if stop is not None:
                stop()
    else:
        uvicorn.run(create_app(settings), **options)
    return 0
