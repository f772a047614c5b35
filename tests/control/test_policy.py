"""The policy's guards, one by one (pure functions: no store, no clock)."""

from __future__ import annotations

from typing import Any

from control.loop import ArrivalCursor
from control.policy import Policy, Situation, breaker_should_trip, decide

SPARE = {"job_id": "j", "slot": 2, "rank": 2, "node": "n1", "gpu": 0, "role": "spare"}


def situation(**overrides) -> Situation:  # type: ignore[no-untyped-def]
    base: dict[str, Any] = {
        "now_ms": 1_000_000,
        "breaker_tripped": False,
        "inflight_by_job": {},
        "inflight_fleet": 0,
        "last_request_ms": {},
        "spares_by_job": {"j": [dict(SPARE)]},
        "drained": set(),
    }
    base.update(overrides)
    return Situation(**base)


def run(policy: Policy, s: Situation, trigger: str = "preventive"):  # type: ignore[no-untyped-def]
    return decide(policy, s, job_id="j", node="n0", gpu=1, trigger=trigger)


def test_all_guards_pass_requests_the_free_spare() -> None:
    d = run(Policy(), situation())
    assert d.action == "request" and d.target is not None and d.target["slot"] == 2


def test_dry_run_decides_but_does_not_act() -> None:
    d = run(Policy(dry_run=True), situation())
    assert d.action == "dry_run" and d.target is not None


def test_breaker_stops_preventive_but_not_unplanned() -> None:
    s = situation(breaker_tripped=True)
    assert run(Policy(), s).action == "declined"
    assert "breaker" in run(Policy(), s).reason
    assert run(Policy(), s, "unplanned").action == "request"


def test_cooldown_per_job_and_gpu() -> None:
    s = situation(last_request_ms={("j", "n0", 1): 1_000_000 - 60_000})
    assert run(Policy(cooldown_s=600), s).action == "declined"
    assert "cooldown" in run(Policy(cooldown_s=600), s).reason
    assert run(Policy(cooldown_s=30), s).action == "request"
    assert run(Policy(cooldown_s=600), situation(last_request_ms={("j", "n0", 2): 0})).action == (
        "request"
    )
    other_job = situation(last_request_ms={("k", "n0", 1): 1_000_000 - 60_000})
    assert run(Policy(cooldown_s=600), other_job).action == "request"


def test_a_cooldown_reads_the_same_at_every_tick() -> None:
    """The loop audits a decision when its reason changes: a reason that counted seconds
    wrote a row every tick."""
    last = {("j", "n0", 1): 1_000_000 - 60_000}
    reasons = {
        run(Policy(cooldown_s=600), situation(now_ms=now, last_request_ms=last)).reason
        for now in (1_000_000, 1_001_000, 1_030_000)
    }
    assert len(reasons) == 1


def test_in_flight_caps_per_job_and_fleet() -> None:
    assert run(Policy(), situation(inflight_by_job={"j": 1})).action == "declined"
    assert run(Policy(max_inflight_per_job=2), situation(inflight_by_job={"j": 1})).action == (
        "request"
    )
    d = run(Policy(max_inflight_fleet=3), situation(inflight_fleet=3))
    assert d.action == "declined" and "fleet-wide" in d.reason


def test_a_spare_must_be_free_healthy_and_undrained() -> None:
    assert run(Policy(), situation(spares_by_job={})).action == "declined"
    assert run(Policy(), situation(drained={"n1"})).action == "declined"
    assert run(Policy(), situation(unsafe={("n1", 0)})).action == "declined"
    other = dict(SPARE, slot=3, node="n2")
    d = run(Policy(), situation(drained={"n1"}, spares_by_job={"j": [dict(SPARE), other]}))
    assert d.action == "request" and d.target == other


def test_breaker_needs_both_a_share_and_a_count() -> None:
    p = Policy(breaker_pct=5, breaker_min_gpus=3)
    assert not breaker_should_trip(p, crossings_in_window=1, fleet_size=6)  # 17 %, one GPU
    assert not breaker_should_trip(p, crossings_in_window=3, fleet_size=1000)  # 0.3 %
    assert breaker_should_trip(p, crossings_in_window=3, fleet_size=20)


def test_arrival_cursor_waits_for_holes_then_skips_them() -> None:
    cursor = ArrivalCursor(0, hole_wait_s=2.0)
    cursor.consume([1, 2, 4, 5], now=0.0)  # 3 not committed yet
    assert cursor.position == 2
    assert list(cursor.fresh([3, 4, 5, 6])) == [True, False, False, True]
    cursor.consume([3, 4, 5], now=1.0)  # 3 arrived late: nothing lost
    assert cursor.position == 5 and not cursor.seen
    cursor.consume([7], now=2.0)  # 6 was rolled back: skipped after the wait
    assert cursor.position == 5
    cursor.consume([], now=4.5)
    assert cursor.position == 7
