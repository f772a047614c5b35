"""The buffers that turn the simulator's ticks into the dataset's Arrow tables and frames.

Column names and types come from :mod:`forewarn.datasets`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from forewarn.datasets import FAILURE_COLUMNS, FAILURE_DTYPES, NOT_REPORTED

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

    from sim.fleet import EventRow, FleetModel, Tick

__all__ = [
    "SLOWDOWN_COLUMNS",
    "BlockBuffer",
    "events_frame",
    "failures_frame",
    "pending_failures",
    "slowdowns_frame",
]

SLOWDOWN_COLUMNS: dict[str, str] = {
    "ts_ms": "int64",
    "end_ts_ms": "int64",
    "node": "str",
    "gpu": "int64",
    "uuid": "str",
    "kind": "str",
    "factor": "float64",
    "throttle_reasons": "int64",
    "injected": "bool",
}
"""The columns of ``slowdowns.parquet`` and their dtypes: one row per straggler episode
(``sim.slowdowns``), ``end_ts_ms`` its end (planned, for one still running at the end)."""


class BlockBuffer:
    """Up to ``block`` ticks of the whole fleet, as (ticks x GPUs) arrays per column."""

    def __init__(self, model: FleetModel, block: int) -> None:
        self.m, self.block, self.n = model, block, 0
        self.ts = np.zeros(block, dtype=np.int64)
        self.present = np.zeros((block, model.g), dtype=bool)
        self.cols: dict[str, np.ndarray] = {}

    @property
    def full(self) -> bool:
        return self.n >= self.block

    def add(self, tick: Tick) -> None:
        if not self.cols:
            self.cols = {
                k: np.zeros((self.block, self.m.g), dtype=v.dtype) for k, v in tick.columns.items()
            }
        self.ts[self.n] = tick.ts_ms
        self.present[self.n] = tick.present
        for k, v in tick.columns.items():
            self.cols[k][self.n] = v
        self.n += 1

    def clear(self) -> None:
        self.n = 0

    def to_table(self, schema: pa.Schema) -> pa.Table:
        import pyarrow as pa

        m, n = self.m, self.n
        mask = self.present[:n].ravel()
        rows = int(mask.sum())
        gidx = np.tile(np.arange(m.g, dtype=np.int32), n)[mask]
        arrays: list[pa.Array] = []
        for f in schema:
            c = f.name
            if c == "ts_ms":
                arr = pa.array(np.repeat(self.ts[:n], m.g)[mask])
            elif c == "node":
                names = pa.array(m.node_names, pa.string())
                arr = pa.DictionaryArray.from_arrays(
                    pa.array(m.node_of.astype(np.int32)[gidx]), names
                ).cast(pa.string())
            elif c == "gpu":
                arr = pa.array(m.gpu_index[gidx].astype(np.int64))
            elif c == "uuid":
                arr = pa.DictionaryArray.from_arrays(
                    pa.array(gidx), pa.array(m.uuids, pa.string())
                ).cast(pa.string())
            elif c == "vendor":
                arr = pa.DictionaryArray.from_arrays(
                    pa.array(np.zeros(rows, dtype=np.int32)), pa.array(["nvidia"])
                ).cast(pa.string())
            elif c in NOT_REPORTED:
                arr = pa.nulls(rows, f.type)
            elif c == "mem_total_mib":
                arr = pa.array(np.full(rows, float(m.params["fleet"]["mem_total_mib"])))
            elif c == "pcie_link_width_max":
                arr = pa.array(np.full(rows, int(m.params["fleet"]["pcie_link_width_max"])))
            else:
                # from_pandas: a NaN (a reading that vanished) is written as a null
                arr = pa.array(self.cols[c][:n].ravel()[mask], from_pandas=True).cast(f.type)
            arrays.append(arr)
        return pa.Table.from_arrays(arrays, schema=schema)


def events_frame(model: FleetModel, rows: list[EventRow]) -> pd.DataFrame:
    """Event rows of the dataset, sorted by ts_ms, node, gpu (whole-node events first)."""
    import pandas as pd

    if rows:
        ts, node, gpu, kind, xid, msg, src = (list(c) for c in zip(*rows, strict=True))
    else:
        ts, node, gpu, kind, xid, msg, src = [], [], [], [], [], [], []
    gpu_a = np.array(gpu, dtype=np.int64)
    xid_a = np.array(xid, dtype=np.int64)
    df = pd.DataFrame(
        {
            "ts_ms": np.array(ts, dtype=np.int64),
            "node": pd.Series([model.node_names[n] for n in node], dtype="str"),
            "gpu": pd.array(np.where(gpu_a < 0, 0, gpu_a), dtype="Int64"),
            "kind": pd.Series(kind, dtype="str"),
            "xid": pd.array(np.where(xid_a < 0, 0, xid_a), dtype="Int64"),
            "message": pd.Series(msg, dtype="str"),
            "source": pd.Series(src, dtype="str"),
        }
    )
    df.loc[gpu_a < 0, "gpu"] = pd.NA
    df.loc[xid_a < 0, "xid"] = pd.NA
    order = np.lexsort((gpu_a, np.array(node, dtype=np.int64), df["ts_ms"].to_numpy()))
    return df.iloc[order].reset_index(drop=True)


def failures_frame(model: FleetModel, end_ms: int) -> pd.DataFrame:
    """Ground truth: in-window failures, then those already visible but due after the end."""
    import pandas as pd

    rows = [dict(r, in_window=True) for r in model.failures]
    for r in rows:
        if r["recovered_ts_ms"] > end_ms:
            r["recovered_ts_ms"] = None
    rows += [dict(r, in_window=False) for r in pending_failures(model, end_ms)]
    df = pd.DataFrame(rows, columns=list(FAILURE_COLUMNS))
    df = df.astype(FAILURE_DTYPES)
    return df.sort_values(["ts_ms", "node", "gpu"], kind="stable").reset_index(drop=True)


def pending_failures(model: FleetModel, end_ms: int, horizon_s: float = 86400.0) -> list[dict]:
    """Failures planned within ``horizon_s`` after the end, so labels near the end are right."""
    m = model
    out: list[dict] = []
    limit = m.tf + horizon_s * m.speed
    idx = np.flatnonzero(m.up & (m.fail_f <= limit))
    for g in idx.tolist():
        c = m.cal.classes[int(m.cls[g])]
        ts = int(end_ms + (m.fail_f[g] - m.tf) / m.speed * 1000.0)
        onset = None
        if m.has_prec[g]:
            onset = int(end_ms + (m.onset_f[g] - m.tf) / m.speed * 1000.0)
        out.append(_row(m, g, ts, c, -(len(out) + 1), m.has_prec[g], onset))
    for n in np.flatnonzero(m.node_fail_f <= limit).tolist():
        c = m.cal.classes[int(m.node_cls[n])]
        ts = int(end_ms + (m.node_fail_f[n] - m.tf) / m.speed * 1000.0)
        inc = -(len(out) + 1)
        for g in range(n * m.gpn, (n + 1) * m.gpn):
            if m.up[g]:
                out.append(_row(m, g, ts, c, inc, False, None))
    return out


def _row(m: FleetModel, g: int, ts: int, c: Any, inc: int, has: Any, onset: Any) -> dict:
    return {
        "ts_ms": ts,
        "node": m.node_names[m.node_of[g]],
        "gpu": int(m.gpu_index[g]),
        "kind": c.kind,
        "has_precursors": bool(has),
        "recovered_ts_ms": None,
        "trace_class": c.name,
        "scope": c.scope,
        "incident_id": inc,
        "precursor_onset_ts_ms": onset,
        "injected": bool(m.injected[g]),
        "uuid": m.uuids[g],
    }


def slowdowns_frame(model: FleetModel) -> pd.DataFrame:
    """Straggler episodes (none of them a failure), sorted by ts_ms, node, gpu."""
    import pandas as pd

    df = pd.DataFrame(model.slowdowns.records, columns=list(SLOWDOWN_COLUMNS))
    df = df.astype(SLOWDOWN_COLUMNS)
    return df.sort_values(["ts_ms", "node", "gpu"], kind="stable").reset_index(drop=True)
