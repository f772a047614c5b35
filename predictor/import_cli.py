"""``forewarn import prometheus``: a dataset from a fleet's own dcgm-exporter history.

::

    forewarn import prometheus --url http://prometheus:9090 \\
        --since 2026-11-01T00:00:00Z --until 2026-11-08T00:00:00Z --step 15s --out var/fleet
    forewarn import prometheus --url ... --since now-6h --until now --labels failures.csv --out ...

Times: ISO 8601 (no zone: UTC), Unix seconds, ``now`` or ``now-DURATION`` (``90s``, ``30m``,
``6h``, ``7d``). Without ``--labels`` the failures are the heuristic's (fatal Xids and GPUs
whose series stop: ``predictor/heuristic_labels.py``, ``docs/predictor.md``). Exit 2 with a
message when Prometheus cannot be reached, refuses a query, holds no DCGM series in the range,
or a time is malformed.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import UTC, datetime

__all__ = ["configure", "parse_duration_s", "parse_time_ms", "run"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class TimeError(ValueError):
    """A time or duration the command cannot read."""


def parse_duration_s(text: str) -> float:
    """``15s``, ``1m``, ``2h``, ``1d``, ``500ms`` or plain seconds -> seconds."""
    m = _DURATION.match(text.strip())
    if m is None:
        raise TimeError(f"{text!r} is not a duration (e.g. 15s, 5m, 2h, 7d)")
    return float(m[1]) * _UNIT_S[m[2] or "s"]


def parse_time_ms(text: str, now_s: float | None = None) -> int:
    """ISO 8601 (UTC when no zone), Unix seconds, ``now`` or ``now-DURATION`` -> ms."""
    raw = text.strip()
    now = time.time() if now_s is None else now_s
    if raw == "now":
        return round(now * 1000)
    if raw.startswith("now-"):
        return round((now - parse_duration_s(raw[4:])) * 1000)
    try:
        return round(float(raw) * 1000)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise TimeError(f"{text!r} is not a time (ISO 8601, Unix seconds, now or now-6h)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return round(when.timestamp() * 1000)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "Without --labels, failures are guessed: a fatal Xid (48, 63, 64, 74, 79, 94, 95, 119,\n"
        "120) in DCGM_FI_DEV_XID_ERRORS, or a GPU whose series stop for --lost-after while\n"
        "the rest of the fleet reports. See docs/predictor.md, 'Training on your own fleet'."
    )
    parser.add_argument("source", choices=["prometheus"], help="where the history is kept")
    parser.add_argument("--url", required=True, help="Prometheus base URL, e.g. http://host:9090")
    parser.add_argument("--since", required=True, help="start: ISO 8601, Unix s, now-6h")
    parser.add_argument("--until", default="now", help="end (default: now)")
    parser.add_argument("--out", required=True, metavar="DIR", help="dataset directory")
    parser.add_argument("--step", default="15s", help="query resolution (default 15s)")
    parser.add_argument(
        "--labels",
        metavar="CSV",
        help="failures CSV: node,gpu,ts (or ts_ms),kind[,has_precursors,recovered_ts] "
        "(as 'forewarn simulate convert-csv --failures-csv'); default: the heuristic",
    )
    parser.add_argument(
        "--selector", default="", help='label matchers for every series, e.g. {job="dcgm"}'
    )
    parser.add_argument(
        "--lost-after",
        default="5m",
        help="heuristic: a GPU silent this long while others report is lost (default 5m)",
    )
    parser.add_argument("--timeout", default="60s", help="limit for one request (default 60s)")


def run(args: argparse.Namespace) -> int:
    try:
        since_ms, until_ms = parse_time_ms(args.since), parse_time_ms(args.until)
        step_s = parse_duration_s(args.step)
        lost_after_s = parse_duration_s(args.lost_after)
        timeout_s = parse_duration_s(args.timeout)
    except TimeError as exc:
        print(f"forewarn import: {exc}", file=sys.stderr)
        return 2
    from forewarn.errors import ForewarnError
    from predictor.heuristic_labels import HeuristicRules
    from predictor.prometheus_import import import_prometheus

    try:
        result = import_prometheus(
            args.url,
            args.out,
            since_ms=since_ms,
            until_ms=until_ms,
            step_s=step_s,
            selector=args.selector,
            labels_csv=args.labels,
            rules=HeuristicRules(lost_after_s=lost_after_s),
            timeout_s=timeout_s,
        )
    except ForewarnError as exc:
        print(f"forewarn import: {exc.message}", file=sys.stderr)
        return 2
    m = result.manifest
    print(
        f"wrote {result.path}: {result.samples:,} samples of {m['gpus']} GPUs on {m['nodes']} "
        f"nodes, {result.events:,} events, {result.failures} failures "
        f"(labels: {m['labels']['source']}) from {m['source']['requests']} requests"
    )
    return 0
