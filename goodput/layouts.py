"""The strategies each parallel layout has, and Forewarn on each (``forewarn goodput --layout``).

What a rank lost without warning costs depends on where its state still exists:

- ``ddp`` (replicated data parallel): every rank holds a whole replica (``rank_state_gb``);
  a lost rank is rebuilt on a spare from a healthy replica (``peer-replica``), the step in
  flight redone;
- ``hsdp`` (sharded within a replica group, replicated across groups): the same rebuild,
  from the same shard index in another group; a rank holds ``rank_state_gb / shard_ranks``;
- ``sharded`` (FSDP without a replica): the lost shard exists nowhere else, so without
  Forewarn a failure means checkpoint-restart; no replica path;
- ``peer-copy`` (sharded, each rank's state copied into a buddy's memory every k steps):
  a lost rank is rebuilt from its buddy's copy and replays up to k steps (``peer-copy``);
  the copies cost ``peer_copy_overhead`` of every step.

Every layout has checkpoint-restart. Forewarn on a layout moves the failures its predictor
catches away before they happen (one pause, nothing lost) and leaves the rest to the
layout's own path: replica recovery, peer-copy recovery, or, for ``sharded``, a restart
from the last checkpoint (checkpoints then follow the Young/Daly interval for the failures
left, which are fewer). Each false alarm costs one pause on every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from goodput.model import Assumptions, Outcome, simulate, young_daly_interval_s
from goodput.profile import PredictorProfile
from goodput.schedule import Failure

__all__ = ["LAYOUTS", "LayoutProfile", "simulate_layout"]


@dataclass(frozen=True)
class LayoutProfile:
    """A parallel layout: whether its ranks are sharded and what recovers a lost one."""

    name: str
    sharded: bool
    fallback: str
    """What a rank lost without warning costs: ``peer-replica``, ``peer-copy`` or
    ``checkpoint-restart``."""
    description: str

    @property
    def strategies(self) -> tuple[str, ...]:
        """checkpoint-restart, the layout's own recovery where it has one, and Forewarn."""
        own = () if self.fallback == "checkpoint-restart" else (self.fallback,)
        return ("checkpoint-restart", *own, "forewarn")

    def assumptions(self, a: Assumptions) -> Assumptions:
        """``a`` with a rank's state as this layout holds it."""
        if not self.sharded:
            return a
        return replace(a, rank_state_gb=a.rank_state_gb / a.shard_ranks)


LAYOUTS: dict[str, LayoutProfile] = {
    layout.name: layout
    for layout in (
        LayoutProfile("ddp", False, "peer-replica", "replicated data parallel"),
        LayoutProfile("hsdp", True, "peer-replica", "sharded in a group, replicated across groups"),
        LayoutProfile("sharded", True, "checkpoint-restart", "sharded, no replica"),
        LayoutProfile("peer-copy", True, "peer-copy", "sharded, in-memory copies every k steps"),
    )
}


def simulate_layout(
    layout: LayoutProfile,
    strategy: str,
    failures: list[Failure],
    assumptions: Assumptions,
    *,
    gpus: int,
    rng: np.random.Generator,
    profile: PredictorProfile,
    horizon_s: float,
    mttf_s: float,
) -> Outcome:
    """One strategy of ``layout.strategies`` over a schedule, for a window of ``horizon_s``."""
    if strategy not in layout.strategies:
        raise ValueError(f"layout {layout.name} has no {strategy!r} ({layout.strategies})")
    a = layout.assumptions(assumptions)
    kwargs = {"gpus": gpus, "rng": rng, "horizon_s": horizon_s, "mttf_s": mttf_s}
    if strategy == "checkpoint-restart":
        return simulate(strategy, failures, a, **kwargs)  # type: ignore[arg-type]
    if layout.fallback == "peer-replica":
        chosen = profile if strategy == "forewarn" else None
        name = "forewarn" if chosen is not None else "peer-replica"
        return simulate(name, failures, a, profile=chosen, **kwargs)  # type: ignore[arg-type]
    if layout.fallback == "peer-copy":
        from goodput.model import _Clock, _migrating

        out = _migrating(
            strategy,
            failures,
            a,
            profile if strategy == "forewarn" else None,
            gpus,
            rng,
            _Clock(horizon_s, None),
            redo_steps=a.peer_copy_every_steps,
            extra_overhead=a.peer_copy_overhead,
        )
        return out
    return _forewarn_restart(failures, a, profile, gpus, rng, horizon_s)


