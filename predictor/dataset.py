"""Reading a labelled dataset (``docs/datasets.md``) and replaying it through the live state.

A dataset directory holds ``manifest.json``, ``samples/`` (Parquet parts), ``events.parquet``
and ``failures.parquet``. :func:`replay` walks the samples in steps of ``step_s``, folds each
step into a :class:`predictor.state.GpuWindowState` exactly as the live scorer does with what the
store received since its last tick, and hands the state to a callback after every step. The
features a callback computes at time ``t`` are the ones the service would have computed at
``t`` (the decayed windows do not depend on how the rows were split into steps).

A dataset is read from a local directory or any fsspec URL (``s3://bucket/forewarn/history``,
``file://...``): the service's Parquet history can stay on object storage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from forewarn.errors import InvalidInput
from predictor.state import VALUE_COLUMNS, GpuWindowState, SampleBlock

__all__ = [
    "Dataset",
    "block_from_table",
    "load_dataset",
    "read_failures",
    "read_manifest",
    "replay",
    "split_at",
    "steps",
]


@dataclass
class Dataset:
    """One labelled fleet history."""

    path: Path | str
    """The local directory, or the URL it was read from."""
    manifest: dict[str, Any]
    samples: SampleBlock
    events: pd.DataFrame
    failures: pd.DataFrame
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def start_ms(self) -> int:
        return int(self.manifest.get("start_ms", self.samples.ts_ms.min()))

    @property
    def end_ms(self) -> int:
        return int(self.manifest.get("end_ms", self.samples.ts_ms.max() + 1))


def block_from_table(table: pa.Table) -> SampleBlock:
    """Sample rows of an Arrow table as a :class:`SampleBlock` (null -> NaN), sorted by time."""
    n = table.num_rows
    values = np.full((n, len(VALUE_COLUMNS)), np.nan)
    names = set(table.column_names)
    for j, name in enumerate(VALUE_COLUMNS):
        if name in names:
            col = pc.cast(table.column(name), pa.float64())
            values[:, j] = col.to_numpy(zero_copy_only=False)
    ts = table.column("ts_ms").to_numpy().astype(np.int64)
    node = table.column("node").to_numpy(zero_copy_only=False).astype(object)
    gpu = table.column("gpu").to_numpy().astype(np.int64)
    block = SampleBlock(ts, node, gpu, values)
    if n and not bool((np.diff(ts) >= 0).all()):
        order = np.argsort(ts, kind="stable")
        block = SampleBlock(ts[order], node[order], gpu[order], values[order])
    return block


def _location(path: str | Path) -> tuple[Any, str]:
    """(fsspec filesystem, path on it) of a local path or a URL."""
    fs, root = fsspec.core.url_to_fs(str(path))
    return fs, str(root).rstrip("/")


def _read_samples(fs: Any, path: str) -> SampleBlock:
    """The samples of a dataset, read batch by batch into one preallocated block.

    Only the columns the state uses are read and the node names come from the Parquet
    dictionary (one string object per node, not per row), so a 20M-row fleet-week costs about
    its value matrix (rows x columns x 8 bytes) rather than several times that.
    """
    files = sorted(fs.glob(f"{path}/*.parquet")) if fs.isdir(path) else [path]
    if not files:
        raise InvalidInput(f"no Parquet part in {path}")
    pfs = [pq.ParquetFile(f, filesystem=fs) for f in files]
    n = sum(pf.metadata.num_rows for pf in pfs)
    ts = np.empty(n, dtype=np.int64)
    gpu = np.empty(n, dtype=np.int64)
    node = np.empty(n, dtype=object)
    values = np.full((n, len(VALUE_COLUMNS)), np.nan)
    at = 0
    for pf in pfs:
        names = set(pf.schema_arrow.names)
        cols = ["ts_ms", "node", "gpu", *(c for c in VALUE_COLUMNS if c in names)]
        for batch in pf.iter_batches(batch_size=1 << 20, columns=cols):
            m = batch.num_rows
            ts[at : at + m] = batch.column("ts_ms").to_numpy(zero_copy_only=False)
            gpu[at : at + m] = batch.column("gpu").to_numpy(zero_copy_only=False)
            codes = pc.dictionary_encode(batch.column("node"))
            labels = np.asarray(codes.dictionary.to_pylist(), dtype=object)
            node[at : at + m] = labels[codes.indices.to_numpy(zero_copy_only=False)]
            for j, name in enumerate(VALUE_COLUMNS):
                if name in names:
                    col = pc.cast(batch.column(name), pa.float64())
                    values[at : at + m, j] = col.to_numpy(zero_copy_only=False)
            at += m
    if n and not bool((np.diff(ts) >= 0).all()):
        order = np.argsort(ts, kind="stable")
        ts, node, gpu = ts[order], node[order], gpu[order]
        values = values[order]
    return SampleBlock(ts, node, gpu, values)


def _read(fs: Any, path: str, what: str) -> pd.DataFrame:
    try:
        return pq.read_table(path, filesystem=fs).to_pandas()
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc}") from exc


def read_failures(path: str | Path) -> pd.DataFrame:
    """The failure labels of a dataset (local directory or URL), without its samples."""
    fs, root = _location(path)
    return _read(fs, f"{root}/failures.parquet", "failures")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a dataset (local directory or URL).

    Raises:
        InvalidInput: no manifest, or a manifest of another format.
    """
    fs, root = _location(path)
    try:
        with fs.open(f"{root}/manifest.json", "r", encoding="utf-8") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{path} is not a dataset (manifest.json: {exc})") from exc
    if manifest.get("format") != "forewarn-dataset":
        raise InvalidInput(f"{path}/manifest.json: format is not forewarn-dataset")
    return dict(manifest)


