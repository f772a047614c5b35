"""The ingest fast path (msgspec, columns) decides exactly as the reference path (pydantic, row
by row): same rows stored, same rows refused, for any batch Hypothesis can make."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.ingest import parse_json, prepare_batch, prepare_body
from api.settings import Settings
from forewarn.wire import SAMPLE_FIELDS, sample_columns

SETTINGS = Settings(
    max_sample_age_s=10 * 365 * 86400.0,
    max_clock_skew_s=10 * 365 * 86400.0,
    raw_window_h=10 * 365 * 24.0,
)
NOW = datetime(2026, 12, 1, tzinfo=UTC)
NOW_MS = int(NOW.timestamp() * 1000)

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=300),
    st.integers(min_value=2**47, max_value=2**64),
    st.floats(min_value=-100, max_value=6000, allow_nan=False),
    st.sampled_from(["7", "nvidia", "amd", "", "GPU-1"]),
)
fields = st.sampled_from([f for f in SAMPLE_FIELDS if f not in ("node", "gpu", "ts")])


@st.composite
def rows(draw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "node": draw(st.sampled_from(["n1", "n1", "n1", "n2", ".."])),
        "gpu": draw(st.one_of(st.integers(min_value=-1, max_value=300), st.just(True))),
        "ts": (NOW - timedelta(seconds=draw(st.integers(0, 10**6)))).isoformat(),
    }
    for name, value in draw(st.dictionaries(fields, values, max_size=8)).items():
        row[name] = value
    return row


def _same(a: Any, b: Any) -> None:
    assert list(a.samples) == list(b.samples)
    assert [(e.kind, e.index) for e in a.rejected] == [(e.kind, e.index) for e in b.rejected]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(rows(), max_size=12))
def test_rows_shape_fast_and_reference_agree(batch: list[dict[str, Any]]) -> None:
    raw = json.dumps({"node": "n1", "samples": batch}).encode()
    fast = prepare_body(raw, None, settings=SETTINGS, now_ms=NOW_MS)
    reference = prepare_batch(parse_json(raw, max_objects=10**6), settings=SETTINGS, now_ms=NOW_MS)
    _same(fast, reference)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(rows(), min_size=1, max_size=12))
def test_columns_shape_stores_what_rows_store(batch: list[dict[str, Any]]) -> None:
    columns = sample_columns(batch, "n1")
    if columns is None:  # rows that are not plainly samples of n1 are sent as rows
        return
    if any("vendor" in r and r["vendor"] is None for r in batch):
        # In columns a null is "not reported" (the field's default, nvidia); a row that says
        # vendor: null is refused. The two cannot agree on it: the columns say what is meant.
        return
    raw = json.dumps({"node": "n1", "sample_columns": columns}).encode()
    as_columns = prepare_body(raw, None, settings=SETTINGS, now_ms=NOW_MS)
    as_rows = prepare_batch(
        parse_json(json.dumps({"node": "n1", "samples": batch}).encode(), max_objects=10**6),
        settings=SETTINGS,
        now_ms=NOW_MS,
    )
    _same(as_columns, as_rows)


def test_a_null_in_a_column_is_the_fields_default() -> None:
    """Rows that do not report ``vendor`` beside one that does: the columns hold nulls for
    them, which mean "not reported" (nvidia), as the rows shape stores them."""
    batch = [
        {"node": "n1", "gpu": 0, "ts": (NOW - timedelta(seconds=i)).isoformat()} for i in range(3)
    ]
    batch[2]["vendor"] = "7"
    columns = sample_columns(batch, "n1")
    assert columns is not None and columns["vendor"] == [None, None, "7"]
    raw = json.dumps({"node": "n1", "sample_columns": columns}).encode()
    as_columns = prepare_body(raw, None, settings=SETTINGS, now_ms=NOW_MS)
    rows = json.dumps({"node": "n1", "samples": batch}).encode()
    as_rows = prepare_batch(parse_json(rows, max_objects=10**6), settings=SETTINGS, now_ms=NOW_MS)
    _same(as_columns, as_rows)
    assert [e.index for e in as_columns.rejected] == [2]
