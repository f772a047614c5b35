"""Incremental per-GPU telemetry state: the one path from raw rows to features.

Training replays a dataset through :class:`GpuWindowState` and the live scorer feeds it what the
store received since the last tick; both then call :func:`predictor.features.compute`. Nothing
recomputes a 24 h window from raw rows: every trailing window is an exponentially decayed sum
whose time constant is the window length (5 min, 1 h, 24 h and 7 days for the GPU's own
history). Each row contributes ``value * exp(-(now - t_row) / tau)``, so the state at ``now``
depends only on the rows with ``ts <= now`` and never on how they were split into updates:
replaying a week in 60 s chunks gives the same numbers as feeding it one tick at a time.

Counters are cumulative as the hardware reports them. An increment is ``value - previous``;
a value below the previous one is a reset (reboot, driver reload) and counts as ``value``
errors since the reset; a null leaves the previous value in place, so a gap only spreads
the increment over the missing samples. Rows older than the newest row already seen for a
GPU are ignored (a re-sent batch does not count twice).

A GPU's *life* ends at a recovery or reset: a ``gpu_recovered`` or ``counter_reset`` event,
or a counter read below its previous value. An ECC error is *evidence* (the time of the last
SBE / DBE that ``since_sbe_s`` / ``since_dbe_s`` and the ``dbe`` rule read) only when it
happened within the GPU's current life: a sample whose gap from the previous one contains a
life boundary carries the counts of the life before (the DBE of a failure is first read in
the first sample after the repair), so an increase in it counts as evidence only for a counter
that was itself reset (its value is then the errors since the reset); and evidence from before
the boundary is forgotten at it. The boundary events must reach the state no later than the
first sample after them (the collector sends them in the same batch; the replay and the
scorer fold a tick's events before its samples).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import scipy.sparse

from forewarn.errors import InvalidInput
from forewarn.wire import COUNTER_FIELDS
from predictor.catalog import FATAL_XIDS, XID_CLASSES, xid_class

__all__ = [
    "EVENT_CHANNELS",
    "GAUGES",
    "LATEST",
    "VALUE_COLUMNS",
    "WINDOWS",
    "GpuWindowState",
    "SampleBlock",
]

WINDOWS: dict[str, float] = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0, "7d": 604800.0}
"""Window name -> time constant (s) of its decayed sums."""

GAUGES: tuple[str, ...] = ("temp_gpu_c", "temp_mem_c", "power_w", "sm_clock_mhz", "util_gpu_pct")
"""Readings whose decayed means are kept (per window 5m, 1h, 24h)."""

LATEST: tuple[str, ...] = (
    *GAUGES,
    "pcie_link_width",
    "pcie_link_width_max",
    "remap_pending",
    "remap_failure",
    "retired_pages_pending",
)
"""Readings whose latest non-null value is kept."""

EVENT_CHANNELS: tuple[str, ...] = (
    *(f"xid_{c}" for c in XID_CLASSES),
    "ecc_storm",
    "link_down",
    "thermal_shutdown",
    "telemetry_stalled",
    "counter_reset",
    "gpu_lost",
    "power_loss",
)
"""Event counters kept per window; Xids by class (``predictor.catalog``)."""

# NVML clock-event reason bits (SOURCES.md): thermal = SW/HW thermal slowdown, power = SW power
# cap / HW power brake, hw = HW slowdown (thermal or power brake asserted by the board).
THERMAL_BITS = 0x20 | 0x40
POWER_BITS = 0x04 | 0x80
HW_SLOWDOWN_BITS = 0x08
FLAGS: tuple[tuple[str, int], ...] = (
    ("thermal_throttle", THERMAL_BITS),
    ("power_throttle", POWER_BITS),
    ("hw_slowdown", HW_SLOWDOWN_BITS),
)
_LAST_TIMES = ("sbe", "dbe", *EVENT_CHANNELS, "fatal_xid")
LIFE_EVENTS: tuple[str, ...] = ("gpu_recovered", "counter_reset")
"""Events that end a GPU's life: the counts read after them include the life before."""