def _forewarn_restart(
    failures: list[Failure],
    a: Assumptions,
    profile: PredictorProfile,
    gpus: int,
    rng: np.random.Generator,
    horizon_s: float,
) -> Outcome:
    """Forewarn on a layout with no replica: caught failures and false alarms cost one
    pause; a missed failure rolls back to the last checkpoint and restarts.

    The job alternates ``interval`` seconds of training and ``ckpt_save_s`` of saving; a
    pause stops that cycle where it stands, a restart begins it anew. The draws of which
    failures are caught and when false alarms fall use the streams ``_migrating`` uses, so
    every layout sees the same catches and alarms.
    """
    catch_rng, alarm_rng, _ = rng.spawn(3)
    events: list[tuple[float, str]] = []
    for f in failures:
        caught = catch_rng.random() < profile.recall.get(f.kind, 0.0)
        events.append((f.t_s, "preventive" if caught else "missed"))
    per_s = profile.false_alarms_per_1000_gpu_days / 1000.0 * gpus / 86400.0
    n = int(alarm_rng.poisson(per_s * horizon_s))
    events += [(float(t), "false alarm") for t in alarm_rng.uniform(0, horizon_s, size=n)]
    events.sort(key=lambda e: e[0])
    missed = sum(1 for _, what in events if what == "missed")
    interval = a.ckpt_interval_s or young_daly_interval_s(a.ckpt_save_s, horizon_s / max(1, missed))
    cycle = interval + a.ckpt_save_s
    rate = 1.0 / (1.0 + a.wrapper_overhead)
    pause = a.migration_pause_s(gpus)
    lost: dict[str, float] = {}
    t = useful = committed = phase = 0.0  # phase: where in the train/save cycle the job is

    def lose(what: str, seconds: float) -> None:
        lost[what] = lost.get(what, 0.0) + seconds

    def run_until(end: float) -> None:
        nonlocal t, useful, committed, phase
        end = min(end, horizon_s)
        while t < end:
            if phase < interval:  # training
                dt = min(end - t, interval - phase)
                useful += dt * rate
                lose("slower steps (wrapper, saves)", dt * (1.0 - rate))
            else:  # saving
                dt = min(end - t, cycle - phase)
                lose("checkpoint saves", dt)
            phase += dt
            t += dt
            if phase >= cycle:
                committed, phase = useful, 0.0

    def down(seconds: float, what: str) -> None:
        nonlocal t
        seconds = min(seconds, max(0.0, horizon_s - t))
        t += seconds
        lose(what, seconds)

    counts = {"preventive": 0, "missed": 0, "false alarm": 0}
    for when, what in events:
        if when >= horizon_s:
            break
        if when < t:  # during a restart or a pause: a missed failure restarts it anew
            if what == "missed":
                counts[what] += 1
                down(when + a.restart_s - t, "restart")
            elif what == "preventive":
                counts[what] += 1  # moved away while the job stood still: nothing more
            continue
        run_until(when)
        counts[what] += 1
        if what == "missed":
            lose("work rolled back", useful - committed)
            useful, phase = committed, 0.0
            down(a.restart_s, "restart")
        else:
            down(pause, "preventive migration" if what == "preventive" else "false alarm")
    run_until(horizon_s)
    return Outcome(
        "forewarn",
        t,
        useful,
        len(failures),
        preventive=counts["preventive"],
        restarts=counts["missed"],
        false_alarms=counts["false alarm"],
        lost_s=lost,
    )
