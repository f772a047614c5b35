"""The job agent's service link against a fake service (httpx.MockTransport)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from forewarn.errors import NoSpareAvailable
from forewarn.wire import JobRegistration, MigrationCommand, MigrationReason, Placement
from migrator.service_link import ServiceLink, ServiceRefused, parse_placement


def link_for(handler: Any, **kw: Any) -> ServiceLink:
    return ServiceLink(
        "http://service", token="t", job_id="j", transport=httpx.MockTransport(handler), **kw
    )


def test_preflight_refuses_clearly() -> None:
    def unknown(request: httpx.Request) -> httpx.Response:
        body = {"error": {"code": "unauthorized", "message": "unknown token"}}
        return httpx.Response(401, json=body)

    with pytest.raises(ServiceRefused, match=r"401.*unknown token"):
        link_for(unknown).preflight()

    def reader(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"scopes": ["read"]})

    with pytest.raises(ServiceRefused, match="needs 'operate'"):
        link_for(reader).preflight()


def test_placement_maps_slots_to_fleet_gpus() -> None:
    seen: list[dict[str, Any]] = []

    def service(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(201, json={})

    link = link_for(service, placement=parse_placement("sim-a:3,sim-b:0"))
    link.register(
        JobRegistration(
            job_id="j",
            world_size=1,
            spares=1,
            placement=[
                Placement(rank=0, node="host", slot=0),
                Placement(rank=1, node="host", slot=1, role="spare"),
            ],
        )
    )
    assert [(p["node"], p["gpu"]) for p in seen[0]["placement"]] == [("sim-a", 3), ("sim-b", 0)]


class Agent:
    status, gen, message = "running", 0, ""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.error = error

    def submit(self, **kw: Any) -> str:
        self.calls.append(kw)
        if self.error:
            raise self.error
        return str(kw["migration_id"])


def command(trigger: str) -> MigrationCommand:
    return MigrationCommand(
        migration_id="mig_1",
        job_id="j",
        rank=1,
        reason=MigrationReason.PLANNED,
        trigger=trigger,
        requested_at=datetime.now(UTC),
        target=Placement(rank=1, node="n1", gpu=0, slot=2, role="spare"),
    )


def test_a_command_reaches_the_agent_once_and_is_acknowledged() -> None:
    link = link_for(lambda r: httpx.Response(200, json={}))
    agent = Agent()
    link._agent = agent
    assert link.deliver(command("manual"))
    assert link.deliver(command("manual"))  # delivered again by the next poll: not submitted
    assert len(agent.calls) == 1
    assert (agent.calls[0]["reason"], agent.calls[0]["spare_slot"]) == ("planned", 2)
    path, body = link._outbox.get_nowait()
    assert path == "/v1/migrations/mig_1/progress" and body["state"] == "acknowledged"


def test_a_retryable_refusal_waits_for_the_next_poll() -> None:
    link = link_for(lambda r: httpx.Response(200, json={}))
    link._agent = Agent(NoSpareAvailable("no spare"))
    assert not link.deliver(command("preventive"))
    assert link._outbox.empty() and "mig_1" not in link._seen
