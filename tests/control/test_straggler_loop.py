"""The control loop's straggler path on both backends: timings stored as the heartbeat stores
them and samples of a throttled GPU -> one straggler migration with the named reason, one
``rank.straggling`` event, no repeated rows; dry-run; a decline audited once; a restart."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from api.routes.jobs import command_of
from control import orchestrator
from control.loop import ControlLoop
from forewarn.wire import MigrationReport, Placement, RankTimings
from store import Store
from store import control as db
from store.outbox import events_after
from store.writes import sample_row
from tests.control.conftest import make_loop
from tests.factories import sample

NOW = int(time.time() * 1000)
THROTTLED = "clocks held down: HW thermal slowdown (0x40)"


def heartbeat(store: Store, compute_1: float = 1.6, *, at_ms: int = NOW) -> None:
    """Rank 1 computes ``compute_1`` s a step, rank 0 1.0 s (what the route stores)."""
    timings = RankTimings(
        window=20,
        step=100,
        total_steps=1100,
        rank=[0, 1],
        compute_s=[1.0, compute_1],
        wait_s=[compute_1 - 1.0, 0.0],
        step_s=[compute_1 + 0.1, compute_1 + 0.1],
    )
    with store.begin() as c:
        db.store_timings(c, job_id="j", timings=timings.model_dump(), received_ms=at_ms)


def throttled_gpu(store: Store) -> None:
    for k, bits in enumerate((0, 0x40)):
        ts = datetime.fromtimestamp((NOW - 2000 + k * 1000) / 1000, UTC)
        store.write(samples=[sample_row(sample(node="n0", gpu=1, ts=ts, throttle_reasons=bits))])


def past_move(store: Store, pause_s: float) -> None:
    """A completed migration of the job that measured its pause."""
    with store.begin() as c:
        db.insert_migration(
            c,
            {
                "id": "mig_past",
                "job_id": "j",
                "rank": 0,
                "trigger": "manual",
                "state": "completed",
                "reasons": "[]",
                "requested_ms": NOW - 3_600_000,
                "finished_ms": NOW - 3_590_000,
                "pause_s": pause_s,
            },
        )


def ticks(loop: ControlLoop, start_s: int, stop_s: int) -> None:
    for k in range(start_s, stop_s):
        loop.tick(NOW + k * 5000)


def outbox(store: Store, kind: str) -> list[dict]:  # type: ignore[type-arg]
    with store.engine.connect() as c:
        return [e["data"] for e in events_after(c, 0, limit=10_000) if e["type"] == kind]


def read(store: Store) -> tuple[list[dict], list[dict]]:  # type: ignore[type-arg]
    with store.engine.connect() as c:
        moves = [m for m in db.list_migrations(c) if m["id"] != "mig_past"]
        return moves, db.read_audit(c, kind="migration")


def test_a_throttled_straggler_is_moved_once_with_its_reason(registered: Store) -> None:
    loop, _ = make_loop(registered, straggler_window_s=10)
    throttled_gpu(registered)
    past_move(registered, pause_s=4.0)
    heartbeat(registered)
    ticks(loop, 0, 2)  # above for 5 s: not yet
    assert read(registered)[0] == [] and outbox(registered, "rank.straggling") == []
    ticks(loop, 2, 8)
    moves, entries = read(registered)
    (m,) = moves
    assert (m["trigger"], m["rank"], m["source_node"], m["source_gpu"]) == ("straggler", 1, "n0", 1)
    assert m["target_slot"] == 2 and m["reasons"] == [THROTTLED]
    assert m["detail"] == f"straggler: {THROTTLED}"
    command = command_of(m)
    assert (command.reason, command.trigger) == ("planned", "straggler")
    (requested,) = [e for e in entries if e["action"] == "requested"]
    assert (
        "gain 600 s over 1000 steps left, cost 4 s (this job's measured pause)"
        in (requested["reason"])
    )
    (event,) = outbox(registered, "rank.straggling")
    assert (event["job_id"], event["rank"], event["node"], event["gpu"]) == ("j", 1, "n0", 1)
    assert (event["compute_s"], event["peers_median_s"], event["reason"]) == (1.6, 1.0, THROTTLED)
    assert len(outbox(registered, "migration.requested")) == 1
    with registered.engine.connect() as c:
        (job,) = db.get_jobs(c, job_id="j")
    slow = next(r for r in job["ranks"] if r["rank"] == 1)["timing"]
    assert slow["straggling"] and slow["reason"] == THROTTLED

    # The move completes at step 100: medians over steps before it no longer judge the rank.
    report = MigrationReport(
        migration_id=m["id"],
        job_id="j",
        rank=1,
        outcome="completed",
        step=100,
        source=Placement(rank=1, node="n0", gpu=1, slot=1),
        target=Placement(rank=1, node="n1", gpu=0, slot=2),
        pause_s=3.0,
        finished_at=datetime.now(UTC),
    )
    with registered.begin() as c:
        orchestrator.apply_report(c, report, now_ms=NOW + 40_000)
    ticks(loop, 9, 11)
    with registered.engine.connect() as c:
        state = {t["rank"]: t for t in db.timing_rows(c, job_id="j")}[1]
        watched = db.read_watched(c)
    assert not state["straggling"] and state["above_since_ms"] is None
    assert len(read(registered)[0]) == 1
    # The episode ended with the move, from its first tick above its peers' (tick 0).
    (end,) = outbox(registered, "rank.recovered")
    assert (end["job_id"], end["rank"], end["ended_by"], end["reason"]) == (
        "j",
        1,
        "moved",
        THROTTLED,
    )
    assert (end["above_since_ms"], end["ended_ms"]) == (NOW, NOW + 9 * 5000)
    assert end["duration_s"] == 45.0
    # Two ranks judged at ticks 1-7, each 5 s after the last but counted as at most 3 ticks
    # of this loop (1 s each); after the move rank 1 is not judged, and rank 0 alone has no
    # peers: nothing counts.
    assert watched is not None and watched["since_ms"] == NOW
    assert watched["rank_ms"] == 7 * 2 * 3000


def test_dry_run_records_once_and_a_new_leader_does_not_announce_again(
    registered: Store,
) -> None:
    loop, _ = make_loop(registered, straggler_window_s=0, dry_run=True)
    throttled_gpu(registered)
    heartbeat(registered)
    ticks(loop, 0, 4)
    moves, entries = read(registered)
    assert moves == []
    (entry,) = entries
    assert entry["action"] == "dry_run" and entry["data"]["trigger"] == "straggler"
    assert entry["data"]["straggler"]["cost_from"] == "policy"
    assert entry["data"]["straggler"]["reason"] == THROTTLED
    loop.leadership.release()  # the leader dies; another takes over
    again, _ = make_loop(registered, straggler_window_s=0, dry_run=True)
    ticks(again, 4, 6)
    assert len(outbox(registered, "rank.straggling")) == 1
    assert len(read(registered)[1]) == 2  # the standing decision, audited once by each leader


def test_a_gain_below_the_cost_is_declined_once_and_a_recovery_clears(registered: Store) -> None:
    loop, _ = make_loop(registered, straggler_window_s=0, straggler_move_cost_s=1000)
    for k, compute in enumerate(
        (1.3, 1.31, 1.32, 1.33)
    ):  # 300 s gain; figures change, not the decision
        heartbeat(registered, compute_1=compute, at_ms=NOW + k * 5000)
        loop.tick(NOW + k * 5000)
    moves, entries = read(registered)
    assert moves == []
    (entry,) = entries
    assert entry["action"] == "declined" and "does not exceed the move's cost" in entry["reason"]
    assert entry["data"]["straggler"]["cost_from"] == "policy"
    (event,) = outbox(registered, "rank.straggling")
    assert event["reason"] == "unknown"  # no sample of the GPU shows anything
    heartbeat(registered, compute_1=1.05, at_ms=NOW + 20_000)
    loop.tick(NOW + 20_000)
    with registered.engine.connect() as c:
        state = {t["rank"]: t for t in db.timing_rows(c, job_id="j")}[1]
        episodes = db.straggler_episodes(c)
    assert not state["straggling"] and state["above_since_ms"] is None
    (end,) = outbox(registered, "rank.recovered")
    assert (end["ended_by"], end["duration_s"], end["compute_s"]) == ("cleared", 20.0, 1.05)
    assert end["peers_median_s"] == 1.0 and end["reason"] == "unknown"
    (episode,) = episodes
    assert episode["started"]["compute_s"] == 1.3 and episode["ended"] == end


def test_an_episode_ends_when_its_job_stops_sending_timings(registered: Store) -> None:
    """A straggler whose job went quiet (no heartbeat within the agent timeout) is not left
    open for ever, where its span would grow in the history: ``rank.recovered``, ``stale``."""
    loop, _ = make_loop(registered, straggler_window_s=0, straggler_move_cost_s=86_400)
    heartbeat(registered, compute_1=1.3)
    loop.tick(NOW)
    assert len(outbox(registered, "rank.straggling")) == 1
    quiet = NOW + int(loop.agent_timeout_s * 1000) + 5000
    loop.tick(quiet)
    loop.tick(quiet + 5000)  # once only
    (end,) = outbox(registered, "rank.recovered")
    assert (end["ended_by"], end["above_since_ms"], end["ended_ms"]) == ("stale", NOW, quiet)
    with registered.engine.connect() as c:
        state = {t["rank"]: t for t in db.timing_rows(c, job_id="j")}[1]
    assert not state["straggling"] and state["above_since_ms"] is None


def test_a_heartbeat_that_leaves_a_straggler_out_does_not_lose_its_episode(
    registered: Store,
) -> None:
    """During its move a straggler's rank can be missing from one heartbeat's timings: its row
    (and its open episode) stays, so the loop still ends the episode (here: stale) instead of
    a later heartbeat starting the rank afresh with the episode never ended."""
    loop, _ = make_loop(registered, straggler_window_s=0, straggler_move_cost_s=86_400)
    heartbeat(registered, compute_1=1.3)
    loop.tick(NOW)
    assert len(outbox(registered, "rank.straggling")) == 1
    only_0 = RankTimings(
        window=20, step=101, total_steps=1100, rank=[0], compute_s=[1.0], wait_s=[0.3],
        step_s=[1.4],
    )  # fmt: skip
    with registered.begin() as c:
        db.store_timings(c, job_id="j", timings=only_0.model_dump(), received_ms=NOW + 1000)
        kept = {t["rank"]: t for t in db.timing_rows(c, job_id="j")}
    assert kept[1]["straggling"]
    quiet = NOW + int(loop.agent_timeout_s * 1000) + 5000
    loop.tick(quiet)
    (end,) = outbox(registered, "rank.recovered")
    assert end["rank"] == 1
