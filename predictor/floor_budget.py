"""Which of the floor's rules stay a floor on this fleet: the rules held to the alarm budget.

The floor (:mod:`predictor.floor`) alarms on hard evidence whatever the model says, and the
alarm budget (:mod:`predictor.budget`) can only raise the model's threshold above it. On most
fleets a rule trips on a healthy GPU rarely; on some it is the fleet's normal: nodes that run
hot throttle every few minutes (``thermal``), a fleet's memory remaps rows it never needs again
(``remap``, and its Xid 63 in ``fatal_xid``). There one rule alone spends the operator's whole
budget many times over (300 false alarms per 1,000 GPU-days against a budget of 2, measured on
a fleet of hot nodes), and nothing the model does brings it back.

:class:`FloorBudget` counts each rule's alarms on healthy GPUs the way the alarm budget counts
healthy time (one GPU-block of ``block_s`` in which the rule tripped is one alarm; a block is
healthy ``confirm_s`` after its end unless its GPU failed meanwhile) and stops treating a rule
as a floor on this fleet once its own alarms flood the budget: more than ``over`` (10) times
the budget explains. A rule a few times over the budget stays a floor: a row remap pending is
precise evidence that costs a few false alarms, and dropping it loses the memory failures the
rules at the same rate catch (measured: leave-one-family-out folds where ``remap`` alone ran at
3-4 times a budget of 2 lost 2-3 memory failures when held to the budget itself); a hot node's
thermal slowdown at 150 times the budget is a flood.

- **confirmed**: over the confirmed healthy GPU-blocks (weighted down with ``half_life_days``
  as the alarm budget's), the rule's count ``k`` is improbable for a rule within ``over`` times
  the budget: ``P(Poisson(over x share x blocks) >= k) < alpha``, ``share`` being the budget
  per GPU-block;
- **early**, before anything is confirmed (the fleet's first hours, when a rule that trips on
  every hot node would otherwise alarm on each of them): over the blocks not yet confirmed, the
  rule tripped on at least ``spread`` GPUs that are still up, plus two for every GPU it had
  tripped on that failed within those blocks, and that many is as improbable within
  ``over`` times the budget. A GPU with precursors is up until it fails, and on a fleet where
  GPUs fail often several are at once; the rule's own foretold failures in the same hours say
  how many, about one to come for each one seen (a precursor's lead is shorter than
  ``confirm_s``) and one more. One failing GPU, or a few, never demote a rule early; a rule
  that trips on many GPUs at once that do not then fail is the fleet's normal.

The alarms a rule raised before it was demoted were the rule's, not the model's:
:meth:`FloorBudget.released` names the GPUs a newly demoted rule had floored in the blocks not
yet confirmed, and the loop (and the evaluation's replay) drops those blocks from the alarm
budget's healthy time, so that a rule demoted after a few hours does not leave the model's
own threshold at the top of the scale.

A demoted rule is still evidence: its sentence stays among a GPU's reasons, and the model
decides that GPU's alarm. A rule is a floor again once neither count is above what ``over``
times the budget expects (``P(Poisson >= count) >= 0.5``; the early count forgets a block
when it is confirmed, the confirmed count decays), so that it does not come and go by the hour.

Example::

    rules = FloorBudget(2.0)
    for each tick:
        rules.observe(hit_masks, now_ms=now, healthy=up)   # floor_mask() per slot
        floor = (hit_masks & rules.active_mask) != 0
    rules.discard([slot_of_the_failed_gpu])
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np
from scipy.special import gammainc

from predictor.budget import ticks
from predictor.floor import FLOOR_RULES

__all__ = ["FloorBudget", "floor_mask", "replay"]

_ALL = (1 << len(FLOOR_RULES)) - 1
_STAY_DOWN = 0.5  # a demoted rule stays so while its count is above the budget's median


def floor_mask(hits: np.ndarray) -> np.ndarray:
    """Per row of the boolean matrix of :func:`predictor.floor.floor_hits`, the tripped rules
    as one integer (bit ``j``: rule ``j`` of :data:`FLOOR_RULES`)."""
    hits = np.asarray(hits, dtype=bool)
    if not hits.size:
        return np.zeros(len(hits), dtype=np.int64)
    return (hits.astype(np.int64) << np.arange(hits.shape[1], dtype=np.int64)).sum(axis=1)


def _improbable(k: float, expected: float, alpha: float) -> bool:
    """``P(Poisson(expected) >= k) < alpha`` (``k`` may be a decayed, non-integer count)."""
    if k <= 0:
        return False
    return float(gammainc(k, max(expected, 1e-12))) < alpha


class FloorBudget:
    """Per floor rule, its alarms on healthy GPUs against ``false_alarms_per_1000_gpu_days``.

    Args:
        false_alarms_per_1000_gpu_days: the operator's budget (the alarm budget's).
        block_s, confirm_s, half_life_days: as :class:`predictor.budget.AlarmBudget`'s.
        alpha: how improbable a rule's count must be, within ``over`` times the budget, to
            demote it.
        spread: the fewest GPUs a rule must trip on to be demoted before any confirmation.
    """

    def __init__(
        self,
        false_alarms_per_1000_gpu_days: float = 2.0,
        *,
        block_s: float = 3600.0,
        confirm_s: float = 12 * 3600.0,
        half_life_days: float = 14.0,
        alpha: float = 0.01,
        spread: int = 3,
        over: float = 10.0,
    ) -> None:
        if false_alarms_per_1000_gpu_days <= 0:
            raise ValueError("the budget must be positive")
        self.budget = float(false_alarms_per_1000_gpu_days)
        self.block_ms = int(block_s * 1000)
        self.confirm_ms = int(confirm_s * 1000)
        self.half_life_ms = half_life_days * 86_400_000
        self.alpha = float(alpha)
        self.spread = int(spread)
        self.share = self.budget / 1000.0 * block_s / 86400.0
        """The budget per GPU-block: the probability a healthy GPU-block may alarm."""
        self.over = float(over)
        self._flood = self.over * self.share  # per GPU-block: a rule's alarms above it flood
        n = len(FLOOR_RULES)
        self._hits = np.zeros(n)  # confirmed healthy GPU-blocks each rule tripped in (decayed)
        self._blocks = 0.0  # confirmed healthy GPU-blocks (decayed)
        self._at_ms: int | None = None  # the time the confirmed weights refer to
        self._block: int | None = None
        self._cur = np.zeros(0, dtype=np.int64)  # this block's tripped rules per slot
        self._seen = np.zeros(0, dtype=bool)  # slots observed healthy in this block
        self._pending: deque[tuple[int, np.ndarray, np.ndarray]] = deque()
        # (block, per rule: GPUs it had tripped on that failed in that block)
        self._failed: deque[tuple[int, np.ndarray]] = deque()
        self._reported = np.ones(n, dtype=bool)  # the rules active at the last released()
        self._down = np.zeros(n, dtype=bool)  # the rules demoted when last judged
        self._now_ms: int | None = None
        self._kept_early: dict[str, int] = {}  # rules demoted early by an earlier leader: until
        self._active: np.ndarray | None = None

    # -- feeding -------------------------------------------------------------------------

    def observe(self, masks: np.ndarray, *, now_ms: int, healthy: np.ndarray | None = None) -> None:
        """Fold in one tick: ``masks[i]`` the rules slot ``i`` trips (:func:`floor_mask`; -1:
        not scored); ``healthy`` (bool, same length) leaves out GPUs known not to be healthy."""
        m = np.asarray(masks, dtype=np.int64)
        self._now_ms = now_ms if self._now_ms is None else max(self._now_ms, now_ms)
        seen = m >= 0
        if healthy is not None:
            seen &= np.asarray(healthy, dtype=bool)
        block = int(now_ms // self.block_ms)
        if self._block is None:
            self._block = block
        if block != self._block:
            self._pending.append(((self._block + 1) * self.block_ms, self._cur, self._seen))
            self._cur = np.zeros(len(self._cur), dtype=np.int64)
            self._seen = np.zeros(len(self._seen), dtype=bool)
            self._block = block
        if len(m) > len(self._cur):
            grow = len(m) - len(self._cur)
            self._cur = np.r_[self._cur, np.zeros(grow, dtype=np.int64)]
            self._seen = np.r_[self._seen, np.zeros(grow, dtype=bool)]
        self._cur[: len(m)] |= np.where(seen, m, 0)
        self._seen[: len(m)] |= seen
        self._confirm(now_ms)
        self._active = None

    def discard(self, slots: Iterable[int]) -> None:
        """These GPUs failed: their unconfirmed blocks are not healthy time (the rules that
        tripped on them foretold it)."""
        idx = np.unique(np.fromiter((int(i) for i in slots), dtype=np.int64))
        if not len(idx):
            return
        tripped = self._unconfirmed()
        self._failed.append((self._block or 0, _bits(tripped[idx[idx < len(tripped)]])))
        for cur, seen in [(self._cur, self._seen)] + [(c, s) for _, c, s in self._pending]:
            ok = idx[idx < len(cur)]
            cur[ok] = 0
            seen[ok] = False
        self._active = None

    def _confirm(self, now_ms: int) -> None:
        oldest = (now_ms - self.confirm_ms) // self.block_ms - 1  # the unconfirmed blocks'
        while self._failed and self._failed[0][0] < oldest:
            self._failed.popleft()
        while self._pending and self._pending[0][0] + self.confirm_ms <= now_ms:
            end_ms, cur, seen = self._pending.popleft()
            if self._at_ms is not None and end_ms > self._at_ms:
                decay = 0.5 ** ((end_ms - self._at_ms) / self.half_life_ms)
                self._hits *= decay
                self._blocks *= decay
            self._at_ms = end_ms if self._at_ms is None else max(self._at_ms, end_ms)
            self._hits += _bits(cur[seen])
            self._blocks += float(seen.sum())

    # -- reading -------------------------------------------------------------------------

    def _unconfirmed(self) -> np.ndarray:
        """Per slot, the rules it tripped in the blocks not yet confirmed."""
        gpus = np.where(self._seen, self._cur, 0)
        for _, cur, seen in self._pending:
            n = min(len(cur), len(gpus))
            gpus[:n] |= np.where(seen[:n], cur[:n], 0)
            if len(cur) > n:
                gpus = np.r_[gpus, np.where(seen[n:], cur[n:], 0)]
        return gpus

    def _early(self) -> tuple[np.ndarray, float]:
        """Per rule, the GPUs it tripped on in the blocks not yet confirmed, and those
        blocks' healthy GPU-block count."""
        blocks = float(self._seen.sum()) + sum(float(seen.sum()) for _, _, seen in self._pending)
        return _bits(self._unconfirmed()), blocks

    @property
    def active(self) -> np.ndarray:
        """Per rule of :data:`FLOOR_RULES`, whether it is a floor on this fleet."""
        if self._active is None:
            early_gpus, early_blocks = self._early()
            out = np.ones(len(FLOOR_RULES), dtype=bool)
            for j in range(len(FLOOR_RULES)):
                # Demoted at alpha; a demoted rule is a floor again only once neither count
                # is above what the budget expects, so that it does not come and go by the hour.
                down = bool(self._down[j])
                alpha = _STAY_DOWN if down else self.alpha
                confirmed = self._hits[j] >= 1 and _improbable(
                    self._hits[j], self._flood * self._blocks, alpha
                )
                spread = 1 if down else self.early_spread[j]
                early = early_gpus[j] >= spread and _improbable(
                    early_gpus[j], self._flood * early_blocks, alpha
                )
                kept = self._kept_early.get(FLOOR_RULES[j].name, 0) > (self._now_ms or 0)
                out[j] = not (confirmed or early or kept)
            self._down = ~out
            self._active = out
        return self._active

    @property
    def early_spread(self) -> np.ndarray:
        """Per rule, the fewest GPUs it must trip on in the unconfirmed blocks to be demoted
        there: ``spread``, and two for every GPU it tripped on that failed within them."""
        failed = sum((n for _, n in self._failed), np.zeros(len(FLOOR_RULES)))
        return self.spread + 2 * failed

    def released(self) -> tuple[np.ndarray, float]:
        """What the rules demoted since the last call had floored, whose alarms were the
        rule's, not the model's: the slots they tripped on in the blocks not yet confirmed,
        and their confirmed GPU-blocks (weighted)."""
        now = self.active
        newly = self._reported & ~now
        self._reported = now.copy()
        if not newly.any():
            return np.zeros(0, dtype=np.int64), 0.0
        bits = int(sum(1 << int(j) for j in np.flatnonzero(newly)))
        return np.flatnonzero(self._unconfirmed() & bits), float(self._hits[newly].sum())

    @property
    def active_mask(self) -> int:
        """:attr:`active` as a bit mask, to ``&`` with :func:`floor_mask`."""
        return int(sum(1 << j for j, a in enumerate(self.active) if a))

    def demoted(self) -> list[dict[str, Any]]:
        """The rules that are not a floor on this fleet, with what they cost: false alarms per
        1,000 GPU-days over the confirmed healthy time, and GPUs tripped in the unconfirmed."""
        early_gpus, early_blocks = self._early()
        per = 1000.0 * 86_400_000 / self.block_ms
        return [
            {
                "rule": rule.name,
                "false_alarms_per_1000_gpu_days": (
                    float(self._hits[j] / self._blocks * per) if self._blocks else None
                ),
                "healthy_gpu_blocks": self._blocks,
                "unconfirmed_gpus": int(early_gpus[j]),
                "unconfirmed_gpu_blocks": early_blocks,
            }
            for j, rule in enumerate(FLOOR_RULES)
            if not self.active[j]
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "demoted": self.demoted(),
            "alpha": self.alpha,
            "over": self.over,
            "spread": self.spread,
            "early_spread": dict(
                zip([r.name for r in FLOOR_RULES], self.early_spread.tolist(), strict=True)
            ),
            "healthy_gpu_blocks": self._blocks,
        }

    # -- keeping it across restarts ----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The confirmed counts (unconfirmed blocks are left out, as the alarm budget's), and
        the rules demoted on unconfirmed evidence with when that evidence is confirmed: a
        restarted or new leader does not floor a fleet's hot nodes again (and alarm on each
        of them once more) while it gathers that evidence anew."""
        until = None if self._block is None else (self._block + 1) * self.block_ms + self.confirm_ms
        early_gpus, early_blocks = self._early()
        early = {
            r.name: until
            for j, r in enumerate(FLOOR_RULES)
            if until is not None
            and early_gpus[j] >= self.early_spread[j]
            and _improbable(early_gpus[j], self._flood * early_blocks, self.alpha)
        }
        early.update({k: v for k, v in self._kept_early.items() if k not in early})
        return {
            "version": 1,
            "block_ms": self.block_ms,
            "at_ms": self._at_ms,
            "rules": [r.name for r in FLOOR_RULES],
            "hits": self._hits.tolist(),
            "blocks": self._blocks,
            "early_until_ms": early,
        }

    def restore(self, state: dict[str, Any]) -> bool:
        """Start from :meth:`state`'s counts; False (nothing changed) when they were kept with
        another block length, other rules or in a format this version does not read."""
        if state.get("version") != 1 or state.get("block_ms") != self.block_ms:
            return False
        if state.get("rules") != [r.name for r in FLOOR_RULES]:
            return False
        try:
            hits = np.asarray(state["hits"], dtype=np.float64)
            blocks = float(state["blocks"])
        except (KeyError, TypeError, ValueError):
            return False
        if hits.shape != (len(FLOOR_RULES),) or not np.all(np.isfinite(hits)) or hits.min() < 0:
            return False
        if not math.isfinite(blocks) or blocks < 0:
            return False
        early = state.get("early_until_ms") or {}
        if not isinstance(early, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in early.items()
        ):
            return False
        self._hits, self._blocks = hits, blocks
        self._kept_early = dict(early)
        self._at_ms = None if state.get("at_ms") is None else int(state["at_ms"])
        # What it demotes now was released by the leader that kept it: not again.
        self._active = None
        self._reported = self.active.copy()
        return True


def _bits(masks: np.ndarray) -> np.ndarray:
    """Per rule, how many of ``masks`` have its bit."""
    m = np.asarray(masks, dtype=np.int64) & _ALL
    return np.array(
        [float(((m >> j) & 1).sum()) for j in range(len(FLOOR_RULES))], dtype=np.float64
    )


def replay(
    rules: FloorBudget,
    ts_ms: np.ndarray,
    slot: np.ndarray,
    masks: np.ndarray,
    failures: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The rules that were a floor for each row (a bit mask) when it was scored, replaying
    rows in time order through ``rules`` as :func:`predictor.budget.replay` replays the alarm
    budget: a row is judged by what ``rules`` knew before its tick, then its tick is observed;
    ``failures`` = (ts_ms, slot) are discarded when they happen. Also (ts_ms, slot) of the
    GPUs each demotion released (:meth:`FloorBudget.released`), for the alarm budget's replay
    to discard as the loop does, and (ts_ms, confirmed GPU-blocks) to take off the top of its
    scale."""
    slot = np.asarray(slot, dtype=np.int64)
    masks = np.asarray(masks, dtype=np.int64)
    out = np.zeros(len(slot), dtype=np.int64)
    freed_ts: list[np.ndarray] = []
    freed_slot: list[np.ndarray] = []
    forgot: list[tuple[int, float]] = []
    n_slots = int(slot.max()) + 1 if len(slot) else 0
    for t, idx, failed, _ in ticks(ts_ms, failures):
        rules.discard(failed)
        out[idx] = rules.active_mask
        vec = np.full(n_slots, -1, dtype=np.int64)
        vec[slot[idx]] = masks[idx]
        rules.observe(vec, now_ms=t)
        freed, weight = rules.released()
        if len(freed):
            freed_ts.append(np.full(len(freed), t + 1, dtype=np.int64))  # before the next tick
            freed_slot.append(freed)
        if weight:
            forgot.append((t + 1, weight))
    slots = (
        (np.concatenate(freed_ts), np.concatenate(freed_slot))
        if freed_ts
        else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    )
    forget = (
        np.array([t for t, _ in forgot], dtype=np.int64),
        np.array([w for _, w in forgot], dtype=np.float64),
    )
    return out, slots, forget
