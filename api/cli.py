"""``forewarn serve``: run the service under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os

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


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from api.settings import Settings
    from store import Store

    if args.database_url:
        os.environ["FOREWARN_DATABASE_URL"] = args.database_url
    if args.data_dir:
        os.environ["FOREWARN_DATA_DIR"] = args.data_dir
    settings = Settings()  # refuses unsafe production settings before anything starts
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    options = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": False,
    }
    if args.workers > 1:
        # Each worker process builds its own app from the same FOREWARN_* environment.
        Store.open(settings.resolved_database_url()).close()  # migrate once, before the fork
        uvicorn.run("api.app:create_app", factory=True, workers=args.workers, **options)
    else:
        uvicorn.run(create_app(settings), **options)
    return 0
