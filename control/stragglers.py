"""Stragglers: a rank whose compute keeps its peers waiting, why, and whether moving it pays.

Under data parallelism every rank's step takes the same wall time (the all-reduce waits for
the slowest), so a slow GPU shows in the job wrapper's ``compute_s`` (step start -> arrival at
the step's first collective, :class:`forewarn.wire.RankTimings`) and in its peers' ``wait_s``.
Everything here is pure: the control loop reads the stored timings, placement and samples and
writes what these functions return.

- :func:`judge`: a rank is *above* when its ``compute_s`` exceeds its peers' median (the other
  ranks of the job) by ``straggler_margin`` (relative) and ``straggler_min_s`` (absolute); it
  becomes a straggler once it stayed above for ``straggler_window_s``, and clears only when
  its excess falls below the lower ``straggler_clear_margin`` (or half ``straggler_min_s``).
- :func:`name_reason`: what the GPU's own telemetry says about it (clock-event reasons,
  temperature, a narrowed or downgraded PCIe link, interconnect errors rising), else
  ``"unknown"``.
- :func:`projected_gain` and :func:`move_cost`: the seconds a move would save over the rest of
  the run, against the pause a move costs (measured on this job, else on the fleet, else the
  policy's default).
- :func:`summarise_history`: the fleet's own straggler history (the episodes announced, the
  rank time judged) as a rate per GPU-day, a slowdown and a duration: what
  ``forewarn goodput --stragglers-from`` takes in place of figures nobody published.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = [
    "THROTTLE_BITS",
    "Gain",
    "History",
    "Judgement",
    "RankState",
    "judge",
    "move_cost",
    "name_reason",
    "peer_medians",
    "projected_gain",
    "summarise_history",
]

THROTTLE_BITS: tuple[tuple[int, str], ...] = (
    (0x80, "HW power brake slowdown"),
    (0x40, "HW thermal slowdown"),
    (0x20, "SW thermal slowdown"),
    (0x08, "HW slowdown"),
    (0x04, "SW power cap"),
)
"""NVML clocks-event reasons (``nvmlClocksEventReason*``, formerly ``ClocksThrottleReason``)
that slow a busy GPU, most severe first. Idle (0x1), application clocks (0x2), sync boost
(0x10) and display clock (0x100) are settings or load, not a fault, and are not named."""

_LINK_COUNTERS: tuple[tuple[str, str], ...] = (
    ("nvlink_crc_flit", "NVLink CRC flit"),
    ("nvlink_crc_data", "NVLink CRC data"),
    ("nvlink_replay", "NVLink replay"),
    ("nvlink_recovery", "NVLink recovery"),
    ("pcie_replay", "PCIe replay"),
)


@dataclass
class RankState:
    """A rank's straggler state, as stored between ticks (``rank_timings``)."""

    above_since_ms: int | None = None
    """Since when its compute stayed above the margin (None: it is not above)."""
    straggling: bool = False
    straggling_ms: int | None = None
    """When it became a straggler."""
    reason: str | None = None


@dataclass(frozen=True)
class Judgement:
    rank: int
    compute_s: float
    peers_median_s: float
    state: RankState
    became: bool
    """It became a straggler at this judgement."""
    cleared: bool
    """It stopped being one at this judgement."""


def judge(
    policy: Any,
    compute_s: Mapping[int, float],
    states: Mapping[int, RankState],
    *,
    now_ms: int,
) -> list[Judgement]:
    """Judge every rank of one job from its ``compute_s`` (seconds, by rank).

    Args:
        policy: a :class:`control.policy.Policy` (its ``straggler_*`` fields).
        compute_s: the job's active ranks' compute times, one median each.
        states: each rank's state from the last judgement (missing: a fresh state).
        now_ms: the time of this judgement.

    Returns:
        One judgement per rank, with its new state (the caller stores it). A job with fewer
        than two ranks has no peers: nothing is judged.
    """
    if len(compute_s) < 2:
        return []
    out = []
    ranks = sorted(compute_s)
    medians = peer_medians([compute_s[r] for r in ranks])
    for rank, median in zip(ranks, medians.tolist(), strict=True):
        mine = compute_s[rank]
        excess = mine - median
        above = excess >= policy.straggler_min_s and excess > policy.straggler_margin * median
        below_clear = (
            excess < policy.straggler_min_s / 2 or excess <= policy.straggler_clear_margin * median
        )
        before = states.get(rank, RankState())
        state = RankState(before.above_since_ms, before.straggling, before.straggling_ms)
        state.reason = before.reason
        became = cleared = False
        if state.straggling:
            if below_clear:
                state = RankState()
                cleared = True
        elif above:
            if state.above_since_ms is None:
                state.above_since_ms = now_ms
            if now_ms - state.above_since_ms >= policy.straggler_window_s * 1000:
                state.straggling, state.straggling_ms, became = True, now_ms, True
        else:
            state = RankState()
        out.append(Judgement(rank, mine, median, state, became, cleared))
    return out


