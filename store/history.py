"""The Parquet history: closed raw partitions kept as a dataset that training reads directly.

When an hour of raw samples leaves the raw tier, the tiering task writes it as one Parquet part
(zstd) under the history URL (default ``<data dir>/history``; any fsspec URL, e.g.
``s3://bucket/forewarn``), and refreshes ``events.parquet``, ``failures.parquet`` and
``manifest.json`` beside the parts from the store's events. The directory is a dataset in the
format of ``docs/datasets.md``::

    HISTORY/manifest.json
    HISTORY/samples/part-20261203t06.parquet   (one part an hour, sorted by ts_ms, node, gpu)
    HISTORY/events.parquet
    HISTORY/failures.parquet                    (labels derived from the events)

so ``forewarn train --data HISTORY`` trains on the fleet's own data with no export step, and
:func:`read_history` yields its sample frames for any other reader.

Failure labels come from the operator's failure records (``store.failures``: ground truth,
``trace_class`` "operator"; each replaces an event-derived failure of its GPU within ten
minutes) and from the events that end a job: the fatal Xids (48, 63, 64, 74, 79, 94,
95, 119, 120), ``gpu_lost``, ``thermal_shutdown``, ``link_down`` and ``power_loss`` (a node's
event labels each of its GPUs). Events of one GPU within ten minutes of a failure belong to it;
the next ``gpu_recovered`` event marks it back in service. Whether the failure had precursors
is the caller's judgement (the tiering task reads it from the rollups).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from forewarn.datasets import EVENT_DTYPES, FAILURE_DTYPES, sample_dtypes, sample_schema

__all__ = [
    "FATAL_XIDS",
    "History",
    "failures_from_events",
    "read_history",
]

FATAL_XIDS: dict[int, str] = {
    48: "memory",
    64: "memory",
    94: "memory",
    95: "memory",
    74: "nvlink",
    79: "pcie",
    119: "other",
    120: "other",
}
"""Xids that end a job, with the failure kind they label. Not Xid 63 (a row remap recorded:
the GPU works on until its next reset; a precursor of a memory failure, not the failure)."""
_FATAL_EVENTS = {
    "gpu_lost": "gpu_lost",
    "thermal_shutdown": "thermal",
    "link_down": "nvlink",
    "power_loss": "power_loss",
}
_SAME_FAILURE_MS = 10 * 60_000

Precursors = Callable[[str, int, int], bool]
"""Whether GPU (node, gpu) showed warning signs before a failure at ts_ms."""


def _part_name(start_ms: int) -> str:
    return f"part-{datetime.fromtimestamp(start_ms / 1000, UTC):%Y%m%dt%H}.parquet"


def _part_start(name: str) -> int | None:
    try:
        at = datetime.strptime(name.removeprefix("part-")[:11], "%Y%m%dt%H")
    except ValueError:
        return None
    return int(at.replace(tzinfo=UTC).timestamp() * 1000)


class History:
    """A Parquet history at ``url`` (a local path or any fsspec URL)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def parts(self) -> list[tuple[int, str]]:
        """(start_ms, path) of every samples part, oldest first."""
        directory = self._path("samples")
        if not self.fs.exists(directory):
            return []
        out = []
        for path in self.fs.ls(directory, detail=False):
            start = _part_start(str(path).rsplit("/", 1)[-1])
            if start is not None:
                out.append((start, str(path)))
        return sorted(out)

    def write_part(self, start_ms: int, frames: Iterator[pd.DataFrame]) -> int:
        """Write one closed partition's samples (frames in time order) as a part.

        Returns:
            Rows written; an hour with no sample writes no file.
        """
        self.fs.makedirs(self._path("samples"), exist_ok=True)
        final = self._path("samples", _part_name(start_ms))
        temp = final + ".tmp"
        schema = sample_schema()
        dtypes = sample_dtypes()
        rows = 0
        writer: pq.ParquetWriter | None = None
        pending: list[pa.Table] = []
        pending_rows = 0

        def flush() -> None:
            nonlocal writer, pending, pending_rows
            if not pending:
                return
            if writer is None:
                writer = pq.ParquetWriter(
                    temp, schema, filesystem=self.fs, compression="zstd", compression_level=6
                )
            table = pa.concat_tables(pending)
            writer.write_table(table, row_group_size=table.num_rows)
            pending, pending_rows = [], 0

        for frame in frames:
            if not len(frame):
                continue
            shaped = frame[list(dtypes)].astype(dtypes)
            pending.append(pa.Table.from_pandas(shaped, schema=schema, preserve_index=False))
            pending_rows += len(frame)
            rows += len(frame)
            if pending_rows >= 1 << 20:
                flush()
        flush()
        if writer is not None:
            writer.close()
            self.fs.mv(temp, final)
        return rows

    def expire(self, before_ms: int) -> int:
        """Remove the parts of hours that ended at or before ``before_ms``; returns how many."""
        removed = 0
        for start, path in self.parts():
            if start + 3_600_000 <= before_ms:
                self.fs.rm(path)
                removed += 1
        return removed

    def write_labels(
        self,
        events: pd.DataFrame,
        gpus: pd.DataFrame,
        precursors: Precursors | None = None,
        *,
        records: pd.DataFrame | None = None,
    ) -> dict[str, Any]:
        """Refresh ``events.parquet``, ``failures.parquet`` and ``manifest.json``.

        Args:
            events: the store's events over the history's span (dataset event columns).
            gpus: the fleet's GPUs (``node``, ``gpu``, ``uuid``).
            precursors: tells whether a failure's GPU showed warning signs before it.
            records: the operator's failure records (``ts_ms``, ``node``, ``gpu``, ``kind``;
                ``gpu`` null: the whole node), which override the events.
        """
        parts = self.parts()
        start_ms = parts[0][0] if parts else 0
        end_ms = parts[-1][0] + 3_600_000 if parts else 0
        events = events[(events["ts_ms"] >= start_ms) & (events["ts_ms"] < end_ms)]
        events = events.astype(EVENT_DTYPES)
        failures = failures_from_events(
            events, gpus, end_ms=end_ms, precursors=precursors, records=records
        )
        with self.fs.open(self._path("events.parquet"), "wb") as f:
            events.to_parquet(f, index=False, compression="zstd")
        with self.fs.open(self._path("failures.parquet"), "wb") as f:
            failures.to_parquet(f, index=False, compression="zstd")
        rows = sum(pq.ParquetFile(p, filesystem=self.fs).metadata.num_rows for _, p in parts)
        nodes = gpus["node"].nunique() if len(gpus) else 0
        manifest = {
            "format": "forewarn-dataset",
            "version": 1,
            "generator": "forewarn-store 0.1.0",
            "seed": 0,
            "gpus": len(gpus),
            "nodes": int(nodes),
            "gpus_per_node": int(gpus.groupby("node").size().max()) if len(gpus) else 0,
            "start_ms": start_ms,
            "end_ms": end_ms,
            "interval_s": None,
            "params": {},
            "counts": {
                "samples": rows,
                "events": len(events),
                "failures": len(failures),
                "incidents": int(failures["incident_id"].nunique()) if len(failures) else 0,
            },
            "injections": [],
        }
        with self.fs.open(self._path("manifest.json"), "w") as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        return manifest


