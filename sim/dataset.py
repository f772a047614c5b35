"""Write a labelled fleet history in the dataset format (``docs/datasets.md``).

``generate_dataset(out_dir, gpus=, days=, interval_s=, seed=, params=)`` runs the fleet model
tick by tick and writes ``manifest.json``, ``samples/part-*.parquet`` (sorted by ts_ms, node,
gpu; missing samples are absent rows), ``events.parquet`` and ``failures.parquet``. The same
arguments give the same bytes.

Rows are buffered as (ticks x GPUs) column blocks and written as one Parquet row group per
block, so memory stays bounded however long the history is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from forewarn import __version__, datasets
from forewarn.errors import InvalidInput
from sim import blocks
from sim.calibration import per_gpu_hazard_per_h
from sim.config import Params, load_params, validate
from sim.fleet import FleetModel
from sim.shapes import families
from sim.slowdowns import SLOWDOWN_KINDS

__all__ = ["DEFAULT_START_MS", "DatasetInfo", "generate_dataset", "write_parquet_frame"]

DEFAULT_START_MS = 1_735_689_600_000
"""2025-01-01T00:00:00Z: a fixed default start keeps the output reproducible."""

ROWS_PER_GROUP = 1_000_000
ROWS_PER_FILE = 50_000_000


@dataclass(frozen=True)
class DatasetInfo:
    """What ``generate_dataset`` wrote."""

    path: Path
    samples: int
    events: int
    failures: int
    manifest: dict[str, Any]


def write_parquet_frame(df: Any, path: Path) -> None:
    """Write a pandas frame to Parquet the same way every time (byte-reproducible)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(table, path, compression="zstd")


def _prepare(
    gpus: int, days: float, interval_s: float | None, params: Params | Mapping[str, Any] | None
) -> tuple[Params, float, int]:
    if gpus < 1:
        raise InvalidInput("gpus must be at least 1")
    if not days > 0:
        raise InvalidInput("days must be positive")
    # A full set (a manifest's params, randomised()) or dotted overrides: both are merged onto
    # a fresh copy of the defaults, so the caller's dict is never changed and keys that an
    # older manifest lacks take their defaults.
    full = load_params(overrides=params)
    if interval_s is not None:
        full["sampling"]["interval_s"] = float(interval_s)
        validate(full)
    step = float(full["sampling"]["interval_s"])
    ticks = round(days * 86400.0 / step)
    if ticks < 1:
        raise InvalidInput("the history is shorter than one sampling interval")
    return full, step, ticks


def _node_index(model: FleetModel, node: Any) -> int:
    if isinstance(node, int) or (isinstance(node, str) and node.isdigit()):
        n = int(node)
    elif node in model.node_names:
        n = model.node_names.index(node)
    else:
        raise InvalidInput(f"injection on an unknown node {node!r}")
    if not 0 <= n < model.nodes:
        raise InvalidInput(f"injection on node {n}: the fleet has {model.nodes} nodes")
    return n