def peer_medians(values: Sequence[float]) -> np.ndarray:
    """For each value, the median of all the others: O(n log n), not O(n²) (a 16,384-rank
    job is judged every tick)."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n < 2:
        return np.full(n, np.nan)
    order = np.argsort(v, kind="stable")
    s = v[order]
    where = np.empty(n, dtype=np.int64)
    where[order] = np.arange(n)  # each value's position in s

    def others(k: int) -> np.ndarray:
        # The k-th smallest of the others: s[k] below the value's own position, else s[k + 1].
        return np.where(k < where, s[k], s[np.minimum(k + 1, n - 1)])

    m = n - 1
    if m % 2:
        return others(m // 2)
    return (others(m // 2 - 1) + others(m // 2)) / 2


def name_reason(samples: Sequence[Mapping[str, Any]], *, hot_c: float) -> str:
    """Why a GPU is slow, from its recent samples (oldest first): every cause that shows,
    joined by ``"; "``, or ``"unknown"``.

    Args:
        samples: rows with :class:`forewarn.wire.GpuSample`'s field names (``None`` or
            missing: not reported); the newest is the last.
        hot_c: the die temperature at or above which the GPU counts as hot.
    """
    if not samples:
        return "unknown"
    newest = samples[-1]
    causes: list[str] = []
    bits = _int(newest.get("throttle_reasons"))
    if bits:
        named = [f"{name} (0x{bit:x})" for bit, name in THROTTLE_BITS if bits & bit]
        if named:
            causes.append("clocks held down: " + ", ".join(named))
    temp = _float(newest.get("temp_gpu_c"))
    if temp is not None and temp >= hot_c:
        causes.append(f"hot: {temp:g} °C")
    width, width_max = _int(newest.get("pcie_link_width")), _int(newest.get("pcie_link_width_max"))
    if width is not None and width_max is not None and 0 < width < width_max:
        causes.append(f"PCIe link at x{width} of x{width_max}")
    gen = _int(newest.get("pcie_link_gen"))
    gens = [g for g in (_int(s.get("pcie_link_gen")) for s in samples) if g is not None]
    if gen is not None and gens and gen < max(gens):
        causes.append(f"PCIe link down to gen {gen} (was gen {max(gens)})")
    grown = []
    for field, name in _LINK_COUNTERS:
        rise = _rise(s.get(field) for s in samples)
        if rise > 0:
            grown.append(f"{name} +{rise}")
    if grown:
        causes.append("link errors rising: " + ", ".join(grown))
    return "; ".join(causes) or "unknown"


@dataclass(frozen=True)
class Gain:
    seconds: float
    """The seconds of the whole job's time a move would save over the rest of the run."""
    remaining_steps: int
    remaining_from: Literal["total_steps", "horizon"]


def projected_gain(
    *,
    compute_s: float,
    peers_median_s: float,
    step: int,
    total_steps: int | None,
    horizon_steps: int,
) -> Gain:
    """(compute_s - peers' median) x the steps left (``total_steps - step``; the policy's
    horizon when the job did not say how long it runs)."""
    if total_steps is not None:
        remaining, source = max(total_steps - step, 0), "total_steps"
    else:
        remaining, source = horizon_steps, "horizon"
    excess = max(compute_s - peers_median_s, 0.0)
    return Gain(excess * remaining, remaining, source)  # type: ignore[arg-type]


