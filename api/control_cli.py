"""``forewarn control``: the control loop in a process of its own.

``forewarn serve`` starts one as its child by default (``FOREWARN_CONTROL_PROCESS``), so
scoring a large fleet never holds the interpreter that answers ingest and the dashboard; it
can also be run by hand beside services started with ``FOREWARN_CONTROL_ENABLED=false``. It
reads the same ``FOREWARN_*`` settings as the service, opens the store, loads the model in
force and ticks (:class:`control.loop.ControlLoop`); like every replica's loop it acts only
while it holds the leadership. What the service shows of it (the model scoring, the threshold
in force, the ticks) is the status it publishes in the store.

Started by a service (``--parent PID``) it ends when that service does: it asks the kernel for
SIGTERM when its parent dies (``PR_SET_PDEATHSIG``, Linux), and checks every second that its
parent is still the one it was started by (elsewhere, and for a parent gone before it asked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from api.settings import Settings
    from store import Store

__all__ = ["configure", "run"]

log = logging.getLogger("forewarn.control")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        help="SQLAlchemy URL (default: FOREWARN_DATABASE_URL, else SQLite in the data dir)",
    )
    parser.add_argument("--data-dir", help="data directory (default: FOREWARN_DATA_DIR or ./var)")
    parser.add_argument(
        "--replica", default="", help="the replica id the loop names itself by in its status"
    )
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="info")


async def _run(settings: Settings, store: Store, replica: str, parent: int | None) -> None:
    from api.control_service import build_loop
    from forewarn import heap

    loop = await asyncio.to_thread(build_loop, settings, store, replica)
    heap.settle()  # the model and the modules live as long as the process
    task = asyncio.create_task(loop.run(), name="control")
    stop = asyncio.Event()
    running = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        running.add_signal_handler(sig, stop.set)

    async def orphaned() -> None:
        if parent is None:  # run by hand: it ends when asked to
            return
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("the service that started this control loop is gone; stopping")
        stop.set()

    watch = asyncio.create_task(orphaned())
    await stop.wait()
    for t in (task, watch):
        t.cancel()
    await asyncio.gather(task, watch, return_exceptions=True)


def _die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux; else nothing)."""
    import ctypes

    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def run(args: argparse.Namespace) -> int:
    from forewarn import heap

    # Each tick allocates and frees the same large arrays. First of all: importing NumPy (with
    # the settings) starts its BLAS threads, and a thread that allocated has an arena of its own.
    heap.keep_large_blocks()

    from pydantic import ValidationError

    from api.settings import Settings
    from store import Store

    if args.database_url:
        os.environ["FOREWARN_DATABASE_URL"] = args.database_url
    if args.data_dir:
        os.environ["FOREWARN_DATA_DIR"] = args.data_dir
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"forewarn control: invalid settings: {exc}", file=sys.stderr)
        return 2
    if args.parent is not None:
        _die_with_parent()
        if os.getppid() != args.parent:
            return 0  # the service died before this process asked
    # Migrated by the service that started it; by hand, brought to the schema's head here.
    store = Store.open(
        settings.resolved_database_url(), migrate=args.parent is None, writer_process=False
    )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_run(settings, store, args.replica, args.parent))
    finally:
        store.close()
    return 0
