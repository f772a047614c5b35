"""The alarm budget: a live threshold met on the fleet's own score distribution.

An operator says how many false alarms a fleet may raise — ``false_alarms_per_1000_gpu_days``
(default 2) — not which probability is "high". A probability fixed on simulated data does not
transfer: another fleet's healthy GPUs score higher or lower, and the same threshold gives
ten times the alarms there. :class:`AlarmBudget` watches the scores of healthy GPU-time and
keeps the threshold that the budget allows on *this* fleet:

1. time is cut into blocks (``block_s``, 1 h); per GPU and block it keeps the highest score,
   so a GPU-block above the threshold is (at most) one alarm, whatever the alarm's length;
2. a block becomes *healthy* time ``confirm_s`` (12 h) after it ends, unless its GPU failed
   meanwhile (:meth:`AlarmBudget.discard`): the hours before a failure are not what the
   budget is about, and a fleet with many failures must not raise its own threshold;
3. the threshold is the score a healthy GPU-block exceeds with probability
   ``budget / 1000 * block_s / 1 day``. Such a rare level is read off the tail: above the
   level ``u`` that a larger share of blocks exceeds (at least ``tail_blocks``), the excess
   of the score's logit is close to exponential, so the level is ``u + mean excess *
   ln(share above u / wanted share)`` (peaks over threshold). Blocks are weighted down with a
   half-life (``half_life_days``), so the threshold follows a fleet that changes.

Until ``min_blocks`` healthy GPU-blocks are confirmed (by default one over the wanted share:
12,000 GPU-hours at 2 per 1,000 GPU-days, half a day of a 1,024-GPU fleet) the threshold is
provisional: the same fit over confirmed and not yet confirmed blocks (a failure discards its
GPU's blocks from both). Before ``provisional_blocks`` (500) closed blocks were seen at all, it
is ``fallback`` (e.g. the model card's), raised to the same fit over the block still open
(each GPU's highest score so far) once that holds 500 GPUs: a card's threshold can be far too
low on a fleet it never saw, and a 1,024-GPU fleet would otherwise alarm on it for its whole
first hour. A card's threshold can be far off either way, so it is left early; a fit on a few
hundred *confirmed* hours alone would be trusted too early, so the confirmed fit waits for its
own, larger amount.

Example::

    budget = AlarmBudget(2.0, fallback=model.card["raw_threshold"])
    for each tick:
        frame = scorer.score()
        budget.observe(frame["score"].to_numpy(), now_ms=now)   # index = the scorer's slot
        alarm = frame["score"].to_numpy() >= budget.threshold
    budget.discard([slot_of_the_failed_gpu])                   # when a GPU fails
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["AlarmBudget", "logit", "replay", "ticks"]

_EDGES = np.linspace(-30.0, 30.0, 6001)  # logit bins of 0.01
_CENTRES = (_EDGES[:-1] + _EDGES[1:]) / 2
_EPS = 1e-12


def _histogram(v: np.ndarray) -> np.ndarray:
    bins = np.clip(np.searchsorted(_EDGES, v, side="right") - 1, 0, len(_CENTRES) - 1)
    return np.bincount(bins, minlength=len(_CENTRES)).astype(np.float64)


def _sigmoid(v: float) -> float:
    return float(1.0 / (1.0 + math.exp(-v)))


def logit(p: np.ndarray) -> np.ndarray:
    """log(p / (1 - p)) of scores in [0, 1] (clipped away from 0 and 1)."""
    q = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1 - _EPS)
    return np.log(q) - np.log1p(-q)


class AlarmBudget:
    """A live alarm threshold for ``false_alarms_per_1000_gpu_days`` on the observed fleet.

    Args:
        false_alarms_per_1000_gpu_days: the budget.
        fallback: the threshold (score scale) until enough healthy time is seen.
        block_s: length of a block; one GPU-block above the threshold counts one alarm.
        confirm_s: a block counts as healthy this long after its end if its GPU did not fail.
        half_life_days: weight of a block halves with this age (forgetting an old fleet).
        tail_blocks: the tail fit uses at least this many (weighted) blocks above ``u``.
        min_blocks: healthy GPU-blocks needed before the fleet's own threshold is used; None:
            one over the wanted share (12,000 GPU-hours at 2 per 1,000 GPU-days), so that the
            healthy time holds at least one expected false alarm and the fit reads its level
            instead of extrapolating from a far commoner one (at least 500).
        provisional_blocks: GPU-blocks seen (confirmed or not) before the provisional fit
            replaces ``fallback``.
    """

    def __init__(
        self,
        false_alarms_per_1000_gpu_days: float = 2.0,
        *,
        fallback: float = 0.5,
        block_s: float = 3600.0,
        confirm_s: float = 12 * 3600.0,
        half_life_days: float = 14.0,
        tail_blocks: float = 30.0,
        min_blocks: float | None = None,
        provisional_blocks: float = 500.0,
    ) -> None:
        if false_alarms_per_1000_gpu_days <= 0:
            raise ValueError("the budget must be positive")
        self.budget = float(false_alarms_per_1000_gpu_days)
        self.fallback = float(fallback)
        self.block_ms = int(block_s * 1000)
        self.confirm_ms = int(confirm_s * 1000)
        self.half_life_ms = half_life_days * 86_400_000
        self.tail_blocks = float(tail_blocks)
        self.share = self.budget / 1000.0 * block_s / 86400.0
        """Wanted probability that a healthy GPU-block exceeds the threshold."""
        self.min_blocks = max(500.0, 1.0 / self.share) if min_blocks is None else min_blocks
        self.provisional_blocks = min(float(provisional_blocks), self.min_blocks)
        self._hist = np.zeros(len(_CENTRES))
        self._hist_ms: int | None = None  # the time the histogram's weights refer to
        self._block: int | None = None
        self._cur = np.full(0, np.nan)
        self._pending: deque[tuple[int, np.ndarray]] = deque()
        self._threshold: float | None = None

    # -- feeding -------------------------------------------------------------------------

    def observe(
        self, scores: np.ndarray, *, now_ms: int, healthy: np.ndarray | None = None
    ) -> None:
        """Fold in the scores of one tick, ``scores[i]`` being GPU slot ``i`` (slots must keep
        their meaning from call to call; NaN: not scored). ``healthy`` (same length, bool)
        leaves out GPUs known not to be healthy (drained, already failing)."""
        s = logit(np.asarray(scores, dtype=np.float64))
        s = np.where(np.isfinite(np.asarray(scores, dtype=np.float64)), s, np.nan)
        if healthy is not None:
            s = np.where(np.asarray(healthy, dtype=bool), s, np.nan)
        block = int(now_ms // self.block_ms)
        if self._block is None:
            self._block = block
        if block != self._block:
            self._close(self._block)
            self._block = block
        if len(s) > len(self._cur):
            self._cur = np.r_[self._cur, np.full(len(s) - len(self._cur), np.nan)]
        cur = self._cur[: len(s)]
        self._cur[: len(s)] = np.fmax(cur, s)
        self._confirm(now_ms)

    def discard(self, slots: Iterable[int]) -> None:
        """These GPUs failed (or were found faulty): their unconfirmed time is not healthy."""
        idx = np.fromiter((int(i) for i in slots), dtype=np.int64)
        if not len(idx):
            return
        self._cur[idx[idx < len(self._cur)]] = np.nan
        for _, values in self._pending:
            values[idx[idx < len(values)]] = np.nan

    def forget(self, score: float, weight: float) -> None:
        """Take up to ``weight`` confirmed GPU-blocks off the bin of ``score``: the floor's
        alarms (counted at its score) of a rule no longer a floor, which were not the
        model's (:meth:`predictor.floor_budget.FloorBudget.released`)."""
        if weight <= 0:
            return
        i = int(np.flatnonzero(_histogram(logit(np.array([score]))))[0])
        self._hist[i] = max(0.0, self._hist[i] - float(weight))
        self._threshold = None

    def _close(self, block: int) -> None:
        end_ms = (block + 1) * self.block_ms
        self._pending.append((end_ms, self._cur.copy()))
        self._cur = np.full(len(self._cur), np.nan)

    def _confirm(self, now_ms: int) -> None:
        changed = False
        while self._pending and self._pending[0][0] + self.confirm_ms <= now_ms:
            end_ms, values = self._pending.popleft()
            self._decay_to(end_ms)
            self._hist += _histogram(values[np.isfinite(values)])
            changed = True
        if changed:
            self._threshold = None

    def _decay_to(self, t_ms: int) -> None:
        if self._hist_ms is not None and t_ms > self._hist_ms:
            self._hist *= 0.5 ** ((t_ms - self._hist_ms) / self.half_life_ms)
        self._hist_ms = t_ms if self._hist_ms is None else max(self._hist_ms, t_ms)

    # -- reading -------------------------------------------------------------------------

    @property
    def healthy_blocks(self) -> float:
        """Weighted count of confirmed healthy GPU-blocks."""
        return float(self._hist.sum())

    @property
    def warm(self) -> bool:
        """Whether the threshold stands on confirmed healthy time only."""
        return self.healthy_blocks >= self.min_blocks

    @property
    def threshold(self) -> float:
        """The alarm threshold on the score scale (alarm: score >= threshold)."""
        if self.warm:
            if self._threshold is None:
                self._threshold = _sigmoid(self._tail_level(self._hist))
            return self._threshold
        provisional = self._hist + self._pending_hist()
        closed = provisional.sum()
        if closed >= self.provisional_blocks:
            return _sigmoid(self._tail_level(provisional))
        # Too few closed blocks to fit: the card's threshold, raised to what this fleet's own
        # open block already shows (each GPU's highest score so far; a partial block's maximum
        # is no higher than the whole block's, so this fit only ever errs low, and the card's
        # threshold bounds it from below).
        now = self._cur[np.isfinite(self._cur)]
        if closed + len(now) < self.provisional_blocks:
            return self.fallback
        return max(self.fallback, _sigmoid(self._tail_level(provisional + _histogram(now))))

    def _pending_hist(self) -> np.ndarray:
        if not self._pending:
            return np.zeros(len(_CENTRES))
        v = np.concatenate([values[np.isfinite(values)] for _, values in self._pending])
        return _histogram(v)

    def _tail_level(self, h: np.ndarray) -> float:
        n = h.sum()
        above = np.cumsum(h[::-1])[::-1]  # weight at or above each bin
        k = max(self.tail_blocks, 20.0 * self.share * n)
        if k >= n:
            return float(_CENTRES[np.flatnonzero(h)[-1]])
        iu = int(np.flatnonzero(above >= k)[-1])
        u = _EDGES[iu]
        w = h[iu:]
        excess = float((w * (_CENTRES[iu:] - u)).sum() / max(w.sum(), _EPS))
        share_u = float(above[iu] / n)
        if share_u <= self.share:  # enough data: the plain empirical level
            return float(u)
        return float(u + max(excess, 1e-3) * math.log(share_u / self.share))

    def summary(self) -> dict[str, Any]:
        """What the threshold stands on, for status pages and model cards."""
        return {
            "false_alarms_per_1000_gpu_days": self.budget,
            "threshold": self.threshold,
            "warm": self.warm,
            "healthy_gpu_blocks": self.healthy_blocks,
            "block_s": self.block_ms / 1000.0,
            "fallback": self.fallback,
        }

    # -- keeping it across restarts ----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a restarted service needs to keep this fleet's threshold: the confirmed
        healthy-time histogram (its non-empty bins) and the time its weights refer to. Blocks
        not yet confirmed are left out, so a restart forgets at most ``confirm_s`` of healthy
        time. The histogram does not depend on the budget: a new budget can start from it."""
        bins = np.flatnonzero(self._hist)
        return {
            "version": 1,
            "block_ms": self.block_ms,
            "hist_ms": self._hist_ms,
            "bins": bins.tolist(),
            "weights": self._hist[bins].tolist(),
        }

    def restore(self, state: dict[str, Any]) -> bool:
        """Start from :meth:`state`'s histogram; False (and nothing changed) when it was kept
        with another block length or in a format this version does not read."""
        if state.get("version") != 1 or state.get("block_ms") != self.block_ms:
            return False
        bins = np.asarray(state.get("bins", []), dtype=np.int64)
        weights = np.asarray(state.get("weights", []), dtype=np.float64)
        if len(bins) != len(weights) or (
            len(bins) and not 0 <= bins.min() <= bins.max() < len(_CENTRES)
        ):
            return False
        hist = np.zeros(len(_CENTRES))
        hist[bins] = weights
        self._hist = hist
        self._hist_ms = None if state.get("hist_ms") is None else int(state["hist_ms"])
        self._threshold = None
        return True


def ticks(
    ts_ms: np.ndarray,
    failures: tuple[np.ndarray, np.ndarray] | None = None,
    events: tuple[np.ndarray, np.ndarray] | None = None,
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Rows in time order, a tick at a time, as a live loop meets them: per distinct time
    ``t``, the rows' indexes, the failed slots and the ``events`` values (both ``(ts_ms,
    value)``) that happened since the previous tick, up to ``t``."""
    ts_ms = np.asarray(ts_ms, dtype=np.int64)
    if not len(ts_ms):
        return
    order = np.argsort(ts_ms, kind="stable")
    cuts = np.flatnonzero(np.diff(ts_ms[order])) + 1
    f_ts, f_val = _in_time_order(failures, np.int64)
    e_ts, e_val = _in_time_order(events, np.float64)
    fi = ei = 0
    for idx in np.split(order, cuts):
        t = int(ts_ms[idx[0]])
        fj = int(np.searchsorted(f_ts, t, side="right"))
        ej = int(np.searchsorted(e_ts, t, side="right"))
        failed = f_val[fi:fj]
        yield t, idx, failed[failed >= 0], e_val[ei:ej]
        fi, ei = fj, ej


