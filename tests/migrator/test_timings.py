"""Step timing: the straggler shows in its compute and its peers' wait, and stays behind when
its rank moves to a spare. One real gloo job (3 ranks, 1 spare), the rest without processes."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from forewarn.wire import JobHeartbeat
from migrator.agent import Agent, AgentConfig
from migrator.faults import FaultPlan
from migrator.service_link import ServiceLink
from migrator.timing import StepClock, decode, encode, summarize
from tests.migrator.harness import ROOT, SCRIPT

DELAY = 0.1


def _peers(values: list[float], slow: int) -> list[float]:
    return [v for i, v in enumerate(values) if i != slow]


def test_a_slow_process_shows_in_its_compute_and_its_peers_wait_until_its_rank_moves(
    tmp_path: Path,
) -> None:
    # Rank 1's process turns slow at step 2; rank 1 asks at step 9 to be moved to the spare.
    plan = FaultPlan().slow_at(1, 2, DELAY, where="forward").migrate_at(1, 9)
    steps = 24
    cfg = AgentConfig(
        command=[sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(steps)],
        nproc=3,
        spares=1,
        timeout_s=10.0,
        faults=plan,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    agent = Agent(cfg)
    # The service link's own body builder, as its heartbeat thread calls it (never sent).
    link = ServiceLink("http://127.0.0.1:9", token=None, job_id="job")
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(agent.run()), daemon=True)
    runner.start()
    before: JobHeartbeat | None = None  # the last beat of generation 0 that saw step >= 6
    while runner.is_alive():
        beat = JobHeartbeat.model_validate(link._heartbeat(agent))
        t = beat.timings
        if beat.generation == 0 and t is not None and t.step >= 6 and len(t.rank) == 3:
            before = beat
        runner.join(timeout=0.05)
    assert codes == [0], agent.message
    after = JobHeartbeat.model_validate(link._heartbeat(agent))

    assert before is not None and before.timings is not None
    t = before.timings
    assert t.rank == [0, 1, 2] and t.window == 20 and t.total_steps == steps
    # The slow rank computes longer before the all-reduce by about the delay; its peers wait.
    assert t.compute_s[1] - max(_peers(t.compute_s, 1)) > DELAY / 2
    assert min(_peers(t.wait_s, 1)) > DELAY / 2
    assert t.wait_s[1] < min(_peers(t.wait_s, 1))

    # Moved to the spare at step 10: the spare is not slow, and rank 1 counts from its steps.
    assert after.generation == 1 and after.timings is not None
    t = after.timings
    assert t.rank == [0, 1, 2] and t.step == steps - 1
    assert t.compute_s[1] - max(_peers(t.compute_s, 1)) < DELAY / 2
    assert max(t.wait_s) < DELAY / 2
    assert agent.reports[0].rank == 1 and agent.reports[0].outcome == "completed"


# -- the bookkeeping, without processes ---------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step(clock: StepClock, fake: FakeClock, k: int, compute: float, wait: float) -> None:
    clock.begin()
    fake.now += compute
    assert clock.arrive()
    fake.now += wait
    clock.completed()
    assert not clock.arrive()  # the step's later collectives are not timed
    fake.now += 0.5
    clock.end(k)


def test_the_clock_keeps_the_last_window_steps_and_skips_steps_without_a_collective() -> None:
    fake = FakeClock()
    clock = StepClock(3, clock=fake)
    assert clock.take(slot=4) is None
    for k in range(5):
        _step(clock, fake, k, compute=float(k), wait=1.0)
    clock.begin()
    clock.end(5)  # no collective (an FSDP step): no row
    clock.total = 9
    slot, total, rows = decode(clock.take(slot=4) or b"")
    assert (slot, total) == (4, 9)
    assert rows == [(2.0, 2.0, 1.0, 3.5), (3.0, 3.0, 1.0, 4.5), (4.0, 4.0, 1.0, 5.5)]
    assert clock.take(slot=4) is None  # nothing new since
    with pytest.raises(ValueError):
        StepClock(0)


def test_summarize_takes_medians_in_rank_order_and_ignores_a_moved_ranks_old_slot() -> None:
    rows: dict[int, list[Any]] = {
        0: [(k, 0.01, 0.2, 0.3) for k in range(30)],
        2: [(k, 0.2, 0.001 * k, 0.3) for k in range(25)],
        1: [(k, 0.01, 0.3, 0.3) for k in range(29)],
    }
    blobs = {0: encode(0, 30, rows[0]), 2: encode(2, None, rows[2]), 1: encode(1, 30, rows[1])}
    got = summarize(blobs, {0: 0, 1: 1, 2: 2}, window=5)
    assert got is not None
    assert got.rank == [0, 1, 2] and got.window == 5 and got.step == 29 and got.total_steps == 30
    assert got.compute_s == [0.01, 0.01, 0.2]
    assert got.wait_s[2] == pytest.approx(0.022)  # the median of steps 20..24
    # Rank 2 moved to slot 3, which has not written yet: rank 2's old rows are not its.
    moved = summarize({**blobs, 1: b""}, {0: 0, 1: 1, 2: 3})
    assert moved is not None and moved.rank == [0]
    assert summarize({0: b""}, {0: 0}) is None
    assert summarize({}, {}) is None


class CountingStore:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, n: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]


def test_slow_at_slows_the_process_that_held_the_rank_not_the_rank() -> None:
    text = FaultPlan().slow_at(1, 2, 0.001, where="backward").to_json()
    store = CountingStore()
    source, spare = FaultPlan.from_json(text), FaultPlan.from_json(text)
    source.fire("backward", 1, 1, kv=store, job=None)
    assert source.slowed == {}
    source.fire("backward", 1, 2, kv=store, job=None)
    assert source.slowed == {"backward": 0.001}
    source.fire("backward", 0, 7, kv=store, job=None)  # still slow under another rank
    assert source.slowed == {"backward": 0.001}
    spare.fire("backward", 1, 2, kv=store, job=None)  # rank 1 at step 2 again (a redo)
    assert spare.slowed == {}  # the fault fired once per job: the spare is not slow
    with pytest.raises(ValueError):
        FaultPlan().slow_at(0, 0, 0.0)