def _layout() -> tuple[dict[str, int], np.ndarray]:
    names: list[tuple[str, float]] = []
    for c in COUNTER_FIELDS:
        names += [(f"inc:{c}:{w}", t) for w, t in WINDOWS.items()]
    names += [(f"reset:{w}", WINDOWS[w]) for w in ("1h", "24h")]
    for g in GAUGES:
        for w in ("5m", "1h", "24h"):
            names += [(f"num:{g}:{w}", WINDOWS[w]), (f"den:{g}:{w}", WINDOWS[w])]
    for w in ("5m", "1h"):
        names += [(f"flag:{f}:{w}", WINDOWS[w]) for f, _ in FLAGS]
        names.append((f"den:throttle:{w}", WINDOWS[w]))
    names += [(f"n:{w}", WINDOWS[w]) for w in ("5m", "1h", "24h")]
    for q in ("gap", "gap2"):  # seconds since the GPU's previous sample, and its square
        names += [(f"{q}:{w}", WINDOWS[w]) for w in ("1h", "24h")]
    names += [(f"vanish:{w}", WINDOWS[w]) for w in ("5m", "1h")]
    for e in EVENT_CHANNELS:
        names += [(f"ev:{e}:{w}", WINDOWS[w]) for w in ("5m", "1h", "24h")]
    return {n: i for i, (n, _) in enumerate(names)}, np.array([t for _, t in names])


COLUMN, TAU = _layout()

VALUE_COLUMNS: tuple[str, ...] = (
    *COUNTER_FIELDS,
    *GAUGES,
    "throttle_reasons",
    *(c for c in LATEST if c not in GAUGES),
)
"""Sample columns the state reads, in the column order of :attr:`SampleBlock.values`."""
_THROTTLE_AT = VALUE_COLUMNS.index("throttle_reasons")
_LATEST_AT = np.array([VALUE_COLUMNS.index(c) for c in LATEST])
_SBE_DBE = (
    ("sbe", [COUNTER_FIELDS.index("ecc_sbe_volatile"), COUNTER_FIELDS.index("ecc_sbe_aggregate")]),
    ("dbe", [COUNTER_FIELDS.index("ecc_dbe_volatile"), COUNTER_FIELDS.index("ecc_dbe_aggregate")]),
)


def _base_layout() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each state column, which base quantity of ``_fold_samples`` feeds it and with
    which time constant (event columns are fed by ``_fold_events`` and get base -1)."""
    base = [f"inc:{c}" for c in COUNTER_FIELDS] + ["reset"]
    base += [f"num:{g}" for g in GAUGES] + [f"den:{g}" for g in GAUGES]
    base += [f"flag:{f}" for f, _ in FLAGS] + ["den:throttle", "n", "gap", "gap2", "vanish"]
    taus = np.unique(TAU)
    base_of = np.zeros(len(TAU), dtype=np.int64)
    tau_of = np.zeros(len(TAU), dtype=np.int64)
    for name, j in COLUMN.items():
        stem = name.rsplit(":", 1)[0]
        base_of[j] = base.index(stem) if stem in base else -1
        tau_of[j] = int(np.searchsorted(taus, TAU[j]))
    return base_of, tau_of, taus


_BASE_OF, _TAU_OF, _TAUS = _base_layout()
_EVENT_COLUMNS = _BASE_OF < 0
_SAMPLE_COLUMNS = np.flatnonzero(~_EVENT_COLUMNS)
_SUM_AT = (_TAU_OF * (_BASE_OF.max() + 1) + _BASE_OF)[_SAMPLE_COLUMNS]
_CHUNK_ROWS = 1 << 15


def _decayed_sums(base: np.ndarray, decay: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """What a tick's rows add to the state's sample columns (:data:`_SAMPLE_COLUMNS`): per
    group of consecutive rows (``starts``) and column, the sum over the group of the column's
    base quantity (``base``, rows x base quantities) times its time constant's decay (``decay``,
    rows x time constants).

    One sparse product, (groups x time constants) x rows against rows x base quantities: a
    100,000-GPU tick of 5 rows a GPU multiplies 500,000 x 33 numbers per time constant, where
    spreading each row over the ~100 columns first allocated and summed 500,000 x 147.
    """
    n, groups, k = len(base), len(starts), decay.shape[1]
    indptr = np.concatenate([*(starts + j * n for j in range(k)), [k * n]])
    weights = scipy.sparse.csr_array(
        (np.ascontiguousarray(decay.T).ravel(), np.tile(np.arange(n), k), indptr),
        shape=(k * groups, n),
    )
    sums = (weights @ base).reshape(k, groups, base.shape[1]).transpose(1, 0, 2)
    return sums.reshape(groups, k * base.shape[1])[:, _SUM_AT]


class SampleBlock:
    """Sample rows as arrays: ``ts_ms`` (int64), ``node`` (object), ``gpu`` (int64) and
    ``values`` (float64, NaN = null, columns :data:`VALUE_COLUMNS`). The replay converts a
    whole dataset once and slices it; the live scorer converts each tick's frame."""

    __slots__ = ("gpu", "node", "ts_ms", "values")

    def __init__(self, ts_ms: np.ndarray, node: np.ndarray, gpu: np.ndarray, values: np.ndarray):
        self.ts_ms, self.node, self.gpu, self.values = ts_ms, node, gpu, values

    def __len__(self) -> int:
        return len(self.ts_ms)

    def __getitem__(self, rows: slice | np.ndarray) -> SampleBlock:
        """The rows of a slice, a boolean mask or an index array."""
        return SampleBlock(self.ts_ms[rows], self.node[rows], self.gpu[rows], self.values[rows])

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> SampleBlock:
        """Columns the frame lacks are null; nullable ints and booleans become floats."""
        values = np.full((len(frame), len(VALUE_COLUMNS)), np.nan)
        for j, name in enumerate(VALUE_COLUMNS):
            if name in frame.columns:
                s = frame[name]
                if s.dtype == object or str(s.dtype) in ("boolean", "bool"):
                    s = s.astype("Float64")
                values[:, j] = s.to_numpy(dtype=np.float64, na_value=np.nan)
        return cls(
            frame["ts_ms"].to_numpy(dtype=np.int64),
            frame["node"].to_numpy(dtype=object),
            frame["gpu"].to_numpy(dtype=np.int64),
            values,
        )