def _in_time_order(
    pairs: tuple[np.ndarray, np.ndarray] | None, dtype: type
) -> tuple[np.ndarray, np.ndarray]:
    if pairs is None:
        return np.zeros(0, np.int64), np.zeros(0, dtype)
    ts = np.asarray(pairs[0], dtype=np.int64)
    order = np.argsort(ts, kind="stable")
    return ts[order], np.asarray(pairs[1], dtype=dtype)[order]


def replay(
    budget: AlarmBudget,
    ts_ms: np.ndarray,
    slot: np.ndarray,
    score: np.ndarray,
    failures: tuple[np.ndarray, np.ndarray] | None = None,
    forget: tuple[np.ndarray, np.ndarray, float] | None = None,
) -> np.ndarray:
    """The threshold each scored row met when it was scored, replaying rows in time order
    through ``budget`` (a row is judged by what the budget knew before its tick; then its
    tick is observed). ``failures`` = (ts_ms, slot) of known failures, discarded when they
    happen, as the live service learns of them; ``forget`` = (ts_ms, weight, score): confirmed
    blocks taken off ``score``'s bin at those times (:meth:`AlarmBudget.forget`)."""
    slot = np.asarray(slot, dtype=np.int64)
    score = np.asarray(score, dtype=np.float64)
    out = np.full(len(slot), np.nan)
    n_slots = int(slot.max()) + 1 if len(slot) else 0
    weights = None if forget is None else (forget[0], forget[1])
    for t, idx, failed, weight in ticks(ts_ms, failures, weights):
        budget.discard(failed)
        if len(weight):
            budget.forget(forget[2] if forget is not None else 0.0, float(weight.sum()))
        out[idx] = budget.threshold
        vec = np.full(n_slots, np.nan)
        vec[slot[idx]] = score[idx]
        budget.observe(vec, now_ms=t)
    return out
