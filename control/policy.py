"""The policy: when a GPU's risk becomes a migration, and every guard in front of it.

:class:`Policy` is what operators set (``GET/PUT /v1/policy``; the settings give the defaults).
:func:`decide` is pure: given one crossed GPU under an active rank and the fleet's situation
it returns a :class:`Decision` — ``request``, ``dry_run`` or ``declined`` with a reason — and
the control loop records every decision in the audit log.

Guards, in the order they are checked:

1. the breaker: more than ``breaker_pct`` % of the fleet (and at least ``breaker_min_gpus``)
   crossed the threshold within ``breaker_window_s`` -> no automatic preventive action until an
   operator resets it (a fleet-wide event is not a failing GPU: moving everything would hurt);
2. cooldown: a migration of the same job off this GPU was requested less than
   ``cooldown_s`` ago (another job's rank on the GPU is not held);
3. in flight: the job already has ``max_inflight_per_job`` migrations in flight, or the fleet
   ``max_inflight_fleet``;
4. a spare must be free: a live spare of the job on a node that is not drained, on a GPU that
   is not itself alarmed or failed;
5. dry-run: everything passed, the decision is recorded and nothing is done.

A straggler (trigger ``straggler``, :mod:`control.stragglers`) passes the same guards,
and two of its own before the in-flight limits: the straggler breaker (more than
``straggler_breaker_pct`` % of the judged ranks, and at least ``straggler_breaker_min``,
straggle at once: a shared cause, not a slow GPU) and the gain (the seconds a move would save
over the rest of the run must exceed what a move costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from store.control import RankSlot

__all__ = [
    "Decision",
    "Policy",
    "Situation",
    "StragglerCase",
    "breaker_should_trip",
    "decide",
    "stragglers_should_trip",
]


_WEEK_S = 7 * 86400.0
"""The longest any of the policy's durations may be."""


class Policy(BaseModel):
    """What turns risk into action. Every field has a default (``FOREWARN_POLICY_*``).

    Every number is bounded and finite (a ``cooldown_s`` of 1e308 is a typing error, not a
    policy): a value outside its bounds is refused with 422.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    """Risk at or above which a score counts as alarming; None: the alarm budget's threshold,
    or the model card's when there is no budget."""
    alarm_budget: float | None = Field(default=None, gt=0.0, le=1000.0)
    """False alarms per 1,000 GPU-days this fleet may raise. The threshold then follows the
    fleet's own risk distribution (``predictor.budget.AlarmBudget``; the card's threshold
    until enough healthy GPU-time was seen). Ignored when ``threshold`` is set."""
    hysteresis: int = Field(default=3, ge=1, le=1000)
    """Consecutive alarming scores before a GPU counts as crossed."""
    cooldown_s: float = Field(default=600.0, ge=0, le=_WEEK_S)
    """After a migration of a job off a GPU, how long before another of that job may be
    requested off it."""
    max_inflight_per_job: int = Field(default=1, ge=1, le=100_000)
    max_inflight_fleet: int = Field(default=8, ge=1, le=100_000)
    breaker_pct: float = Field(default=5.0, gt=0, le=100)
    """The breaker trips when more than this share of GPUs crossed within the window…"""
    breaker_min_gpus: int = Field(default=3, ge=1, le=1_000_000)
    """…and at least this many did (a 6-GPU fleet must not trip on one GPU)."""
    breaker_window_s: float = Field(default=600.0, gt=0, le=_WEEK_S)
    dry_run: bool = False
    """Decide and record every decision in the audit log; request nothing."""
    act_on_failures: bool = True
    """Move a rank off a GPU that was lost or reported a fatal Xid (the unplanned path)."""
    stale_after_s: float = Field(default=30.0, gt=0, le=_WEEK_S)
    """A GPU with no sample for this long is flagged stale (its risk is unknown)."""

    # Stragglers (control.stragglers): a rank whose compute keeps its peers waiting.
    straggler_margin: float = Field(default=0.2, gt=0, le=10)
    """A rank is above when its compute_s exceeds its peers' median by this share (0.2: 20 %)…"""
    straggler_min_s: float = Field(default=0.02, ge=0, le=3600)
    """…and by at least this many seconds (a 1-ms step is not slow at 20 %)."""
    straggler_window_s: float = Field(default=120.0, ge=0, le=_WEEK_S)
    """Above for this long before a rank counts as a straggler."""
    straggler_clear_margin: float = Field(default=0.1, ge=0, le=10)
    """A straggler clears only when its excess falls to this share of its peers' median (or
    below half ``straggler_min_s``); less than ``straggler_margin`` (hysteresis)."""
    straggler_hot_c: float = Field(default=85.0, ge=0, le=150)
    """Die temperature at or above which a straggler's GPU is named hot."""
    act_on_stragglers: bool = True
    """Move a straggler to a spare when the gain exceeds the cost (false: flag and announce
    only)."""
    straggler_horizon_steps: int = Field(default=1000, ge=1, le=10**9)
    """Steps left assumed for the gain when the job did not say how many it runs."""
    straggler_move_cost_s: float = Field(default=60.0, ge=0, le=86400)
    """A move's cost when no completed migration measured one (this job's, else the fleet's
    median pause is used)."""
    straggler_breaker_pct: float = Field(default=25.0, gt=0, le=100)
    """No straggler moves while more than this share of the judged ranks straggle…"""
    straggler_breaker_min: int = Field(default=3, ge=1, le=1_000_000)
    """…and at least this many do (a fleet-wide cause: moving them all would not help)."""

    @model_validator(mode="after")
    def _clear_below_flag(self) -> Policy:
        if self.straggler_clear_margin >= self.straggler_margin:
            raise ValueError("straggler_clear_margin must be below straggler_margin")
        return self


