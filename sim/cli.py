"""``forewarn simulate``: a simulated GPU fleet, streamed live or written as a dataset.

::

    forewarn simulate --gpus 64 --service http://127.0.0.1:8765 --speed 60      # live
    forewarn simulate --gpus 1024 --days 1 --seed 7 --out var/ds                # history
    forewarn simulate inject --node sim-node-0002 --gpu 3 --kind memory --lead-s 300
    forewarn simulate --gpus 16 --days 0.1 --out var/s --slow sim-node-0001:3:thermal:600@60
    forewarn simulate slow --node sim-node-0002 --gpu 3 --kind pcie --duration-s 600
    forewarn simulate convert-csv --csv gpu.csv --node host1 --out var/real     # real export
    forewarn simulate --gpus 16 --speed 60 --serve-dcgm-exporter 9400           # for Prometheus

Live mode posts one batch stream per node to ``POST /v1/ingest`` (token from ``--token`` or
``FOREWARN_INGEST_TOKEN``) through the collector's batching pusher, each node's samples in
the ``sample_columns`` shape built straight from the model's arrays, stamps samples with the
wall clock, and serves the control API (``sim/control.py``) on localhost so that
failures can be injected while it runs. ``--serve-dcgm-exporter PORT`` serves the fleet's
current readings as a dcgm-exporter would (``http://HOST:PORT/metrics``, ``sim/exposition.py``)
for a Prometheus to scrape; it needs no service (with ``--service`` it does both).
``--inject NODE:GPU:KIND[:LEAD_S][@AT_S]`` injects from the command line, in both modes
(AT_S: seconds after the start); ``--slow NODE:GPU:KIND[:DURATION_S[:FACTOR]][@AT_S]`` makes a
GPU a straggler the same way (``sim/slowdowns.py``: slower, never failing).

Before streaming, live mode times a few warm-up ticks and says plainly whether this machine
can hold the rate asked (GPUs x 1/interval); while it runs, a tick that comes a whole interval
late is skipped and its samples are counted as missed in the status line, beside what the
pusher has sent, holds, spooled and dropped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from forewarn import __version__
from forewarn.errors import ForewarnError, InvalidInput

__all__ = ["Senders", "TickCost", "configure", "measure_tick", "parse_inject", "parse_slow", "run"]

WARM_UP_TICKS = 3
"""Ticks timed before a live stream starts (not sent)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        default="run",
        choices=["run", "inject", "slow", "convert-csv"],
        help="run (default): live or history; inject: ask a running simulator for a failure; "
        "slow: ask it for a straggler; convert-csv: turn a CSV export into a dataset",
    )
    parser.add_argument("--gpus", type=int, default=64, help="fleet size (8 GPUs a node)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same fleet (default 0)")
    parser.add_argument("--params", help="TOML file of parameter overrides")
    parser.add_argument(
        "--randomised",
        type=int,
        metavar="SEED",
        help="draw every parameter with a range from this seed (sim.randomised)",
    )
    parser.add_argument(
        "--telemetry-collapse",
        action="store_true",
        help="GPUs that fall off the bus (gpu_lost) show telemetry collapse first: growing "
        "gaps, then readings that vanish (sim.config.TELEMETRY_COLLAPSE)",
    )
    parser.add_argument("--interval", type=float, help="sampling period, s (live default 1)")
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="NODE:GPU:KIND[:LEAD_S][@AT_S]",
        help="force a failure (repeatable)",
    )
    parser.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="NODE:GPU:KIND[:DURATION_S[:FACTOR]][@AT_S]",
        help="make a GPU a straggler, never a failure (repeatable): KIND thermal, power_cap, "
        "power_brake or pcie; DURATION_S wall seconds (default: drawn); FACTOR how much longer "
        "its share of a step takes (default: the kind's); AT_S seconds after the start",
    )
    hist = parser.add_argument_group("history")
    hist.add_argument("--days", type=float, help="write DAYS of history to --out")
    hist.add_argument("--out", help="dataset directory")
    live = parser.add_argument_group("live")
    live.add_argument("--service", help="service base URL, e.g. http://127.0.0.1:8765")
    live.add_argument("--token", help="ingest token (default: $FOREWARN_INGEST_TOKEN)")
    live.add_argument("--speed", type=float, default=1.0, help="failure dynamics run X faster")
    live.add_argument("--duration", type=float, help="stop after this many seconds")
    live.add_argument(
        "--batch-max-delay-s",
        type=float,
        default=1.0,
        metavar="S",
        help="longest a sample waits before its node's batch is sent (default %(default)s, "
        "as forewarn collect; never under --interval)",
    )
    live.add_argument(
        "--senders",
        type=int,
        default=8,
        metavar="N",
        help="batching pushers sending side by side, each for a share of the nodes, as a "
        "fleet's collectors do (default %(default)s)",
    )
    live.add_argument(
        "--serve-dcgm-exporter",
        type=int,
        metavar="PORT",
        help="serve the fleet's readings as dcgm-exporter text on http://HOST:PORT/metrics "
        "(0: any free port; no --service needed)",
    )
    live.add_argument(
        "--exporter-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the dcgm-exporter endpoint binds to (default %(default)s)",
    )
    live.add_argument(
        "--control-port", type=int, default=8799, help="control API port on 127.0.0.1 (0: off)"
    )
    inj = parser.add_argument_group("inject")
    inj.add_argument("--control", default="http://127.0.0.1:8799", help="control API URL")
    inj.add_argument("--node", help="node name, e.g. sim-node-0002 (convert-csv: node of --csv)")
    inj.add_argument("--gpu", type=int, help="GPU index on the node")
    inj.add_argument(
        "--kind",
        help="inject: failure kind (memory, thermal, nvlink, pcie, power_loss, gpu_lost, "
        "other); slow: straggler kind (thermal, power_cap, power_brake, pcie)",
    )
    inj.add_argument("--lead-s", type=float, help="seconds of precursors before the failure")
    inj.add_argument(
        "--duration-s", type=float, help="slow: seconds the straggler lasts (default: drawn)"
    )
    inj.add_argument(
        "--factor", type=float, help="slow: how much longer its share of a step takes (>= 1)"
    )
    conv = parser.add_argument_group("convert-csv")
    conv.add_argument("--csv", action="append", default=[], help="samples CSV (repeatable)")
    conv.add_argument("--events-csv", help="events CSV (optional)")
    conv.add_argument("--failures-csv", help="failures CSV (optional)")


