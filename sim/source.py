"""The simulated source: a whole fleet of simulated GPUs behind the ``Source`` protocol.

It is the collector's ``simulated`` source (the ``collector.base.Source`` protocol). It
answers ``read(now)`` exactly as a hardware source does — one :class:`GpuSample` per GPU
whose sample reached the collector, and every :class:`Event` since the previous call — from
the vectorised model in :mod:`sim`. Operators use it to rehearse policies before
turning on automatic migration; the demo and the end-to-end tests use it as their fleet.

Samples carry the ``now`` they were read at (the wall clock in live mode: the service refuses
timestamps in the future); ``speed`` makes only the failure dynamics (hazard, precursor growth,
repair) run faster. ``inject`` forces a failure on a chosen GPU, ``slow`` makes one a straggler
(slower, never failing), for demos and tests.

``read_batches(now)`` is the same tick in the shape the service decodes fastest: per node,
the ``sample_columns`` of an ingest batch built straight from the model's numpy arrays (one
list per field, no object per sample) and the node's events. It is what ``forewarn simulate``
streams: a fleet of 16,384 GPUs costs a tenth of a core at 1 Hz this way against more than a
core through ``read`` (``benchmarks/simulator.py``). Both give the same samples.

Example::

    src = SimulatedSource(gpus=64, seed=1, speed=60.0)
    src.inject("sim-node-0002", 3, "memory", lead_s=120)
    readings = src.read(datetime.now(UTC))
    for batch in src.read_batches(datetime.now(UTC)):
        pusher.add_columns(batch.node, batch.columns, batch.events)
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from forewarn.errors import InvalidInput, NotFound
from forewarn.wire import Event, GpuSample, to_ms
from sim.config import FAILURE_KINDS, Params, load_params
from sim.fleet import EventRow, FleetModel, Tick
from sim.slowdowns import SLOWDOWN_KINDS

__all__ = ["NodeBatch", "SimulatedSource", "from_collect_args", "tick_columns", "tick_rows"]

# Wire fields that are integers: a column the model holds as floats is sent as integers.
_INT_FIELDS = frozenset(
    name
    for name, prop in GpuSample.model_json_schema()["properties"].items()
    if "integer" in {option.get("type") for option in prop.get("anyOf", [prop])}
)


def tick_rows(model: FleetModel, tick: Tick) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The samples and events of a tick as wire JSON objects (``ts`` as Unix seconds)."""
    idx = np.flatnonzero(tick.present)
    ts = tick.ts_ms / 1000.0
    fleet = model.params["fleet"]
    cols = {k: v[idx].tolist() for k, v in tick.columns.items()}
    names = list(cols)
    samples: list[dict[str, Any]] = []
    for j, g in enumerate(idx.tolist()):
        row: dict[str, Any] = {
            "node": model.node_names[model.node_of[g]],
            "gpu": int(model.gpu_index[g]),
            "ts": ts,
            "uuid": model.uuids[g],
            "vendor": "nvidia",
            "mem_total_mib": float(fleet["mem_total_mib"]),
            "pcie_link_width_max": int(fleet["pcie_link_width_max"]),
        }
        for k in names:
            v = cols[k][j]
            row[k] = None if v != v else v  # NaN: a reading that vanished
        samples.append(row)
    return samples, [_event_json(model, row) for row in tick.events]


@dataclass(frozen=True)
class NodeBatch:
    """One node's readings of one tick, in the columnar shape of an ingest batch."""

    node: str
    columns: dict[str, list[Any]]
    """``IngestBatch.sample_columns``: ``ts_ms``, ``gpu`` and one list per reported field,
    ``None`` for a reading that vanished; empty when no sample of the node arrived."""
    events: list[Event]

    @property
    def rows(self) -> int:
        """Samples + events."""
        return len(self.columns.get("gpu", ())) + len(self.events)


def _as_values(name: str, values: np.ndarray) -> np.ndarray:
    """A column as values of the wire's type (NaN, a vanished reading: None)."""
    if values.dtype.kind == "f":
        nan = np.isnan(values)
        if name in _INT_FIELDS and not nan.any():
            return values.astype(np.int64)
        if nan.any():
            out = values.astype(object)
            out[nan] = None
            return out
    return values


def _event_json(model: FleetModel, row: EventRow) -> dict[str, Any]:
    """A tick's event as a wire JSON object (``ts`` as Unix seconds)."""
    ts_ms, n, gpu, kind, xid, msg, src = row
    ev: dict[str, Any] = {
        "node": model.node_names[n],
        "ts": ts_ms / 1000.0,
        "kind": kind,
        "message": msg,
        "source": src,
    }
    if gpu >= 0:
        ev["gpu"] = gpu
    if xid >= 0:
        ev["xid"] = xid
    return ev


