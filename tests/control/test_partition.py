"""Partitioned scoring (control.partition): three control loops on one PostgreSQL share the
fleet's scoring, the leader merges and decides; a follower that dies and a leader that steps
down hand their shares on. The real scorer and the shipped model, a simulated fleet."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pytest

from control import loop as loop_module
from control.loop import ControlLoop
from control.partition import SHARD_COLUMNS, Share, decode, encode, owners
from control.policy import Policy
from forewarn.wire import Event, GpuSample
from predictor import registry
from predictor.state import VALUE_COLUMNS, GpuWindowState, SampleBlock
from sim.config import load_params
from sim.source import SimulatedSource
from store import Store
from store import control as db
from store.writes import event_row, sample_row
from tests.control.scene import WEAR_PARAMS

T0 = 1_900_000_000.0
GPUS = 256  # 32 nodes


def test_every_bucket_has_one_owner_and_a_member_that_leaves_moves_only_its_own() -> None:
    three = owners(["a:1", "b:2", "c:3"])
    assert three.shape == (db.BUCKETS,) and set(three.tolist()) == {0, 1, 2}
    assert all(0.25 < np.mean(three == i) < 0.42 for i in range(3))  # about a third each
    assert (owners(["a:1", "b:2", "c:3"]) == three).all()  # every member computes the same
    two = owners(["a:1", "c:3"])  # b left: a keeps its buckets, c its own
    kept = three != 1
    assert (np.where(two == 0, 0, 2)[kept] == three[kept]).all()
    share = Share("c:3")
    gained, lost = share.assign(["a:1", "b:2"])
    assert len(gained) == np.sum(three == 2) and len(lost) == 0  # first: all of its own
    gained, lost = share.assign(["a:1"])
    assert set(gained.tolist()) == set(np.flatnonzero((three == 1) & (two == 1)).tolist())
    assert len(lost) == 0
    gained, lost = share.assign(["a:1", "b:2"])  # b is back: c gives back what it took
    assert len(gained) == 0 and set(lost.tolist()) == set(
        np.flatnonzero(three == 1).tolist()
    ) & set(np.flatnonzero(two == 1).tolist())
    assert share.assign(["a:1", "b:2"])[0].size == 0


def test_a_shard_is_the_frame_it_was_given() -> None:
    scores = pd.DataFrame(
        {
            "node": ["n1", "n0", "n1"],
            "gpu": [3, 0, 1],
            "model_risk": [0.5, 1e-9, np.nan],
            "floor": [True, False, False],
            "floor_rules": [4, 0, 0],
            "reasons": [["row remap pending", "x \u00b0C"], [], []],
            "last_seen_ms": [T0 * 1000, 0, np.nan],
        }
    )
    back = decode(encode(scores))
    assert list(back.columns) == list(SHARD_COLUMNS)
    pd.testing.assert_frame_equal(back, scores.astype({"last_seen_ms": np.float64}))
    empty = decode(encode(scores[:0]))
    assert len(empty) == 0 and list(empty.columns) == list(SHARD_COLUMNS)


class Fleet:
    """A simulated fleet written to the store a second at a time, and the loops that tick."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.source = SimulatedSource(GPUS, seed=5, params=load_params(WEAR_PARAMS), speed=60.0)
        self.t = T0
        self.model = registry.load_latest(registry.SHIPPED_DIR)
        self.loops: dict[str, ControlLoop] = {}

    def loop(self, name: str) -> ControlLoop:
        loop = ControlLoop(
            self.store,
            model=self.model,
            defaults=Policy(threshold=0.02, hysteresis=1, cooldown_s=0),
            tick_s=1.0,
            replica=name,
            partitioned=True,
            clock=lambda: self.t,
        )
        self.loops[name] = loop
        return loop

    def second(self, *ticking: str) -> None:
        rows = self.source.read(datetime.fromtimestamp(self.t, UTC))
        self.store.write(
            samples=[sample_row(r) for r in rows if isinstance(r, GpuSample)],
            events=[event_row(r) for r in rows if isinstance(r, Event)],
        )
        self.t += 1.0
        for name in ticking:
            self.loops[name].step(int(self.t * 1000))

    def shares(self, *names: str) -> list[set[int]]:
        return [set(self.loops[n].share.buckets.tolist()) for n in names]  # type: ignore[union-attr]


@pytest.fixture
def fleet(postgres_url: str) -> Iterator[Fleet]:
    from tests.conftest import reset_postgres

    reset_postgres(postgres_url)
    store = Store.open(postgres_url)
    f = Fleet(store)
    try:
        yield f
    finally:
        for loop in f.loops.values():
            loop.leadership.release()
        store.close()


