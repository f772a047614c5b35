"""Packed raw samples: the raw tier's closed hours, one blob per GPU and minute.

A wide row costs 188 bytes a sample on SQLite and about 450 on PostgreSQL (row header, the
node, UUID and vendor strings again in every row, 8-byte numbers, two indexes); a GPU's
telemetry within a minute is mostly constant or slowly moving. So once the tiering task has
rolled an hour up (``store.tiering``), it packs the hour's samples, losslessly, into
``sample_blocks``: one row per (node, gpu, minute) holding that minute's samples column by
column, and drops the hour's wide rows in the same transaction. Readers of raw windows read
both tables (:func:`merge`), so a window reads the same before and after its hours are packed;
the hot hours (what ingest writes, the control loop reads by arrival and the dashboard shows)
stay wide. It is what TimescaleDB's compressed chunks do (segment by device, order by time).

A blob (format version 1)::

    header   magic "FWB", version, rows, integer columns, float columns, strings' length
    body     zstd of
             integers  rows x (ts_ms, counters, flags as 0/1), each column the difference to
                       the row before (the first row as it is), byte-shuffled
             nulls     one bit per (row, integer column but ts_ms), column-major
             floats    rows x gauges, each float64's bits XORed with the row before's,
                       byte-shuffled (NULL is NaN, as reads return it)
             strings   JSON: per string column (uuid, vendor) the distinct values and, when
                       there is more than one, each row's index into them

The columns of a version are written down here (:data:`LAYOUTS`) and never change: a sample
schema with another column set is a new version, and blobs of every version stay readable
(a column a version lacks reads as NULL). ``tests/store/test_blocks.py`` fails when the
schema moves without a new version.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from sqlalchemy import (
    Connection,
    text,
)

from store.schema import (
    BOOL_COLUMNS,
    FLOAT_COLUMNS,
    FRAME_COLUMNS,
    INT_COLUMNS,
    chunk_table,
)

__all__ = [
    "BLOCK_MS",
    "LAYOUTS",
    "block_rows",
    "last_samples",
    "merge",
    "read",
    "sample_blocks",
    "unpack",
    "with_packed",
]

BLOCK_MS = 60_000
"""Each blob holds one GPU's samples of one UTC minute."""

sample_blocks = chunk_table("sample_blocks", "n", end_ms=False, start_index=True)
"""Packed raw samples, one row per GPU and minute (on PostgreSQL partitioned by hour)."""

_STRINGS = ("uuid", "vendor")

LAYOUTS: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    1: (
        (
            "ts_ms",
            "throttle_reasons",
            "ecc_sbe_volatile",
            "ecc_dbe_volatile",
            "ecc_sbe_aggregate",
            "ecc_dbe_aggregate",
            "ecc_deferred",
            "retired_pages_sbe",
            "retired_pages_dbe",
            "remap_correctable",
            "remap_uncorrectable",
            "nvlink_crc_flit",
            "nvlink_crc_data",
            "nvlink_replay",
            "nvlink_recovery",
            "pcie_replay",
            "pcie_link_width",
            "pcie_link_width_max",
            "pcie_link_gen",
            "retired_pages_pending",
            "remap_pending",
            "remap_failure",
        ),
        (
            "temp_gpu_c",
            "temp_mem_c",
            "power_w",
            "sm_clock_mhz",
            "mem_clock_mhz",
            "util_gpu_pct",
            "util_mem_pct",
            "mem_used_mib",
            "mem_total_mib",
        ),
    ),
}
"""Per format version: its integer columns (``ts_ms`` first, flags last) and float columns."""

VERSION = max(LAYOUTS)
_INTS, _FLOATS = LAYOUTS[VERSION]
_MAGIC = b"FWB"
_HEADER = struct.Struct("<3sBIHHI")  # magic, version, rows, integer and float columns, strings
_CODEC = pa.Codec("zstd", compression_level=3)


def _shuffle(matrix: np.ndarray) -> bytes:
    """A rows x columns matrix of 8-byte values, column by column, byte plane by plane."""
    rows, cols = matrix.shape
    planes = np.ascontiguousarray(matrix.T).view(np.uint8).reshape(cols, rows, 8)
    return planes.transpose(0, 2, 1).tobytes()


def _unshuffle(
    body: bytes | memoryview, offset: int, rows: int, cols: int, dtype: str
) -> np.ndarray:
    planes = np.frombuffer(body, dtype=np.uint8, count=rows * cols * 8, offset=offset)
    columns = np.ascontiguousarray(planes.reshape(cols, 8, rows).transpose(0, 2, 1))
    return columns.view(dtype).reshape(cols, rows).T