def _event(model: FleetModel, row: EventRow) -> Event:
    return Event.model_validate(_event_json(model, row))


def tick_columns(model: FleetModel, tick: Tick) -> list[NodeBatch]:
    """A tick as one :class:`NodeBatch` per node with a sample or an event, in node order.

    Each field of the whole fleet becomes per-node lists in one numpy call (a reshape to
    nodes x GPUs, then ``tolist``), and a node's columns are those lists zipped with the
    field names, so no object is built per sample. The samples are those of
    :func:`tick_rows`, field for field.
    """
    g, nodes, gpn = model.g, model.nodes, model.gpn
    fleet = model.params["fleet"]
    arrays: dict[str, np.ndarray] = {
        "ts_ms": np.full(g, int(tick.ts_ms), dtype=np.int64),
        "gpu": model.gpu_index,
        "uuid": np.asarray(model.uuids, dtype=object),
        "vendor": np.full(g, "nvidia", dtype=object),
        "mem_total_mib": np.full(g, float(fleet["mem_total_mib"])),
        "pcie_link_width_max": np.full(g, int(fleet["pcie_link_width_max"]), dtype=np.int64),
        **tick.columns,
    }
    names = list(arrays)
    per_node = [_as_values(k, v).reshape(nodes, gpn).tolist() for k, v in arrays.items()]
    present = tick.present.reshape(nodes, gpn)
    count = present.sum(axis=1).tolist()
    by_node: dict[int, dict[str, list[Any]]] = {}
    for node, (c, lists) in enumerate(zip(count, zip(*per_node, strict=True), strict=True)):
        if c == gpn:
            by_node[node] = dict(zip(names, lists, strict=True))
        elif c:  # a GPU down, lost or its sample missed: keep those present
            keep = np.flatnonzero(present[node]).tolist()
            by_node[node] = {k: [v[i] for i in keep] for k, v in zip(names, lists, strict=True)}
    events: dict[int, list[Event]] = {}
    for row in tick.events:
        events.setdefault(row[1], []).append(_event(model, row))
    return [
        NodeBatch(model.node_names[node], by_node.get(node, {}), events.get(node, []))
        for node in sorted(by_node.keys() | events.keys())
    ]