def assert_folded_from_the_start(store: Store, loop: ControlLoop) -> None:
    """Every GPU of ``loop``'s scorer holds what folding all its stored rows in time order
    gives (the decayed sums and readings), as a warm from the window and ticks should."""
    state = loop.scorer.state
    assert loop.share is not None and loop.share.buckets is not None
    reference = GpuWindowState()
    with store.engine.connect() as c:
        rows = db.sample_arrays_in(
            c, VALUE_COLUMNS, since_ms=0, until_ms=None, buckets=loop.share.buckets.tolist()
        )
        events = db.events_window(c, since_ms=0)
        ours = np.isin([db.node_buckets(c, [n])[n] for n in events["node"]], loop.share.buckets)
    reference.update(
        SampleBlock(rows.ts_ms, rows.node, rows.gpu, rows.values),
        events[ours] if len(events) else events,
        now_ms=state.now_ms,
    )
    assert reference.size == state.size
    mine = reference.slots(
        np.asarray(state.nodes, dtype=object)[state.node_of[: state.size]],
        state.gpu_of[: state.size],
        create=False,
    )
    for name in ("acc", "latest", "last_counter"):
        np.testing.assert_allclose(
            getattr(state, name)[: state.size],
            getattr(reference, name)[mine],
            rtol=1e-9,
            atol=1e-9,
            equal_nan=True,
            err_msg=name,
        )


def status(store: Store) -> dict[str, Any]:
    with store.engine.connect() as c:
        found = db.read_status(c)
    assert found is not None
    return found


def risks(store: Store) -> dict[tuple[str, int], dict[str, Any]]:
    with store.engine.connect() as c:
        return {(r["node"], r["gpu"]): r for r in db.risk_rows(c)}


def outbox(store: Store) -> list[str]:
    with store.engine.connect() as c:
        return [str(r[0]) for r in c.exec_driver_sql("SELECT type FROM outbox").all()]