def failures_from_events(
    events: pd.DataFrame,
    gpus: pd.DataFrame,
    *,
    end_ms: int | None = None,
    precursors: Precursors | None = None,
    records: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Failure labels (``failures.parquet`` columns) from job-ending events and the
    operator's records.

    Args:
        events: event rows (``ts_ms``, ``node``, ``gpu``, ``kind``, ``xid``).
        gpus: ``node``, ``gpu``, ``uuid`` of the fleet (expands node-wide events).
        end_ms: the end of the history (recoveries after it are unknown).
        precursors: ``(node, gpu, ts_ms) -> bool``, whether the GPU's telemetry warned before
            the failure (``has_precursors``); default: never.
        records: operator failure records (``ts_ms``, ``node``, ``gpu``, ``kind``), kept as
            they are (``trace_class`` "operator"); an event-derived failure of the same GPU
            within ten minutes of one is dropped.
    """
    columns = list(FAILURE_DTYPES)
    evs: list[dict[str, Any]] = events.to_dict("records")  # type: ignore[assignment]
    uuid = {(n, int(g)): u for n, g, u in zip(gpus["node"], gpus["gpu"], gpus["uuid"], strict=True)}
    rows: list[dict[str, Any]] = []
    for event in sorted(evs, key=lambda e: int(e["ts_ms"])):
        kind, xid, gpu = event["kind"], event["xid"], event["gpu"]
        if kind == "xid" and not pd.isna(xid):
            failure = FATAL_XIDS.get(int(xid))
        else:
            failure = _FATAL_EVENTS.get(str(kind))
        if failure is None:
            continue
        if pd.isna(gpu):
            targets = [g for n, g in sorted(uuid) if n == event["node"]]
            scope = "node"
        else:
            targets, scope = [int(gpu)], "gpu"
        for g in targets:
            rows.append(
                {
                    "ts_ms": int(event["ts_ms"]),
                    "node": event["node"],
                    "gpu": g,
                    "kind": failure,
                    "scope": scope,
                    "trace_class": "",
                }
            )
    said: list[dict[str, Any]] = []
    for rec in [] if records is None else records.to_dict("records"):
        node_wide = pd.isna(rec["gpu"])
        targets = [g for n, g in sorted(uuid) if n == rec["node"]] if node_wide else [rec["gpu"]]
        for g in targets:
            said.append(
                {
                    "ts_ms": int(rec["ts_ms"]),
                    "node": str(rec["node"]),
                    "gpu": int(g),
                    "kind": str(rec["kind"]),
                    "scope": "node" if node_wide else "gpu",
                    "trace_class": "operator",
                }
            )
    rows = [r for r in rows if not _told(said, r)] + said
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in FAILURE_DTYPES.items()})
    table = pd.DataFrame(rows).sort_values(["node", "gpu", "ts_ms"], kind="stable")
    # Events of one GPU close after a failure are that failure (a lost GPU also logs Xid 79).
    gap = table.groupby(["node", "gpu"])["ts_ms"].diff()
    table = table[~(gap <= _SAME_FAILURE_MS)].copy()
    recovered = events[events["kind"] == "gpu_recovered"]
    table["recovered_ts_ms"] = [
        _next(recovered, n, g, ts, end_ms)
        for n, g, ts in zip(table["node"], table["gpu"], table["ts_ms"], strict=True)
    ]
    table["has_precursors"] = [
        bool(precursors(n, int(g), int(ts))) if precursors is not None else False
        for n, g, ts in zip(table["node"], table["gpu"], table["ts_ms"], strict=True)
    ]
    table["incident_id"] = table.groupby(["node", "ts_ms"]).ngroup().astype(np.int64)
    table["precursor_onset_ts_ms"] = pd.NA
    table["injected"] = False
    table["in_window"] = True
    table["uuid"] = [
        uuid.get((n, int(g)), "") or "" for n, g in zip(table["node"], table["gpu"], strict=True)
    ]
    table = table.sort_values(["ts_ms", "node", "gpu"], kind="stable", ignore_index=True)
    return table[columns].astype(FAILURE_DTYPES)


def _told(said: list[dict[str, Any]], row: dict[str, Any]) -> bool:
    """Whether an operator's record covers this event-derived failure (same GPU, near)."""
    return any(
        s["node"] == row["node"]
        and s["gpu"] == row["gpu"]
        and abs(s["ts_ms"] - row["ts_ms"]) <= _SAME_FAILURE_MS
        for s in said
    )


def _next(recovered: pd.DataFrame, node: str, gpu: int, ts: int, end_ms: int | None) -> Any:
    mine = recovered[
        (recovered["node"] == node) & (recovered["gpu"] == gpu) & (recovered["ts_ms"] > ts)
    ]
    if not len(mine):
        return pd.NA
    first = int(mine["ts_ms"].min())
    return first if end_ms is None or first < end_ms else pd.NA


def read_history(
    url: str,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    columns: Sequence[str] | None = None,
) -> Iterator[pd.DataFrame]:
    """Sample frames of a Parquet history (dataset columns and dtypes), one a part, in time
    order, restricted to ``since_ms <= ts_ms < until_ms``."""
    history = History(url)
    for start, path in history.parts():
        if until_ms is not None and start >= until_ms:
            break
        if since_ms is not None and start + 3_600_000 <= since_ms:
            continue
        filters = []
        if since_ms is not None:
            filters.append(("ts_ms", ">=", since_ms))
        if until_ms is not None:
            filters.append(("ts_ms", "<", until_ms))
        table = pq.read_table(
            path,
            filesystem=history.fs,
            columns=list(columns) if columns else None,
            filters=filters or None,
        )
        yield table.to_pandas()