class SimulatedSource:
    """A simulated fleet of ``gpus`` GPUs (8 to a node by default) as one telemetry source.

    Args:
        gpus: fleet size, rounded up to whole nodes.
        seed: the fleet and everything that happens to it follow from it.
        params: a full parameter set or dotted overrides (None: ``defaults.toml``).
        speed: failure dynamics run this many times faster than the wall clock.
    """

    name = "simulated"

    def __init__(
        self,
        gpus: int = 8,
        *,
        seed: int = 0,
        params: Params | Mapping[str, Any] | None = None,
        speed: float = 1.0,
    ) -> None:
        if gpus < 1:
            raise InvalidInput("gpus must be at least 1")
        if not speed > 0:
            raise InvalidInput("speed must be positive")
        full = load_params(overrides=params)
        self.model = FleetModel(gpus, full, seed, speed)
        self._last: datetime | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def node_names(self) -> list[str]:
        return list(self.model.node_names)

    def read(self, now: datetime) -> list[GpuSample | Event]:
        """Samples at ``now`` and the events since the previous call."""
        with self._lock:
            tick = self._step(now)
            samples, events = tick_rows(self.model, tick)
        out: list[GpuSample | Event] = [GpuSample.model_validate(s) for s in samples]
        out.extend(Event.model_validate(e) for e in events)
        return out

    def read_batches(self, now: datetime) -> list[NodeBatch]:
        """The same tick as :meth:`read`, as one columnar :class:`NodeBatch` per node."""
        with self._lock:
            tick = self._step(now)
            return tick_columns(self.model, tick)

    def _step(self, now: datetime) -> Tick:
        if now.tzinfo is None:
            now = now.replace(tzinfo=UTC)
        dt = 0.0 if self._last is None else max(0.0, (now - self._last).total_seconds())
        self._last = now if self._last is None or now > self._last else self._last
        return self.model.step(dt, to_ms(now))

    def inject(
        self, node: str | int, gpu: int, kind: str, lead_s: float | None = None
    ) -> dict[str, Any]:
        """Force ``kind`` on GPU ``gpu`` of ``node`` (name or index); see ``FleetModel.inject``.

        Returns ``{"node", "gpu", "kind", "fails_in_s"}``.

        Raises:
            NotFound: no such node or GPU.
            InvalidInput: an unknown kind or a negative lead.
            Conflict: the GPU is out of service (failed and not yet repaired).
        """
        m = self.model
        n = self._node(node, gpu)
        if kind not in FAILURE_KINDS:
            raise InvalidInput(f"unknown failure kind {kind!r}", details={"kinds": FAILURE_KINDS})
        if lead_s is not None and lead_s < 0:
            raise InvalidInput("lead_s must not be negative")
        with self._lock:
            fails_in = m.inject(n, int(gpu), kind, lead_s)
        return {"node": m.node_names[n], "gpu": int(gpu), "kind": kind, "fails_in_s": fails_in}

    def _node(self, node: str | int, gpu: int) -> int:
        m = self.model
        if isinstance(node, int) or (isinstance(node, str) and node.isdigit()):
            n = int(node)
        elif node in m.node_names:
            n = m.node_names.index(node)
        else:
            raise NotFound(f"no simulated node {node!r}", details={"node": node})
        if not 0 <= n < m.nodes or not 0 <= int(gpu) < m.gpn:
            raise NotFound(f"no GPU {gpu} on node {node!r}", details={"node": node, "gpu": gpu})
        return n

    def slow(
        self,
        node: str | int,
        gpu: int,
        kind: str,
        duration_s: float | None = None,
        factor: float | None = None,
    ) -> dict[str, Any]:
        """Make GPU ``gpu`` of ``node`` a straggler of ``kind`` (``thermal``, ``power_cap``,
        ``power_brake``, ``pcie``) for ``duration_s`` wall seconds, ``factor`` times slower;
        see ``FleetModel.slow``. It is not a failure: no event, nothing in :meth:`failures`.

        Returns the ground-truth record (``ts_ms``, ``end_ts_ms``, ``node``, ``gpu``, ``uuid``,
        ``kind``, ``factor``, ``throttle_reasons``, ``injected``).

        Raises:
            NotFound: no such node or GPU.
            InvalidInput: an unknown kind, a duration not above 0 or a factor under 1.
            Conflict: the GPU is out of service.
        """
        n = self._node(node, gpu)
        if kind not in SLOWDOWN_KINDS:
            raise InvalidInput(f"unknown slowdown kind {kind!r}", details={"kinds": SLOWDOWN_KINDS})
        if duration_s is not None and not duration_s > 0:
            raise InvalidInput("duration_s must be positive")
        if factor is not None and not factor >= 1.0:
            raise InvalidInput("factor must be at least 1 (1: full speed)")
        with self._lock:
            at = None if self._last is not None else to_ms(datetime.now(UTC))  # before a tick
            return dict(self.model.slow(n, int(gpu), kind, duration_s, factor, ts_ms=at))

    def slowdowns(self) -> list[dict[str, Any]]:
        """Ground truth so far: one dict per straggler episode (see :meth:`slow`), the
        running ones with their planned end."""
        with self._lock:
            return [dict(r) for r in self.model.slowdowns.records]

    def slowdown_factor(self, node: str | int, gpu: int) -> float:
        """How much longer GPU ``gpu`` of ``node`` takes for its share of a step now (1.0:
        not slowed): a synchronous job runs at the speed of its slowest GPU."""
        n = self._node(node, gpu)
        with self._lock:
            return float(self.model.slowdowns.factor[n * self.model.gpn + int(gpu)])

    def status(self) -> dict[str, Any]:
        """Fleet counts for the control API: GPUs up, degrading and failures so far."""
        m = self.model
        with self._lock:
            degrading = int((m.up & m.has_prec & (m.tf >= m.onset_f)).sum())
            return {
                "gpus": m.g,
                "nodes": m.nodes,
                "gpus_up": int(m.up.sum()),
                "gpus_degrading": degrading,
                "failures": len(m.failures),
                "gpus_slowed": int(m.slowdowns.active().size),
                "speed": m.speed,
                "lemon_nodes": [m.node_names[n] for n in np.flatnonzero(m.lemon).tolist()],
            }

    def failures(self) -> list[dict[str, Any]]:
        """Ground truth so far: one dict per GPU failure (see ``failures.parquet``)."""
        with self._lock:
            return [dict(f) for f in self.model.failures]

    def close(self) -> None:
        self._closed = True


def from_collect_args(args: argparse.Namespace) -> SimulatedSource:
    """``forewarn collect --source simulated`` (the ``forewarn.sources`` entry point): the
    fleet of ``--sim-gpus`` GPUs, ``--sim-seed`` and ``--sim-speed``."""
    return SimulatedSource(args.sim_gpus, seed=args.sim_seed, speed=args.sim_speed)
