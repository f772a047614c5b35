"""The control loop: telemetry -> risk -> policy -> migration, once per tick, on the leader.

Every ``control_tick_s`` the replica that holds the leadership (:mod:`control.leader`)

1. reads the samples and events the store received since the last tick, by arrival order
   (:class:`ArrivalCursor`), folds them into the :class:`predictor.scoring.Scorer` and scores
   every GPU it has seen; a GPU with hard evidence (:mod:`predictor.floor`) is raised to the
   threshold in force, and counts at the top of the alarm budget's scale;
2. updates each GPU's streak of alarming scores (hysteresis), its crossed/cleared, stale and
   failed flags, writes the latest risk and a bounded history, and announces changes
   (``risk.threshold_crossed``, ``risk.cleared``, ``gpu.stale``, ``gpu.failed``);
3. judges every running job's ranks from the step timings its heartbeats stored
   (:mod:`control.stragglers`): a rank whose compute stayed above its peers' for the
   policy's window becomes a straggler, named from its GPU's newest samples
   (``rank.straggling``);
4. for every crossed or failed GPU under an active rank, every active rank on a drained
   node and every straggler, asks the policy (:func:`control.policy.decide`) and records
   the decision in the audit log (once per episode and outcome, not once per tick); a
   ``request`` becomes a ``requested`` migration that the job agent long-polls;
5. fails in-flight migrations that can no longer finish (:func:`orchestrator.reconcile`).

Steps 2-5 are one transaction, shaped as a plan: the rows, events, audit entries and
migrations are written on the transaction's connection as they are derived, while the changes
to the loop's memory (each GPU's streak and flags, the breaker's window, which decisions were
audited, the alarm budget's kept time) are collected in a :class:`TickPlan` and applied only
after the commit. A tick that fails anywhere, its commit included, leaves the memory as it was,
so the next tick derives and writes the same events again; fatal events it read are judged
again too (the scorer has folded them, the cursor has moved past them).

Fencing: the tick's first statement compares the leadership epoch this replica took over with
(:func:`store.control.fence`); every take-over raises the epoch, so a leader that lost its lock
without noticing (its lock connection died, a long pause) finds a newer epoch, writes nothing
and steps down.

Becoming leader (at start, or when the previous leader died) raises the epoch, warms the scorer
from the window the store still holds, reloads each GPU's streak and flags from
``risk_latest`` and rebuilds the breaker's window from the ``risk.threshold_crossed`` events
within it (since the last breaker reset), so a restart neither loses a crossing nor announces
it twice and the new leader trips the breaker as the old one would have; a straggler's state
is in ``rank_timings`` and is read every tick.

The loop shares nothing in memory with the web service: it may run in a thread of the service
or in a process of its own (``forewarn control``, which the service starts by default). What
the service shows of it is in the store: each tick publishes the loop's status (who leads,
the model that scores, the threshold in force, the alarm budget, the ticks' durations) in the
tick's own transaction (:func:`store.control.publish_status`), and an operator's breaker reset
reaches it as a time in the store that every tick reads.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import os
import socket
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from control import orchestrator
from control import straggler_watch as watch
from control.leader import Leadership
from control.partition import LIVE_TICKS, SHARD_COLUMNS, Share, decode, encode
from control.policy import (
    Decision,
    Policy,
    Situation,
    breaker_should_trip,
    decide,
    stragglers_should_trip,
)
from forewarn.errors import Conflict
from forewarn.threads import to_thread_to_end
from predictor.budget import AlarmBudget
from predictor.floor import FLOOR_RULES, FLOOR_SCORE, floored
from predictor.floor_budget import FloorBudget
from predictor.state import VALUE_COLUMNS, SampleBlock
from store import Store
from store import control as db
from store.outbox import emit_event

__all__ = ["ArrivalCursor", "ControlLoop", "Deposed", "GpuState", "TickPlan"]

log = logging.getLogger("forewarn.control")

REFRESH_MS = 30_000
RISK_STEP = 1e-4
"""A stored risk is rewritten before REFRESH_MS when it moved by about this much."""
WARM_PAGE_ROWS = 500_000
"""Samples a take-over's warm reads at a time (about half a GB of the driver's rows)."""
WARM_SHARE_OF_TICK = 0.5
"""Buckets a loop of the partitioned scoring gains are warmed a page at a time, for up to
this share of a tick's interval each tick (at least a page): the rest of its share is scored
and the leader decides meanwhile."""
BUDGET_KEY = "alarm_budget"
"""``control_state`` key of the alarm budget's confirmed healthy time (JSON)."""
FLOOR_BUDGET_KEY = "floor_budget"
"""``control_state`` key of the floor rules' confirmed alarms on healthy GPUs (JSON)."""
BUDGET_KEEP_EVERY_MS = 60_000
"""A GPU's stored score is rewritten at least this often even when nothing in it changed."""

FATAL_EVENT_KINDS = frozenset({"gpu_lost", "power_loss", "thermal_shutdown"})

_EMPTY_SHARD = pd.DataFrame({k: [] for k in SHARD_COLUMNS})