def parse_inject(text: str) -> dict[str, Any]:
    """``NODE:GPU:KIND[:LEAD_S][@AT_S]`` -> ``{"node", "gpu", "kind", "lead_s", "at_s"}``."""
    spec, _, at = text.partition("@")
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise InvalidInput(f"--inject {text!r}: expected NODE:GPU:KIND[:LEAD_S][@AT_S]")
    try:
        out: dict[str, Any] = {
            "node": parts[0],
            "gpu": int(parts[1]),
            "kind": parts[2],
            "lead_s": float(parts[3]) if len(parts) == 4 else None,
            "at_s": float(at) if at else 0.0,
        }
    except ValueError as exc:
        raise InvalidInput(f"--inject {text!r}: {exc}") from exc
    return out


def parse_slow(text: str) -> dict[str, Any]:
    """``NODE:GPU:KIND[:DURATION_S[:FACTOR]][@AT_S]`` -> ``{"node", "gpu", "kind",
    "duration_s", "factor", "at_s"}`` (None: the default)."""
    from sim.slowdowns import SLOWDOWN_KINDS

    spec, _, at = text.partition("@")
    parts = spec.split(":")
    if not 3 <= len(parts) <= 5:
        raise InvalidInput(f"--slow {text!r}: expected NODE:GPU:KIND[:DURATION_S[:FACTOR]][@AT_S]")
    if parts[2] not in SLOWDOWN_KINDS:
        raise InvalidInput(f"--slow {text!r}: KIND is one of {', '.join(SLOWDOWN_KINDS)}")
    try:
        out: dict[str, Any] = {
            "node": parts[0],
            "gpu": int(parts[1]),
            "kind": parts[2],
            "duration_s": float(parts[3]) if len(parts) > 3 and parts[3] else None,
            "factor": float(parts[4]) if len(parts) > 4 else None,
            "at_s": float(at) if at else 0.0,
        }
    except ValueError as exc:
        raise InvalidInput(f"--slow {text!r}: {exc}") from exc
    if out["duration_s"] is not None and not out["duration_s"] > 0:
        raise InvalidInput(f"--slow {text!r}: DURATION_S must be positive")
    if out["factor"] is not None and not out["factor"] >= 1.0:
        raise InvalidInput(f"--slow {text!r}: FACTOR must be at least 1")
    return out


