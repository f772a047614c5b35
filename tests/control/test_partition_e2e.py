"""Three real ``forewarn serve`` replicas share the scoring on one PostgreSQL
(``FOREWARN_PARTITIONED_SCORING``) while samples stream in through all three: a follower's
control process stopped (SIGSTOP) hands its share to the others, takes it back when it
resumes, and a killed leader's replica hands the loop and its share on. Throughout, what the
leader publishes covers every GPU of the fleet once."""

from __future__ import annotations

import os
import signal
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from store import Store
from store import control as db
from tests.conftest import LiveService, reset_postgres, start_service
from tests.control.test_leader import wait_for
from tests.factories import sample_dict

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(300)]

NODES = 32
GPUS = NODES * 8


class Feed:
    """Every GPU's sample once a second, each node's batch to the next replica in turn."""

    def __init__(self, services: list[LiveService]) -> None:
        self.services = services
        self.stop = threading.Event()
        self.errors = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        turn = 0
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                now = datetime.now(UTC)
                for n in range(NODES):
                    alive = [s for s in self.services if s.process.poll() is None]
                    service = alive[turn % len(alive)]
                    turn += 1
                    node = f"pn{n:02d}"
                    body = {"node": node, "samples": [sample_dict(node, g, now) for g in range(8)]}
                    try:
                        client.post(
                            service.url + "/v1/ingest",
                            json=body,
                            headers={"Authorization": f"Bearer {service.ingest_token}"},
                        ).raise_for_status()
                    except httpx.HTTPError:
                        self.errors += 1
                self.stop.wait(max(0.0, 1.0 - (datetime.now(UTC) - now).total_seconds()))


def shared(store: Store) -> dict[str, Any]:
    """The leader's last word on the shared scoring, and the GPUs its merge covered."""
    with store.engine.connect() as c:
        status = db.read_status(c) or {}
    partition = status.get("partition") or {}
    followers = partition.get("followers") or {}
    return {
        "replica": status.get("replica"),
        "members": partition.get("members") or [],
        "warming": partition.get("warming", 0),
        "gpus": partition.get("gpus", 0) + sum(f["gpus"] for f in followers.values()),
        "ages": [f["age_s"] for f in followers.values()],
    }


def covered(store: Store, members: int) -> Any:
    """The shared scoring with ``members`` loops, none warming, every GPU scored once and no
    follower's scores older than 5 s: that state, else None."""
    s = shared(store)
    ok = (
        len(s["members"]) == members
        and not s["warming"]
        and s["gpus"] == GPUS
        and all(a < 5 for a in s["ages"])
    )
    return s if ok else None


def test_replicas_share_the_scoring_through_a_stopped_follower_and_a_killed_leader(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reset_postgres(postgres_url)
    monkeypatch.setenv("FOREWARN_CONTROL_TICK_S", "1")
    monkeypatch.setenv("FOREWARN_PARTITIONED_SCORING", "true")
    services: dict[str, LiveService] = {}
    for name in ("ra", "rb", "rc"):
        monkeypatch.setenv("FOREWARN_REPLICA_ID", name)
        services[name] = start_service(postgres_url, tmp_path / f"{name}.log", timeout_s=120)
    store = Store.open(postgres_url, migrate=False)
    feed = Feed(list(services.values()))
    try:
        first = wait_for("three loops covering the fleet", lambda: covered(store, 3), 120)
        leader = first["replica"]
        follower = next(m for m in first["members"] if not m.startswith(f"{leader}@"))
        pid = int(follower.rsplit(":", 1)[1])

        os.kill(pid, signal.SIGSTOP)  # a follower's control process, mid-whatever
        try:
            two = wait_for("two loops covering the fleet", lambda: covered(store, 2), 90)
            assert follower not in two["members"] and two["replica"] == leader
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for("the follower back in its share", lambda: covered(store, 3), 90)

        services[leader].process.send_signal(signal.SIGKILL)  # its control process follows
        services[leader].process.wait(timeout=10)
        after = wait_for(
            "a new leader and the two loops left covering the fleet",
            lambda: (s := covered(store, 2)) and s["replica"] != leader and s,
            120,
        )
        assert all(not m.startswith(f"{leader}@") for m in after["members"])
        assert feed.errors < NODES  # the killed replica's share of one second, at most
        with store.engine.connect() as c:
            assert len(db.risk_rows(c)) == GPUS
    finally:
        feed.stop.set()
        feed.thread.join(timeout=10)
        store.close()
        for service in services.values():
            service.stop()