def generate_dataset(
    out_dir: str | Path,
    *,
    gpus: int = 1024,
    days: float = 1.0,
    interval_s: float | None = None,
    seed: int = 0,
    params: Params | Mapping[str, Any] | None = None,
    start_ms: int = DEFAULT_START_MS,
    injections: Iterable[Mapping[str, Any]] = (),
    slowdowns: Iterable[Mapping[str, Any]] = (),
) -> DatasetInfo:
    """Simulate ``gpus`` GPUs for ``days`` days and write the labelled dataset to ``out_dir``.

    Args:
        out_dir: created if needed; existing dataset files in it are replaced.
        gpus: fleet size, rounded up to whole nodes (``fleet.gpus_per_node``, default 8).
        days: length of the history (may be fractional).
        interval_s: sampling period in seconds; None takes ``sampling.interval_s`` of params.
        seed: the same seed (with the same other arguments) gives the same bytes.
        params: a full parameter set (``load_params()``, ``randomised(seed)``) or overrides
            with dotted keys (``{"kinds.memory.lead_median_s": 3600}``); None: the defaults.
        start_ms: timestamp of the first tick, ms since the epoch (UTC).
        injections: forced failures, each ``{"at_s", "node", "gpu", "kind"}`` and optional
            ``"lead_s"`` (see ``FleetModel.inject``); node: its name or index.
        slowdowns: forced straggler episodes, each ``{"at_s", "node", "gpu", "kind"}`` and
            optional ``"duration_s"`` and ``"factor"`` (see ``FleetModel.slow``); written to
            ``slowdowns.parquet`` with those the rate draws, never to the failures (the file
            is there when the fleet has stragglers: forced ones or a rate above 0).

    Returns:
        counts of what was written and the manifest.

    Raises:
        InvalidInput: bad sizes or parameters.
    """
    import pandas as pd
    import pyarrow.parquet as pq

    full, step, ticks = _prepare(gpus, days, interval_s, params)
    out = Path(out_dir)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    for old in (out / "samples").glob("part-*.parquet"):
        old.unlink()
    model = FleetModel(gpus, full, seed)
    injections, slowdowns = list(injections), list(slowdowns)
    pending = sorted(injections, key=lambda j: float(j["at_s"]))
    slow_pending = sorted(slowdowns, key=lambda j: float(j["at_s"]))
    step_ms = round(step * 1000.0)
    block = max(1, ROWS_PER_GROUP // model.g)
    buf = blocks.BlockBuffer(model, block)
    events: list[tuple[int, int, int, str, int, str, str]] = []
    writer: pq.ParquetWriter | None = None
    part, rows_in_part, samples = 0, 0, 0
    arrow_schema = datasets.sample_schema()

    def flush() -> None:
        nonlocal writer, part, rows_in_part, samples
        table = buf.to_table(arrow_schema)
        buf.clear()
        if table.num_rows == 0:
            return
        if writer is not None and rows_in_part + table.num_rows > ROWS_PER_FILE:
            writer.close()
            writer, part, rows_in_part = None, part + 1, 0
        if writer is None:
            path = out / "samples" / f"part-{part:05d}.parquet"
            writer = pq.ParquetWriter(path, arrow_schema, compression="zstd")
        writer.write_table(table, row_group_size=table.num_rows)
        rows_in_part += table.num_rows
        samples += table.num_rows

    for k in range(ticks):
        while pending and float(pending[0]["at_s"]) <= k * step:
            j = pending.pop(0)
            model.inject(
                _node_index(model, j["node"]), int(j["gpu"]), str(j["kind"]), j.get("lead_s")
            )
        while slow_pending and float(slow_pending[0]["at_s"]) <= k * step:
            j = slow_pending.pop(0)
            if j["kind"] not in SLOWDOWN_KINDS:
                raise InvalidInput(f"unknown slowdown kind {j['kind']!r}")
            model.slow(
                _node_index(model, j["node"]),
                int(j["gpu"]),
                str(j["kind"]),
                j.get("duration_s"),
                j.get("factor"),
                ts_ms=start_ms + max(k - 1, 0) * step_ms,  # the last tick: the model's time
            )
        tick = model.step(step if k else 0.0, start_ms + k * step_ms)
        buf.add(tick)
        events.extend(tick.events)
        if buf.full:
            flush()
    flush()
    if writer is None:  # nothing present at all: still write an empty, typed part
        pq.write_table(arrow_schema.empty_table(), out / "samples" / "part-00000.parquet")
    else:
        writer.close()

    end_ms = start_ms + (ticks - 1) * step_ms
    ev = blocks.events_frame(model, events)
    write_parquet_frame(ev, out / "events.parquet")
    fl = blocks.failures_frame(model, end_ms)
    write_parquet_frame(fl, out / "failures.parquet")
    sl = blocks.slowdowns_frame(model)
    (out / "slowdowns.parquet").unlink(missing_ok=True)
    with_stragglers = bool(len(sl) or slowdowns or full["slowdowns"]["rate_per_gpu_day"] > 0)
    if with_stragglers:  # a fleet without them writes what it wrote before they existed
        write_parquet_frame(sl, out / "slowdowns.parquet")
    in_window = fl[fl["in_window"]]
    manifest = {
        "format": "forewarn-dataset",
        "version": 1,
        "generator": f"forewarn-simulator {__version__}",
        "seed": int(seed),
        "gpus": model.g,
        "nodes": model.nodes,
        "gpus_per_node": model.gpn,
        "start_ms": int(start_ms),
        "end_ms": int(end_ms),
        "interval_s": step,
        "params": full,
        "families": families(full),
        "lemon_nodes": [model.node_names[n] for n in np.flatnonzero(model.lemon).tolist()],
        "per_gpu_hazard_per_h": per_gpu_hazard_per_h(full),
        "counts": {
            "samples": samples,
            "events": len(ev),
            "failures": len(in_window),
            "incidents": int(in_window["incident_id"].nunique()),
            **({"slowdowns": len(sl)} if with_stragglers else {}),
        },
        "injections": [dict(j) for j in sorted(injections, key=lambda j: float(j["at_s"]))],
        "slowdowns": [dict(j) for j in sorted(slowdowns, key=lambda j: float(j["at_s"]))],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    del pd
    return DatasetInfo(out, samples, len(ev), len(in_window), manifest)
