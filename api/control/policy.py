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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Decision", "Policy", "Situation", "breaker_should_trip", "decide"]


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
    spares_by_job: dict[str, list[dict[str, Any]]]
    """Live spares of each job (job_ranks rows), in slot order."""
    drained: set[str]
    unsafe: set[tuple[str, int]] = field(default_factory=set)
    """GPUs a spare must not be on: crossed, failed or stale."""


@dataclass
class Decision:
    action: Literal["request", "dry_run", "declined"]
    reason: str
    target: dict[str, Any] | None = None


def free_spare(situation: Situation, job_id: str) -> dict[str, Any] | None:
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
) -> Decision:
    """Whether to move the rank of ``job_id`` on (node, gpu); see the module docstring."""
    if trigger == "preventive" and situation.breaker_tripped:
        return Decision("declined", "breaker tripped: automatic action is stopped")
    last = situation.last_request_ms.get((job_id, node, gpu))
    if (
        trigger == "preventive"
        and last is not None
        and situation.now_ms - last < policy.cooldown_s * 1000
    ):
        # The reason names when, not how long ago: it is the same at every tick of the
        # cooldown, so the audit log records it once, not once a tick.
        at = datetime.fromtimestamp(last / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return Decision(
            "declined",
            f"cooldown: a migration of this job off this GPU was requested at {at} "
            f"(cooldown {policy.cooldown_s:g} s)",
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
    return Decision("request", f"{trigger}: guards passed", target)


def breaker_should_trip(policy: Policy, *, crossings_in_window: int, fleet_size: int) -> bool:
    """True when the crossings in the breaker window are too many to be failing GPUs."""
    if crossings_in_window < policy.breaker_min_gpus or fleet_size <= 0:
        return False
    return crossings_in_window * 100.0 > policy.breaker_pct * fleet_size