@dataclass
class Situation:
    """What :func:`decide` needs to know about the fleet, read once per tick."""

    now_ms: int
    breaker_tripped: bool
    inflight_by_job: dict[str, int]
    inflight_fleet: int
    last_request_ms: dict[tuple[str, str, int], int]
    """Newest migration requested of each (job, node, gpu): the cooldown is per job, so one
    job's move off a GPU does not hold another job's rank on it."""
    spares_by_job: dict[str, list[RankSlot]]
    """Live spares of each job (job_ranks rows), in slot order."""
    drained: set[str]
    unsafe: set[tuple[str, int]] = field(default_factory=set)
    """GPUs a spare must not be on: crossed, failed or stale."""
    stragglers_tripped: str | None = None
    """Why straggler moves are held this tick (too many ranks straggle at once), or None."""


@dataclass(frozen=True)
class StragglerCase:
    """What a straggler's decision weighs: the seconds a move saves against what it costs."""

    gain_s: float
    remaining_steps: int
    remaining_from: str
    """``total_steps`` (the job said how many it runs) or ``horizon`` (the policy's)."""
    cost_s: float
    cost_from: str
    """``job`` (this job's measured pauses), ``fleet`` or ``policy`` (its default)."""

    @property
    def cost_named(self) -> str:
        return {
            "job": "this job's measured pause",
            "fleet": "the fleet's measured pause",
            "policy": "the policy's default",
        }.get(self.cost_from, self.cost_from)

    def describe(self) -> str:
        steps = (
            f"{self.remaining_steps} steps left"
            if self.remaining_from == "total_steps"
            else f"a horizon of {self.remaining_steps} steps"
        )
        return (
            f"gain {self.gain_s:.3g} s over {steps}, cost {self.cost_s:.3g} s ({self.cost_named})"
        )


@dataclass
class Decision:
    action: Literal["request", "dry_run", "declined"]
    reason: str
    target: RankSlot | None = None


def free_spare(situation: Situation, job_id: str) -> RankSlot | None:
    for spare in situation.spares_by_job.get(job_id, []):
        if spare["node"] in situation.drained:
            continue
        if spare.get("gpu") is not None and (spare["node"], spare["gpu"]) in situation.unsafe:
            continue
        return spare
    return None


def decide(
    policy: Policy,
    situation: Situation,
    *,
    job_id: str,
    node: str,
    gpu: int,
    trigger: str,
    straggler: StragglerCase | None = None,
) -> Decision:
    """Whether to move the rank of ``job_id`` on (node, gpu); see the module docstring.

    Args:
        straggler: for ``trigger="straggler"``, its gain and cost (required there).
    """
    automatic = trigger in ("preventive", "straggler")
    if automatic and situation.breaker_tripped:
        return Decision("declined", "breaker tripped: automatic action is stopped")
    if trigger == "straggler" and situation.stragglers_tripped:
        return Decision("declined", situation.stragglers_tripped)
    last = situation.last_request_ms.get((job_id, node, gpu))
    if automatic and last is not None and situation.now_ms - last < policy.cooldown_s * 1000:
        # The reason names when, not how long ago: it is the same at every tick of the
        # cooldown, so the audit log records it once, not once a tick.
        at = datetime.fromtimestamp(last / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return Decision(
            "declined",
            f"cooldown: a migration of this job off this GPU was requested at {at} "
            f"(cooldown {policy.cooldown_s:g} s)",
        )
    if trigger == "straggler":
        if straggler is None:
            raise ValueError("a straggler's decision needs its gain and cost")
        if straggler.gain_s <= straggler.cost_s:
            # No figures in the reason: they change at every heartbeat, and the audit log
            # records a decline once per reason (the figures are in the entry's data).
            return Decision(
                "declined",
                "straggler: the projected gain does not exceed the move's cost "
                f"({straggler.cost_named})",
            )
    if situation.inflight_by_job.get(job_id, 0) >= policy.max_inflight_per_job:
        return Decision("declined", f"job {job_id} already has a migration in flight")
    if situation.inflight_fleet >= policy.max_inflight_fleet:
        return Decision(
            "declined",
            f"{situation.inflight_fleet} migrations in flight fleet-wide (max "
            f"{policy.max_inflight_fleet})",
        )
    target = free_spare(situation, job_id)
    if target is None:
        return Decision("declined", f"job {job_id} has no free spare on a healthy, undrained GPU")
    if policy.dry_run:
        return Decision("dry_run", "dry-run: would migrate", target)
    if straggler is not None:
        return Decision("request", f"straggler: {straggler.describe()}", target)
    return Decision("request", f"{trigger}: guards passed", target)


def breaker_should_trip(policy: Policy, *, crossings_in_window: int, fleet_size: int) -> bool:
    """True when the crossings in the breaker window are too many to be failing GPUs."""
    if crossings_in_window < policy.breaker_min_gpus or fleet_size <= 0:
        return False
    return crossings_in_window * 100.0 > policy.breaker_pct * fleet_size


def stragglers_should_trip(policy: Policy, *, stragglers: int, judged: int) -> str | None:
    """Why straggler moves are held (too many ranks straggle at once), or None."""
    if stragglers < policy.straggler_breaker_min or judged <= 0:
        return None
    if stragglers * 100.0 <= policy.straggler_breaker_pct * judged:
        return None
    # The reason names the policy's bounds, not the counts: it stays the same while the
    # condition holds, so the audit log records it once.
    return (
        f"more than {policy.straggler_breaker_pct:g} % of the judged ranks (and at least "
        f"{policy.straggler_breaker_min}) straggle at once: a shared cause, not one slow GPU; "
        "no straggler is moved"
    )
