"""The webhook rules the dispatcher applies to what the store's queries return
(:mod:`api.webhooks.rules`), and the store's fan-out query agreeing with them."""

from __future__ import annotations

from typing import Any

import orjson

from api.webhooks.rules import disable_reason, new_webhook_id, wants
from store import Store
from store import webhooks as wstore
from tests.webhooks.conftest import emit, subscribe


def _hook(**filters: Any) -> dict[str, Any]:
    return {"id": "wh_a", "event_types": ["*"], "job_id": None, "node": None, **filters}


def _event(type_: str, job_id: str | None = None, node: str | None = None, **data: Any) -> dict:
    return {"type": type_, "job_id": job_id, "node": node, "data": orjson.dumps(data).decode()}


def test_wants_applies_types_job_and_node_and_routes_tests_and_disablings_by_id() -> None:
    assert wants(_hook(), _event("gpu.failed", node="n1"))
    assert not wants(_hook(event_types=["node.drained"]), _event("gpu.failed"))
    assert wants(_hook(job_id="j1"), _event("migration.requested", job_id="j1"))
    assert not wants(_hook(job_id="j1"), _event("migration.requested", job_id="j2"))
    assert not wants(_hook(node="n1"), _event("gpu.failed", node="n2"))
    # a test goes to the subscription it names, whatever its filters, and to no other
    narrow = _hook(event_types=["node.drained"], job_id="j9")
    assert wants(narrow, _event("webhook.test", webhook_id="wh_a"))
    assert not wants(_hook(), _event("webhook.test", webhook_id="wh_b"))
    # a subscription does not hear of its own disabling; the others' it does
    assert not wants(_hook(), _event("webhook.disabled", webhook_id="wh_a"))
    assert wants(_hook(), _event("webhook.disabled", webhook_id="wh_b"))


def test_a_run_of_failures_disables_at_the_limit_and_a_success_never_does() -> None:
    assert disable_reason(ok=False, failures=2, disable_after=3, error="boom") is None
    why = disable_reason(ok=False, failures=3, disable_after=3, error="HTTP 500")
    assert why == "3 consecutive failed attempts; last: HTTP 500"
    assert disable_reason(ok=True, failures=5, disable_after=3, error=None) is None


def test_new_ids_are_distinct_and_prefixed() -> None:
    ids = {new_webhook_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("wh_") and len(i) == 27 for i in ids)


def test_the_fan_out_query_keeps_every_event_the_rules_want(store: Store) -> None:
    """The store's query may select more than a subscription wants (every test event), never
    less: whatever ``wants`` takes among all events, the query returned."""
    hook = subscribe(store, "http://127.0.0.1:9/x", event_types=["gpu.failed"], node="n1")
    other = subscribe(store, "http://127.0.0.1:9/y")
    emit(store, "gpu.failed", node="n1", gpu=0)
    emit(store, "gpu.failed", node="n2", gpu=0)
    emit(store, "node.drained", node="n1")
    for target in (hook["id"], other["id"]):
        emit(store, "webhook.test", webhook_id=target)
    with store.begin() as connection:
        row = wstore.get_webhook(connection, hook["id"])
        assert row is not None
        top = wstore.max_outbox_seq(connection)
        selected, cursor = wstore.events_to_fan_out(connection, row, up_to_seq=top)
        every = wstore.events_by_seq(connection, list(range(1, top + 1)))
    assert cursor == top
    wanted = [e["id"] for e in every if wants(row, e)]
    assert wanted == [e["id"] for e in selected if wants(row, e)]
    kinds = [(e["type"], e["node"]) for e in every if wants(row, e)]
    assert kinds == [("gpu.failed", "n1"), ("webhook.test", None)]