def _params(args: argparse.Namespace) -> dict[str, Any]:
    from sim.config import TELEMETRY_COLLAPSE, load_params, randomised

    base = load_params(
        args.params, TELEMETRY_COLLAPSE if getattr(args, "telemetry_collapse", False) else None
    )
    return randomised(args.randomised, base) if args.randomised is not None else base


def run(args: argparse.Namespace) -> int:
    try:
        if args.action in ("inject", "slow"):
            return _inject(args)
        if args.action == "convert-csv":
            return _convert(args)
        if args.service or args.serve_dcgm_exporter is not None:
            return _live(args)
        if args.out and args.days:
            return _history(args)
        print(
            "forewarn simulate: give --service URL or --serve-dcgm-exporter PORT (live) "
            "or --days D --out DIR",
            file=sys.stderr,
        )
        return 2
    except ForewarnError as exc:
        print(f"forewarn simulate: {exc.message}", file=sys.stderr)
        return 1


def _history(args: argparse.Namespace) -> int:
    from sim.dataset import generate_dataset

    params = _params(args)
    injections = [parse_inject(t) for t in args.inject]
    slowdowns = [parse_slow(t) for t in args.slow]
    t0 = time.perf_counter()
    info = generate_dataset(
        args.out,
        gpus=args.gpus,
        days=args.days,
        interval_s=args.interval,
        seed=args.seed,
        params=params,
        injections=injections,
        slowdowns=slowdowns,
    )
    took = time.perf_counter() - t0
    print(
        f"wrote {info.path}: {info.samples:,} samples, {info.events:,} events, "
        f"{info.failures} failures ({info.manifest['counts']['incidents']} incidents), "
        f"{info.manifest['counts'].get('slowdowns', 0)} straggler episodes "
        f"in {took:.1f} s ({info.samples / max(took, 1e-9):,.0f} samples/s)"
    )
    return 0


