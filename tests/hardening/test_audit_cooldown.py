"""The cooldown in the control loop: one audit row per decision, and per job (issue 32).

The audit log wrote "declined: cooldown … N s ago" at every tick (29 rows a minute for one
rank), and a migration of one job off a GPU held another job's rank on it for the cooldown.
"""

from __future__ import annotations

import time

from control import orchestrator
from store import Store
from store import control as db
from tests.control.conftest import make_loop, register, registered  # noqa: F401 (fixture)

NOW = int(time.time() * 1000)


def _fail_all(store: Store, now_ms: int) -> None:
    with store.begin() as c:
        for m in db.list_migrations(c, states=db.ACTIVE_STATES):
            orchestrator.advance(c, m["id"], "failed", now_ms=now_ms, error="agent gone")


def test_a_cooldown_is_audited_once_not_every_tick(registered: Store) -> None:  # noqa: F811
    loop, scorer = make_loop(registered, hysteresis=1, cooldown_s=600)
    scorer.risk[("n0", 1)] = 0.9
    loop.tick(NOW)
    _fail_all(registered, NOW + 500)  # the rank stays on the GPU, the cooldown runs
    for k in range(1, 31):
        loop.tick(NOW + k * 1000)
    with registered.engine.connect() as c:
        rows = db.read_audit(c, kind="migration")
    cooldowns = [r for r in rows if "cooldown" in (r["reason"] or "")]
    assert len(cooldowns) == 1, [r["reason"] for r in cooldowns]


def test_the_cooldown_is_per_job(registered: Store) -> None:  # noqa: F811
    loop, scorer = make_loop(registered, hysteresis=1, cooldown_s=600)
    scorer.risk[("n0", 1)] = 0.9
    loop.tick(NOW)
    _fail_all(registered, NOW + 500)
    register(registered, "k")  # another job: its rank 1 on the same GPU, its own spare
    loop.tick(NOW + 1000)
    with registered.engine.connect() as c:
        moving = [m["job_id"] for m in db.list_migrations(c, states=db.ACTIVE_STATES)]
    assert moving == ["k"]
