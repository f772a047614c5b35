"""The alarm budget: the threshold follows the fleet's own scores, and keeps to the budget."""

from __future__ import annotations

import numpy as np
import pytest

from predictor.budget import AlarmBudget, logit, replay


def _fleet(shift: float, *, gpus: int = 1024, days: float = 7.0, step_s: float = 600.0, seed=0):
    """Healthy GPUs whose score logits wander around ``-6 + shift`` (a slow per-GPU level plus
    noise), scored every ``step_s``."""
    rng = np.random.default_rng(seed)
    steps = int(days * 86400 / step_s)
    level = rng.normal(-6.0 + shift, 0.7, gpus)
    ts = np.repeat(np.arange(steps, dtype=np.int64) * int(step_s * 1000), gpus)
    slot = np.tile(np.arange(gpus), steps)
    lg = np.repeat(level[None, :], steps, axis=0).ravel() + rng.normal(0, 1.0, steps * gpus)
    return ts, slot, 1 / (1 + np.exp(-lg))


def _false_alarms_per_1000_gpu_days(ts, slot, score, thr, block_s=3600.0) -> float:
    """GPU-blocks with a score at or above its threshold, per 1,000 GPU-days."""
    hit = score >= thr
    block = ts // int(block_s * 1000)
    alarmed = np.unique(np.c_[slot[hit], block[hit]], axis=0)
    gpu_days = len(np.unique(slot)) * (ts.max() - ts.min()) / 86_400_000
    return len(alarmed) / gpu_days * 1000


@pytest.mark.parametrize("shift", [0.0, 3.0])
def test_realised_false_alarms_stay_within_twice_the_budget_on_any_level(shift) -> None:
    ts, slot, score = _fleet(shift)
    budget = AlarmBudget(2.0, fallback=0.999999)
    thr = replay(budget, ts, slot, score)
    assert budget.warm
    rate = _false_alarms_per_1000_gpu_days(ts, slot, score, thr)
    assert 0.5 <= rate <= 4.0, rate
    # the threshold moved with the fleet: a shift of 3 in the logit moves it about as much
    assert abs(float(logit(budget.threshold)) - (-6 + shift)) < 8


def test_threshold_transfers_between_fleets() -> None:
    levels = []
    for shift in (0.0, 3.0):
        ts, slot, score = _fleet(shift, seed=1)
        b = AlarmBudget(2.0)
        replay(b, ts, slot, score)
        levels.append(float(logit(b.threshold)))
    assert 2.0 < levels[1] - levels[0] < 4.0


def test_failing_gpus_do_not_raise_the_threshold() -> None:
    ts, slot, score = _fleet(0.0, days=3.0, seed=2)
    clean = AlarmBudget(2.0)
    replay(clean, ts, slot, score)
    # 40 GPUs score near 1 for the 6 hours before they fail
    sick = np.arange(40) * 20
    fail_ts = np.full(40, int(2.5 * 86_400_000))
    ramp = (np.isin(slot, sick)) & (ts > fail_ts[0] - 6 * 3_600_000) & (ts < fail_ts[0])
    up = ~(np.isin(slot, sick) & (ts >= fail_ts[0]))  # a failed GPU is no longer scored
    noisy = np.where(ramp, 0.99, score)
    told = AlarmBudget(2.0)
    replay(told, ts[up], slot[up], noisy[up], failures=(fail_ts, sick))
    assert abs(float(logit(told.threshold)) - float(logit(clean.threshold))) < 0.5


def test_fallback_until_warm_and_validation() -> None:
    b = AlarmBudget(2.0, fallback=0.3)
    b.observe(np.full(8, 0.01), now_ms=0)
    assert not b.warm and b.threshold == 0.3
    assert b.summary()["warm"] is False
    with pytest.raises(ValueError):
        AlarmBudget(0.0)


def test_a_new_fleet_leaves_the_cards_threshold_after_500_gpu_hours_seen() -> None:
    """The card's threshold holds for the first 500 GPU-hours; then a provisional fit over
    hours not yet confirmed replaces it, long before 12,000 confirmed hours make it warm."""
    ts, slot, score = _fleet(0.0, gpus=100, days=1.0, seed=3)
    b = AlarmBudget(2.0, fallback=0.999)
    assert b.provisional_blocks == 500 and b.min_blocks == pytest.approx(12_000)
    hour = 3_600_000
    early = ts < 5 * hour
    replay(b, ts[early], slot[early], score[early])
    assert b.threshold == 0.999  # 4 hours closed: 400 GPU-hours
    later = (ts >= 5 * hour) & (ts < 7 * hour)
    replay(b, ts[later], slot[later], score[later])
    assert not b.warm and b.healthy_blocks == 0
    assert b.threshold < 0.9  # a fit on this fleet's own scores, not the card's 0.999
    assert (score[ts < 7 * hour] >= b.threshold).mean() < 0.001  # and still in its tail


def test_a_card_threshold_too_low_for_the_fleet_is_raised_within_its_first_hour() -> None:
    """A 1,024-GPU fleet that scores far higher than the card's fleet: before its first hour
    closes, the threshold is already the fleet's own, not the card's; a fleet scoring lower
    keeps the card's threshold until then."""
    ts, slot, score = _fleet(3.0, gpus=1024, days=1 / 24, step_s=60.0, seed=4)
    card = float(1 / (1 + np.exp(2.0)))  # logit -2: about 2 % of this fleet's GPU-minutes
    assert (score >= card).mean() > 0.01
    b = AlarmBudget(2.0, fallback=card)
    thr = replay(b, ts, slot, score)
    assert thr[0] == card  # nothing seen yet
    later = ts >= 10 * 60_000
    assert thr[later].min() > card
    alarmed = np.unique(slot[later & (score >= thr)])
    assert len(alarmed) <= 5  # against 1,024 x 2 % on the card's threshold
    quiet_ts, quiet_slot, quiet = _fleet(-3.0, gpus=1024, days=1 / 24, step_s=60.0, seed=4)
    q = AlarmBudget(2.0, fallback=card)
    assert (replay(q, quiet_ts, quiet_slot, quiet) == card).all()