def move_cost(
    *, job_pauses_s: Sequence[float], fleet_pauses_s: Sequence[float], default_s: float
) -> tuple[float, Literal["job", "fleet", "policy"]]:
    """The pause a move costs: the median measured pause of this job's completed migrations,
    else of the fleet's, else the policy's default; and which one it is."""
    if job_pauses_s:
        return float(statistics.median(job_pauses_s)), "job"
    if fleet_pauses_s:
        return float(statistics.median(fleet_pauses_s)), "fleet"
    return float(default_s), "policy"


def _rise(values: Iterable[Any]) -> int:
    """How much a cumulative counter grew over the samples (a reset to a lower value starts
    counting again from there)."""
    total, last = 0, None
    for value in values:
        v = _int(value)
        if v is None:
            continue
        if last is not None and v > last:
            total += v - last
        last = v
    return total


def _int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        if value != value:  # NaN, pandas NA
            return None
        return int(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any) -> float | None:
    number = _int(value) if isinstance(value, bool) else value
    if number is None:
        return None
    try:
        result = float(number)
    except (TypeError, ValueError):
        return None
    return None if result != result else result


@dataclass(frozen=True)
class History:
    """The fleet's own straggler history, summed up (:func:`summarise_history`)."""

    episodes: int
    """Episodes announced (``rank.straggling``)."""
    ended: int
    """Of them, those that ended (``rank.recovered``)."""
    rank_days: float
    """Rank time the watch judged, in days (each rank of a job of two or more, with fresh
    timings, per tick)."""
    since_ms: int | None
    episodes_per_gpu_day: float | None
    """``episodes / rank_days``; None before any rank time was judged."""
    slowdown: float | None
    """Median of ``compute_s / peers_median_s`` when each episode was announced."""
    duration_mean_s: float | None
    """Mean span of an episode, from its compute first above its peers' to its end: the
    spans of the ended ones and the time so far of those that last, over the ended count
    (the exponential's estimate with censored spans); None before one ended."""
    detect_median_s: float | None
    """Median of announcement minus first above: the policy's window as it played out."""
    ended_by: dict[str, int]
    reasons: dict[str, int]


def summarise_history(
    episodes: Sequence[Mapping[str, Any]],
    watched: Mapping[str, int] | None,
    *,
    now_ms: int,
) -> History:
    """Sum up ``episodes`` (each ``{"started": data, "ended": data or None}``, the two
    events' data, :func:`store.control.straggler_episodes`) over ``watched``
    (``{"rank_ms", "since_ms"}``, :func:`store.control.read_watched`)."""
    slowdowns: list[float] = []
    spans_ms = 0
    ended = 0
    detect: list[float] = []
    ended_by: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for episode in episodes:
        started = episode["started"]
        first = int(started.get("above_since_ms") or 0)
        peers = float(started.get("peers_median_s") or 0.0)
        if peers > 0:
            slowdowns.append(float(started.get("compute_s") or 0.0) / peers)
        reason = str(started.get("reason") or "unknown")
        reasons[reason] = reasons.get(reason, 0) + 1
        end = episode.get("ended")
        if end is not None:
            ended += 1
            spans_ms += max(0, int(end["ended_ms"]) - first)
            how = str(end.get("ended_by") or "cleared")
            ended_by[how] = ended_by.get(how, 0) + 1
        else:
            spans_ms += max(0, now_ms - first)
        if end is not None and end.get("straggling_ms") is not None:
            detect.append((int(end["straggling_ms"]) - first) / 1000)
    rank_days = (watched["rank_ms"] / 86_400_000) if watched else 0.0
    return History(
        episodes=len(episodes),
        ended=ended,
        rank_days=rank_days,
        since_ms=watched["since_ms"] if watched else None,
        episodes_per_gpu_day=len(episodes) / rank_days if rank_days > 0 else None,
        slowdown=float(statistics.median(slowdowns)) if slowdowns else None,
        duration_mean_s=spans_ms / 1000 / ended if ended else None,
        detect_median_s=float(statistics.median(detect)) if detect else None,
        ended_by=ended_by,
        reasons=reasons,
    )
