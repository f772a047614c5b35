"""The operator's failure records: recorded, listed and retracted through the API (audited),
and taken over the event-derived labels in the Parquet history that training reads."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from store import Store, tiers
from store.history import failures_from_events
from store.rollups import MINUTE_MS
from tests.api.conftest import READ, make_settings
from tests.store.test_tiers import HOUR, START, raw_frame, rows_of

OPERATE = {"Authorization": "Bearer operate-token-0123456789"}


@pytest.fixture
def client(database_url: str, tmp_path: Path) -> TestClient:
    settings = make_settings(
        database_url,
        tmp_path,
        tokens={OPERATE["Authorization"].split()[1]: ["operate", "read"]},
        control_enabled=False,
        webhook_dispatch=False,
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client  # type: ignore[misc]


def test_records_are_kept_listed_retracted_and_audited(client: TestClient) -> None:
    body = {"node": "n7", "gpu": 3, "ts": "2026-12-01T10:00:00Z", "kind": "memory"}
    assert client.post("/v1/failures", json=body, headers=READ).status_code == 403
    made = client.post("/v1/failures", json=body | {"note": "RMA 1234"}, headers=OPERATE)
    assert made.status_code == 201, made.text
    rec = made.json()
    assert (rec["node"], rec["gpu"], rec["kind"], rec["note"]) == ("n7", 3, "memory", "RMA 1234")
    whole = {"node": "n8", "ts": "2026-12-01T09:00:00+00:00", "kind": "power_loss"}
    assert client.post("/v1/failures", json=whole, headers=OPERATE).status_code == 201
    listed = client.get("/v1/failures", headers=READ).json()
    assert [(r["node"], r["gpu"]) for r in listed["data"]] == [("n8", None), ("n7", 3)]
    for bad in (
        body | {"kind": "cosmic"},
        body | {"ts": "2026-12-01T10:00:00"},  # no zone
        body | {"ts": "2999-01-01T00:00:00Z"},  # the future
        body | {"node": ".."},
        body | {"gpu": -1},
    ):
        r = client.post("/v1/failures", json=bad, headers=OPERATE)
        assert r.status_code == 422, (bad, r.text)
    gone = client.delete(f"/v1/failures/{rec['id']}", headers=OPERATE)
    assert gone.status_code == 200 and gone.json()["retracted_at"]
    assert client.delete("/v1/failures/fail_nothere", headers=OPERATE).status_code == 404
    assert [r["node"] for r in client.get("/v1/failures", headers=READ).json()["data"]] == ["n8"]
    both = client.get("/v1/failures", params={"retracted": "true"}, headers=READ).json()
    assert both["count"] == 2
    audit = client.get("/v1/audit", params={"kind": "failure"}, headers=READ).json()["data"]
    assert [a["action"] for a in audit] == ["recorded", "recorded", "retracted"]


def test_records_override_and_add_to_the_labels_from_events() -> None:
    gpus = pd.DataFrame({"node": ["a", "a", "b", "b"], "gpu": [0, 1, 0, 1], "uuid": "u"})
    events = pd.DataFrame(
        {
            "ts_ms": [1_000_000, 5_000_000],
            "node": ["a", "a"],
            "gpu": pd.array([0, 1], dtype="Int64"),
            "kind": ["xid", "xid"],
            "xid": pd.array([79, 48], dtype="Int64"),
        }
    )
    records = pd.DataFrame(
        {
            "ts_ms": [1_120_000, 9_000_000],  # two minutes after a:0's Xid 79; node b later
            "node": ["a", "b"],
            "gpu": pd.array([0, None], dtype="Int64"),
            "kind": ["memory", "power_loss"],
        }
    )
    got = failures_from_events(events, gpus, records=records)
    assert got[["ts_ms", "node", "gpu", "kind", "scope", "trace_class"]].values.tolist() == [
        [1_120_000, "a", 0, "memory", "gpu", "operator"],  # the operator's kind, not "pcie"
        [5_000_000, "a", 1, "memory", "gpu", ""],  # from its event alone
        [9_000_000, "b", 0, "power_loss", "node", "operator"],
        [9_000_000, "b", 1, "power_loss", "node", "operator"],
    ]


def test_a_row_remap_is_not_a_failure_label() -> None:
    """Xid 63 (a row remap recorded; the GPU works on) precedes memory failures by hours in
    real fleets and in the simulator: labelled as the failure it would move the label early."""
    gpus = pd.DataFrame({"node": ["a", "a"], "gpu": [0, 1], "uuid": "u"})
    events = pd.DataFrame(
        {
            "ts_ms": [1_000_000, 2_000_000, 9_000_000],
            "node": ["a", "a", "a"],
            "gpu": pd.array([0, 1, 1], dtype="Int64"),
            "kind": ["xid", "xid", "xid"],
            "xid": pd.array([63, 63, 48], dtype="Int64"),
        }
    )
    got = failures_from_events(events, gpus)
    assert got[["ts_ms", "node", "gpu", "kind"]].values.tolist() == [[9_000_000, "a", 1, "memory"]]


def test_the_history_labels_a_failure_only_the_operator_saw(store: Store, tmp_path: Path) -> None:
    from predictor.dataset import load_dataset
    from store.failures import record_failure

    raw = raw_frame(gpus=2, hours=3, step_s=60)
    store.write(samples=rows_of(raw))
    with store.begin() as c:  # no event at all: the board was pulled and replaced
        record_failure(
            c, node="node-a", gpu=0, ts_ms=START + 50 * MINUTE_MS, kind="memory", now_ms=START
        )
        gone = record_failure(
            c, node="node-a", gpu=1, ts_ms=START + 60 * MINUTE_MS, kind="pcie", now_ms=START
        )
    with store.begin() as c:
        from store.failures import retract_failure

        retract_failure(c, gone["id"], now_ms=START + HOUR)
    policy = tiers.TierPolicy(raw_window_s=3600.0, history_url=str(tmp_path / "history"))
    store.maintain_tiers(policy, now_ms=START + 4 * HOUR)
    failures = load_dataset(tmp_path / "history").failures
    assert failures[["ts_ms", "node", "gpu", "kind", "trace_class"]].values.tolist() == [
        [START + 50 * MINUTE_MS, "node-a", 0, "memory", "operator"]
    ]