def _inject(args: argparse.Namespace) -> int:
    import httpx

    what = args.action
    if args.node is None or args.gpu is None or args.kind is None:
        raise InvalidInput(f"{what} needs --node, --gpu and --kind")
    body: dict[str, Any] = {"node": args.node, "gpu": args.gpu, "kind": args.kind}
    optional = ("lead_s",) if what == "inject" else ("duration_s", "factor")
    for name in optional:
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    try:
        resp = httpx.post(f"{args.control.rstrip('/')}/{what}", json=body, timeout=10.0)
    except httpx.HTTPError as exc:
        print(f"forewarn simulate {what}: cannot reach {args.control}: {exc}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(resp.json()))
    except ValueError:  # not the simulator's control API answering
        print(
            f"forewarn simulate {what}: {args.control} answered {resp.status_code}: "
            f"{resp.text[:200]}",
            file=sys.stderr,
        )
        return 1
    return 0 if resp.status_code == 200 else 1


def _convert(args: argparse.Namespace) -> int:
    from sim.csv_import import convert_csv

    if not args.csv or not args.out:
        raise InvalidInput("convert-csv needs --csv FILE and --out DIR")
    info = convert_csv(
        args.csv,
        args.out,
        node=args.node,
        events_csv=args.events_csv,
        failures_csv=args.failures_csv,
    )
    print(f"wrote {args.out}: {info['samples']:,} samples, {info['events']:,} events")
    return 0


@dataclass(frozen=True)
class TickCost:
    """What one live tick costs on this machine: stepping the fleet, its columns, their JSON
    and gzip as the ingest client sends them (the HTTP exchange itself is not counted)."""

    gpus: int
    interval_s: float
    wall_s: float
    """Median seconds of one tick by the wall clock."""
    cpu_s: float
    """Median CPU seconds of this process for one tick."""

    @property
    def holds(self) -> bool:
        """Whether a tick fits in the interval (by the wall clock: what the loop waits on)."""
        return self.wall_s < self.interval_s

    def describe(self) -> str:
        share = self.wall_s / self.interval_s
        head = (
            f"a tick of {self.gpus} GPUs takes {self.wall_s:.3f} s "
            f"({self.cpu_s:.3f} s of CPU), {share:.0%} of the {self.interval_s:g} s interval"
        )
        if self.holds:
            return head
        most = int(self.gpus * self.interval_s / max(self.wall_s, 1e-9))
        return (
            f"{head}: this machine cannot hold {self.gpus} GPUs every {self.interval_s:g} s. "
            f"Ticks will come late and the samples of the skipped ones are missed (counted in "
            f"the status line); about {most} GPUs fit at this interval, or ask for "
            f"--interval {self.wall_s * 1.25:.2g} or more"
        )


def measure_tick(source: Any, interval_s: float, ticks: int = WARM_UP_TICKS) -> TickCost:
    """Time ``ticks`` ticks of ``source`` (a :class:`sim.source.SimulatedSource`) as live mode
    runs them, without sending anything: the median wall and CPU seconds of one tick."""
    walls, cpus = [], []
    for _ in range(ticks):
        w0, c0 = time.perf_counter(), time.process_time()
        for batch in source.read_batches(datetime.now(UTC)):
            body = {"schema_version": 1, "node": batch.node, "sample_columns": batch.columns}
            gzip.compress(json.dumps(body, separators=(",", ":")).encode(), compresslevel=5)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return TickCost(source.model.g, interval_s, sorted(walls)[ticks // 2], sorted(cpus)[ticks // 2])


class Senders:
    """Several batching pushers, each sending the batches of a share of the nodes, so that one
    slow answer holds up only its share (a fleet's collectors send side by side too)."""

    def __init__(self, pushers: list[Any]) -> None:
        self.pushers = pushers
        self._of: dict[str, Any] = {}

    def start(self) -> None:
        for p in self.pushers:
            p.start()

    def add_columns(self, node: str, columns: dict[str, list[Any]], events: list[Any]) -> None:
        pusher = self._of.get(node)
        if pusher is None:
            pusher = self._of[node] = self.pushers[len(self._of) % len(self.pushers)]
        pusher.add_columns(node, columns, events)

    @property
    def stats(self) -> Any:
        """The pushers' ``PushStats`` summed."""
        total = self.pushers[0].stats
        for p in self.pushers[1:]:
            s = p.stats
            for name in ("sent_total", "duplicate_total", "dropped_total", "spooled", "buffered"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return total

    def close(self) -> None:
        for p in self.pushers:
            p.close()


def _live(args: argparse.Namespace) -> int:
    from collector.push import BatchingPusher, IngestClient
    from forewarn.wire import AgentStatus
    from sim.control import ControlServer
    from sim.exposition import DcgmExposition, ExporterServer
    from sim.source import SimulatedSource

    if args.interval is not None and not args.interval > 0:
        raise InvalidInput("--interval must be positive")
    token = args.token or os.environ.get("FOREWARN_INGEST_TOKEN")
    if args.service and not token:
        raise InvalidInput("live mode needs --token or FOREWARN_INGEST_TOKEN")
    interval = float(args.interval or 1.0)
    params = _params(args)
    params["sampling"]["interval_s"] = interval
    source = SimulatedSource(args.gpus, seed=args.seed, params=params, speed=args.speed)
    started = datetime.now(UTC)

    statuses: dict[str, AgentStatus] = {}

    def status(node: str) -> AgentStatus:  # built once a node: the pusher asks every request
        if node not in statuses:
            statuses[node] = AgentStatus(
                agent_id=f"forewarn-sim/{node}",
                source="simulated",
                version=__version__,
                started_at=started,
                interval_s=interval,
            )
        return statuses[node]

    pusher = None
    if args.service:
        pusher = Senders(
            [
                BatchingPusher(
                    IngestClient(args.service, str(token)),
                    max_rows=5000,
                    max_delay_s=max(args.batch_max_delay_s, interval),
                    agent_status=status,
                )
                for _ in range(max(1, min(args.senders, source.model.nodes)))
            ]
        )
    cost = measure_tick(source, interval)
    if pusher is not None:
        pusher.start()
    exposition, exporter = DcgmExposition(), None
    control = None
    try:
        if args.serve_dcgm_exporter is not None:
            first = source.read_batches(datetime.now(UTC))
            exposition.update_batches(first)
            if pusher is not None:
                for batch in first:
                    pusher.add_columns(batch.node, batch.columns, batch.events)
            exporter = ExporterServer(
                exposition, host=args.exporter_host, port=args.serve_dcgm_exporter
            ).start()
        if args.control_port:
            control = ControlServer(source, port=args.control_port).start()
    except OSError as exc:
        if exporter is not None:
            exporter.close()
        if pusher is not None:
            pusher.close()
        raise InvalidInput(f"cannot listen: {exc}") from exc
    pending = sorted(
        [dict(parse_inject(t), what="inject") for t in args.inject]
        + [dict(parse_slow(t), what="slow") for t in args.slow],
        key=lambda j: j["at_s"],
    )
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    where = f", control API {control.url}" if control else ""
    sinks = [args.service] if args.service else []
    if exporter is not None:
        sinks.append(f"dcgm-exporter {exporter.url}")
    print(
        f"simulating {source.model.g} GPUs on {source.model.nodes} nodes -> "
        f"{' and '.join(sinks)} every {interval:g} s, speed {args.speed:g}{where}",
        flush=True,
    )
    out = sys.stdout if cost.holds else sys.stderr
    print(f"forewarn simulate: {cost.describe()}", file=out, flush=True)
    t0 = time.monotonic()
    k, last_report, cpu0 = 0, t0, time.process_time()
    ticks, late, missed = 0, 0, 0

    def report(elapsed: float) -> None:
        nonlocal cpu0
        st = source.status()
        cpu, cpu0 = time.process_time() - cpu0, time.process_time()
        sent = ""
        if pusher is not None:
            s = pusher.stats
            sent = (
                f"sent={s.sent_total} behind={s.buffered + s.spooled} "
                f"(buffered={s.buffered} spooled={s.spooled}) dropped={s.dropped_total} "
            )
        print(
            f"t={elapsed:.0f}s ticks={ticks} late={late} missed={missed} {sent}"
            f"cpu={cpu / max(time.monotonic() - last_report, 1e-9):.2f} core "
            f"up={st['gpus_up']}/{st['gpus']} failures={st['failures']}",
            flush=True,
        )

    try:
        while not stop:
            elapsed = time.monotonic() - t0
            if args.duration is not None and elapsed >= args.duration:
                break
            while pending and pending[0]["at_s"] <= elapsed:
                j = pending.pop(0)
                if j["what"] == "slow":
                    done = source.slow(j["node"], j["gpu"], j["kind"], j["duration_s"], j["factor"])
                else:
                    done = source.inject(j["node"], j["gpu"], j["kind"], j["lead_s"])
                print(json.dumps(done))
            batches = source.read_batches(datetime.now(UTC))
            if pusher is not None:
                for batch in batches:
                    pusher.add_columns(batch.node, batch.columns, batch.events)
            if exporter is not None:
                exposition.update_batches(batches)
            k += 1
            ticks += 1
            behind = int((time.monotonic() - t0) / interval) - k
            if behind > 0:  # whole ticks are due already: skip them and say so
                late += behind
                missed += behind * int(source.model.up.sum())
                k += behind
            if time.monotonic() - last_report >= 60.0:
                report(time.monotonic() - t0)
                last_report = time.monotonic()
            time.sleep(max(0.0, t0 + k * interval - time.monotonic()))
    except KeyboardInterrupt:
        pass
    finally:
        if control is not None:
            control.close()
        if exporter is not None:
            exporter.close()
        if pusher is not None:
            pusher.close()
        source.close()
    if pusher is None:
        print(f"stopped after {ticks} ticks, {late} late ticks skipped ({missed} samples missed)")
        return 0
    s = pusher.stats
    print(
        f"stopped after {ticks} ticks: sent {s.sent_total} rows, dropped {s.dropped_total}, "
        f"spooled {s.spooled}; {late} late ticks skipped ({missed} samples missed)"
    )
    return 0
