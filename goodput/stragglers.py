"""Stragglers beside failures: GPUs that run slower for a while and slow the whole job.

A synchronous job runs at the speed of its slowest rank, so a GPU that throttles its clocks or
runs its PCIe link at reduced width slows every rank without failing. An episode of
``duration_s`` with a slowdown ``s`` (the straggler takes ``s`` times as long for its share of
a step) costs the job, per strategy:

- **without mitigation** (checkpoint-restart, peer-replica): the whole episode at ``1/s``
  speed, ``duration x (1 - 1/s)`` seconds of training lost;
- **forewarn**: the detection delay at ``1/s`` speed, then one move of the slow rank to a
  spare (a preventive migration's stall, measured: ``Assumptions.migration_pause_s``, the fit
  in ``goodput/data/preventive_stall.json``), then full speed. An episode shorter than the
  detection delay ends before anything is moved.

Episodes arrive as a Poisson process at ``episodes_per_gpu_day x gpus`` (they are independent
of failures), last an exponential time around ``duration_s``; overlapping episodes slow the
job once (the same slowdown), so the loss is the union of their spans.

What was published is kept in ``goodput/data/stragglers.json`` (:func:`published`): the
duration of an episode (Greyhound, as a reader's summary reports it), and no rate per GPU and
no slowdown of one episode. So the term has no default rate or slowdown: the command shows it
when both are given, as a what-if, or from a fleet's own history (:func:`from_history`: the
episodes a running service announced over the rank time it watched,
``GET /v1/stragglers/history``), and says so otherwise.

How soon Forewarn ends an episode is ours to measure, not to assume: ``benchmarks/stragglers.py``
times it end to end (real processes, the default policy) and ``goodput/data/
straggler_detection.json`` keeps the figure (:func:`measured_detect_s`), the command's default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DETECTION_PATH",
    "STRAGGLERS_PATH",
    "Episode",
    "PublishedStragglers",
    "StragglerCost",
    "Stragglers",
    "cost",
    "from_history",
    "measured_detect_s",
    "published",
    "schedule",
]

STRAGGLERS_PATH = Path(__file__).with_name("data") / "stragglers.json"
DETECTION_PATH = Path(__file__).with_name("data") / "straggler_detection.json"
DAY_S = 86400.0


@dataclass(frozen=True)
class PublishedStragglers:
    """The straggler figures found in publications (``goodput/data/stragglers.json``)."""

    episodes_per_gpu_day: float | None
    slowdown: float | None
    duration_mean_s: float | None
    duration_source: str
    missing: str | None
    citations: tuple[str, ...]
    figures: dict[str, Any]
    """Each source's published figures, by its id."""


def published(path: Path = STRAGGLERS_PATH) -> PublishedStragglers:
    """What ``path`` records (None: not published)."""
    doc = json.loads(path.read_text())

    def number(key: str) -> float | None:
        value = doc.get(key)
        return None if value is None else float(value)

    return PublishedStragglers(
        episodes_per_gpu_day=number("episodes_per_gpu_day"),
        slowdown=number("slowdown"),
        duration_mean_s=number("duration_mean_s"),
        duration_source=str(doc.get("duration_source", "")),
        missing=doc.get("missing"),
        citations=tuple(s["citation"] for s in doc["sources"]),
        figures={s["id"]: s.get("figures", {}) for s in doc["sources"]},
    )


def measured_detect_s(path: Path = DETECTION_PATH) -> float:
    """Seconds from a straggler's first slow step until Forewarn's move of it was done, as
    ``benchmarks/stragglers.py`` measured them with the default policy (median of its runs)."""
    return float(json.loads(path.read_text())["detect_s"])


