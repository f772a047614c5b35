"""Counter deltas across resets and gaps, and chunking invariance of the window state."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.features import FEATURE_NAMES, compute
from predictor.state import COLUMN, GpuWindowState

T0 = 1_735_689_600_000


def _frame(ts, values, column="ecc_sbe_volatile", node="n0", gpu=0) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "ts_ms": np.asarray(ts, dtype=np.int64),
            "node": node,
            "gpu": gpu,
            column: pd.array(values, dtype="Int64"),
        }
    )


@st.composite
def counter_series(draw):
    """A counter read every 10 s with errors, resets (restart at the errors since reset),
    nulls (unreported reads) and missing rows; returns (ts, readings, true error count)."""
    n = draw(st.integers(2, 60))
    value, errors, ts, readings, t = 0, 0, [], [], T0
    seen_first = False
    for _ in range(n):
        t += 10_000 * draw(st.integers(1, 4))  # gaps of up to 40 s
        step = draw(st.integers(0, 50))
        if draw(st.booleans()) and draw(st.integers(0, 5)) == 0:
            value = step  # a reset, then `step` new errors
        else:
            value += step
        if draw(st.integers(0, 6)) == 0:
            readings.append(None)  # the read failed: NULL, the hardware still counted
        else:
            readings.append(value)
        ts.append(t)
        if readings[-1] is not None:
            if seen_first:
                errors += step_since_last(readings)
            seen_first = True
    return ts, readings, errors


def step_since_last(readings):
    cur = readings[-1]
    prev = next(v for v in reversed(readings[:-1]) if v is not None)
    return cur - prev if cur >= prev else cur


@settings(max_examples=30, deadline=None)
@given(counter_series())
def test_increments_survive_resets_and_nulls(series) -> None:
    ts, readings, errors = series
    # increments counted like the hardware: delta, or the new value after a reset
    state = GpuWindowState(capacity=4)
    state.update(_frame(ts, readings), now_ms=ts[-1])
    total = state.acc[0, COLUMN["inc:ecc_sbe_volatile:7d"]]
    # decay over at most 40 min against a 7 d constant is below 0.4 %
    assert abs(total - errors) <= 5e-3 * max(errors, 1) + 1e-9


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 25), min_size=1, max_size=8), st.integers(0, 2**31 - 1))
def test_features_do_not_depend_on_how_rows_are_split(cuts, seed) -> None:
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(30):
        for g in range(4):
            if rng.random() < 0.15:
                continue  # a missing sample
            rows.append(
                {
                    "ts_ms": T0 + k * 30_000 + g,
                    "node": f"n{g // 2}",
                    "gpu": g % 2,
                    "temp_gpu_c": 50 + rng.normal() + (k if g == 3 else 0),
                    "ecc_sbe_volatile": int(k * (g + 1) * rng.integers(0, 3)),
                    "throttle_reasons": int(rng.choice([0, 0x20, 0x4])),
                    # a reading that comes and goes (vanished metrics)
                    "power_w": np.nan if rng.random() < 0.3 else 300.0,
                }
            )
    frame = pd.DataFrame(rows)
    frame["ecc_sbe_volatile"] = frame["ecc_sbe_volatile"].cummax().astype("Int64")
    frame["throttle_reasons"] = frame["throttle_reasons"].astype("Int64")
    end = int(frame["ts_ms"].max())
    whole = GpuWindowState()
    whole.update(frame, now_ms=end)
    parts = GpuWindowState()
    bounds = sorted({int(T0 + c * 30_000) for c in cuts} | {end})
    lo = -1
    for b in bounds:
        part = frame[(frame["ts_ms"] > lo) & (frame["ts_ms"] <= b)]
        parts.update(part, now_ms=b)
        lo = b
    a, b_ = compute(whole), compute(parts)
    order_a = np.lexsort((whole.gpu_of[: whole.size], whole.node_of[: whole.size]))
    order_b = np.lexsort((parts.gpu_of[: parts.size], parts.node_of[: parts.size]))
    np.testing.assert_allclose(a[order_a], b_[order_b], rtol=2e-5, atol=1e-4, equal_nan=True)


def test_gap_spreads_increment_and_shows_as_staleness() -> None:
    frame = _frame([T0, T0 + 60_000, T0 + 3_660_000], [0, 10, 70])
    state = GpuWindowState()
    state.update(frame, now_ms=T0 + 3_660_000 + 120_000)
    x = compute(state)
    assert x[0, FEATURE_NAMES.index("staleness_s")] == 120.0
    assert abs(state.acc[0, COLUMN["inc:ecc_sbe_volatile:7d"]] - 70) < 0.1


def test_resent_rows_are_not_counted_twice() -> None:
    frame = _frame([T0, T0 + 10_000, T0 + 20_000], [0, 5, 9])
    state = GpuWindowState()
    state.update(frame, now_ms=T0 + 20_000)
    state.update(frame, now_ms=T0 + 30_000)
    assert abs(state.acc[0, COLUMN["inc:ecc_sbe_volatile:7d"]] - 9) < 1e-3


def test_node_level_event_reaches_every_gpu_of_the_node() -> None:
    frame = pd.concat([_frame([T0], [0], gpu=g) for g in range(3)])
    state = GpuWindowState()
    state.update(frame, now_ms=T0)
    events = pd.DataFrame(
        {
            "ts_ms": [T0 + 1000],
            "node": ["n0"],
            "gpu": pd.array([None], dtype="Int64"),
            "kind": ["xid"],
            "xid": pd.array([79], dtype="Int64"),
        }
    )
    state.update(None, events, now_ms=T0 + 1000)
    x = compute(state)
    assert (x[:, FEATURE_NAMES.index("xid_bus_1h")] > 0.99).all()
    assert (x[:, FEATURE_NAMES.index("since_fatal_xid_s")] == 0).all()


def test_gaps_and_vanished_readings_are_features() -> None:
    """Gap lengths (time-weighted, over the hour and against the GPU's own day) and readings
    reported before but missing now."""
    ts = [T0 + k * 10_000 for k in range(30)] + [T0 + 600_000, T0 + 900_000]
    frame = _frame(ts, list(range(len(ts))))
    frame["power_w"] = [300.0] * 30 + [np.nan, np.nan]
    state = GpuWindowState()
    state.update(frame, now_ms=ts[-1])
    x = compute(state)[0]
    col = FEATURE_NAMES.index
    assert x[col("metrics_vanished_now")] == 1  # power was reported, is not now
    assert 0 < x[col("metrics_vanished_5m")] < 1
    # 29 gaps of 10 s, one of 310 s and one of 300 s: the moments in gaps of ~300 s dominate
    assert 200 < x[col("gap_len_1h")] < 310
    fresh = GpuWindowState()
    fresh.update(_frame(ts[:30], list(range(30))), now_ms=ts[29])
    assert compute(fresh)[0, col("gap_len_1h")] == pytest.approx(10.0)
    assert compute(fresh)[0, col("metrics_vanished_now")] == 0


def _lives_fleet() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Three GPUs a minute apart for an hour: GPU 0 shows a DBE at minute 5, is out from
    minute 10 to 20 and comes back (a recovery event) with the count of a second DBE from
    its failure; GPU 1 shows a DBE at minute 30 and is reset (its volatile counter read
    below before) at minute 40; GPU 2 shows a DBE at minute 50."""
    rows = []
    for k in range(60):
        for g in range(3):
            if g == 0 and 10 <= k < 20:
                continue
            agg = {0: (k >= 5) + (k >= 20), 1: int(k >= 30), 2: int(k >= 50)}[g]
            vol = agg if not (g == 1 and k >= 40) else 0
            rows.append(
                {
                    "ts_ms": T0 + k * 60_000,
                    "node": "n0",
                    "gpu": g,
                    "ecc_dbe_volatile": vol,
                    "ecc_dbe_aggregate": agg,
                    "ecc_sbe_volatile": 3 if g == 1 and k < 40 else 0,
                }
            )
    events = pd.DataFrame(
        {
            "ts_ms": [T0 + 15 * 60_000],
            "node": ["n0"],
            "gpu": pd.array([0], dtype="Int64"),
            "kind": ["gpu_recovered"],
            "xid": pd.array([None], dtype="Int64"),
        }
    )
    return pd.DataFrame(rows), events


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 59), min_size=0, max_size=8))
def test_ecc_evidence_ends_with_a_life_however_rows_are_split(cuts) -> None:
    """A DBE from before a recovery or reset, or carried over one, is no evidence; one after
    it is; the same whichever updates the rows and events come in."""
    frame, events = _lives_fleet()
    end = T0 + 59 * 60_000
    parts = GpuWindowState()
    lo = -1
    for b in sorted({T0 + c * 60_000 for c in cuts} | {end}):
        rows = frame[(frame["ts_ms"] > lo) & (frame["ts_ms"] <= b)]
        ev = events[(events["ts_ms"] > lo) & (events["ts_ms"] <= b)]
        parts.update(rows, ev if len(ev) else None, now_ms=b)
        lo = b
    since = compute(parts)[:, FEATURE_NAMES.index("since_dbe_s")]
    assert since[0] == since[1] == 7 * 86400.0  # its life's DBEs: none
    assert since[2] == 9 * 60.0


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_folding_in_chunks_of_gpus_gives_the_same_state(monkeypatch, chunk_rows) -> None:
    """A large tick is folded in chunks of whole GPUs (their temporaries stay small); the state
    is the same as from one chunk, counters, resets, nulls, gaps and vanished readings included."""
    import predictor.state as state_module

    rng = np.random.default_rng(chunk_rows)
    n = 400
    frame = pd.DataFrame(
        {
            "ts_ms": T0 + rng.integers(0, 60, n) * 1_000,
            "node": [f"n{i}" for i in rng.integers(0, 6, n)],
            "gpu": rng.integers(0, 8, n),
            "ecc_sbe_volatile": pd.array(
                np.where(rng.random(n) < 0.1, None, rng.integers(0, 9, n)), dtype="Int64"
            ),
            "temp_gpu_c": np.where(rng.random(n) < 0.2, np.nan, 50 + rng.normal(size=n)),
            "throttle_reasons": pd.array(rng.choice([0, 0x20, 0x4], n), dtype="Int64"),
        }
    )
    states = []
    for rows in (1 << 30, chunk_rows):
        monkeypatch.setattr(state_module, "_CHUNK_ROWS", rows)
        s = GpuWindowState()
        s.update(frame[frame["ts_ms"] < T0 + 30_000], now_ms=T0 + 30_000)
        s.update(frame[frame["ts_ms"] >= T0 + 30_000], now_ms=T0 + 60_000)
        states.append(s)
    whole, chunked = states
    for name in ("acc", "last_counter", "latest", "last_time", "reported", "vanished_now"):
        np.testing.assert_allclose(
            getattr(whole, name)[: whole.size],
            getattr(chunked, name)[: chunked.size],
            rtol=1e-12,
            equal_nan=True,
            err_msg=name,
        )


