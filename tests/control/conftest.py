"""Fakes for the control loop's tests: a scorer whose risks the test sets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

from control import orchestrator
from control.loop import ControlLoop
from control.policy import Policy
from predictor.floor import FLOOR_RULES
from store import Store
from store import control as db
from tests.conftest import start_service
from tests.control.scene import POLICY, WEAR_PARAMS, Scene

RULE_NAMES = [r.name for r in FLOOR_RULES]


class FakeScorer:
    """Stands in for ``predictor.scoring.Scorer``: ``risk[(node, gpu)]`` is what the model
    scores, ``floor[(node, gpu)]`` the rule that trips there (the floor of
    :mod:`predictor.floor`: its name, then what it says after a colon), if any."""

    def __init__(self) -> None:
        self.risk: dict[tuple[str, int], float] = {}
        self.floor: dict[tuple[str, int], str] = {}
        self.state = SimpleNamespace(now_ms=None, size=0)

    def update(self, samples: Any, events: Any = None, *, now_ms: int) -> None:
        self.state.now_ms = now_ms
        self.state.size = len(self.risk)

    def score(self) -> pd.DataFrame:
        keys = sorted(self.risk)
        hit = [k in self.floor for k in keys]
        return pd.DataFrame(
            {
                "node": [k[0] for k in keys],
                "gpu": [k[1] for k in keys],
                "risk": [
                    max(self.risk[k], 0.5) if h else self.risk[k]
                    for k, h in zip(keys, hit, strict=True)
                ],
                "model_risk": [self.risk[k] for k in keys],
                "floor": hit,
                "floor_rules": [
                    1 << RULE_NAMES.index(self.floor[k].split(":")[0]) if h else 0
                    for k, h in zip(keys, hit, strict=True)
                ],
                "alarm": [self.risk[k] >= 0.5 or h for k, h in zip(keys, hit, strict=True)],
                "reasons": [
                    ([f"rule {self.floor[k]}"] if h else [])
                    + (["ECC errors rising"] if self.risk[k] >= 0.5 else [])
                    for k, h in zip(keys, hit, strict=True)
                ],
                "last_seen_ms": [self.state.now_ms] * len(keys),
            }
        )


_made: list[ControlLoop] = []


def make_loop(
    store: Store, *, leadership: Any = None, **policy: Any
) -> tuple[ControlLoop, FakeScorer]:
    scorer = FakeScorer()
    loop = ControlLoop(
        store,
        model=None,
        defaults=Policy(**policy),
        tick_s=1.0,
        scorer=scorer,
        leadership=leadership,
    )
    _made.append(loop)
    assert loop.step(now_ms=1_000)  # leads (one replica), nothing to score yet
    for gpu in range(4):
        scorer.risk[("n0", gpu)] = 0.01
    scorer.risk[("n1", 0)] = 0.01
    loop.model = SimpleNamespace(threshold=0.5)
    return loop, scorer


def register(store: Store, job_id: str = "j") -> None:
    """Ranks 0 and 1 on n0:0 and n0:1, one spare on n1:0."""
    with store.begin() as c:
        db.upsert_job(
            c,
            job={
                "job_id": job_id,
                "world_size": 2,
                "spares": 1,
                "status": "running",
                "registered_ms": 0,
                "heartbeat_ms": 10**13,
            },
            ranks=[
                {"slot": 0, "rank": 0, "node": "n0", "gpu": 0, "role": "active"},
                {"slot": 1, "rank": 1, "node": "n0", "gpu": 1, "role": "active"},
                {"slot": 2, "rank": 2, "node": "n1", "gpu": 0, "role": "spare"},
            ],
        )


def request_move(
    c: Any, *, now_ms: int, trigger: str = "manual", why: str = "test"
) -> dict[str, Any]:
    """Ask, on connection ``c``, for rank 1 of :func:`register`'s job (on n0:1) to move to
    its spare on n1:0; returns the migration row."""
    return orchestrator.request(
        c,
        job_id="j",
        rank=1,
        trigger=trigger,
        now_ms=now_ms,
        source=("n0", 1),
        target={"node": "n1", "gpu": 0, "slot": 2},
        why=why,
    )


@pytest.fixture
def registered(store: Store) -> Iterator[Store]:
    """The store with job ``j`` registered; every loop :func:`make_loop` made gives its
    leadership back when the test ends, before the store closes (on PostgreSQL its lock
    connection would otherwise be left open)."""
    register(store)
    yield store
    while _made:
        _made.pop().leadership.release()


@pytest.fixture
def scene(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: Any
) -> Iterator[Scene]:
    dry = getattr(request, "param", False)
    policy = POLICY[:-1] + (', "dry_run": true}' if dry else "}")
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "0.5")
    monkeypatch.setenv("FOREWARN_POLICY", policy)
    monkeypatch.setenv("FOREWARN_RISK_HISTORY_INTERVAL_S", "1")
    service = start_service(database_url, tmp_path / "service.log", timeout_s=120)
    s = Scene(service, tmp_path)
    s.simulate("--speed", "60", "--params", str(WEAR_PARAMS))
    try:
        yield s
    finally:
        s.close()