@dataclass(frozen=True)
class Stragglers:
    """The straggler term's numbers: a rate, a slowdown and a duration per episode, and how
    soon Forewarn sees one."""

    episodes_per_gpu_day: float
    """Episodes per GPU per day (wall clock)."""
    slowdown: float
    """How many times longer the straggler takes for its share of a step (>= 1)."""
    duration_s: float
    """Mean length of an episode (exponential)."""
    detect_s: float = 60.0
    """Forewarn: from an episode's start until the slow rank is moved (the command's default
    is :func:`measured_detect_s`)."""
    source: str = ""
    """Where the rate, slowdown and duration come from (empty: the user's what-if)."""

    def __post_init__(self) -> None:
        if self.episodes_per_gpu_day < 0 or self.duration_s <= 0 or self.detect_s < 0:
            raise ValueError("stragglers: rate >= 0, duration > 0 and detection >= 0")
        if self.slowdown < 1.0:
            raise ValueError("stragglers: the slowdown is at least 1 (1: full speed)")

    def break_even_s(self, pause_s: float) -> float:
        """The episode length beyond which moving the slow rank costs less than waiting."""
        if self.slowdown == 1.0:
            return float("inf")
        return self.detect_s + pause_s / (1.0 - 1.0 / self.slowdown)


@dataclass(frozen=True)
class Episode:
    """One straggler episode: its start and length, wall seconds."""

    t_s: float
    duration_s: float


def schedule(gpus: int, horizon_s: float, s: Stragglers, rng: np.random.Generator) -> list[Episode]:
    """Episodes of a job on ``gpus`` GPUs during ``horizon_s`` (Poisson, exponential lengths)."""
    n = int(rng.poisson(s.episodes_per_gpu_day * gpus * horizon_s / DAY_S))
    starts = np.sort(rng.uniform(0.0, horizon_s, n))
    lengths = rng.exponential(s.duration_s, n)
    return [Episode(float(t), float(d)) for t, d in zip(starts, lengths, strict=True)]


@dataclass(frozen=True)
class StragglerCost:
    """What the episodes cost one strategy over a window."""

    episodes: int
    moves: int
    slow_s: float
    """Wall seconds the job ran at the straggler's speed (the union of the slow spans)."""
    lost_s: float
    """Training lost: ``slow_s x (1 - 1/slowdown)`` and, with Forewarn, every move's stall."""


def _union_s(spans: list[tuple[float, float]], horizon_s: float) -> float:
    total, end = 0.0, -1.0
    for a, b in sorted(spans):
        b = min(b, horizon_s)
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def cost(
    episodes: list[Episode], s: Stragglers, *, mitigate: bool, pause_s: float, horizon_s: float
) -> StragglerCost:
    """The episodes' cost without mitigation, or with Forewarn's move (``mitigate``) whose
    stall is ``pause_s`` (``Assumptions.migration_pause_s`` at the job's size)."""
    spans, moves = [], 0
    for e in episodes:
        if mitigate and e.duration_s > s.detect_s:
            spans.append((e.t_s, e.t_s + s.detect_s))
            moves += 1
        else:
            spans.append((e.t_s, e.t_s + e.duration_s))
    slow = _union_s(spans, horizon_s)
    lost = slow * (1.0 - 1.0 / s.slowdown) + moves * pause_s
    return StragglerCost(len(episodes), moves, slow, lost)


def from_history(
    history: dict[str, Any],
    *,
    source: str,
    detect_s: float,
    duration_fallback_s: float | None,
) -> Stragglers:
    """The straggler term of a fleet's own history (the JSON of
    ``GET /v1/stragglers/history``): its rate per GPU-day, median slowdown and mean episode
    length; an episode length from ``duration_fallback_s`` (the published one) while no
    episode has ended.

    Raises:
        ValueError: no rank time watched, or no episode length at all.
    """
    rate = history.get("episodes_per_gpu_day")
    if rate is None or not history.get("rank_days"):
        raise ValueError(f"{source}: no rank time was watched yet, so there is no rate")
    duration = history.get("duration_mean_s") or duration_fallback_s
    if duration is None:
        raise ValueError(f"{source}: no episode ended yet and no published length to use")
    slowdown = history.get("slowdown") or 1.0  # no episode: no slowdown (the term is 0)
    said = (
        f"the fleet's own history ({source}): {history.get('episodes', 0)} episodes in "
        f"{float(history['rank_days']):.2f} rank-days since {history.get('since')}, "
        f"{history.get('ended', 0)} ended"
    )
    if not history.get("duration_mean_s"):
        said += "; episode length the published one (none ended)"
    return Stragglers(float(rate), float(slowdown), float(duration), detect_s, said)
