"""Three ways of living through the same failures, on one wall clock.

The job is synchronous: any interruption stops every rank. Each strategy turns the same
failure schedule into time spent computing, time down and work thrown away:

Both migrating strategies still save a checkpoint now and then (``migrating_ckpt_interval_s``,
for a disaster no spare can absorb); its cost is spread over every step.

- **checkpoint-restart**: a checkpoint every ``ckpt_interval_s`` of training, each save
  blocking the job for ``ckpt_save_s``; a failure throws away the work since the last
  completed save and costs ``restart_s`` (detect, replace the node, reload, re-initialise).
  A failure during a restart starts the restart over.
- **peer-replica**: a failed rank is rebuilt on a warm spare from a healthy data-parallel
  replica (Forewarn's unplanned path, without prediction): ``detect_s`` until the survivors
  agree the rank is gone, the state transfer, a new process group, and the step in flight
  done again (uniform over one step).
- **forewarn**: a failure the predictor catches (per-kind recall, drawn per failure) is moved
  away before it happens: a preventive migration, one pause and nothing lost. The rest take
  the peer-replica path. Each false alarm costs one needless migration pause.

Both migrating strategies run inside the ``Migratable`` wrapper, whose per-step cost
(``wrapper_overhead``) slows every step. ``replica_step_overhead`` slows the peer-replica
baseline further where it stands for a framework with its own per-step cost (the published
comparison's TorchFT); it is 0 for Forewarn's own replica path.

Results come from a simulation of the schedule, not a formula: ``useful_s`` (training that
is kept) over ``wall_s`` is the effective training time ratio (ETTR).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from goodput.profile import PredictorProfile
from goodput.schedule import Failure

__all__ = ["STRATEGIES", "Assumptions", "Outcome", "simulate", "young_daly_interval_s"]

STRATEGIES = ("checkpoint-restart", "peer-replica", "forewarn")


@dataclass(frozen=True)
class Assumptions:
    """Every number the comparison depends on, in seconds, GB and fractions."""

    step_s: float = 10.0
    """Time of one training step."""
    ckpt_interval_s: float | None = None
    """Training between checkpoints; None: the Young/Daly optimum for the job's MTTF."""
    ckpt_save_s: float = 60.0
    """How long a checkpoint save blocks training."""
    restart_s: float = 900.0
    """Checkpoint-restart: detect, replace the node, reload the checkpoint, re-initialise."""
    detect_s: float = 30.0
    """Unplanned recovery: until the survivors agree a rank is gone (``launch --timeout-s``)."""
    rank_state_gb: float = 20.0
    """State moved per migrated rank (weights, optimizer, RNG, data position)."""
    transfer_gb_s: float = 25.0
    """Point-to-point bandwidth between the source (or replica) and the spare."""
    pause_per_transfer: float = 1.39
    """A preventive move's stall per second of ideal transfer (bytes / bandwidth), the next
    group formed ahead: the fit in ``goodput/data/preventive_stall.json``
    (``benchmarks/migration.py --parts f``, 4 ranks, loopback, 10 MB, 100 MB and 1 GB, 3 runs
    each, load 0.5 before the run)."""
    pause_fixed_s: float = 0.041
    """Fixed part of that stall (the switch: the transfer's pair group, DDP rebuilt), from
    the same fit."""
    regroup_s: float | None = None
    """A new process-group generation; None: measured, at the job's size
    (:func:`goodput.costs.group_formation_s`, ``benchmarks/group_formation.py``)."""
    wrapper_overhead: float = 0.001
    """Per-step cost of the ``Migratable`` wrapper: the benchmark measured 0.13 ms a step
    (0.02 % of a 0.7 s step); 0.1 % leaves room for a shared store under thousands of ranks."""
    migrating_ckpt_interval_s: float | None = 4 * 3600.0
    """Checkpoints a migrating job still keeps (for a disaster); None: none."""
    replica_step_overhead: float = 0.0
    """Extra per-step cost of the peer-replica baseline (0: Forewarn's own replica path)."""
    shard_ranks: int = 8
    """Sharded layouts (HSDP, sharded, peer-copy): ranks one replica is sharded over; a rank
    holds ``rank_state_gb / shard_ranks`` (``rank_state_gb`` is a whole replica's state)."""
    peer_copy_every_steps: int = 10
    """Peer-copy layout: a rank's state is copied to its buddy's memory every k steps; a
    rank lost without warning replays up to k steps from that copy."""
    peer_copy_overhead: float = 0.01
    """Peer-copy layout: per-step cost of the copies (the layout's goal bound, < 1 %)."""
    formation_at_switch: bool = False
    """What-if (the migrator before it formed groups ahead): a preventive or planned move
    forms the next generation inside its stall. By default the migrator forms it while
    training goes on and agrees on the handover step only once it is formed
    (``docs/migration.md``), so the stall is the transfer and the switch."""

    def regroup_at(self, ranks: int | None) -> float:
        """Seconds to form a new generation of ``ranks`` ranks (measured rule unless set)."""
        if self.regroup_s is not None:
            return self.regroup_s
        if ranks is None:
            raise ValueError("the measured group formation needs the job's size (ranks)")
        from goodput.costs import group_formation_s

        return group_formation_s(ranks)

    def _moved_s(self) -> float:
        transfer = self.rank_state_gb / self.transfer_gb_s
        return self.pause_per_transfer * transfer + self.pause_fixed_s

    def migration_pause_s(self, ranks: int | None = None) -> float:
        """One preventive (or planned) migration of a job of ``ranks`` ranks: the job waits
        this long, nothing is lost. The new generation was formed while training went on,
        so the stall is the transfer and the switch (``pause_per_transfer`` x bytes /
        bandwidth + ``pause_fixed_s``); with ``formation_at_switch`` the group formation
        at the job's size is added."""
        regroup = self.regroup_at(ranks) if self.formation_at_switch else 0.0
        return self._moved_s() + regroup

    def replica_recovery_s(self, ranks: int | None = None) -> float:
        """One unplanned recovery from a replica, before the step in flight is redone: it
        always forms a new generation while the job stands still."""
        return self.detect_s + self._moved_s() + self.regroup_at(ranks)


