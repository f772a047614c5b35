"""Turn a CSV export of real GPU telemetry into a dataset (the format of ``docs/datasets.md``).

The example a user starts from is what every NVIDIA node can produce without an agent::

    nvidia-smi --format=csv -l 10 --query-gpu=timestamp,index,uuid,temperature.gpu,\\
    temperature.memory,power.draw,clocks.sm,clocks.mem,clocks_event_reasons.active,\\
    utilization.gpu,utilization.memory,memory.used,memory.total,\\
    ecc.errors.corrected.volatile.total,ecc.errors.uncorrected.volatile.total,\\
    ecc.errors.corrected.aggregate.total,ecc.errors.uncorrected.aggregate.total,\\
    remapped_rows.correctable,remapped_rows.uncorrectable,remapped_rows.pending,\\
    remapped_rows.failure,pcie.link.gen.current,pcie.link.width.current,pcie.link.width.max \\
    > "$(hostname).csv"

Columns may also carry the dataset's own names (``temp_gpu_c``, ``ecc_sbe_volatile``, ...)
with ``ts`` (ISO 8601 or Unix seconds) or ``ts_ms``. Units after a number ("250.1 W",
"45 %") are dropped, "[N/A]" and empty cells become null, "Yes"/"No" become booleans, hex
bitmasks are read as integers. Times without a zone are taken as UTC (run nvidia-smi with
``TZ=UTC``). Events and failures come from optional CSVs with the columns of
``events.parquet`` and ``failures.parquet`` (``ts`` or ``ts_ms``; missing optional columns
become null or false).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from forewarn import __version__
from forewarn.datasets import EVENT_COLUMNS, FAILURE_COLUMNS, SAMPLE_COLUMNS, sample_dtypes
from forewarn.errors import InvalidInput
from sim.dataset import write_parquet_frame

__all__ = ["NVSMI_COLUMNS", "convert_csv", "read_failures_csv"]

NVSMI_COLUMNS = {
    "timestamp": "ts",
    "index": "gpu",
    "uuid": "uuid",
    "temperature.gpu": "temp_gpu_c",
    "temperature.memory": "temp_mem_c",
    "power.draw": "power_w",
    "clocks.sm": "sm_clock_mhz",
    "clocks.current.sm": "sm_clock_mhz",
    "clocks.mem": "mem_clock_mhz",
    "clocks.current.memory": "mem_clock_mhz",
    "clocks_event_reasons.active": "throttle_reasons",
    "clocks_throttle_reasons.active": "throttle_reasons",
    "utilization.gpu": "util_gpu_pct",
    "utilization.memory": "util_mem_pct",
    "memory.used": "mem_used_mib",
    "memory.total": "mem_total_mib",
    "ecc.errors.corrected.volatile.total": "ecc_sbe_volatile",
    "ecc.errors.uncorrected.volatile.total": "ecc_dbe_volatile",
    "ecc.errors.corrected.aggregate.total": "ecc_sbe_aggregate",
    "ecc.errors.uncorrected.aggregate.total": "ecc_dbe_aggregate",
    "retired_pages.single_bit_ecc.count": "retired_pages_sbe",
    "retired_pages.double_bit.count": "retired_pages_dbe",
    "retired_pages.pending": "retired_pages_pending",
    "remapped_rows.correctable": "remap_correctable",
    "remapped_rows.uncorrectable": "remap_uncorrectable",
    "remapped_rows.pending": "remap_pending",
    "remapped_rows.failure": "remap_failure",
    "pcie.link.gen.current": "pcie_link_gen",
    "pcie.link.width.current": "pcie_link_width",
    "pcie.link.width.max": "pcie_link_width_max",
    "host": "node",
    "hostname": "node",
}
_FAILURE_KINDS = {"memory", "thermal", "nvlink", "pcie", "power_loss", "gpu_lost", "other"}


def _header(name: str) -> str:
    base = name.strip().split(" [")[0].strip()  # "power.draw [W]" -> "power.draw"
    return NVSMI_COLUMNS.get(base, base)


def _ts_ms(df: pd.DataFrame, where: str) -> pd.Series:
    if "ts_ms" in df:
        return pd.to_numeric(df["ts_ms"], errors="raise").astype("int64")
    if "ts" not in df:
        raise InvalidInput(f"{where}: needs a ts, ts_ms or timestamp column")
    raw = df["ts"].astype("str").str.strip()
    numeric = pd.to_numeric(raw, errors="coerce")
    if numeric.notna().all():
        return (numeric * 1000).round().astype("int64")
    parsed = pd.to_datetime(raw.str.replace("/", "-", regex=False), utc=True, format="mixed")
    return (parsed - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(milliseconds=1)


def _value(col: pd.Series, dtype: str) -> pd.Series:
    text = col.astype("str").str.strip()
    text = text.mask(text.isin(["", "[N/A]", "N/A", "[Not Supported]", "nan", "None", "<NA>"]))
    if dtype == "boolean":
        low = text.str.lower()
        out = low.map(
            {"yes": True, "no": False, "true": True, "false": False, "1": True, "0": False}
        )
        return out.astype("boolean")
    if dtype == "str":
        return text.astype("str").where(text.notna(), None)
    number = text.str.extract(r"^\s*(0x[0-9a-fA-F]+|[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)")[0]
    hexa = number.str.startswith("0x", na=False)
    values = pd.to_numeric(number.where(~hexa), errors="coerce")
    if hexa.any():
        values[hexa] = [int(h, 16) for h in number[hexa]]
    if dtype in ("Int64", "int64"):
        return values.round().astype("Int64")
    return values.astype("float64")


def _samples(paths: Iterable[str | Path], node: str | None) -> pd.DataFrame:
    frames = []
    for path in paths:
        raw = pd.read_csv(path, dtype=str, skipinitialspace=True, keep_default_na=False)
        raw.columns = [_header(c) for c in raw.columns]
        if "node" not in raw:
            if node is None:
                raise InvalidInput(f"{path}: no node/host column; give --node")
            raw["node"] = node
        if "gpu" not in raw:
            raise InvalidInput(f"{path}: needs a gpu (or index) column")
        out = pd.DataFrame({"ts_ms": _ts_ms(raw, str(path))})
        for col, dtype in sample_dtypes().items():
            if col == "ts_ms":
                continue
            if col in raw:
                out[col] = _value(raw[col], dtype)
            elif col == "vendor":
                out[col] = "nvidia"
            else:
                out[col] = pd.Series(pd.NA, index=raw.index, dtype="object")
        frames.append(out)
    df = pd.concat(frames, ignore_index=True)
    df["gpu"] = df["gpu"].astype("Int64")
    if df["gpu"].isna().any():
        raise InvalidInput("some rows have no GPU index")
    df = df.astype(sample_dtypes())[list(SAMPLE_COLUMNS)]
    df = df.drop_duplicates(["node", "gpu", "ts_ms"], keep="last")
    return df.sort_values(["ts_ms", "node", "gpu"], kind="stable").reset_index(drop=True)


def _events(path: str | Path | None) -> pd.DataFrame:
    types = {
        "ts_ms": "int64",
        "node": "str",
        "gpu": "Int64",
        "kind": "str",
        "xid": "Int64",
        "message": "str",
        "source": "str",
    }
    if path is None:
        return pd.DataFrame({c: pd.Series([], dtype=t) for c, t in types.items()})
    raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    df = pd.DataFrame({"ts_ms": _ts_ms(raw, str(path))})
    for col in EVENT_COLUMNS[1:]:
        df[col] = _value(raw[col], types[col]) if col in raw else None
    df["source"] = df["source"].fillna("csv")
    return df.astype(types).sort_values(["ts_ms", "node", "gpu"], kind="stable")


def _failures(path: str | Path | None) -> pd.DataFrame:
    types = {
        "ts_ms": "int64",
        "node": "str",
        "gpu": "int64",
        "kind": "str",
        "has_precursors": "bool",
        "recovered_ts_ms": "Int64",
    }
    if path is None:
        raw = pd.DataFrame({"ts_ms": [], "node": [], "gpu": []}, dtype=str)
    else:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    df = pd.DataFrame({"ts_ms": _ts_ms(raw, str(path))})
    df["node"], df["gpu"] = raw["node"], _value(raw["gpu"], "Int64")
    df["kind"] = raw["kind"].str.strip() if "kind" in raw else "other"
    bad = set(df["kind"]) - _FAILURE_KINDS
    if bad:
        raise InvalidInput(f"{path}: unknown failure kinds {sorted(bad)}")
    hp = raw.get("has_precursors")
    df["has_precursors"] = _value(hp, "boolean").fillna(False) if hp is not None else False
    if "recovered_ts_ms" in raw:
        df["recovered_ts_ms"] = _value(raw["recovered_ts_ms"], "Int64")
    elif "recovered_ts" in raw and raw["recovered_ts"].str.strip().ne("").all():
        df["recovered_ts_ms"] = _ts_ms(pd.DataFrame({"ts": raw["recovered_ts"]}), str(path))
    else:
        df["recovered_ts_ms"] = pd.NA
    df = df.astype(types).sort_values(["ts_ms", "node", "gpu"], kind="stable")
    df["trace_class"] = pd.Series([""] * len(df), dtype="str", index=df.index)
    df["scope"] = pd.Series(["gpu"] * len(df), dtype="str", index=df.index)
    df["incident_id"] = np.arange(1, len(df) + 1, dtype=np.int64)
    df["precursor_onset_ts_ms"] = pd.array([pd.NA] * len(df), dtype="Int64")
    df["injected"] = False
    df["in_window"] = True
    df["uuid"] = pd.Series([""] * len(df), dtype="str", index=df.index)
    return df.reset_index(drop=True)[list(FAILURE_COLUMNS)]


def read_failures_csv(path: str | Path) -> pd.DataFrame:
    """A failures CSV (``node,gpu,ts|ts_ms,kind`` and optional ``has_precursors``,
    ``recovered_ts|recovered_ts_ms``) as a ``failures.parquet`` frame; the importers share it.

    Raises:
        InvalidInput: no timestamps, or unknown failure kinds.
    """
    return _failures(path)


def convert_csv(
    samples_csv: Iterable[str | Path],
    out_dir: str | Path,
    *,
    node: str | None = None,
    events_csv: str | Path | None = None,
    failures_csv: str | Path | None = None,
) -> dict[str, Any]:
    """Write a dataset from CSV exports; returns the manifest.

    Args:
        samples_csv: one or more samples CSVs (nvidia-smi query output or dataset columns).
        out_dir: the dataset directory (created).
        node: node name for files without a node/host column (one file per node).
        events_csv, failures_csv: optional events and ground-truth failures.

    Raises:
        InvalidInput: a file without timestamps or GPU index, or unknown failure kinds.
    """
    paths = [samples_csv] if isinstance(samples_csv, str | Path) else list(samples_csv)
    samples = _samples(paths, node)
    if samples.empty:
        raise InvalidInput("no sample rows in the CSV files")
    out = Path(out_dir)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    write_parquet_frame(samples, out / "samples" / "part-00000.parquet")
    events, failures = _events(events_csv), _failures(failures_csv)
    write_parquet_frame(events, out / "events.parquet")
    write_parquet_frame(failures, out / "failures.parquet")
    steps = samples.groupby(["node", "gpu"])["ts_ms"].diff().dropna()
    per_node = samples.groupby("node")["gpu"].nunique()
    manifest: dict[str, Any] = {
        "format": "forewarn-dataset",
        "version": 1,
        "generator": f"forewarn csv-import {__version__}",
        "seed": 0,
        "gpus": int(samples[["node", "gpu"]].drop_duplicates().shape[0]),
        "nodes": int(per_node.size),
        "gpus_per_node": int(per_node.max()),
        "start_ms": int(samples["ts_ms"].min()),
        "end_ms": int(samples["ts_ms"].max()),
        "interval_s": float(np.median(steps) / 1000.0) if len(steps) else 0.0,
        "params": {},
        "sources": [str(p) for p in paths],
        "counts": {"samples": len(samples), "events": len(events), "failures": len(failures)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return {"samples": len(samples), "events": len(events), "manifest": manifest}