def test_a_state_that_forgets_gpus_holds_the_others_as_if_it_never_had_them() -> None:
    """``keep``: the GPUs a share of the fleet no longer scores leave the state; the others'
    windows are as if only they had ever been folded, and a GPU forgotten and seen again
    starts afresh."""
    rng = np.random.default_rng(3)
    n = 600
    frame = pd.DataFrame(
        {
            "ts_ms": T0 + rng.integers(0, 120, n) * 1_000,
            "node": [f"n{i}" for i in rng.integers(0, 6, n)],
            "gpu": rng.integers(0, 8, n),
            "ecc_sbe_volatile": rng.integers(0, 9, n),
            "temp_gpu_c": 50 + rng.normal(size=n),
        }
    ).sort_values("ts_ms", kind="stable")
    first, second = frame[frame["ts_ms"] < T0 + 60_000], frame[frame["ts_ms"] >= T0 + 60_000]
    kept = {"n0", "n2", "n5"}
    forgetting = GpuWindowState()
    forgetting.update(first, now_ms=T0 + 60_000)
    nodes = np.asarray(forgetting.nodes, dtype=object)[forgetting.node_of[: forgetting.size]]
    forgetting.keep(np.isin(nodes, list(kept)))
    assert set(np.asarray(forgetting.nodes)[forgetting.node_of[: forgetting.size]]) == kept
    forgetting.update(second, now_ms=T0 + 120_000)
    never = GpuWindowState()
    never.update(first[first["node"].isin(kept)], now_ms=T0 + 60_000)
    never.update(second, now_ms=T0 + 120_000)
    assert forgetting.size == never.size

    def by_gpu(s: GpuWindowState) -> dict[tuple[str, int], int]:
        return {(s.nodes[s.node_of[i]], int(s.gpu_of[i])): i for i in range(s.size)}

    a, b = by_gpu(forgetting), by_gpu(never)
    assert a.keys() == b.keys()
    order_a = [a[k] for k in sorted(a)]
    order_b = [b[k] for k in sorted(b)]
    for name in GpuWindowState._PER_SLOT:
        if name in ("node_of", "gpu_of"):
            continue
        np.testing.assert_allclose(
            getattr(forgetting, name)[order_a].astype(float),
            getattr(never, name)[order_b].astype(float),
            rtol=1e-12,
            equal_nan=True,
            err_msg=name,
        )


def test_features_are_finite_or_missing_even_past_float32() -> None:
    # A counter past what float32 holds (a corrupt reading: 1e300 errors) makes its rate
    # overflow the matrix's float32: the feature is missing, never infinite, on either side of
    # the booster's column-major read.
    frame = _frame([T0, T0 + 10_000], [0, 0])
    frame.loc[1, "ecc_sbe_volatile"] = None
    state = GpuWindowState()
    state.update(frame, now_ms=T0 + 10_000)
    huge = frame.iloc[[1]].assign(ts_ms=T0 + 20_000, ecc_sbe_volatile=pd.array([None], "Int64"))
    state.update(huge, now_ms=T0 + 20_000)
    state.last_counter[0, 0] = -1e300  # the next reading looks like an increase of 1e300
    state.update(_frame([T0 + 30_000], [0]), now_ms=T0 + 30_000)
    x = compute(state)
    assert x.flags["F_CONTIGUOUS"] and x.shape == (1, len(FEATURE_NAMES))
    assert not np.isinf(x).any()
    assert np.isnan(x[0, FEATURE_NAMES.index("ecc_sbe_volatile_rate_5m")])
