"""The dataset format's columns and their types, defined once for every writer and reader,
beside the wire schema they follow (the store's history, the simulator and the predictor all
import it; none of them owns it).

The simulator (``sim.dataset``), the importers (CSV in ``sim.csv_import``, Prometheus in
``predictor.prometheus_import``) and the predictor's reader use these names and types; the
columns follow the wire schema (:class:`forewarn.wire.GpuSample`).

Sample columns are ``ts_ms`` then every field of :class:`forewarn.wire.GpuSample` except
``ts``, in schema order. In pandas (what ``pd.read_parquet`` gives back, thanks to the pandas
metadata stored in each file): strings as ``str``, floats as ``float64``, optional integers
(counters, the throttle bitmask, link width and generation) as nullable ``Int64``, optional
booleans as nullable ``boolean``. Fields the simulated GPU does not report (pre-Ampere
retired pages, AMD deferred errors) are all null, as a real H100 reports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forewarn.wire import SAMPLE_FIELDS

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "EVENT_COLUMNS",
    "EVENT_DTYPES",
    "FAILURE_COLUMNS",
    "FAILURE_DTYPES",
    "NOT_REPORTED",
    "SAMPLE_COLUMNS",
    "STRING_COLUMNS",
    "sample_dtypes",
    "sample_schema",
]

SAMPLE_COLUMNS: tuple[str, ...] = ("ts_ms", *(f for f in SAMPLE_FIELDS if f != "ts"))
EVENT_COLUMNS = ("ts_ms", "node", "gpu", "kind", "xid", "message", "source")
FAILURE_COLUMNS = (
    "ts_ms",
    "node",
    "gpu",
    "kind",
    "has_precursors",
    "recovered_ts_ms",
    "trace_class",
    "scope",
    "incident_id",
    "precursor_onset_ts_ms",
    "injected",
    "in_window",
    "uuid",
)

STRING_COLUMNS = ("node", "uuid", "vendor")
_STR = STRING_COLUMNS
_BOOL = ("retired_pages_pending", "remap_pending", "remap_failure")
_FLOAT = (
    "temp_gpu_c",
    "temp_mem_c",
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "util_gpu_pct",
    "util_mem_pct",
    "mem_used_mib",
    "mem_total_mib",
)
# Not reported by a simulated NVIDIA Ampere+/Hopper GPU: always null.
NOT_REPORTED = ("ecc_deferred", "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending")


EVENT_DTYPES: dict[str, str] = {
    "ts_ms": "int64",
    "node": "str",
    "gpu": "Int64",
    "kind": "str",
    "xid": "Int64",
    "message": "str",
    "source": "str",
}
"""pandas dtype of every event column (``gpu`` null: a whole-node event)."""
FAILURE_DTYPES: dict[str, str] = {
    "ts_ms": "int64",
    "node": "str",
    "gpu": "int64",
    "kind": "str",
    "has_precursors": "bool",
    "recovered_ts_ms": "Int64",
    "trace_class": "str",
    "scope": "str",
    "incident_id": "int64",
    "precursor_onset_ts_ms": "Int64",
    "injected": "bool",
    "in_window": "bool",
    "uuid": "str",
}
"""pandas dtype of every failure (ground-truth) column."""
assert tuple(EVENT_DTYPES) == EVENT_COLUMNS and tuple(FAILURE_DTYPES) == FAILURE_COLUMNS


def sample_dtypes() -> dict[str, str]:
    """pandas dtype of every sample column."""
    out: dict[str, str] = {}
    for c in SAMPLE_COLUMNS:
        if c in ("ts_ms", "gpu"):
            out[c] = "int64"
        elif c in _STR:
            out[c] = "str"
        elif c in _BOOL:
            out[c] = "boolean"
        elif c in _FLOAT:
            out[c] = "float64"
        else:
            out[c] = "Int64"
    return out


_SCHEMA: Any = None


def sample_schema() -> pa.Schema:
    """The Arrow schema of a samples file, with the pandas metadata that restores dtypes."""
    global _SCHEMA
    if _SCHEMA is None:
        import pandas as pd
        import pyarrow as pa

        empty = pd.DataFrame({c: pd.Series([], dtype=t) for c, t in sample_dtypes().items()})
        base = pa.Schema.from_pandas(empty, preserve_index=False)
        fields = [pa.field(f.name, pa.string()) if f.name in _STR else f for f in base]
        _SCHEMA = pa.schema(fields, metadata=base.metadata)
    return _SCHEMA
