"""``forewarn collect``: run the node agent — read the GPUs, push to the service.

Examples::

    forewarn collect --service http://forewarn:8765 --token $TOKEN            # auto: NVML, AMD
    forewarn collect --source dcgm-exporter --url http://localhost:9400/metrics \\
        --service http://forewarn:8765 --token $TOKEN --interval-s 15
    forewarn collect --source simulated --sim-gpus 64 --service http://127.0.0.1:8765 --token T
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from collector.base import Source
from forewarn.errors import ForewarnError, SourceUnavailable

__all__ = ["build_sources", "configure", "run"]

log = logging.getLogger("forewarn.collector")

BUILT_IN = ("auto", "nvml", "amd", "dcgm-exporter")
"""Sources of the collector itself; others come from ``forewarn.sources`` entry points."""


def configure(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--source",
        choices=[*BUILT_IN, *sorted(_plugins())],
        default="auto",
        help="auto tries NVML, then AMD SMI (default %(default)s)",
    )
    parser.add_argument("--url", help="dcgm-exporter metrics URL (with --source dcgm-exporter)")
    parser.add_argument(
        "--service",
        default=env("FOREWARN_SERVICE_URL"),
        help="service base URL (env FOREWARN_SERVICE_URL)",
    )
    parser.add_argument(
        "--token",
        default=env("FOREWARN_INGEST_TOKEN"),
        help="ingest token (env FOREWARN_INGEST_TOKEN)",
    )
    parser.add_argument("--node", default=socket.gethostname(), help="node name (default: host)")
    parser.add_argument(
        "--interval-s", type=float, default=1.0, help="sampling period, s (default %(default)s)"
    )
    parser.add_argument(
        "--spool-dir",
        default=env("FOREWARN_SPOOL_DIR", "var/collector-spool"),
        help="where batches wait while the service is unreachable (env FOREWARN_SPOOL_DIR; "
        "default %(default)s, relative to the working directory)",
    )
    parser.add_argument(
        "--spool-max-mib",
        type=float,
        default=256.0,
        help="spool bound on disk; the oldest batches go first (default %(default)s)",
    )
    parser.add_argument("--kernel-log", help="also read Xids from this log (/dev/kmsg or a file)")
    parser.add_argument(
        "--batch-max-rows", type=int, default=5000, help="rows per request (default %(default)s)"
    )
    parser.add_argument(
        "--batch-max-delay-s",
        type=float,
        default=10.0,
        help="longest a reading waits before it is sent (default %(default)s: what lets one "
        "service hold 16,384 GPUs at 1 Hz; the risk it adds to detection is docs/telemetry.md's)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=10.0,
        help="agent status sent at least this often, for stall detection (default %(default)s)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=10.0, help="per request to the service, s"
    )
    parser.add_argument("--no-gzip", action="store_true", help="send request bodies uncompressed")
    parser.add_argument(
        "--rows",
        action="store_true",
        help="send samples as one JSON object each (default: sample_columns, a list a field; "
        "a service that does not take columns gets rows anyway)",
    )
    parser.add_argument("--duration-s", type=float, help="stop after this long (default: never)")
    parser.add_argument(
        "--sim-gpus", type=int, default=8, help="--source simulated: fleet size (8 a node)"
    )
    parser.add_argument("--sim-seed", type=int, default=0, help="--source simulated: seed")
    parser.add_argument(
        "--sim-speed", type=float, default=1.0, help="--source simulated: failures run X faster"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="default %(default)s",
    )


_AUTO_HELP = (
    "no GPU source found: NVML ({nvml}); AMD SMI ({amd}).\n"
    "  NVIDIA: install the driver and `pip install 'forewarn[nvidia]'`;\n"
    "  AMD: install ROCm and `pip install 'forewarn[amd]'`;\n"
    "  dcgm-exporter already running: --source dcgm-exporter --url http://localhost:9400/metrics;\n"
    "  no GPUs (a rehearsal): --source simulated."
)


def _plugins() -> dict[str, EntryPoint]:
    """Sources installed beside the collector (``forewarn.sources`` entry points: the
    simulator's, for one), found by name so that the collector imports none of them."""
    return {ep.name: ep for ep in entry_points(group="forewarn.sources")}


def _primary(args: argparse.Namespace) -> Source:
    kind = args.source
    if kind == "nvml":
        from collector.nvml import NvmlSource

        return NvmlSource(args.node)
    if kind == "amd":
        from collector.amd import AmdSource

        return AmdSource(args.node)
    if kind == "dcgm-exporter":
        if not args.url:
            raise SourceUnavailable("--source dcgm-exporter needs --url http://HOST:9400/metrics")
        from collector.dcgm_exporter import DcgmExporterSource

        return DcgmExporterSource(args.url, node=args.node)
    plugin = _plugins().get(kind)
    if plugin is not None:
        source: Source = plugin.load()(args)
        return source
    errors = {}
    for name in ("nvml", "amd"):
        try:
            return _primary(argparse.Namespace(**{**vars(args), "source": name}))
        except SourceUnavailable as exc:
            errors[name] = exc.message
    raise SourceUnavailable(_AUTO_HELP.format(**errors))


def build_sources(args: argparse.Namespace) -> list[Source]:
    """The primary source, and the kernel-log source beside it when asked for."""
    primary = _primary(args)
    sources: list[Source] = [primary]
    if args.kernel_log:
        from collector.kernel_log import KernelLogSource

        bus_ids: Any = getattr(primary, "bus_ids", None) or {}
        sources.append(KernelLogSource(args.node, args.kernel_log, bus_ids=bus_ids))
    return sources


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.service or not args.token:
        print("forewarn collect: --service URL and --token T are required", file=sys.stderr)
        return 2
    from collector.agent import SamplingLoop
    from collector.push import BatchingPusher, IngestClient
    from collector.spool import DiskSpool

    try:
        sources = build_sources(args)
    except ForewarnError as exc:
        print(f"forewarn collect: {exc.message}", file=sys.stderr)
        return 3
    client = IngestClient(
        args.service,
        args.token,
        timeout_s=args.timeout_s,
        gzip=not args.no_gzip,
        columns=not args.rows,
    )
    if args.interval_s <= 0 or args.spool_max_mib <= 0 or args.batch_max_rows <= 0:
        print("forewarn collect: intervals, sizes and counts must be positive", file=sys.stderr)
        return 2
    try:
        spool = DiskSpool(Path(args.spool_dir), max_bytes=int(args.spool_max_mib * 2**20))
    except OSError as exc:
        for source in sources:
            source.close()
        print(
            f"forewarn collect: cannot use spool directory {args.spool_dir!r} ({exc}); "
            "give a writable --spool-dir",
            file=sys.stderr,
        )
        return 3
    pusher = BatchingPusher(
        client,
        spool=spool,
        max_rows=args.batch_max_rows,
        max_delay_s=args.batch_max_delay_s,
        heartbeat_s=args.heartbeat_s,
    )
    agent = SamplingLoop(
        sources,
        pusher,
        interval_s=args.interval_s,
        node=args.node,
        heartbeat=args.source != "simulated",  # the host is no node of the simulated fleet
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())  # Ctrl-C: flush and spool, no trace
    log.info(
        "collecting from %s every %.3g s into %s (agent %s)",
        agent.source_name,
        args.interval_s,
        args.service,
        agent.agent_id,
    )
    agent.run(duration_s=args.duration_s)  # closes (flush, spool) on any exit
    log.info("stopped: %s", agent.describe())
    return 0
