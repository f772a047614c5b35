"""``forewarn serve``: run the service under uvicorn."""

from __future__ import annotations

import argparse
import logging

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8765, help="port (default %(default)s)")
    parser.add_argument(
        "--database-url",
        help="SQLAlchemy URL (default: FOREWARN_DATABASE_URL, else SQLite in the data dir)",
    )
    parser.add_argument("--data-dir", help="data directory (default: FOREWARN_DATA_DIR or ./var)")
    parser.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from api.settings import Settings

    overrides = {}
    if args.database_url:
        overrides["database_url"] = args.database_url
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    settings = Settings(**overrides)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