def young_daly_interval_s(save_s: float, mttf_s: float) -> float:
    """The checkpoint interval that minimises expected loss: sqrt(2 x save x MTTF)."""
    return math.sqrt(2.0 * save_s * mttf_s)


@dataclass
class Outcome:
    """What one strategy made of one schedule."""

    strategy: str
    wall_s: float
    useful_s: float
    failures: int
    preventive: int = 0
    replica_recoveries: int = 0
    restarts: int = 0
    false_alarms: int = 0
    lost_s: dict[str, float] = field(default_factory=dict)
    redo_steps: int = 1
    """Steps a recovery may redo (1: the step in flight; k: a peer copy's replay)."""

    @property
    def ettr(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 1.0

    @property
    def no_loss_share(self) -> float:
        """Failures handled with nothing recomputed (preventive migrations)."""
        return self.preventive / self.failures if self.failures else 1.0

    @property
    def at_most_one_step_share(self) -> float:
        """Failures that cost at most the step in flight (preventive or replica)."""
        if not self.failures:
            return 1.0
        one_step = self.replica_recoveries if self.redo_steps == 1 else 0
        return (self.preventive + one_step) / self.failures

    def gpu_hours_lost_per_day(self, gpus: int) -> float:
        return (1.0 - self.ettr) * gpus * 24.0

    def as_dict(self, gpus: int) -> dict[str, object]:
        d = asdict(self)
        d.update(
            ettr=self.ettr,
            no_loss_share=self.no_loss_share,
            at_most_one_step_share=self.at_most_one_step_share,
            gpu_hours_lost_per_day=self.gpu_hours_lost_per_day(gpus),
        )
        return d


class _Clock:
    """Wall clock of one run: compute until a time, or go down for a while.

    Stops at ``horizon_s`` (a fixed window) or when ``work_s`` of training is done (a fixed
    job), whichever is given.
    """

    def __init__(self, horizon_s: float | None, work_s: float | None) -> None:
        if (horizon_s is None) == (work_s is None):
            raise ValueError("give exactly one of horizon_s and work_s")
        self.t = 0.0
        self.useful = 0.0
        self.horizon = math.inf if horizon_s is None else horizon_s
        self.work = math.inf if work_s is None else work_s
        self.lost: dict[str, float] = {}

    @property
    def done(self) -> bool:
        return self.t >= self.horizon or self.useful >= self.work

    def _lose(self, what: str, seconds: float) -> None:
        self.lost[what] = self.lost.get(what, 0.0) + seconds

    def compute(self, until: float, rate: float) -> None:
        """Train from now to ``until`` at ``rate`` useful seconds per wall second."""
        end = min(until, self.horizon)
        if end <= self.t:
            return
        dt = end - self.t
        if self.useful + dt * rate >= self.work:
            dt = (self.work - self.useful) / rate
            end = self.t + dt
        self.useful += dt * rate
        self._lose("slower steps (wrapper, saves)", dt * (1.0 - rate))
        self.t = end

    def down(self, seconds: float, what: str) -> None:
        seconds = min(seconds, max(0.0, self.horizon - self.t))
        self.t += seconds
        self._lose(what, seconds)

    def discard(self, seconds: float, what: str) -> None:
        """Training already counted that is thrown away (rolled back)."""
        self.useful -= seconds
        self._lose(what, seconds)


def _checkpoint_restart(
    failures: list[Failure], a: Assumptions, interval_s: float, clock: _Clock
) -> Outcome:
    cycle = interval_s + a.ckpt_save_s
    committed = 0.0  # training kept in a completed checkpoint
    restarts = 0

    def train(until: float) -> bool:
        """Train from a fresh (re)start to ``until``; True when the job or the window ends."""
        nonlocal committed
        start = clock.t
        seg = min(until, clock.horizon) - start
        remaining = clock.work - committed
        if math.isfinite(remaining):
            saves = max(0, math.ceil(remaining / interval_s) - 1)
            need = remaining + saves * a.ckpt_save_s
            if need <= seg:  # the job ends in this segment (no save needed at the very end)
                clock.t, clock.useful = start + need, clock.work
                clock._lose("checkpoint saves", saves * a.ckpt_save_s)
                return True
        n = int(seg // cycle)
        tail = seg - n * cycle
        committed += n * interval_s
        clock._lose("checkpoint saves", n * a.ckpt_save_s + max(0.0, tail - interval_s))
        clock.t = start + seg
        if until >= clock.horizon:  # the window closes with the job alive: keep what it has
            clock.useful = committed + min(tail, interval_s)
            return True
        clock._lose("work rolled back", min(tail, interval_s))
        clock.useful = committed
        return False

    ended = False
    for f in failures:
        if f.t_s >= clock.horizon:
            break
        if f.t_s < clock.t:  # failed again while restarting: the restart begins anew
            clock.down(f.t_s + a.restart_s - clock.t, "restart")
            restarts += 1
            continue
        if train(f.t_s):
            ended = True
            break
        clock.down(a.restart_s, "restart")
        restarts += 1
    if not ended and not clock.done:
        train(math.inf)
    return Outcome(
        "checkpoint-restart",
        clock.t,
        clock.useful,
        len(failures),
        restarts=restarts,
        lost_s=clock.lost,
    )


def _migrating(
    name: str,
    failures: list[Failure],
    a: Assumptions,
    profile: PredictorProfile | None,
    gpus: int,
    rng: np.random.Generator,
    clock: _Clock,
    *,
    redo_steps: int = 1,
    extra_overhead: float = 0.0,
) -> Outcome:
    """Replica (``redo_steps`` 1) or peer-copy recovery (``redo_steps`` k: the steps since
    the buddy's copy are replayed) of what the predictor misses; with a profile, preventive
    moves of what it catches and one pause per false alarm."""
    overhead = a.wrapper_overhead + (a.replica_step_overhead if profile is None else 0)
    rate = 1.0 / (1.0 + overhead + extra_overhead)
    if a.migrating_ckpt_interval_s:  # saves kept for a disaster slow the job evenly
        rate *= a.migrating_ckpt_interval_s / (a.migrating_ckpt_interval_s + a.ckpt_save_s)
    pause = a.migration_pause_s(gpus)
    recovery = a.replica_recovery_s(gpus)
    redo_max_s = a.step_s * redo_steps
    # One stream per kind of draw, so that a strategy with no predictor draws the same steps
    # in flight as one whose predictor catches nothing.
    catch_rng, alarm_rng, step_rng = rng.spawn(3)
    events: list[tuple[float, str]] = []
    for f in failures:
        caught = profile is not None and catch_rng.random() < profile.recall.get(f.kind, 0.0)
        events.append((f.t_s, "preventive" if caught else "replica"))
    if profile is not None and math.isfinite(clock.horizon):
        per_s = profile.false_alarms_per_1000_gpu_days / 1000.0 * gpus / 86400.0
        n = int(alarm_rng.poisson(per_s * clock.horizon))
        events += [(float(t), "false alarm") for t in alarm_rng.uniform(0, clock.horizon, size=n)]
    elif profile is not None:  # a fixed job: false alarms over a bound on its wall time
        per_s = profile.false_alarms_per_1000_gpu_days / 1000.0 * gpus / 86400.0
        bound = 10.0 * clock.work + (failures[-1].t_s if failures else 0.0)
        n = int(alarm_rng.poisson(per_s * bound))
        events += [(float(t), "false alarm") for t in alarm_rng.uniform(0.0, bound, size=n)]
    events.sort(key=lambda e: e[0])
    counts = {"preventive": 0, "replica": 0, "false alarm": 0}
    for t, what in events:
        clock.compute(t, rate)
        if clock.done:
            break
        counts[what] += 1
        if what == "replica":
            clock.down(recovery, "replica recovery" if redo_steps == 1 else "peer-copy recovery")
            redo = float(step_rng.uniform(0.0, redo_max_s))
            what_redone = "step in flight" if redo_steps == 1 else "steps replayed from the copy"
            clock.discard(min(redo, clock.useful), what_redone)
        else:
            clock.down(pause, "preventive migration" if what == "preventive" else "false alarm")
    clock.compute(math.inf, rate)
    return Outcome(
        name,
        clock.t,
        clock.useful,
        len(failures),
        preventive=counts["preventive"],
        replica_recoveries=counts["replica"],
        false_alarms=counts["false alarm"],
        lost_s=clock.lost,
        redo_steps=redo_steps,
    )


def simulate(
    strategy: str,
    failures: list[Failure],
    assumptions: Assumptions,
    *,
    gpus: int,
    rng: np.random.Generator,
    profile: PredictorProfile | None = None,
    horizon_s: float | None = None,
    work_s: float | None = None,
    mttf_s: float | None = None,
) -> Outcome:
    """Run one strategy over a schedule, for a window (``horizon_s``) or a job (``work_s``).

    ``profile`` is the predictor (forewarn only); ``mttf_s`` sets the Young/Daly checkpoint
    interval when ``assumptions.ckpt_interval_s`` is None.
    """
    clock = _Clock(horizon_s, work_s)
    if strategy == "checkpoint-restart":
        interval = assumptions.ckpt_interval_s
        if interval is None:
            if mttf_s is None:
                raise ValueError("checkpoint interval: give ckpt_interval_s or mttf_s")
            interval = young_daly_interval_s(assumptions.ckpt_save_s, mttf_s)
        return _checkpoint_restart(failures, assumptions, interval, clock)
    if strategy == "peer-replica":
        return _migrating(strategy, failures, assumptions, None, gpus, rng, clock)
    if strategy == "forewarn":
        if profile is None:
            raise ValueError("forewarn needs the predictor's profile")
        return _migrating(strategy, failures, assumptions, profile, gpus, rng, clock)
    raise ValueError(f"unknown strategy {strategy!r} (one of {STRATEGIES})")