def _blob(
    steps: np.ndarray,
    nulls: np.ndarray,
    scales: np.ndarray,
    lanes: np.ndarray,
    described: list[Any],
) -> bytes:
    text_part = json.dumps(described, separators=(",", ":")).encode()
    body = (
        _shuffle(steps)
        + np.packbits(np.ascontiguousarray(nulls.T)).tobytes()
        + _shuffle(lanes)
        + text_part
    )
    head = _HEADER.pack(_MAGIC, VERSION, len(steps), steps.shape[1], lanes.shape[1], len(text_part))
    return head + scales.tobytes() + _CODEC.compress(body, asbytes=True)


def _described(values: np.ndarray) -> list[Any]:
    """A string column of one block: its distinct values, and each row's index into them
    when there is more than one."""
    codes, distinct = pd.factorize(values, use_na_sentinel=False)
    named = [None if pd.isna(v) else str(v) for v in distinct]
    return [named] if len(named) == 1 else [named, codes.tolist()]


_XOR = 255
"""A float column's scale byte when its values are kept as XORed bits."""
_DECIMALS = (1.0, 10.0, 100.0, 1000.0)


def _lanes(
    ints: np.ndarray, floats: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 8-byte lanes of blocks lying one after another in ``ints`` and ``floats`` (each
    block from its row in ``starts`` to the next one's), all blocks at once.

    Integers become each the difference to the row before (int64 arithmetic wraps, and so
    does the sum that undoes it). A float column of a block whose values are all decimals of
    at most three places (telemetry mostly is: whole degrees and MHz, watts to the hundredth)
    becomes the integers ``value * 10**k``, differenced the same way, when dividing them back
    gives the very same bits; any other (NULLs, -0.0, infinities, noise) its bits XORed with
    the row before's. A block's first row is kept as it is.

    Returns:
        (integer lanes, scale bytes: blocks x float columns, float lanes)
    """
    rows = len(ints)
    sizes = np.diff(np.r_[starts, rows])
    steps = ints.copy()
    steps[1:] -= ints[:-1]
    steps[starts] = ints[starts]
    bits = floats.view(np.int64)
    lanes = bits.copy()
    lanes[1:] ^= bits[:-1]
    lanes[starts] = bits[starts]
    scales = np.full((len(starts), floats.shape[1]), _XOR, dtype=np.uint8)
    if not rows:
        return steps, scales, lanes
    with np.errstate(invalid="ignore", over="ignore"):
        usable = np.isfinite(floats) & (np.abs(floats) < 2**40)
        for k, scale in enumerate(_DECIMALS):
            whole = np.round(floats * scale).astype(np.int64)
            exact = usable & ((whole / scale).view(np.int64) == bits)
            chosen = np.logical_and.reduceat(exact, starts, axis=0) & (scales == _XOR)
            if not chosen.any():
                continue
            scales[chosen] = k
            steps_k = whole.copy()
            steps_k[1:] -= whole[:-1]
            steps_k[starts] = whole[starts]
            where = np.repeat(chosen, sizes, axis=0)
            lanes[where] = steps_k[where]
    return steps, scales, lanes


def _raw(blob: bytes) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """(format version, integers, nulls, floats, strings) of a blob, as :func:`block_rows`
    took them (nulls column-major: integer columns but ts_ms x rows)."""
    magic, version, rows, n_int, n_float, n_text = _HEADER.unpack_from(blob)
    scales = np.frombuffer(blob, np.uint8, n_float, _HEADER.size)
    if magic != _MAGIC or version not in LAYOUTS:
        raise ValueError("not a packed-samples blob of a known version")
    null_bytes = (rows * (n_int - 1) + 7) // 8
    size = rows * n_int * 8 + null_bytes + rows * n_float * 8 + n_text
    body = _CODEC.decompress(blob[_HEADER.size + n_float :], decompressed_size=size, asbytes=True)
    ints = np.cumsum(_unshuffle(body, 0, rows, n_int, "<i8"), axis=0)
    at = rows * n_int * 8
    nulls = np.unpackbits(np.frombuffer(body, np.uint8, null_bytes, at), count=rows * (n_int - 1))
    at += null_bytes
    lanes = _unshuffle(body, at, rows, n_float, "<i8")
    floats = np.empty((rows, n_float))
    for i, k in enumerate(scales):
        if k == _XOR:
            floats[:, i] = np.bitwise_xor.accumulate(lanes[:, i]).view(np.float64)
        else:
            floats[:, i] = np.cumsum(lanes[:, i]) / _DECIMALS[k]
    strings = []
    for entry in json.loads(bytes(body[at + rows * n_float * 8 :]).decode()):
        distinct = np.array(entry[0], dtype=object)
        strings.append(np.repeat(distinct, rows) if len(entry) == 1 else distinct[entry[1]])
    return (
        version,
        ints,
        nulls.reshape(n_int - 1, rows).astype(bool),
        floats,
        strings,
    )


def _columns(
    version: int, ints: np.ndarray, nulls: np.ndarray, floats: np.ndarray, strings: list[np.ndarray]
) -> dict[str, Any]:
    int_names, float_names = LAYOUTS[version]
    out: dict[str, Any] = {"ts_ms": ints[:, 0]}
    for i, name in enumerate(int_names[1:]):
        values, mask = ints[:, i + 1], nulls[i]
        if name in BOOL_COLUMNS:
            out[name] = pd.arrays.BooleanArray(values.astype(bool), mask)
        else:
            out[name] = pd.arrays.IntegerArray(values, mask)
    for i, name in enumerate(float_names):
        out[name] = floats[:, i]
    out.update(zip(_STRINGS, strings, strict=True))
    return out


def unpack(blob: bytes) -> tuple[int, dict[str, Any]]:
    """(format version, columns) of a blob written by :func:`block_rows`: ``ts_ms`` int64, each
    integer column an ``Int64`` array, each flag a ``boolean`` array, each float float64, each
    string column an object array.

    Raises:
        ValueError: not a sample blob, or one of an unknown version.
    """
    version, ints, nulls, floats, strings = _raw(blob)
    return version, _columns(version, ints, nulls, floats, strings)


def block_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The ``sample_blocks`` rows of a sample frame (the dataset's columns, any order, at most
    one row per GPU and ``ts_ms``): one per GPU and minute."""
    if not len(frame):
        return []
    node = frame["node"].to_numpy(dtype=object)
    gpu = frame["gpu"].to_numpy(dtype=np.int64)
    ts = frame["ts_ms"].to_numpy(dtype=np.int64)
    names, node_code = np.unique(node.astype(str), return_inverse=True)
    minute = ts - ts % BLOCK_MS
    order = np.lexsort((ts, minute, gpu, node_code))
    ints = np.zeros((len(frame), len(_INTS)), dtype=np.int64)
    nulls = np.zeros((len(frame), len(_INTS) - 1), dtype=bool)
    ints[:, 0] = ts
    for i, name in enumerate(_INTS[1:]):
        if name not in frame:
            nulls[:, i] = True
            continue
        column = frame[name]
        nulls[:, i] = column.isna().to_numpy()
        ints[:, i + 1] = column.to_numpy(dtype=np.int64, na_value=0)
    floats = np.full((len(frame), len(_FLOATS)), np.nan)
    for i, name in enumerate(_FLOATS):
        if name in frame:
            floats[:, i] = frame[name].to_numpy(dtype=np.float64, na_value=np.nan)
    strings = [
        frame[s].to_numpy(dtype=object) if s in frame else np.full(len(frame), None)
        for s in _STRINGS
    ]
    ints, nulls, floats = ints[order], nulls[order], floats[order]
    strings = [s[order] for s in strings]
    key_node, key_gpu, key_minute = node_code[order], gpu[order], minute[order]
    edges = np.flatnonzero(
        np.r_[
            True,
            (key_node[1:] != key_node[:-1])
            | (key_gpu[1:] != key_gpu[:-1])
            | (key_minute[1:] != key_minute[:-1]),
            True,
        ]
    )
    starts = edges[:-1]
    steps, scales, lanes = _lanes(ints, floats, starts)
    # A string column constant within a block (as UUID and vendor are) is described once.
    constant = []
    for values in strings:
        codes, distinct = pd.factorize(values, use_na_sentinel=False)
        named = [None if pd.isna(v) else str(v) for v in distinct]
        low = np.minimum.reduceat(codes, starts)
        same = low == np.maximum.reduceat(codes, starts)
        constant.append([[[named[c]]] if one else None for c, one in zip(low, same, strict=True)])
    out = []
    for g, (a, b) in enumerate(itertools.pairwise(edges)):
        described = [
            c[g] if c[g] is not None else _described(v[a:b])
            for c, v in zip(constant, strings, strict=True)
        ]
        out.append(
            {
                "node": str(names[key_node[a]]),
                "gpu": int(key_gpu[a]),
                "start_ms": int(key_minute[a]),
                "n": int(b - a),
                "data": _blob(steps[a:b], nulls[a:b], scales[g], lanes[a:b], described),
            }
        )
    return out


def _decoded(found: Iterable[tuple[Any, ...]]) -> pd.DataFrame:
    """A sample frame of ``(node, gpu, data)`` blob rows, in their order: the blobs' matrices
    are joined first and made columns once (per format version)."""
    by_version: dict[int, list[tuple[str, int, tuple[Any, ...]]]] = {}
    for node, gpu, blob in found:
        version, *parts = _raw(bytes(blob))
        by_version.setdefault(version, []).append((str(node), int(gpu), tuple(parts)))
    frames = []
    for version, blocks in sorted(by_version.items()):
        sizes = [len(p[0]) for _, _, p in blocks]
        columns = _columns(
            version,
            np.concatenate([p[0] for _, _, p in blocks]),
            np.concatenate([p[1] for _, _, p in blocks], axis=1),
            np.concatenate([p[2] for _, _, p in blocks]),
            [np.concatenate([p[3][k] for _, _, p in blocks]) for k in range(len(_STRINGS))],
        )
        data: dict[str, Any] = {
            "ts_ms": columns["ts_ms"],
            "node": np.repeat(np.array([n for n, _, _ in blocks], dtype=object), sizes),
            "gpu": np.repeat(np.array([g for _, g, _ in blocks], dtype=np.int64), sizes),
        }
        total = sum(sizes)
        for name in FRAME_COLUMNS[3:]:
            # A column an older layout lacks reads as NULL.
            data[name] = columns[name] if name in columns else _nulls(name, total)
        frames.append(pd.DataFrame(data, columns=list(FRAME_COLUMNS)))
    if not frames:
        return _empty()
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def _nulls(name: str, size: int) -> Any:
    if name in INT_COLUMNS:
        return pd.array([None] * size, dtype="Int64")
    if name in BOOL_COLUMNS:
        return pd.array([None] * size, dtype="boolean")
    if name in FLOAT_COLUMNS:
        return np.full(size, np.nan)
    return np.full(size, None, dtype=object)


def _empty() -> pd.DataFrame:
    data = {
        name: np.zeros(0, dtype=np.int64) if name in ("ts_ms", "gpu") else _nulls(name, 0)
        for name in FRAME_COLUMNS
    }
    return pd.DataFrame(data, columns=list(FRAME_COLUMNS))


def _fetch(connection: Connection, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    result = connection.execute(text(sql), params)
    rows = list(result.cursor.fetchall()) if result.cursor is not None else []
    result.close()
    return rows


def _where(
    since_ms: int | None, until_ms: int | None, node: str | None, gpu: int | None
) -> tuple[str, dict[str, Any]]:
    """The condition on ``sample_blocks`` for blocks that may hold samples of the window."""
    conditions, params = ["1=1"], {}
    for name, column, value in (
        ("lo", "start_ms >=", None if since_ms is None else since_ms - since_ms % BLOCK_MS),
        ("hi", "start_ms <", until_ms),
        ("node", "node =", node),
        ("gpu", "gpu =", gpu),
    ):
        if value is not None:
            conditions.append(f"{column} :{name}")
            params[name] = value
    return " AND ".join(conditions), params


def _within(frame: pd.DataFrame, since_ms: int | None, until_ms: int | None) -> pd.DataFrame:
    """The rows of decoded blocks with ``since_ms <= ts_ms < until_ms``."""
    ts = frame["ts_ms"].to_numpy()
    keep = np.ones(len(frame), dtype=bool)
    if since_ms is not None:
        keep &= ts >= since_ms
    if until_ms is not None:
        keep &= ts < until_ms
    return frame if keep.all() else frame[keep]


def read(
    connection: Connection,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    node: str | None = None,
    gpu: int | None = None,
) -> pd.DataFrame:
    """Packed samples with ``since_ms <= ts_ms < until_ms`` (of one node or GPU), sorted by
    (ts_ms, node, gpu), in the sample-frame shape."""
    where, params = _where(since_ms, until_ms, node, gpu)
    sql = f"SELECT node, gpu, data FROM sample_blocks WHERE {where} ORDER BY start_ms, node, gpu"
    return _sorted(_within(_decoded(_fetch(connection, sql, params)), since_ms, until_ms))


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    """(ts_ms, node, gpu) order; blocks of one minute hold each GPU's rows apart."""
    if len(frame) < 2:
        return frame.reset_index(drop=True)
    node = frame["node"].to_numpy(dtype=object).astype(str)
    order = np.lexsort((frame["gpu"].to_numpy(), node, frame["ts_ms"].to_numpy()))
    if (order[1:] > order[:-1]).all():
        return frame.reset_index(drop=True)
    return frame.iloc[order].reset_index(drop=True)


_KEYS_PER_QUERY = 300


def samples_at(connection: Connection, keys: Sequence[tuple[str, int, int]]) -> pd.DataFrame:
    """The packed sample of each ``(node, gpu, ts_ms)`` in ``keys`` that a block holds, in the
    sample-frame shape, sorted by (node, gpu): one query for every few hundred keys, each key
    a primary-key probe of its minute's block (the keys drive the join: as an ``IN`` list
    SQLite scanned the whole table), in the partitions of the keys' hours only."""
    frames = []
    for first in range(0, len(keys), _KEYS_PER_QUERY):
        part = keys[first : first + _KEYS_PER_QUERY]
        starts = [ts_ms - ts_ms % BLOCK_MS for _, _, ts_ms in part]
        params: dict[str, Any] = {"lo": min(starts), "hi": max(starts)}
        for k, ((node, gpu, _), start) in enumerate(zip(part, starts, strict=True)):
            params.update({f"n{k}": node, f"g{k}": gpu, f"s{k}": start})
        wanted = ", ".join(f"(:n{k}, :g{k}, :s{k})" for k in range(len(part)))
        if connection.dialect.name == "postgresql":
            sql = (
                f"SELECT b.node, b.gpu, b.data FROM (VALUES {wanted}) AS k(node, gpu, start_ms) "
                "JOIN LATERAL (SELECT node, gpu, data FROM sample_blocks WHERE node = k.node "
                "AND gpu = k.gpu AND start_ms = k.start_ms "
                "AND start_ms BETWEEN :lo AND :hi LIMIT 1) b ON true"
            )
        else:
            sql = (
                f"SELECT b.node, b.gpu, b.data FROM (VALUES {wanted}) AS k CROSS JOIN "
                "sample_blocks b ON b.node = k.column1 AND b.gpu = k.column2 "
                "AND b.start_ms = k.column3 AND b.start_ms BETWEEN :lo AND :hi"
            )
        decoded = _decoded(_fetch(connection, sql, params))
        times = pd.DataFrame(part, columns=["node", "gpu", "ts_ms"])
        frames.append(decoded.merge(times.astype({"gpu": np.int64}), on=["node", "gpu", "ts_ms"]))
    frames = [f for f in frames if len(f)]
    if not frames:
        return _empty()
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    return frame.sort_values(["node", "gpu"], kind="stable", ignore_index=True)


def last_samples(
    connection: Connection,
    *,
    since_ms: int,
    until_ms: int,
    node: str | None = None,
    gpu: int | None = None,
) -> pd.DataFrame:
    """Each GPU's newest packed sample with ``since_ms <= ts_ms < until_ms``: its newest block
    there is decoded, no other."""
    where, params = _where(since_ms, until_ms, node, gpu)
    sql = (
        "SELECT b.node, b.gpu, b.data FROM sample_blocks b JOIN (SELECT node, gpu, "
        f"MAX(start_ms) AS newest FROM sample_blocks WHERE {where} GROUP BY node, gpu) l "
        "ON b.node = l.node AND b.gpu = l.gpu AND b.start_ms = l.newest"
    )
    frame = _within(_decoded(_fetch(connection, sql, params)), since_ms, until_ms)
    return frame.sort_values("ts_ms", kind="stable").drop_duplicates(["node", "gpu"], keep="last")


def with_packed(
    connection: Connection,
    wide: pd.DataFrame,
    *,
    since_ms: int | None,
    until_ms: int | None,
    node: str | None = None,
    gpu: int | None = None,
) -> pd.DataFrame:
    """``wide``, the wide rows of a window just read, with the window's packed samples
    (:func:`merge`). The blocks are read after the wide rows, so a read that meets an hour
    being packed finds each of its samples in one or both: before the packing commits in the
    wide rows, after it in the blocks."""
    packed = read(connection, since_ms=since_ms, until_ms=until_ms, node=node, gpu=gpu)
    return merge(wide, packed)


def merge(wide: pd.DataFrame, packed: pd.DataFrame) -> pd.DataFrame:
    """Wide rows and packed ones of the same window as one frame sorted by (ts_ms, node, gpu):
    a sample in both (read while its hour was packed, or sent again after) counts once, as
    packed. ``packed`` has every column ``wide`` has."""
    if not len(packed):
        return wide
    packed = packed[list(wide.columns)]
    if not len(wide):
        return packed.reset_index(drop=True)
    both = pd.concat([packed, wide.astype(packed.dtypes.to_dict())], ignore_index=True)
    both = both.drop_duplicates(["node", "gpu", "ts_ms"], keep="first")
    return _sorted(both)