def _last_valid(
    values: np.ndarray, seen: np.ndarray, gstart: np.ndarray, gend: np.ndarray
) -> np.ndarray:
    """Per group (rows gstart..gend) and column of ``values``, the last non-NaN value (NaN if
    none); ``seen`` holds, per row and column, the last row up to it with a value (-1: none)."""
    idx = seen[gend]
    ok = idx >= gstart[:, None]
    out = np.take_along_axis(values, np.where(ok, idx, 0), axis=0)
    return np.where(ok, out, np.nan)


_EMPTY = {
    "acc": 0.0,
    "last_counter": np.nan,
    "latest": np.nan,
    "last_time": np.nan,
    "first_ms": np.nan,
    "last_ms": np.nan,
    "reported": False,
    "vanished_now": 0.0,
    "life_ms": np.nan,
}
"""What a slot holds before its GPU is first seen (as :meth:`GpuWindowState._alloc` fills)."""


class GpuWindowState:
    """Decayed window sums and latest readings for every GPU seen, vectorised over the fleet.

    Example::

        state = GpuWindowState()
        state.update(samples_frame, events_frame, now_ms=...)
        matrix = predictor.features.compute(state, now_ms)
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.now_ms: int | None = None
        self.size = 0
        self.nodes: list[str] = []
        self._node_index: dict[str, int] = {}
        self._slot_of = np.full((16, 256), -1, dtype=np.int64)
        self._alloc(capacity)

    # -- slots ---------------------------------------------------------------------------
    def _alloc(self, cap: int) -> None:
        def grow(old: np.ndarray | None, shape: tuple[int, ...], fill: float) -> np.ndarray:
            new = np.full(shape, fill)
            if old is not None:
                new[: len(old)] = old
            return new

        g = getattr
        self.acc = grow(g(self, "acc", None), (cap, len(TAU)), 0.0)
        self.last_counter = grow(g(self, "last_counter", None), (cap, len(COUNTER_FIELDS)), np.nan)
        self.latest = grow(g(self, "latest", None), (cap, len(LATEST)), np.nan)
        self.last_time = grow(g(self, "last_time", None), (cap, len(_LAST_TIMES)), np.nan)
        self.first_ms = grow(g(self, "first_ms", None), (cap,), np.nan)
        self.last_ms = grow(g(self, "last_ms", None), (cap,), np.nan)
        self.node_of = grow(g(self, "node_of", None), (cap,), -1).astype(np.int64)
        self.gpu_of = grow(g(self, "gpu_of", None), (cap,), -1).astype(np.int64)
        self.reported = grow(g(self, "reported", None), (cap, len(VALUE_COLUMNS)), 0).astype(bool)
        self.vanished_now = grow(g(self, "vanished_now", None), (cap,), 0.0)
        self.life_ms = grow(g(self, "life_ms", None), (cap,), np.nan)
        self.capacity = cap

    _PER_SLOT = (
        "acc",
        "last_counter",
        "latest",
        "last_time",
        "first_ms",
        "last_ms",
        "node_of",
        "gpu_of",
        "reported",
        "vanished_now",
        "life_ms",
    )

    def keep(self, mask: np.ndarray) -> None:
        """Forget the GPUs whose slot ``mask`` (one flag per slot, ``size`` of them) is off;
        the others keep their state, in the same order (a share of the fleet scored elsewhere
        now: :mod:`control.partition`)."""
        kept = np.flatnonzero(np.asarray(mask, dtype=bool)[: self.size])
        if len(kept) == self.size:
            return
        for name in self._PER_SLOT:
            array = getattr(self, name)
            array[: len(kept)] = array[kept]
            array[len(kept) : self.size] = -1 if name in ("node_of", "gpu_of") else _EMPTY[name]
        self.size = len(kept)
        self._slot_of[:] = -1
        self._slot_of[self.node_of[: self.size], self.gpu_of[: self.size]] = np.arange(self.size)

    def slots(self, node: np.ndarray, gpu: np.ndarray, *, create: bool = True) -> np.ndarray:
        """Slot index of each (node, gpu); new GPUs get a slot (or -1 when ``create`` is off)."""
        inverse, uniq = pd.factorize(np.asarray(node, dtype=object))  # hashing, not sorting
        node_idx = np.empty(len(uniq), dtype=np.int64)
        for i, name in enumerate(uniq):
            idx = self._node_index.get(name)
            if idx is None:
                if not create:
                    node_idx[i] = -1
                    continue
                idx = len(self.nodes)
                self.nodes.append(str(name))
                self._node_index[name] = idx
                if idx >= len(self._slot_of):
                    extra = np.full((len(self._slot_of), 256), -1, dtype=np.int64)
                    self._slot_of = np.vstack([self._slot_of, extra])
            node_idx[i] = idx
        n = node_idx[inverse]
        g = np.asarray(gpu, dtype=np.int64)
        if len(g) and (g.min() < 0 or g.max() > 255):
            raise InvalidInput("gpu index out of range 0..255")
        found = np.where(n >= 0, self._slot_of[np.maximum(n, 0), g], -1)
        missing = (found < 0) & (n >= 0)
        if missing.any() and create:
            pairs = np.unique(np.stack([n[missing], g[missing]], axis=1), axis=0)
            need = self.size + len(pairs)
            if need > self.capacity:
                self._alloc(max(need, 2 * self.capacity))
            new = np.arange(self.size, need)
            self._slot_of[pairs[:, 0], pairs[:, 1]] = new
            self.node_of[new], self.gpu_of[new] = pairs[:, 0], pairs[:, 1]
            self.size = need
            found = self._slot_of[n, g]
        return found

    # -- updates -------------------------------------------------------------------------
    def _advance(self, now_ms: int) -> None:
        if self.now_ms is not None:
            if now_ms < self.now_ms:
                raise InvalidInput(f"state is at {self.now_ms} ms, cannot go back to {now_ms}")
            dt = (now_ms - self.now_ms) / 1000.0
            if dt > 0:
                self.acc[: self.size] *= np.exp(-dt / TAU)
        self.now_ms = now_ms

    def update(
        self,
        samples: pd.DataFrame | SampleBlock | None,
        events: pd.DataFrame | None = None,
        *,
        now_ms: int,
    ) -> None:
        """Fold in the samples and events with ``ts_ms <= now_ms`` and move the clock to it.

        Args:
            samples: rows with the store's sample columns (``ts_ms``, ``node``, ``gpu``, ...);
                any order; columns the source does not report may be absent.
            events: rows with ``ts_ms``, ``node``, ``gpu`` (null: the whole node), ``kind``,
                ``xid``; each event must be given once.
            now_ms: the state's new clock (ms since the epoch), not before the previous one.

        Raises:
            InvalidInput: a row after ``now_ms`` or a clock that goes back.
        """
        self._advance(int(now_ms))
        block: SampleBlock | None = None
        slot = np.zeros(0, dtype=np.int64)
        if samples is not None and len(samples):
            block = samples if isinstance(samples, SampleBlock) else SampleBlock.from_frame(samples)
            if block.ts_ms.max() > int(now_ms):
                raise InvalidInput("a sample is newer than the update's now_ms")
            slot = self.slots(block.node, block.gpu)
        lives = self._lives(events) if events is not None and len(events) else None
        if block is not None:
            self._fold_samples(block, slot, lives)
        if lives is not None:
            np.fmax.at(self.life_ms, lives[0], lives[1].astype(np.float64))
        self._forget_past_lives()
        if events is not None and len(events):
            self._fold_events(events)

    def _forget_past_lives(self) -> None:
        """ECC evidence from before a GPU's latest life boundary is no evidence now."""
        n = self.size
        for key, _ in _SBE_DBE:
            k = _LAST_TIMES.index(key)
            old = self.last_time[:n, k] < self.life_ms[:n]  # NaN on either side: False
            self.last_time[:n, k] = np.where(old, np.nan, self.last_time[:n, k])

    def _lives(self, frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
        """The life boundaries among ``frame``'s events, as (slot, ts_ms) sorted by slot then
        time (a node-wide event ends the life of every GPU of its node known so far)."""
        frame = frame[frame["kind"].astype(str).isin(LIFE_EVENTS)]
        if not len(frame):
            return None
        t = frame["ts_ms"].to_numpy(dtype=np.int64)
        if t.max() > int(self.now_ms or 0):
            raise InvalidInput("an event is newer than the update's now_ms")
        gpu = pd.to_numeric(frame["gpu"], errors="coerce").to_numpy(dtype=np.float64)
        nodes = frame["node"].astype(str).to_numpy()
        per_gpu = ~np.isnan(gpu)
        slots = [self.slots(nodes[per_gpu], gpu[per_gpu].astype(np.int64), create=False)]
        times = [t[per_gpu]]
        for i in np.flatnonzero(~per_gpu):
            node_idx = self._node_index.get(nodes[i])
            if node_idx is None:
                continue
            targets = np.flatnonzero(self.node_of[: self.size] == node_idx)
            slots.append(targets.astype(np.int64))
            times.append(np.full(len(targets), t[i], dtype=np.int64))
        b_slot, b_ts = np.concatenate(slots), np.concatenate(times)
        keep = b_slot >= 0
        b_slot, b_ts = b_slot[keep], b_ts[keep]
        order = np.lexsort((b_ts, b_slot))
        return b_slot[order], b_ts[order]

    def _fold_samples(
        self,
        block: SampleBlock,
        slot: np.ndarray,
        lives: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        now = self.now_ms
        assert now is not None
        t = block.ts_ms
        fresh = ~(t <= self.last_ms[slot])  # NaN last_ms: never seen, keep
        order = np.lexsort((t, slot))
        order = order[fresh[order]]
        if not len(order):
            return
        t, slot = t[order], slot[order]
        dup = np.r_[False, (slot[1:] == slot[:-1]) & (t[1:] == t[:-1])]
        if dup.any():
            order, t, slot = order[~dup], t[~dup], slot[~dup]
        # Each GPU's rows are folded apart from the others', so the rows go in chunks of whole
        # GPUs: a 100,000-GPU tick's temporaries (rows x up to ~150 numbers) then stay small
        # enough for the allocator to reuse instead of mapping fresh pages for each.
        starts = np.flatnonzero(np.r_[True, slot[1:] != slot[:-1]])
        at = np.searchsorted(starts, np.arange(0, len(slot), _CHUNK_ROWS))
        cuts = np.unique(starts[np.minimum(at, len(starts) - 1)])
        for a, b in zip(cuts, [*cuts[1:], len(slot)], strict=True):
            self._fold_sorted(t[a:b], slot[a:b], block.values[order[a:b]], lives)

    def _fold_sorted(
        self,
        t: np.ndarray,
        slot: np.ndarray,
        values: np.ndarray,
        lives: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        """Fold rows sorted by slot then time, none already folded, each (slot, time) once."""
        now = self.now_ms
        assert now is not None
        single = len(slot) == 1 or bool((slot[1:] != slot[:-1]).all())
        if single:  # one row per GPU (the live tick): groups are the rows themselves
            starts = ends = gstart = np.arange(len(slot))
        else:
            starts = np.flatnonzero(np.r_[True, slot[1:] != slot[:-1]])
            ends = np.r_[starts[1:] - 1, len(slot) - 1]
            gstart = np.repeat(starts, np.diff(np.r_[starts, len(slot)]))
        uslot = slot[starts]
        nc = len(COUNTER_FIELDS)
        vals = values[:, :nc]

        has = ~np.isnan(values)
        valid = has[:, :nc]
        if not single:
            # Per row and column, the last row up to it (seen) and before it (seen_before)
            # that has a value: one pass serves the counters' previous readings, each group's
            # last readings and the metrics that vanished.
            rows = np.arange(len(values), dtype=np.int32)[:, None]
            seen = np.maximum.accumulate(np.where(has, rows, np.int32(-1)), axis=0)
            seen_before = np.vstack([np.full((1, len(VALUE_COLUMNS)), -1, np.int32), seen[:-1]])
            in_group_before = seen_before >= gstart[:, None]

        # Counter increments, robust to resets and nulls.
        if single:
            prev = self.last_counter[slot]
        else:
            prev = np.where(
                in_group_before[:, :nc],
                np.take_along_axis(vals, np.maximum(seen_before[:, :nc], 0), axis=0),
                self.last_counter[slot],
            )
        inc = vals - prev
        reset = valid & (inc < 0)
        inc = np.where(reset, vals, inc)
        inc = np.where(valid & ~np.isnan(prev), inc, 0.0)
        last_c = vals if single else _last_valid(vals, seen[:, :nc], starts, ends)
        self.last_counter[uslot] = np.where(np.isnan(last_c), self.last_counter[uslot], last_c)
        # Structure of the stream: the gap before each sample, and how many of the readings
        # this GPU reported before are missing from it (metrics that vanished).
        prev_t = (
            self.last_ms[slot]
            if single
            else np.where(np.arange(len(t)) > gstart, np.r_[np.nan, t[:-1]], self.last_ms[slot])
        )
        gap = np.where(np.isnan(prev_t), 0.0, (t - prev_t) / 1000.0)
        before = self.reported[slot] if single else self.reported[slot] | in_group_before
        vanished = (before & ~has).sum(axis=1).astype(np.float64)
        self.reported[uslot] |= has if single else seen[ends] >= starts[:, None]
        self.vanished_now[uslot] = vanished[ends]
        # A life boundary in the gap before a row (an event, or a counter read below its
        # previous value): the row's increases carry the life before, except a counter's own
        # reset. Evidence from before the latest boundary is forgotten.
        tf = t.astype(np.float64)
        crossed, boundary = self._crossings(slot, t, prev_t, lives)
        row_reset = reset.any(axis=1)
        crossed |= row_reset
        boundary = np.where(row_reset, np.fmax(boundary, tf), boundary)
        evidence = np.where(crossed[:, None], reset & (inc > 0), inc > 0)
        life = boundary if single else np.fmax.reduceat(boundary, starts)
        self.life_ms[uslot] = np.fmax(self.life_ms[uslot], life)
        for key, cols in _SBE_DBE:
            k = _LAST_TIMES.index(key)
            hit = np.where(evidence[:, cols].any(axis=1), tf, -np.inf)
            when = hit if single else np.maximum.reduceat(hit, starts)
            ok = np.isfinite(when) & ~(when < self.life_ms[uslot])
            self.last_time[uslot, k] = np.where(ok, when, self.last_time[uslot, k])

        # Base quantities (one column each), spread over their windows by _BASE_OF / _TAU_OF.
        gauges = values[:, nc : nc + len(GAUGES)]
        g_ok = ~np.isnan(gauges)
        thr = values[:, _THROTTLE_AT]
        thr_ok = ~np.isnan(thr)
        bits = np.where(thr_ok, thr, 0).astype(np.int64)
        flags = np.column_stack([(bits & mask) != 0 for _, mask in FLAGS])
        base = np.column_stack(
            [
                inc,
                reset.any(axis=1),
                np.where(g_ok, gauges, 0.0),
                g_ok,
                flags,
                thr_ok,
                np.ones(len(t)),
                gap,
                gap * gap,
                vanished,
            ]
        )
        decay = np.exp(-((now - t) / 1000.0)[:, None] / _TAUS[None, :])
        self.acc[uslot[:, None], _SAMPLE_COLUMNS] += _decayed_sums(base, decay, starts)
        latest = values[:, _LATEST_AT]
        last_g = latest if single else _last_valid(latest, seen[:, _LATEST_AT], starts, ends)
        self.latest[uslot] = np.where(np.isnan(last_g), self.latest[uslot], last_g)
        self.last_ms[uslot] = t[ends]
        self.first_ms[uslot] = np.where(
            np.isnan(self.first_ms[uslot]), t[starts], self.first_ms[uslot]
        )

    def _crossings(
        self,
        slot: np.ndarray,
        t: np.ndarray,
        prev_t: np.ndarray,
        lives: tuple[np.ndarray, np.ndarray] | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per row (sorted by slot, then time): whether a life boundary falls in its gap
        ``(prev_t, t]`` (a boundary of an earlier update, or one of ``lives``), and the latest
        boundary up to the row's time (NaN: none)."""
        old = self.life_ms[slot]
        crossed = prev_t < old  # NaN on either side: False
        boundary = np.where(old <= t, old, np.nan)
        if lives is None:
            return crossed, boundary
        b_slot, b_ts = lives
        lo = np.searchsorted(b_slot, slot, side="left")
        hi = np.searchsorted(b_slot, slot, side="right")
        has = hi > lo
        for i in np.flatnonzero(has):  # rows of GPUs whose life ended in this update
            ts = b_ts[lo[i] : hi[i]]
            upto = ts[ts <= t[i]]
            if len(upto):
                boundary[i] = np.fmax(boundary[i], float(upto[-1]))
                crossed[i] |= bool(np.isnan(prev_t[i]) or upto[-1] > prev_t[i])
        return crossed, boundary

    def _fold_events(self, frame: pd.DataFrame) -> None:
        now = self.now_ms
        assert now is not None
        t = frame["ts_ms"].to_numpy(dtype=np.int64)
        if t.max() > now:
            raise InvalidInput("an event is newer than the update's now_ms")
        kinds = frame["kind"].astype(str).to_numpy()
        xids = pd.to_numeric(frame["xid"], errors="coerce").to_numpy(dtype=np.float64)
        gpu = pd.to_numeric(frame["gpu"], errors="coerce").to_numpy(dtype=np.float64)
        nodes = frame["node"].astype(str).to_numpy()
        chan = np.empty(len(frame), dtype=object)
        for i, (k, x) in enumerate(zip(kinds, xids, strict=True)):
            if k == "xid":
                chan[i] = f"xid_{xid_class(int(x))}" if not np.isnan(x) else "xid_other"
            else:
                chan[i] = k if k in EVENT_CHANNELS else None
        fatal = np.isin(np.nan_to_num(xids, nan=-1).astype(np.int64), list(FATAL_XIDS))
        fatal &= kinds == "xid"
        per_gpu = ~np.isnan(gpu)
        slot_list = [self.slots(nodes[per_gpu], gpu[per_gpu].astype(np.int64))]
        rows = [np.flatnonzero(per_gpu)]
        for row_i in np.flatnonzero(~per_gpu):  # node-level events reach every GPU of the node
            node_idx = self._node_index.get(nodes[row_i])
            targets: np.ndarray = (
                np.flatnonzero(self.node_of[: self.size] == node_idx)
                if node_idx is not None
                else np.zeros(0, dtype=np.int64)
            )
            slot_list.append(targets.astype(np.int64))
            rows.append(np.full(len(targets), row_i))
        slot = np.concatenate(slot_list)
        row = np.concatenate(rows).astype(np.int64)
        for s, r in zip(slot, row, strict=True):
            c = chan[r]
            when = float(t[r])
            if fatal[r]:
                k = _LAST_TIMES.index("fatal_xid")
                self.last_time[s, k] = np.fmax(self.last_time[s, k], when)
            if c is None:
                continue
            k = _LAST_TIMES.index(c)
            self.last_time[s, k] = np.fmax(self.last_time[s, k], when)
            for w in ("5m", "1h", "24h"):
                j = COLUMN[f"ev:{c}:{w}"]
                self.acc[s, j] += np.exp(-(now - when) / 1000.0 / TAU[j])

    def last_time_of(self, key: str) -> np.ndarray:
        """Per slot, when ``key`` (``sbe``, ``dbe``, an event channel, ``fatal_xid``) last
        happened, in ms (NaN: never)."""
        return self.last_time[: self.size, _LAST_TIMES.index(key)]
