"""The fast path of ingest: a body decoded straight into store rows, in C (msgspec).

Nearly every batch a collector sends is entirely valid. For those, this module turns the body
into :data:`store.writes.SampleRow` tuples without building a pydantic model per row: msgspec
decodes and range-checks whole lists at once, and rows are assembled with ``zip``. Anything it
does not accept goes back to the reference path (pydantic, row by row, in :mod:`api.ingest`),
which says what is wrong and keeps the rows beside it. So this path may only ever refuse more
than the reference, never accept what the reference refuses (a Hypothesis property in
``tests/api/test_ingest_properties.py`` holds it to that).

Two body shapes are accepted:

- rows: ``{"node", "samples": [{field: value, …}, …], …}`` (:class:`forewarn.wire.IngestBatch`);
- columns: ``{"node", "sample_columns": {"gpu": […], "ts_ms": […], field: […], …}, …}`` — one
  list per field, all the same length, ``ts_ms`` integer milliseconds since the epoch (UTC),
  ``null`` where a GPU does not report a field, the node implied by the batch. About a third
  the size of the rows shape, and cheaper to decode at both ends.

The constraints come from :class:`forewarn.wire.GpuSample`'s JSON schema, so the wire schema
stays the one definition of a valid sample.

A repeated JSON key (which every fast JSON parser resolves silently, last one wins) is caught
by comparing the key count of the raw bytes with that of the decoded objects; a mismatch sends
the body to the reference path, which names the key.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from itertools import repeat
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from forewarn.wire import GpuSample
from store.schema import SAMPLE_COLUMNS
from store.writes import SampleColumns

__all__ = [
    "COLUMN_FIELDS",
    "FastBatch",
    "column_error",
    "decode_fast",
    "key_count",
    "rows_from_columns",
    "strict_type_error",
]

_DEFS = GpuSample.model_json_schema()


def _msgspec_type(prop: dict[str, Any]) -> Any:
    """A msgspec type with the constraints of one JSON-schema property of ``GpuSample``."""
    if "anyOf" in prop:
        options = [o for o in prop["anyOf"] if o.get("type") != "null"]
        return _msgspec_type(options[0]) | None
    if "$ref" in prop:
        enum = _DEFS["$defs"][prop["$ref"].rsplit("/", 1)[-1]]["enum"]
        return Literal[tuple(enum)]
    kind = prop.get("type")
    bounds = {}
    if "minimum" in prop:
        bounds["ge"] = prop["minimum"]
    if "maximum" in prop:
        bounds["le"] = prop["maximum"]
    if kind == "integer":
        return Annotated[int, msgspec.Meta(**bounds)] if bounds else int
    if kind == "number":
        return Annotated[float, msgspec.Meta(**bounds)] if bounds else float
    if kind == "boolean":
        return bool
    if kind == "string" and prop.get("format") == "date-time":
        return Annotated[datetime, msgspec.Meta(tz=True)]
    if kind == "string":
        text = {
            k: prop[v]
            for k, v in (("min_length", "minLength"), ("max_length", "maxLength"))
            if v in prop
        }
        if "pattern" in prop:
            text["pattern"] = prop["pattern"]
        return Annotated[str, msgspec.Meta(**text)] if text else str
    raise TypeError(f"no fast decoder for JSON-schema property {prop}")  # pragma: no cover


_FIELD_TYPES: dict[str, Any] = {
    name: _msgspec_type(prop) for name, prop in _DEFS["properties"].items()
}
_REQUIRED = set(_DEFS.get("required", ()))

# The rows shape: a Struct whose field order is the store's column order (ts in place of
# ts_ms), so ``astuple`` gives a store row but for the timestamp.
_SampleStruct = msgspec.defstruct(
    "_SampleStruct",
    [
        (name, _FIELD_TYPES[name])
        if name in _REQUIRED
        else (name, _FIELD_TYPES[name], _DEFS["properties"][name].get("default"))
        for name in (*SAMPLE_COLUMNS[:2], "ts", *SAMPLE_COLUMNS[3:])
    ],
    forbid_unknown_fields=True,
)
_ROWS = list[_SampleStruct]  # type: ignore[valid-type]

COLUMN_FIELDS: tuple[str, ...] = ("gpu", "ts_ms", *SAMPLE_COLUMNS[3:])
"""The keys a ``sample_columns`` object may hold (``gpu`` and ``ts_ms`` required)."""

_TS_MS = Annotated[int, msgspec.Meta(ge=0, le=253_402_300_799_999)]  # to 9999-12-31
_ITEM_TYPES: dict[str, Any] = {
    name: _TS_MS if name == "ts_ms" else _FIELD_TYPES[name] for name in COLUMN_FIELDS
}
_COLUMN_TYPES: dict[str, Any] = {name: list[t] for name, t in _ITEM_TYPES.items()}  # type: ignore[valid-type]
_DEFAULTS: dict[str, Any] = {
    name: _DEFS["properties"][name].get("default") for name in SAMPLE_COLUMNS[3:]
}


def key_count(raw: bytes) -> int:
    """How many object keys a valid JSON text holds, counted on its bytes.

    Inside a JSON string a quote is always escaped, so ``":`` ends a key unless the quote is
    preceded by a backslash. Space between a key and its colon, or a key that ends in an
    escaped backslash, is under-counted: that only sends a batch to the slower, exact path.
    """
    return raw.count(b'":') - raw.count(b'\\":')


class FastBatch(NamedTuple):
    """A body the fast path accepted: the envelope fields and the sample rows."""

    node: str
    samples: list[tuple[Any, ...]] | SampleColumns
    """Store rows; a ``sample_columns`` body that decodes whole stays in columns."""
    sample_index: list[int]
    """The index in the body of each row of ``samples``."""
    events: list[Any]
    agent: dict[str, Any] | None
    rejected: list[tuple[int, str]]
    """(row index, reason) of sample rows the column checks refused (columns shape only)."""


def _dict_keys(value: Any) -> int:
    return len(value) if isinstance(value, dict) else 0


_UNSET = msgspec.UNSET
_Columns = msgspec.defstruct(
    "_Columns",
    [
        (name, _COLUMN_TYPES[name])
        if name in ("gpu", "ts_ms")
        else (name, _COLUMN_TYPES[name] | msgspec.UnsetType, _UNSET)
        for name in COLUMN_FIELDS
    ],
    forbid_unknown_fields=True,
)


class _ColumnBatch(msgspec.Struct, forbid_unknown_fields=True):
    node: str
    sample_columns: _Columns  # type: ignore[valid-type]
    schema_version: Literal[1] | msgspec.UnsetType = _UNSET
    events: list[dict[str, Any]] | msgspec.UnsetType = _UNSET
    agent: dict[str, Any] | msgspec.UnsetType | None = _UNSET


_COLUMN_BATCH = msgspec.json.Decoder(_ColumnBatch)


def decode_fast(raw: bytes, *, max_rows: int, node_ok: Callable[[str], bool]) -> FastBatch | None:
    """Decode ``raw`` on the fast path, or None: let the reference path decide.

    Args:
        raw: the decompressed body.
        max_rows: the most samples a batch may hold.
        node_ok: whether the batch's node name is acceptable (the envelope check).
    """
    if b'"sample_columns"' in raw:
        try:
            batch = _COLUMN_BATCH.decode(raw)
        except (msgspec.DecodeError, RecursionError):  # too deep: the exact path says so
            return _from_untyped(raw, max_rows=max_rows, node_ok=node_ok)
        return _from_column_batch(raw, batch, max_rows=max_rows, node_ok=node_ok)
    return _from_untyped(raw, max_rows=max_rows, node_ok=node_ok)


def _from_column_batch(
    raw: bytes, batch: Any, *, max_rows: int, node_ok: Callable[[str], bool]
) -> FastBatch | None:
    columns = batch.sample_columns
    values = msgspec.structs.astuple(columns)
    present = [v for v in values if v is not _UNSET]
    events = [] if batch.events is _UNSET else batch.events
    agent = None if batch.agent is _UNSET else batch.agent
    n = len(columns.gpu)
    if not node_ok(batch.node) or n > max_rows or len(events) > max_rows:
        return None
    if any(len(v) != n for v in present):
        return None
    keys = sum(v is not _UNSET for v in msgspec.structs.astuple(batch)) + len(present)
    keys += sum(map(len, events)) + _dict_keys(agent)
    if keys != key_count(raw):
        return None
    unset = [value is _UNSET for value in values]
    ordered = [
        [_DEFAULTS[name]] if missing else value
        for name, value, missing in zip(COLUMN_FIELDS, values, unset, strict=True)
    ]
    samples = SampleColumns(batch.node, ordered, n, unset)
    return FastBatch(batch.node, samples, list(range(n)), events, agent, [])


def _from_untyped(raw: bytes, *, max_rows: int, node_ok: Callable[[str], bool]) -> FastBatch | None:
    try:
        top = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # too deep: the exact path says so
        return None
    if not isinstance(top, dict) or set(top) - {
        "schema_version",
        "node",
        "samples",
        "sample_columns",
        "events",
        "agent",
    }:
        return None
    node = top.get("node")
    rows = top.get("samples", [])
    columns = top.get("sample_columns")
    events = top.get("events", [])
    agent = top.get("agent")
    if (
        top.get("schema_version", 1) != 1
        or type(top.get("schema_version", 1)) is not int
        or not isinstance(node, str)
        or not node_ok(node)
        or not isinstance(rows, list)
        or not isinstance(events, list)
        or len(rows) > max_rows
        or len(events) > max_rows
        or (agent is not None and not isinstance(agent, dict))
        or (columns is not None and (rows or not isinstance(columns, dict)))
    ):
        return None
    # Every key of the body must be one of the decoded objects' keys: no repeats.
    keys = len(top) + sum(map(_dict_keys, rows)) + sum(map(_dict_keys, events))
    keys += _dict_keys(agent) + _dict_keys(columns)
    if keys != key_count(raw):
        return None
    if columns is not None:
        try:
            samples, index, bad = rows_from_columns(node, columns, max_rows)
        except ValueError:
            return None
        return FastBatch(node, samples, index, events, agent, bad)
    try:
        structs = msgspec.convert(rows, _ROWS, strict=True)
    except msgspec.ValidationError:
        return None
    astuple = msgspec.structs.astuple
    samples = []
    for struct in structs:
        row = astuple(struct)
        samples.append((row[0], row[1], int(row[2].timestamp() * 1000), *row[3:]))
    return FastBatch(node, samples, list(range(len(samples))), events, agent, [])


def column_error(name: str, value: Any) -> str | None:
    """Why one value of column ``name`` is refused, or None if it is valid."""
    try:
        msgspec.convert(value, _ITEM_TYPES[name], strict=True)
    except msgspec.ValidationError as exc:
        return f"{name}: {str(exc).split(' - at ')[0]}"
    return None


def rows_from_columns(
    node: str, columns: Any, max_rows: int
) -> tuple[list[tuple[Any, ...]], list[int], list[tuple[int, str]]]:
    """Store rows from a ``sample_columns`` object, checking each value on its own.

    Returns:
        (rows, the body index of each row, (index, reason) of each row refused).

    Raises:
        ValueError: the object itself is wrong (unknown or missing columns, unequal lengths).
    """
    if not isinstance(columns, dict):
        raise ValueError("sample_columns must be an object of column lists")
    unknown = sorted(set(columns) - set(COLUMN_FIELDS))
    if unknown:
        raise ValueError(f"unknown sample column(s): {', '.join(map(str, unknown))}")
    missing = [c for c in ("gpu", "ts_ms") if c not in columns]
    if missing:
        raise ValueError(f"sample_columns lacks {' and '.join(missing)}")
    if not all(isinstance(v, list) for v in columns.values()):
        raise ValueError("every sample column must be a list")
    n = len(columns["gpu"])
    if n > max_rows:
        raise ValueError(f"more than {max_rows} samples in one batch")
    if any(len(v) != n for v in columns.values()):
        raise ValueError("sample columns differ in length")
    checked: dict[str, list[Any]] = {}
    bad: dict[int, str] = {}
    for name, values in columns.items():
        try:
            checked[name] = msgspec.convert(values, _COLUMN_TYPES[name], strict=True)
        except msgspec.ValidationError:
            for i, value in enumerate(values):
                reason = column_error(name, value)
                if reason is not None:
                    bad.setdefault(i, reason)
            checked[name] = values
    ordered = [
        checked[name] if name in checked else repeat(_DEFAULTS[name], n)
        for name in SAMPLE_COLUMNS[3:]
    ]
    samples = list(zip(repeat(node, n), checked["gpu"], checked["ts_ms"], *ordered, strict=False))
    index = list(range(n))
    if bad:
        index = [i for i in index if i not in bad]
        samples = [samples[i] for i in index]
    return samples, index, sorted(bad.items())


def _kinds(schema: dict[str, Any]) -> dict[str, str]:
    kinds = {}
    for name, prop in schema["properties"].items():
        options = prop.get("anyOf", [prop])
        types = {o.get("type") for o in options} - {"null", None}
        if len(types) == 1 and (kind := types.pop()) in ("integer", "number", "boolean"):
            kinds[name] = kind
    return kinds


def _event_schema() -> dict[str, Any]:
    from forewarn.wire import Event

    return Event.model_json_schema()


_STRICT_KINDS = {"sample": _kinds(_DEFS), "event": _kinds(_event_schema())}


def strict_type_error(kind: str, row: Any) -> str | None:
    """Why a decoded row has a value of the wrong JSON type, or None.

    The reference path validates with pydantic, which would read ``true`` or ``"7"`` as a
    counter of 1 or 7; a collector that sends those has a bug worth hearing about.
    """
    if not isinstance(row, dict):
        return None
    kinds = _STRICT_KINDS[kind]
    for name, value in row.items():
        expected = kinds.get(name)
        if value is None or expected is None:
            continue
        if expected == "integer":
            ok = type(value) is int
        elif expected == "number":
            ok = type(value) in (int, float)
            expected = "finite number"
        else:
            ok = type(value) is bool
        if not ok:
            got = {str: "a string", bool: "a boolean"}.get(type(value), type(value).__name__)
            return f"{name}: expected a JSON {expected}, got {got}"
    return None