def load_dataset(path: str | Path) -> Dataset:
    """Read a dataset: a local directory or an fsspec URL.

    Raises:
        InvalidInput: no manifest, a manifest of another format, or unreadable Parquet.
    """
    manifest = read_manifest(path)
    fs, root = _location(path)
    try:
        samples = _read_samples(fs, f"{root}/samples")
    except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
        raise InvalidInput(f"cannot read samples in {path}: {exc}") from exc
    events = _read(fs, f"{root}/events.parquet", "events")
    failures = _read(fs, f"{root}/failures.parquet", "failures")
    if len(events):
        events = events.sort_values("ts_ms", kind="stable").reset_index(drop=True)
    return Dataset(
        Path(path) if "://" not in str(path) else path, manifest, samples, events, failures
    )


Sink = Callable[[int, GpuWindowState], None]


def replay(
    dataset: Dataset,
    sink: Sink,
    *,
    step_s: float = 60.0,
    state: GpuWindowState | None = None,
    progress: Callable[[int], None] | None = None,
) -> GpuWindowState:
    """Feed the dataset to a state in steps of ``step_s``; call ``sink(now_ms, state)`` after
    each step. ``progress(n)`` is told how many steps were done (for a progress bar).

    Steps end at ``start + k * step_s`` (the last one at the dataset's end); a step takes the
    rows with ``previous end < ts_ms <= end``.
    """
    state = state or GpuWindowState(capacity=max(int(dataset.manifest.get("gpus", 1024)), 16))
    step_ms = int(step_s * 1000)
    if step_ms <= 0:
        raise InvalidInput("step_s must be positive")
    s_ts = dataset.samples.ts_ms
    e_ts = dataset.events["ts_ms"].to_numpy(dtype=np.int64) if len(dataset.events) else None
    start, end = dataset.start_ms, dataset.end_ms
    edges = np.arange(start + step_ms, end + step_ms, step_ms)
    edges[-1] = min(edges[-1], max(end, start + 1))
    prev_s = prev_e = 0
    for k, now in enumerate(edges):
        hi_s = int(np.searchsorted(s_ts, now, side="right"))
        chunk = dataset.samples[prev_s:hi_s] if hi_s > prev_s else None
        ev = None
        if e_ts is not None:
            hi_e = int(np.searchsorted(e_ts, now, side="right"))
            ev = dataset.events.iloc[prev_e:hi_e] if hi_e > prev_e else None
            prev_e = hi_e
        state.update(chunk, ev, now_ms=int(now))
        prev_s = hi_s
        sink(int(now), state)
        if progress is not None:
            progress(k + 1)
    return state


def split_at(dataset: Dataset, cut_ms: int) -> tuple[Dataset, Dataset]:
    """The dataset before ``cut_ms`` (samples and events with ``ts_ms <= cut_ms``) and after
    it, in memory. Both keep every failure (so that labels near the cut see the failure just
    past it), but each counts only its own (``in_window``): a failure of the other part only
    makes an alarm before it true."""
    cut = int(cut_ms)
    if not dataset.start_ms < cut < dataset.end_ms:
        raise InvalidInput("the cut must fall inside the dataset's time range")
    s = int(np.searchsorted(dataset.samples.ts_ms, cut, side="right"))
    ev_ts = dataset.events["ts_ms"].to_numpy(dtype=np.int64)
    e = int(np.searchsorted(ev_ts, cut, side="right"))
    f = dataset.failures
    own = f["in_window"].astype(bool) if "in_window" in f else pd.Series(True, index=f.index)
    early = (f["ts_ms"] <= cut).to_numpy()
    parts = []
    for lo, hi, ev, mine, span in (
        (0, s, dataset.events.iloc[:e], early, (dataset.start_ms, cut)),
        (s, len(dataset.samples), dataset.events.iloc[e:], ~early, (cut, dataset.end_ms)),
    ):
        manifest = {**dataset.manifest, "start_ms": span[0], "end_ms": span[1]}
        failures = f.assign(in_window=own.to_numpy() & mine)
        parts.append(
            Dataset(
                dataset.path,
                manifest,
                dataset.samples[lo:hi],
                ev.reset_index(drop=True),
                failures,
            )
        )
    return parts[0], parts[1]


def steps(dataset: Dataset, step_s: float) -> int:
    """How many steps :func:`replay` makes (for a progress bar's total)."""
    span = dataset.end_ms - dataset.start_ms
    return max(int(np.ceil(span / (step_s * 1000))), 1)