def crossings(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as c:
        rows = c.exec_driver_sql(
            "SELECT data FROM outbox WHERE type = 'risk.threshold_crossed' ORDER BY seq"
        ).all()
    return [json.loads(r[0]) for r in rows]


@pytest.mark.postgres
def test_three_loops_share_the_scoring_and_the_leader_decides_on_all_of_it(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b", "c"):
        fleet.loop(name)
    for _ in range(4):
        fleet.second("a", "b", "c")
    a, b, c = (fleet.loops[n] for n in "abc")
    assert a.leadership.is_leader and not b.leadership.is_leader
    shares = fleet.shares("a", "b", "c")
    assert set().union(*shares) == set(range(db.BUCKETS))
    assert sum(len(s) for s in shares) == db.BUCKETS  # disjoint
    seen = status(fleet.store)["partition"]
    assert len(seen["members"]) == 3 and set(seen["followers"]) == {b.member, c.member}
    scored = [seen["gpus"]] + [f["gpus"] for f in seen["followers"].values()]
    assert sum(scored) == GPUS and all(n > 0 for n in scored)
    assert a.scorer.state.size == seen["gpus"]  # it scored the fleet alone first: forgotten
    assert all(f["tick_s"] > 0 and f["warming"] == 0 for f in seen["followers"].values())
    # Every GPU's score reached the store through the leader; each follower read its share.
    assert len(risks(fleet.store)) == GPUS
    with fleet.store.begin() as conn:  # a follower's row garbled: the leader ticks on
        conn.execute(
            db.score_shards.update()
            .where(db.score_shards.c.member == c.member)
            .values(tick_ms=fleet.t * 1000 + 1, payload=b"\x00" * 64)
        )
    fleet.second("a")
    assert status(fleet.store)["partition"]["followers"][c.member]["unreadable"]
    assert b.last_read == a.last_read  # every row's number, to move the cursor ...
    assert 0 < b.scorer.state.size < GPUS  # ... but the values of its share only

    # Wear on a GPU of c's share: c's scores carry the floor's rule; the leader crosses it.
    with fleet.store.engine.connect() as conn:
        nodes = [f"sim-node-{i:04d}" for i in range(GPUS // 8)]
        bucket = db.node_buckets(conn, nodes)
    worn = next(n for n in nodes if bucket[n] in set(c.share.buckets.tolist()))  # type: ignore[union-attr]
    fleet.source.inject(worn, 2, "memory", 40.0)
    for _ in range(12):
        fleet.second("a", "b", "c")
    (crossed,) = [x for x in crossings(fleet.store) if (x["node"], x["gpu"]) == (worn, 2)]
    assert crossed["reasons"]  # the follower's words, through its shard
    said = risks(fleet.store)[(worn, 2)]["reasons"]
    assert any("remap" in r for r in said), said  # the floor's rule, once a remap is pending

    # c dies: after the live window its buckets go to a and b, which warm them a page a tick
    # (pages of a few seconds here) while they score the rest of their shares.
    monkeypatch.setattr(loop_module, "WARM_PAGE_ROWS", 400)
    monkeypatch.setattr(loop_module, "WARM_SHARE_OF_TICK", 0.0)
    warming = []
    for _ in range(20):
        fleet.second("a", "b")
        warming.append(status(fleet.store)["partition"]["warming"])
    assert max(warming) > 0 and warming[-1] == 0 and b.warming is None
    after = fleet.shares("a", "b")
    assert set().union(*after) == set(range(db.BUCKETS)) and not after[0] & after[1]
    seen = status(fleet.store)["partition"]
    assert len(seen["members"]) == 2 and seen["gpus"] + seen["followers"][b.member]["gpus"] == GPUS
    # b's windows, c's GPUs it took among them, are those of every row folded in order.
    assert_folded_from_the_start(fleet.store, b)
    assert risks(fleet.store)[(worn, 2)]["crossed"]
    assert "risk.cleared" not in outbox(fleet.store)

    # d joins: it warms the GPUs of the share it gains from the store's window, so they have
    # been watched since the fleet's first second, not since d came.
    # Its first warm fails half-way (the database went away): the next tick warms it again.
    d = fleet.loop("d")
    fold = ControlLoop._fold_page
    failed: list[int] = []

    def fails_once(loop: ControlLoop, warming: Any, now_ms: int) -> bool:
        if loop is d and not failed and warming.samples:
            failed.append(now_ms)
            raise RuntimeError("the database went away")
        return fold(loop, warming, now_ms)

    monkeypatch.setattr(ControlLoop, "_fold_page", fails_once)
    with pytest.raises(RuntimeError, match="went away"):
        fleet.second("a", "b", "d")
    for _ in range(3):
        fleet.second("a", "b", "d")
    assert failed and d.share is not None and 0 < len(d.share.buckets) < db.BUCKETS  # type: ignore[arg-type]
    state = d.scorer.state
    assert state.size > 0 and np.nanmax(state.first_ms[: state.size]) <= T0 * 1000
    assert_folded_from_the_start(fleet.store, d)

    # a steps down: b leads with the scorer it had, and takes a's share; nothing crosses twice.
    scorer = b.scorer
    a.leadership.release()
    for _ in range(20):
        fleet.second("b", "d")
    assert b.leadership.is_leader and b.scorer is scorer
    assert b.warming is None and d.warming is None
    shares = fleet.shares("b", "d")
    assert set().union(*shares) == set(range(db.BUCKETS)) and not shares[0] & shares[1]
    seen = status(fleet.store)["partition"]
    assert seen["gpus"] + seen["followers"][d.member]["gpus"] == GPUS
    assert len([x for x in crossings(fleet.store) if (x["node"], x["gpu"]) == (worn, 2)]) == 1


def test_the_setting_shares_the_scoring_on_postgresql_only(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from api.control_service import partitioned
    from api.settings import Settings

    store = Store.open(f"sqlite:///{tmp_path / 'one.db'}")
    try:
        assert not partitioned(Settings(partitioned_scoring=False), store)
        assert not partitioned(Settings(partitioned_scoring=True), store)
        assert "needs PostgreSQL" in caplog.text
    finally:
        store.close()


@pytest.mark.postgres
def test_the_leader_does_not_wait_for_a_member_stopped_inside_its_write(postgres_url: str) -> None:
    """A follower stopped (SIGSTOP) while it holds its row: the leader's cleanup of dead
    members skips the row instead of hanging its tick on it, and removes it once free."""
    from tests.conftest import reset_postgres

    reset_postgres(postgres_url)
    store = Store.open(postgres_url)
    try:
        with store.begin() as c:
            db.beat_member(c, member="stopped:1", now_ms=1_000, tick_ms=1_000, payload=b"x")
            db.beat_member(c, member="dead:2", now_ms=1_000)
        held = store.engine.connect()
        held.begin()
        held.exec_driver_sql("SELECT 1 FROM score_shards WHERE member = 'stopped:1' FOR UPDATE")
        try:
            with store.begin() as c:
                c.exec_driver_sql("SET LOCAL lock_timeout = '2s'")  # a hang fails, not blocks
                assert db.forget_members(c, before_ms=10_000) == 1
        finally:
            held.rollback()
            held.close()
        with store.begin() as c:
            assert db.live_members(c, since_ms=0) == ["stopped:1"]
            assert db.forget_members(c, before_ms=10_000) == 1
            assert db.live_members(c, since_ms=0) == []
    finally:
        store.close()