class ArrivalCursor:
    """Which arrival sequence numbers have been consumed, tolerant of holes.

    Numbers are handed out when a row is inserted and become visible when its transaction
    commits, so a concurrent writer can commit a lower number after a higher one. The cursor
    only moves over a hole once the hole is ``hole_wait_s`` old; rows past it are read again
    until then and skipped by number (``seen``).
    """

    def __init__(self, start: int = 0, *, hole_wait_s: float = 2.0) -> None:
        self.position = start
        self.seen: set[int] = set()
        self.hole_wait_s = hole_wait_s
        self._stuck_since: float | None = None

    def fresh(self, seqs: Sequence[int] | np.ndarray) -> np.ndarray:
        """Mask of the rows not consumed yet."""
        if not self.seen:
            return np.ones(len(seqs), dtype=bool)
        return np.fromiter((s not in self.seen for s in seqs), dtype=bool, count=len(seqs))

    def consume(self, seqs: Sequence[int] | np.ndarray, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        ordered = np.asarray(seqs, dtype=np.int64)
        if len(ordered) > 1 and not (ordered[1:] > ordered[:-1]).all():
            ordered = np.unique(ordered)  # the store reads them in order: rarely needed
        if not self.seen and len(ordered):
            # The common case, a tick's rows without holes: move over them at once.
            gaps = np.flatnonzero(ordered != self.position + 1 + np.arange(len(ordered)))
            run = int(gaps[0]) if len(gaps) else len(ordered)
            if run:
                self.position += run
                self._stuck_since = None
            ordered = ordered[run:]
        self.seen.update(ordered.tolist())
        while self.seen:
            if self.position + 1 in self.seen:
                self.seen.discard(self.position + 1)
                self.position += 1
                self._stuck_since = None
                continue
            if self._stuck_since is None:
                self._stuck_since = now
            if now - self._stuck_since >= self.hole_wait_s:
                self.position = min(self.seen) - 1
                self._stuck_since = None
                continue
            break


@dataclass
class GpuState:
    """What the loop remembers of one GPU; replaced whole (never changed in place), so a
    tick's plan holds new states and the memory keeps the old ones until the commit."""

    streak: int = 0
    crossed: bool = False
    stale: bool = False
    failed: bool = False
    history_ms: int = 0
    last_alarm: bool = False
    crossed_ms: int | None = None
    written: tuple[Any, ...] = ()
    written_ms: int = 0


_UNSEEN = GpuState()


TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the tick-duration histogram the service exports
(``forewarn_scorer_tick_seconds``)."""


class TickDurations:
    """A histogram of tick durations kept as plain numbers, published with the loop's status."""

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.buckets = [0] * len(TICK_BUCKETS)  # per bucket, not cumulative

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        i = bisect.bisect_left(TICK_BUCKETS, seconds)
        if i < len(self.buckets):
            self.buckets[i] += 1

    def state(self) -> dict[str, Any]:
        return {"count": self.count, "sum": self.sum, "le": list(TICK_BUCKETS), "per": self.buckets}


class Deposed(Exception):
    """The tick found a newer leadership epoch: another replica took over."""


@dataclass
class TickPlan:
    """The changes one tick makes to the loop's memory, applied after its commit.

    Attributes:
        gpus: the new state of every GPU whose state changed (or was first seen).
        crossings_before: crossings of earlier ticks still in the breaker's window.
        crossings: when GPUs crossed in this tick (the breaker's window gains them).
        window_ms: the breaker's window under this tick's policy.
        breaker_reset_ms: when an operator last reset the breaker (crossings up to it no
            longer count), as the store said at this tick.
        audited: the decisions audited so far, by episode (replaces the loop's).
        discard: GPUs that failed this tick (their alarm-budget slots are discarded).
        budget_kept: (healthy blocks, when) if this tick wrote the alarm budget's state.
        floor_kept: the demoted floor rules, if this tick wrote the floor budget's state.
    """

    gpus: dict[tuple[str, int], GpuState] = field(default_factory=dict)
    crossings_before: int = 0
    crossings: list[int] = field(default_factory=list)
    window_ms: int = 0
    audited: dict[tuple[Any, ...], str] = field(default_factory=dict)
    discard: list[tuple[str, int]] = field(default_factory=list)
    budget_kept: tuple[float, int | None] | None = None
    floor_kept: list[str] | None = None
    breaker_reset_ms: int = 0

    def state(self, gpus: dict[tuple[str, int], GpuState], key: tuple[str, int]) -> Any:
        """A GPU's state as this tick leaves it (None if never seen)."""
        st = self.gpus.get(key)
        return st if st is not None else gpus.get(key)

    def in_window(self) -> int:
        return self.crossings_before + len(self.crossings)


@dataclass
class Warming:
    """A warm of the scorer from the store's window, page by page (:meth:`ControlLoop._warm`;
    a share's buckets gained are warmed a few pages a tick: :meth:`ControlLoop._score_share`).

    Attributes:
        buckets: the buckets warmed (None: the fleet).
        lo: where the next page starts (ms).
        span_ms: a page's span of fleet time.
        samples: samples folded so far; events: events so far.
    """

    buckets: np.ndarray | None
    lo: int
    span_ms: int
    samples: int = 0
    events: int = 0


class ControlLoop:
    """One per service process; acts only while this replica leads (see the module docstring).

    Args:
        store: the open store.
        model: a :class:`predictor.model.RiskModel`, or None (no scoring: jobs, migrations and
            drains still work, and GPUs show no risk).
        lifecycle: a :class:`predictor.lifecycle.ModelLifecycle`, or None: the model in force
            is read from it at every tick and swapped in when an operator pinned or rolled
            back another, or a retrained one was promoted (the scorer keeps its windows).
        defaults: the policy from the settings (an operator's ``PUT /v1/policy`` overrides).
        replica: who runs this loop (the service replica's id), named in the published status.
        leadership: who leads (default: a :class:`Leadership` on the store's engine).
        scorer: the scorer to use (default: a :class:`predictor.scoring.Scorer` of the model
            in force, built at each take-over); one given here is kept and warmed instead.
        clock: seconds since the epoch (default :func:`time.time`): a tick's time when
            :meth:`tick` is given none, and the take-over's.
        partitioned: share the scoring with the other replicas' loops (:mod:`control.partition`;
            PostgreSQL): this one scores its share of the fleet, as leader or follower, and the
            leader merges the followers' scores before it decides.
    """

    def __init__(
        self,
        store: Store,
        *,
        model: Any,
        defaults: Policy,
        tick_s: float,
        replica: str = "",
        warm_window_s: float = 900.0,
        history_interval_s: float = 60.0,
        history_days: float = 7.0,
        ack_timeout_s: float = 120.0,
        agent_timeout_s: float = 60.0,
        lifecycle: Any = None,
        leadership: Leadership | None = None,
        scorer: Any = None,
        clock: Callable[[], float] = time.time,
        read_limit: int = 2_000_000,
        partitioned: bool = False,
    ) -> None:
        self.store = store
        self.partitioned = partitioned
        # Unique across machines even when two replicas were given one name by mistake.
        self.member = f"{replica}@{socket.gethostname()}:{os.getpid()}"
        self.share: Share | None = None  # this loop's share of the scoring, once it has one
        self.warming: Warming | None = None  # buckets of the share gained, not warm yet
        self.live_ms = int(max(LIVE_TICKS * tick_s, 5.0) * 1000)
        self._merged: dict[str, int] = {}  # each follower's newest scores merged (tick_ms)
        self.last_partition: dict[str, Any] | None = None
        self.read_limit = read_limit
        self.model = model
        self.lifecycle = lifecycle
        self.defaults = defaults
        self.tick_s = tick_s
        self.replica = replica
        self.warm_window_s = warm_window_s
        self.history_interval_s = history_interval_s
        self.history_days = history_days
        self.ack_timeout_s = ack_timeout_s
        self.agent_timeout_s = agent_timeout_s
        self.leadership = leadership if leadership is not None else Leadership(store.engine)
        self.scorer: Any = scorer
        self._own_scorer = scorer is None
        self.clock = clock
        self.epoch: int | None = None
        self._failed_pending: dict[tuple[str, int], str] = {}
        self.samples = ArrivalCursor()
        self.events = ArrivalCursor()
        self.gpus: dict[tuple[str, int], GpuState] = {}
        self._audited: dict[tuple[Any, ...], str] = {}
        self._crossings: deque[int] = deque()
        self.ticks = 0
        self.last_tick_s = 0.0
        self.threshold_in_force: float | None = None
        self.budget: AlarmBudget | None = None
        self.floor_budget: FloorBudget | None = None
        self._floor: np.ndarray | None = None  # this tick's floor, per row of its scores
        self._floor_demoted: list[str] = []  # the demoted rules as last kept in the store
        self._budget_slots: dict[tuple[str, int], int] = {}
        self._budget_kept: tuple[float, int | None] = (0.0, None)  # (blocks, when) last written
        self.last_phases: dict[str, float] = {}
        self.last_read = 0  # samples the last tick read
        self.durations = TickDurations()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        """Tick forever (cancel to stop); errors are logged and the next tick tries again."""
        try:
            while True:
                started = time.monotonic()
                try:
                    await to_thread_to_end(self.step)
                except Exception:
                    log.exception("control loop tick failed")
                await asyncio.sleep(max(0.0, self.tick_s - (time.monotonic() - started)))
        finally:
            await asyncio.to_thread(self.leadership.release)
            if self.share is not None:
                await asyncio.to_thread(self.leave)

    def leave(self) -> None:
        """Take this loop out of the partitioned scoring (it stops): the others share its
        buckets at their next tick instead of after :data:`control.partition.LIVE_TICKS`."""
        try:
            with self.store.begin() as c:
                db.leave(c, member=self.member)
        except Exception:
            log.exception("could not leave the partitioned scoring")

    def step(self, now_ms: int | None = None) -> bool:
        """Lead if possible, then tick; returns whether this replica leads."""
        was = self.leadership.is_leader
        if not self.leadership.acquire():
            if self.sharing:
                self.follow(now_ms)
            return False
        if not was:
            self.take_over()
        try:
            self.tick(now_ms)
        except Deposed:
            log.warning("another replica took over the control loop; stepping down")
            self.leadership.release()
            return False
        return True

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    @property
    def sharing(self) -> bool:
        """Whether this loop scores a share of the fleet (partitioned, with a model)."""
        return self.partitioned and self.model is not None

    def take_over(self) -> None:
        """Warm the scorer from the store's window and reload each GPU's flags (and, at the
        next tick, the alarm budget's healthy time another leader may have kept since), and
        rebuild the breaker's window from the crossings the store recorded within it.

        The leadership epoch is raised first, in its own transaction: a tick of an earlier
        leader either committed before it (and is read below) or finds the new epoch."""
        self.budget = None
        self.floor_budget = None
        self.epoch = None  # a take-over that fails part-way leaves the replica fenced out
        with self.store.begin() as c:
            epoch = db.bump_epoch(c)
        now_ms = self.now_ms()
        with self.store.engine.connect() as c:
            window_ms = int(self.policy(c).breaker_window_s * 1000)
            self._crossings = deque(db.crossings_since(c, since_ms=now_ms - window_ms))
            sample_top = db.max_sample_seq(c)
            event_top = db.max_event_seq(c)
            self.gpus = {}
            for row in db.risk_rows(c):
                self.gpus[(row["node"], row["gpu"])] = GpuState(
                    streak=row["streak"],
                    crossed=row["crossed"],
                    stale=row["stale"],
                    failed=row["failed"],
                    history_ms=row["scored_ms"],
                    last_alarm=row["alarm"],
                    crossed_ms=row["crossed_ms"],
                )
        self._audited = {}
        self._failed_pending = {}
        self._merged = {}
        if self.sharing:
            # The scorer and cursors of this loop's share go on as they were as a follower.
            if self.share is None:
                self._start_share(sample_top, event_top)
        else:
            self.samples = ArrivalCursor(sample_top)
            self.events = ArrivalCursor(event_top)
            if self._own_scorer:
                self.scorer = None
                if self.model is not None:
                    from predictor.scoring import Scorer

                    self.scorer = Scorer(self.model)
            if self.scorer is not None:
                self._warm(now_ms)
        self.epoch = epoch

    def _warm(self, now_ms: int, buckets: np.ndarray | None = None) -> None:
        """Fold the window the store still holds into the scorer, in time order, a page of
        at most :data:`WARM_PAGE_ROWS` samples at a time: at 16,384 GPUs a second apart, the
        default 15 minutes are 15 million rows, which read at once took minutes and tens of
        GB. ``buckets``: only the nodes of these (a share of the fleet)."""
        warming = self._warming_of(now_ms, buckets)
        while not self._fold_page(warming, now_ms):
            pass
        # Rows numbered after the tops are read again by the cursors; the scorer ignores a
        # sample it already holds (not newer than the GPU's newest).
        log.info(
            "scorer warmed from %d samples and %d events%s",
            warming.samples,
            warming.events,
            "" if buckets is None else f" ({len(buckets)} buckets)",
        )

    def _warming_of(self, now_ms: int, buckets: np.ndarray | None) -> Warming:
        """The warm of ``buckets`` (None: the fleet) from the start of the window."""
        fleet = max(1, self.store.gpu_count())
        if buckets is not None:  # the share's part of the fleet, by bucket
            fleet = max(1, fleet * len(buckets) // db.BUCKETS)
        # Pages of fleet time: at one sample a GPU a second, each holds WARM_PAGE_ROWS rows.
        return Warming(
            buckets=buckets,
            lo=now_ms - int(self.warm_window_s * 1000),
            span_ms=max(1000, WARM_PAGE_ROWS // fleet * 1000),
        )

    def _fold_page(self, warming: Warming, now_ms: int) -> bool:
        """Fold the next page of ``warming`` into the scorer; returns whether it was the last
        (it has no end: samples stamped after now, a collector's clock ahead)."""
        assert self.scorer is not None
        lo, buckets = warming.lo, warming.buckets
        hi = lo + warming.span_ms if lo + warming.span_ms <= now_ms else None
        listed = None if buckets is None else buckets.tolist()
        with self.store.engine.connect() as c:
            page = db.sample_arrays_in(c, VALUE_COLUMNS, since_ms=lo, until_ms=hi, buckets=listed)
            # Events received after the cursor's position come by the cursor (once a share's
            # buckets are warm): folding them here too would count them twice.
            events = db.events_window(c, since_ms=lo, until_ms=hi, up_to_id=self.events.position)
            if buckets is not None and len(events):
                events = events[self._in(c, events["node"].to_numpy(dtype=object), buckets)]
        block = SampleBlock(page.ts_ms, page.node, page.gpu, page.values)
        end = now_ms if hi is None else hi - 1
        clock = _clock(max(end, self.scorer.state.now_ms or 0), block, events)
        self.scorer.update(block, events, now_ms=clock)
        warming.samples += len(page.ts_ms)
        warming.events += len(events)
        if hi is None:
            return True
        warming.lo = hi
        return False

    # -- partitioned scoring (control.partition) ----------------------------------------------

    def _start_share(self, sample_top: int, event_top: int) -> None:
        """Begin scoring a share: cursors at the tops given, a scorer with nothing in it (the
        buckets this loop gains at its first tick are warmed then)."""
        self.samples = ArrivalCursor(sample_top)
        self.events = ArrivalCursor(event_top)
        if self._own_scorer:
            from predictor.scoring import Scorer

            self.scorer = Scorer(self.model)
        self.share = Share(self.member)

    def _in(self, c: Any, nodes: np.ndarray, buckets: np.ndarray | None = None) -> np.ndarray:
        """Mask of ``nodes`` in ``buckets`` (default: this loop's share), their buckets asked
        of the database once per name."""
        assert self.share is not None
        unknown = self.share.unknown(nodes)
        if unknown:
            self.share.node_bucket.update(db.node_buckets(c, unknown))
        return self.share.holds(nodes, buckets)

    def follow(self, now_ms: int | None = None) -> None:
        """A follower's tick: score this loop's share and publish it for the leader."""
        started = time.perf_counter()
        now_ms = self.now_ms() if now_ms is None else now_ms
        self._follow_lifecycle()
        if self.share is None:
            with self.store.engine.connect() as c:
                self._start_share(db.max_sample_seq(c), db.max_event_seq(c))
        assert self.scorer is not None and self.share is not None
        with self.store.engine.connect() as c:
            status = db.read_status(c) or {}
        threshold = status.get("threshold_in_force")
        if isinstance(threshold, int | float):  # reasons for GPUs above half the leader's
            self.scorer.reason_floor = float(threshold) / 2
        scores, _ = self._score_share(now_ms)
        shard = scores[list(SHARD_COLUMNS)] if scores is not None else _EMPTY_SHARD
        payload = encode(shard)
        said = {  # this tick's phases, the whole of the tick before it
            "tick_s": self.last_tick_s,
            "phases": self.last_phases,
            "samples_read": self.last_read,
            "buckets": self.share.size,
            "warming": self._warming_count(),
        }
        with self.store.begin() as c:
            db.beat_member(
                c, member=self.member, now_ms=now_ms, tick_ms=now_ms, gpus=len(shard),
                payload=payload, status=said,
            )  # fmt: skip
        self.ticks += 1
        self.last_tick_s = time.perf_counter() - started

    def _warming_count(self) -> int:
        """Buckets of this loop's share gained and not warm yet."""
        warming = self.warming
        return 0 if warming is None or warming.buckets is None else len(warming.buckets)

    def _score_share(self, now_ms: int) -> tuple[pd.DataFrame | None, pd.DataFrame]:
        """Read this loop's share of the samples received since the last tick (and every
        event), fold them into its scorer, score its share; returns (its scores, or None;
        the fresh events, all of them: the leader judges fatal ones fleet-wide)."""
        share, scorer = self.share, self.scorer
        assert share is not None and scorer is not None
        started = time.perf_counter()
        with self.store.engine.connect() as c:
            live = db.live_members(c, since_ms=now_ms - self.live_ms)
        first = share.buckets is None
        gained, lost = share.assign(live)
        if len(lost) and scorer.state.size:  # scored by another member now: forget them
            state = scorer.state
            nodes = np.asarray(state.nodes, dtype=object)[state.node_of[: state.size]]
            with self.store.engine.connect() as c:
                state.keep(self._in(c, nodes))
        warming = self.warming
        if warming is not None and len(lost):
            assert warming.buckets is not None
            warming.buckets = np.setdiff1d(warming.buckets, lost)
        if first:  # before this loop's first heartbeat: the others score these meanwhile
            try:
                self._warm(now_ms, None if share.whole else share.buckets)
            except BaseException:
                share.buckets, share.members = None, ()  # warmed again at the next tick
                raise
        elif len(gained):  # a member left: warm its buckets a few pages a tick (below)
            if warming is not None:
                assert warming.buckets is not None
                gained = np.union1d(warming.buckets, gained)
            self.warming = self._warming_of(now_ms, gained)
            log.info("warming %d buckets gained from the store's window", len(gained))
        if self.warming is not None:
            self._warm_some(now_ms, until=started + WARM_SHARE_OF_TICK * self.tick_s)
        ready = share.buckets
        assert ready is not None
        if self.warming is not None:
            assert self.warming.buckets is not None
            ready = np.setdiff1d(ready, self.warming.buckets)
        with self.store.engine.connect() as c:
            seqs = db.arrival_seqs_after(c, self.samples.position, limit=self.read_limit)
            read = db.sample_arrays_after(
                c,
                self.samples.position,
                VALUE_COLUMNS,
                limit=self.read_limit,
                buckets=None if len(ready) == db.BUCKETS else ready.tolist(),
                until=int(seqs[-1]) if len(seqs) else self.samples.position,
            )
            events, event_seqs = db.events_after(c, self.events.position)
            ours = self._in(c, events["node"].to_numpy(dtype=object), ready)
        self.last_read = len(seqs)
        if self.last_read >= self.read_limit:
            log.warning("the tick read its limit of %d samples: behind", self.read_limit)
        # A row committed between the two reads is read again at the next tick, with its
        # number: the cursor moves over the numbers of the first read only.
        keep = np.isin(read.seq, seqs) & self.samples.fresh(read.seq)
        samples = SampleBlock(read.ts_ms, read.node, read.gpu, read.values)
        if not keep.all():
            samples = samples[keep]
        efresh = self.events.fresh(event_seqs)
        if not efresh.all():
            keep_events = efresh[events.index.to_numpy()]
            events, ours = events[keep_events], ours[keep_events]
        read_done = time.perf_counter()
        clock = _clock(max(now_ms, scorer.state.now_ms or 0), samples, events[ours])
        scorer.update(samples, events[ours], now_ms=clock)
        scores = None
        if scorer.state.size:
            scores = scorer.score()
            with self.store.engine.connect() as c:
                held = self._in(c, scores["node"].to_numpy(dtype=object), ready)
            if not held.all():
                scores = scores[held].reset_index(drop=True)
        self.samples.consume(seqs)
        self.events.consume(event_seqs)
        self.last_phases = {
            "read_s": read_done - started,
            "score_s": time.perf_counter() - read_done,
        }
        return scores, events

    def _warm_some(self, now_ms: int, *, until: float) -> None:
        """Fold pages of the buckets being warmed until ``until`` (``perf_counter``), at least
        one; once the last page is in, they are scored with the rest of the share. Their rows
        that arrive meanwhile are in the pages (a page is read by time, the last one with no
        end), not in the ticks' reads, which take only the share's warm buckets."""
        warming = self.warming
        assert warming is not None and warming.buckets is not None
        while len(warming.buckets):
            before = warming.samples
            if self._fold_page(warming, now_ms):
                log.info(
                    "%d buckets gained warmed from %d samples and %d events",
                    len(warming.buckets),
                    warming.samples,
                    warming.events,
                )
                break
            if warming.samples > before and time.perf_counter() >= until:
                return  # (an empty page, before the fleet's first samples, costs a query)
        self.warming = None

    def _merge(
        self, c: Any, own: pd.DataFrame | None, now_ms: int
    ) -> tuple[pd.DataFrame | None, dict[str, int]]:
        """The leader's share's scores and every live follower's newest not merged yet, one
        row per GPU (the leader's own first); returns them and the shards' ticks merged."""
        assert self.share is not None
        frames = [] if own is None else [own[list(SHARD_COLUMNS)]]
        merged: dict[str, int] = {}
        report: dict[str, Any] = {}
        for shard in db.shards(c, since_ms=now_ms - self.live_ms, besides=self.member):
            member, tick_ms = shard.member, shard.tick_ms
            new = tick_ms > self._merged.get(member, -1)
            report[member] = {
                "gpus": shard.gpus,
                "age_s": (now_ms - tick_ms) / 1000,
                "merged": new,
                "tick_s": shard.status.get("tick_s"),
                "warming": shard.status.get("warming", 0),
            }
            if new:
                try:
                    frames.append(decode(shard.payload))
                except Exception as exc:  # a row garbled must not stop the leader deciding
                    log.warning("the scores of %s do not read (%s); skipped", member, exc)
                    report[member]["unreadable"] = True
                    continue
                merged[member] = tick_ms
        self.last_partition = {
            "member": self.member,
            "members": list(self.share.members),
            "buckets": self.share.size,
            "warming": self._warming_count(),
            "gpus": 0 if own is None else len(own),
            "followers": report,
        }
        if not frames:
            return None, merged
        scores = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        twice = scores.duplicated(["node", "gpu"], keep="first").to_numpy()
        if twice.any():  # a bucket two members held while the membership changed
            scores = scores[~twice].reset_index(drop=True)
        return scores, merged

    # -- one tick ---------------------------------------------------------------------------

    def policy(self, connection: Any) -> Policy:
        stored = db.read_policy(connection)
        return Policy.model_validate(stored) if stored is not None else self.defaults

    @property
    def model_id(self) -> str | None:
        """The model that scores (its card's stem), recorded with every crossing and decision."""
        card = getattr(self.model, "card", None) or {}
        model_id = card.get("model_id")
        return None if model_id is None else str(model_id)

    def _follow_lifecycle(self) -> None:
        """Swap in the lifecycle's model in force when it changed."""
        if self.lifecycle is None:
            return
        try:
            wanted = self.lifecycle.in_force_id()
            if wanted == self.model_id:
                return
            model = self.lifecycle.load_in_force()
        except Exception:
            log.exception("cannot read the model in force; scoring on with %s", self.model_id)
            return
        log.info("model in force: %s (was %s)", wanted, self.model_id)
        self.model = model
        if self.scorer is not None:
            self.scorer.model = model

    def tick(self, now_ms: int | None = None) -> None:
        started = time.perf_counter()
        now_ms = self.now_ms() if now_ms is None else now_ms
        self._follow_lifecycle()
        if self.share is not None:
            scores, events = self._score_share(now_ms)
            read_done = started + self.last_phases["read_s"]
        else:
            scores, events, read_done = self._score_whole(now_ms)
        score_done = time.perf_counter()
        merged: dict[str, int] = {}
        with self.store.begin() as c:
            if self.epoch is None or not db.fence(c, self.epoch):
                raise Deposed(f"the leadership epoch is no longer {self.epoch}")
            if self.share is not None:
                db.beat_member(c, member=self.member, now_ms=now_ms)
                scores, merged = self._merge(c, scores, now_ms)
            policy = self.policy(c)
            window_ms = int(policy.breaker_window_s * 1000)
            reset_ms = db.breaker_reset_ms(c)
            plan = TickPlan(
                crossings_before=sum(
                    1 for t in self._crossings if now_ms - t <= window_ms and t > reset_ms
                ),
                window_ms=window_ms,
                audited=dict(self._audited),
                breaker_reset_ms=reset_ms,
            )
            threshold = self._threshold(c, plan, policy, scores, now_ms)
            self._apply_scores(c, plan, scores, events, policy, threshold, now_ms)
            if self.scorer is not None:  # reasons for GPUs above half the threshold in force
                self.scorer.reason_floor = threshold / 2
            self._decide(c, plan, policy, now_ms)
            for m in orchestrator.reconcile(
                c,
                now_ms=now_ms,
                ack_timeout_s=self.ack_timeout_s,
                agent_timeout_s=self.agent_timeout_s,
            ):
                log.warning("migration %s failed: %s", m["id"], m["error"])
            if self.ticks % 100 == 0:
                db.prune_history(c, before_ms=now_ms - int(self.history_days * 86_400_000))
                db.forget_members(c, before_ms=now_ms - 100 * self.live_ms)
            db.publish_status(c, self.status(now_ms))
        self._apply(plan, now_ms)
        self._merged.update(merged)
        self.ticks += 1
        end = time.perf_counter()
        self.last_tick_s = end - started
        self.last_phases = {
            "read_s": read_done - started,
            "score_s": score_done - read_done,
            "write_decide_s": end - score_done,
        }
        self.durations.observe(self.last_tick_s)

    def _score_whole(self, now_ms: int) -> tuple[pd.DataFrame | None, pd.DataFrame, float]:
        """Read every sample and event received since the last tick, fold them into the
        scorer and score the fleet; returns (scores or None, the fresh events, when the read
        ended)."""
        with self.store.engine.connect() as c:
            read = db.sample_arrays_after(
                c, self.samples.position, VALUE_COLUMNS, limit=self.read_limit
            )
            events, event_seqs = db.events_after(c, self.events.position)
        sample_seqs = read.seq
        samples = SampleBlock(read.ts_ms, read.node, read.gpu, read.values)
        self.last_read = len(sample_seqs)
        if self.last_read >= self.read_limit:
            log.warning(
                "the tick read its limit of %d samples: the loop is behind the fleet's samples "
                "and scores them late (raise read_limit or partition the fleet)",
                self.read_limit,
            )
        # Samples come in arrival order; the events frame is sorted by time, its index each
        # row's position in arrival order.
        fresh = self.samples.fresh(sample_seqs)
        if not fresh.all():
            samples = samples[fresh]
        efresh = self.events.fresh(event_seqs)
        if not efresh.all():
            events = events[efresh[events.index.to_numpy()]]
        read_done = time.perf_counter()
        scores = None
        if self.scorer is not None:
            clock = _clock(max(now_ms, self.scorer.state.now_ms or 0), samples, events)
            self.scorer.update(samples, events, now_ms=clock)
            if self.scorer.state.size:
                scores = self.scorer.score()
        self.samples.consume(sample_seqs)
        self.events.consume(event_seqs)
        return scores, events, read_done

    def status(self, now_ms: int) -> dict[str, Any]:
        """What the service shows of this loop (published by every tick; the durations are
        those of the ticks before it)."""
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "epoch": self.epoch,
            "tick_ms": now_ms,
            "tick_s": self.tick_s,
            "ticks": self.ticks + 1,
            "model_id": self.model_id,
            "model_threshold": float(self.model.threshold) if self.model is not None else None,
            "threshold_in_force": self.threshold_in_force,
            "alarm_budget": self.budget.summary() if self.budget is not None else None,
            "floor_budget": (
                self.floor_budget.summary() if self.floor_budget is not None else None
            ),
            "last_tick_s": self.last_tick_s,
            "phases": self.last_phases,
            "samples_read": self.last_read,
            "behind": self.last_read >= self.read_limit,
            "durations": self.durations.state(),
            "partition": self.last_partition,
        }

    def _apply(self, plan: TickPlan, now_ms: int) -> None:
        """The tick committed: make its changes to the loop's memory."""
        self.gpus.update(plan.gpus)
        self._crossings.extend(plan.crossings)
        # Oldest first: drop those out of the window and those before the last breaker reset.
        while self._crossings and (
            now_ms - self._crossings[0] > plan.window_ms
            or self._crossings[0] <= plan.breaker_reset_ms
        ):
            self._crossings.popleft()
        self._audited = plan.audited
        self._failed_pending = {}
        if self.budget is not None:
            slots = [self._budget_slots[k] for k in plan.discard if k in self._budget_slots]
            if slots:
                self.budget.discard(slots)
                if self.floor_budget is not None:
                    self.floor_budget.discard(slots)
        if plan.budget_kept is not None:
            self._budget_kept = plan.budget_kept
        if plan.floor_kept is not None:
            self._floor_demoted = plan.floor_kept

    def _threshold(
        self, c: Any, plan: TickPlan, policy: Policy, scores: pd.DataFrame | None, now_ms: int
    ) -> float:
        """The threshold in force this tick: the policy's, else the alarm budget's (judged by
        what it knew before this tick; then this tick's risks are folded in), else the card's.

        Sets this tick's floor (``self._floor``): the rules that trip, less those the alarm
        budget's :class:`FloorBudget` no longer counts as a floor on this fleet (judged, too,
        by what it knew before this tick). Without an alarm budget every rule is a floor."""
        card = float(self.model.threshold) if self.model is not None else 1.0
        self._floor = None if scores is None else scores["floor"].to_numpy(dtype=bool)
        if policy.threshold is not None or policy.alarm_budget is None:
            self.budget = None
            self.floor_budget = None
            self.threshold_in_force = card if policy.threshold is None else policy.threshold
            return self.threshold_in_force
        if self.budget is None or self.budget.budget != policy.alarm_budget:
            self.budget = self._open_budget(c, policy.alarm_budget, card)
        threshold = self.budget.threshold
        if scores is not None and len(scores):
            slots = self._budget_slots
            index = [
                slots.setdefault((n, int(g)), len(slots))
                for n, g in zip(scores["node"].tolist(), scores["gpu"].tolist(), strict=True)
            ]
            assert self.floor_budget is not None
            masks = scores["floor_rules"].to_numpy(dtype=np.int64)
            self._floor = (masks & self.floor_budget.active_mask) != 0
            risk = np.full(len(slots), np.nan)
            # A GPU the rules floor counts at the top of the scale: the rules' false alarms
            # use up the budget too, and the model's threshold leaves room for them.
            risk[index] = np.where(
                self._floor, FLOOR_SCORE, scores["model_risk"].to_numpy(dtype=np.float64)
            )
            healthy = np.ones(len(slots), dtype=bool)
            stale_ms = policy.stale_after_s * 1000
            last_seen = scores["last_seen_ms"].to_numpy(dtype=np.float64)
            healthy[index] = now_ms - last_seen <= stale_ms
            for key, st in self.gpus.items():  # a failed GPU's scores are not healthy time
                if st.failed and key in slots:
                    healthy[slots[key]] = False
            self.budget.observe(risk, now_ms=now_ms, healthy=healthy)
            tripped = np.full(len(slots), -1, dtype=np.int64)
            tripped[index] = masks
            self.floor_budget.observe(tripped, now_ms=now_ms, healthy=healthy)
            # A rule demoted now: the blocks it floored were its alarms, not the model's; they
            # leave the budget's healthy time, so the model's threshold is not held at the top.
            freed, weight = self.floor_budget.released()
            self.budget.discard(freed.tolist())
            self.budget.forget(FLOOR_SCORE, weight)
            self._keep_budget(c, plan, now_ms)
        self.threshold_in_force = threshold
        return threshold

    def _open_budget(self, c: Any, per_1000_gpu_days: float, card: float) -> AlarmBudget:
        """A budget that starts from the fleet's healthy time confirmed so far: the one in
        force (the operator changed the budget, not the fleet), else the one kept in the
        store by this or an earlier leader (a restart or a new leader does not fall back to
        the card's threshold, or to a provisional fit, all over again)."""
        budget = AlarmBudget(per_1000_gpu_days, fallback=card)
        kept = self.budget.state() if self.budget is not None else _kept(c, BUDGET_KEY)
        if isinstance(kept, dict) and not budget.restore(kept):
            log.warning("the kept alarm-budget state does not fit this version; starting afresh")
        rules = FloorBudget(per_1000_gpu_days)
        kept = (
            self.floor_budget.state()
            if self.floor_budget is not None
            else _kept(c, FLOOR_BUDGET_KEY)
        )
        if isinstance(kept, dict) and not rules.restore(kept):
            log.warning("the kept floor-budget state does not fit this version; starting afresh")
        self.floor_budget = rules
        self._floor_demoted = _names_off(rules.active)
        self._budget_slots = {}
        self._budget_kept = (budget.healthy_blocks, None)
        return budget

    def _keep_budget(self, c: Any, plan: TickPlan, now_ms: int) -> None:
        """Write the budget's confirmed healthy time to the store when it grew (blocks are
        confirmed once an hour per GPU), at most once a minute; the floor budget's with it,
        and at once when the rules it demotes changed."""
        assert self.budget is not None
        blocks, at_ms = self._budget_kept
        due = self.budget.healthy_blocks != blocks and (
            at_ms is None or now_ms - at_ms >= BUDGET_KEEP_EVERY_MS
        )
        if due:
            db.set_state(c, BUDGET_KEY, json.dumps(self.budget.state()))
            plan.budget_kept = (self.budget.healthy_blocks, now_ms)
        if self.floor_budget is not None:
            demoted = _names_off(self.floor_budget.active)
            if due or demoted != self._floor_demoted:
                db.set_state(c, FLOOR_BUDGET_KEY, json.dumps(self.floor_budget.state()))
                plan.floor_kept = demoted

    def _apply_scores(
        self,
        c: Any,
        plan: TickPlan,
        scores: pd.DataFrame | None,
        events: pd.DataFrame,
        policy: Policy,
        threshold: float,
        now_ms: int,
    ) -> None:
        # Fatal events of a tick that did not commit are judged again (the cursor moved on).
        failed_now: dict[tuple[str, int], str] = dict(self._failed_pending)
        if len(events):
            from predictor.catalog import GPU_DOWN_XIDS

            for ev in events.to_dict("records"):
                if ev["gpu"] is pd.NA or ev["gpu"] is None:
                    continue
                xid = None if ev["xid"] is pd.NA or ev["xid"] is None else int(ev["xid"])
                kind = str(ev["kind"])
                if kind in FATAL_EVENT_KINDS or (kind == "xid" and xid in GPU_DOWN_XIDS):
                    what = f"Xid {xid}" if kind == "xid" else kind.replace("_", " ")
                    failed_now[(str(ev["node"]), int(ev["gpu"]))] = what
        self._failed_pending = failed_now
        rows: list[db.StoredRisk] = []
        history: list[db.HistoryRow] = []
        stale_ms = policy.stale_after_s * 1000
        history_every_ms = self.history_interval_s * 1000
        gpus = self.gpus
        if scores is not None:
            # The rules are a floor: hard evidence alarms at the threshold in force.
            assert self._floor is not None  # set by _threshold from the same scores
            acted = floored(scores["model_risk"], self._floor, threshold)
            said = scores["reasons"].tolist()
            if self.floor_budget is not None and not self.floor_budget.active.all():
                said = [_demoted_said(r, self.floor_budget.active) for r in said]
            for node, gpu, risk, reasons, last_ms in zip(
                scores["node"].tolist(),
                scores["gpu"].tolist(),
                acted.tolist(),
                said,
                scores["last_seen_ms"].tolist(),
                strict=True,
            ):
                key = (node, int(gpu))
                old = gpus.get(key)
                st = old if old is not None else _UNSEEN
                alarm = bool(risk >= threshold)
                stale = now_ms - last_ms > stale_ms
                streak, crossed, failed = st.streak, st.crossed, st.failed
                if not stale:
                    streak = streak + 1 if alarm else 0
                if streak >= policy.hysteresis and not crossed and not stale:
                    crossed = True
                    plan.crossings.append(now_ms)
                    emit_event(
                        c,
                        "risk.threshold_crossed",
                        {
                            "node": node,
                            "gpu": int(gpu),
                            "risk": risk,
                            "threshold": threshold,
                            "reasons": reasons,
                            "consecutive": streak,
                            "model": self.model_id,
                        },
                        node=node,
                        ts_ms=now_ms,
                    )
                elif crossed and not alarm and not stale:
                    crossed = False
                    plan.audited = {k: v for k, v in plan.audited.items() if k[0] != key}
                    emit_event(
                        c,
                        "risk.cleared",
                        {"node": node, "gpu": int(gpu), "risk": risk, "threshold": threshold},
                        node=node,
                    )
                if stale and not st.stale:
                    emit_event(
                        c,
                        "gpu.stale",
                        {"node": node, "gpu": int(gpu), "last_seen_ms": last_ms},
                        node=node,
                    )
                if key in failed_now and not failed:
                    failed = True
                    plan.discard.append(key)
                    emit_event(
                        c,
                        "gpu.failed",
                        {"node": node, "gpu": int(gpu), "cause": failed_now[key]},
                        node=node,
                    )
                crossed_ms = (
                    (now_ms if st.crossed_ms is None else st.crossed_ms) if crossed else None
                )
                # A row is written when anything in it changed (its reasons included; its risk
                # by RISK_STEP or more), and at least every REFRESH_MS: the decayed sums move a
                # calibrated risk a little every tick, on every GPU.
                written, written_ms = st.written, st.written_ms
                shown = (
                    round(float(risk) / RISK_STEP) if risk == risk else None,  # NaN: unknown
                    alarm,
                    stale,
                    streak,
                    crossed,
                    failed,
                    tuple(reasons),
                )
                if shown != written or now_ms - written_ms >= REFRESH_MS:
                    first = not written_ms
                    written, written_ms = shown, now_ms
                    if first:  # its refreshes at its own phase
                        written_ms -= _phase(key, REFRESH_MS)
                    rows.append(
                        {
                            "node": node,
                            "gpu": int(gpu),
                            "risk": float(risk),
                            "alarm": alarm,
                            "reasons": db.dumps(reasons),
                            "scored_ms": now_ms,
                            "last_seen_ms": int(last_ms),
                            "stale": stale,
                            "streak": streak,
                            "crossed": crossed,
                            "crossed_ms": crossed_ms,
                            "failed": failed,
                        }
                    )
                history_ms = st.history_ms
                if alarm != st.last_alarm or now_ms - history_ms >= history_every_ms:
                    history.append(
                        {
                            "node": node,
                            "gpu": int(gpu),
                            "ts_ms": now_ms,
                            "risk": float(risk),
                            "alarm": alarm,
                        }
                    )
                    history_ms = now_ms
                    if not st.history_ms:  # its first: its next ones at its own phase
                        history_ms -= _phase(key, history_every_ms)
                if (
                    old is None
                    or written is not old.written
                    or (streak, crossed, stale, failed, history_ms, alarm, crossed_ms, written_ms)
                    != (
                        old.streak,
                        old.crossed,
                        old.stale,
                        old.failed,
                        old.history_ms,
                        old.last_alarm,
                        old.crossed_ms,
                        old.written_ms,
                    )
                ):
                    plan.gpus[key] = GpuState(
                        streak=streak,
                        crossed=crossed,
                        stale=stale,
                        failed=failed,
                        history_ms=history_ms,
                        last_alarm=alarm,
                        crossed_ms=crossed_ms,
                        written=written,
                        written_ms=written_ms,
                    )
        for key, what in failed_now.items():  # a GPU the scorer has not seen yet
            seen = plan.state(gpus, key)
            if seen is None or not seen.failed:
                plan.gpus[key] = replace(seen or _UNSEEN, failed=True)
                emit_event(
                    c, "gpu.failed", {"node": key[0], "gpu": key[1], "cause": what}, node=key[0]
                )
        db.upsert_risk(c, rows)
        db.append_history(c, history)

    def _decide(self, c: Any, plan: TickPlan, policy: Policy, now_ms: int) -> None:
        tripped = (db.get_state(c, "breaker_tripped_ms") or "") != ""
        gpus = {**self.gpus, **plan.gpus} if plan.gpus else self.gpus
        fleet = max(len(gpus), 1)
        crossings = plan.in_window()
        if not tripped and breaker_should_trip(
            policy, crossings_in_window=crossings, fleet_size=fleet
        ):
            tripped = True
            db.set_state(c, "breaker_tripped_ms", str(now_ms))
            tripped_data = {
                "crossings": crossings,
                "fleet": fleet,
                "window_s": policy.breaker_window_s,
                "breaker_pct": policy.breaker_pct,
            }
            db.write_audit(
                c,
                ts_ms=now_ms,
                kind="policy",
                action="breaker_tripped",
                reason=f"{crossings} of {fleet} GPUs crossed within "
                f"{policy.breaker_window_s:g} s; automatic action stopped",
                data=tripped_data,
            )
            emit_event(c, "policy.breaker_tripped", tripped_data)
        ranks = db.placements(c)
        active = [r for r in ranks if r["role"] == "active"]
        spares: dict[str, list[db.RankSlot]] = {}
        for r in sorted(ranks, key=lambda r: r["slot"]):
            if r["role"] == "spare":
                spares.setdefault(r["job_id"], []).append(r)
        inflight = db.list_migrations(c, states=db.ACTIVE_STATES)
        by_job: dict[str, int] = {}
        moving: set[tuple[str, int]] = set()
        for m in inflight:
            by_job[m["job_id"]] = by_job.get(m["job_id"], 0) + 1
            moving.add((m["job_id"], m["rank"]))
            if m["target_slot"] is not None:  # a spare already promised is not free
                spares[m["job_id"]] = [
                    s for s in spares.get(m["job_id"], []) if s["slot"] != m["target_slot"]
                ]
        recent = db.list_migrations(c, limit=500)
        last: dict[tuple[str, str, int], int] = {}
        for m in recent:
            if m["source_node"] is not None and m["source_gpu"] is not None:
                k = (m["job_id"], m["source_node"], m["source_gpu"])
                last[k] = max(last.get(k, 0), m["requested_ms"])
        drained = db.drained_nodes(c)
        unsafe = {k for k, st in gpus.items() if st.crossed or st.failed or st.stale}
        slow, judged = watch.judge_stored(
            c,
            policy,
            now_ms=now_ms,
            active=active,
            recent=recent,
            fresh_s=self.agent_timeout_s,
            forget=lambda k: self._forget_straggler(plan, k),
        )
        # The rank time judged: the denominator of the fleet's own straggler rate (a gap
        # longer than a few ticks, the loop away, counts as no watching).
        db.add_watched(c, ranks=judged, now_ms=now_ms, cap_ms=int(3 * self.tick_s * 1000))
        pauses: dict[str, list[float]] = {}
        for m in recent:
            if m["state"] == "completed" and m["pause_s"] is not None:
                pauses.setdefault(m["job_id"], []).append(float(m["pause_s"]))
        fleet_pauses = [p for job_pauses in pauses.values() for p in job_pauses]
        situation = Situation(
            now_ms=now_ms,
            breaker_tripped=tripped,
            inflight_by_job=by_job,
            inflight_fleet=len(inflight),
            last_request_ms=last,
            spares_by_job=spares,
            drained=drained,
            unsafe=unsafe,
            stragglers_tripped=stragglers_should_trip(policy, stragglers=len(slow), judged=judged),
        )
        for r in active:
            if (r["job_id"], r["rank"]) in moving or r["gpu"] is None:
                continue
            key = (r["node"], int(r["gpu"]))
            st = gpus.get(key)
            if st is not None and st.failed and policy.act_on_failures:
                trigger, acting = "unplanned", policy
            elif st is not None and st.crossed and not st.stale:
                trigger, acting = "preventive", policy
            elif r["node"] in drained:
                trigger, acting = "planned", policy.model_copy(update={"dry_run": False})
            elif (r["job_id"], r["rank"]) in slow and policy.act_on_stragglers:
                trigger, acting = "straggler", policy
            else:
                continue
            slow_one = slow.get((r["job_id"], r["rank"])) if trigger == "straggler" else None
            case = (
                watch.case_of(
                    policy,
                    slow_one,
                    job_pauses_s=pauses.get(r["job_id"], []),
                    fleet_pauses_s=fleet_pauses,
                )
                if slow_one is not None
                else None
            )
            decision = decide(
                acting,
                situation,
                job_id=r["job_id"],
                node=key[0],
                gpu=key[1],
                trigger=trigger,
                straggler=case,
            )
            risk_row = self._risk_of(c, key)
            risk = risk_row["risk"] if risk_row else None
            reasons = risk_row["reasons"] if risk_row else []
            outcome = f"{decision.action}:{decision.reason}"
            episode = (key, r["job_id"], r["rank"], trigger)
            if decision.action != "request" and plan.audited.get(episode) == outcome:
                continue
            plan.audited[episode] = outcome
            data: dict[str, Any] = {
                "job_id": r["job_id"],
                "rank": r["rank"],
                "trigger": trigger,
                "model": self.model_id,
                "risk": risk,
                "reasons": reasons,
                "source": {"node": key[0], "gpu": key[1]},
                "target": decision.target
                and {
                    "node": decision.target["node"],
                    "gpu": decision.target["gpu"],
                    "slot": decision.target["slot"],
                },
            }
            if slow_one is not None and case is not None:
                data["straggler"] = {
                    "compute_s": slow_one.compute_s,
                    "peers_median_s": slow_one.peers_median_s,
                    "reason": slow_one.reason,
                    "gain_s": case.gain_s,
                    "remaining_steps": case.remaining_steps,
                    "remaining_from": case.remaining_from,
                    "cost_s": case.cost_s,
                    "cost_from": case.cost_from,
                }
            requested: db.Migration | None = None
            if decision.action == "request":
                try:
                    requested = orchestrator.request(
                        c,
                        job_id=r["job_id"],
                        rank=r["rank"],
                        trigger=trigger,
                        now_ms=now_ms,
                        source=key,
                        target=decision.target,
                        risk=risk,
                        reasons=[slow_one.reason] if slow_one else reasons,
                        detail=f"straggler: {slow_one.reason}"
                        if slow_one
                        else f"scored by model {self.model_id}"
                        if trigger == "preventive" and self.model_id
                        else None,
                        why=decision.reason,
                    )
                except Conflict as refused:  # the database holds one active move per rank
                    decision = Decision("declined", refused.message)
                    plan.audited[episode] = f"{decision.action}:{decision.reason}"
            if requested is not None:
                m = requested
                situation.inflight_by_job[r["job_id"]] = by_job.get(r["job_id"], 0) + 1
                situation.inflight_fleet += 1
                situation.spares_by_job[r["job_id"]] = [
                    s
                    for s in situation.spares_by_job.get(r["job_id"], [])
                    if s["slot"] != m["target_slot"]
                ]
                log.info(
                    "requested %s migration %s of %s rank %s",
                    trigger,
                    m["id"],
                    r["job_id"],
                    r["rank"],
                )
            if decision.action != "request":
                db.write_audit(
                    c,
                    ts_ms=now_ms,
                    kind="migration",
                    action=decision.action,
                    reason=decision.reason,
                    node=key[0],
                    gpu=key[1],
                    job_id=r["job_id"],
                    data=data,
                )

    def _forget_straggler(self, plan: TickPlan, k: tuple[str, int]) -> None:
        """A straggler cleared or moved: its next decline is audited again."""
        plan.audited = {e: v for e, v in plan.audited.items() if e[1:] != (*k, "straggler")}

    def _risk_of(self, c: Any, key: tuple[str, int]) -> db.Risk | None:
        rows = [r for r in db.risk_rows(c, node=key[0]) if r["gpu"] == key[1]]
        return rows[0] if rows else None


def _kept(c: Any, key: str) -> Any:
    """The JSON a leader kept under ``key`` in ``control_state`` (None: none, or unreadable)."""
    text = db.get_state(c, key)
    try:
        return json.loads(text) if text else None
    except ValueError:
        log.warning("the kept %s state is unreadable; starting afresh", key)
        return None


def _names_off(active: np.ndarray) -> list[str]:
    """The floor rules that ``active`` (one bool per rule) says are not a floor."""
    return [r.name for r, a in zip(FLOOR_RULES, active, strict=True) if not a]


def _clock(at_least: int, samples: SampleBlock, events: pd.DataFrame) -> int:
    """The scorer's clock for an update: ``at_least``, or the newest row's time if later (a
    collector's clock ahead of ours)."""
    clock = at_least
    if len(samples):
        clock = max(clock, int(samples.ts_ms.max()))
    if len(events):
        clock = max(clock, int(events["ts_ms"].max()))
    return clock


def _phase(key: tuple[str, int], every_ms: float) -> int:
    """Where in an interval a GPU's periodic rows fall (its history points, its risk row's
    refreshes), the same for a GPU on every replica. A fleet that came up together (or a
    loop that took over a fleet) would otherwise write a history row for every GPU in one
    tick each interval: 100,000 rows, 1.5 s of a 5 s tick, where the ticks between wrote
    none; and rewrite every GPU's unchanged risk row in one tick of six."""
    node, gpu = key
    return zlib.crc32(f"{node}/{gpu}".encode()) % max(int(every_ms), 1)


def _demoted_said(reasons: Sequence[str], active: np.ndarray) -> Sequence[str]:
    """A GPU's reasons with each rule that is not a floor on this fleet said so."""
    if not reasons:
        return reasons
    off = {f"rule {name}:" for name in _names_off(active)}
    return [
        f"{r} - not a floor on this fleet (its false alarms exceed the alarm budget)"
        if r.startswith(tuple(off))
        else r
        for r in reasons
    ]
