"""Whatever a client sends, ingest answers 2xx or 4xx with a JSON error, and stays up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from tests.api.conftest import INGEST, make_settings
from tests.factories import sample_dict

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
field_names = st.sampled_from([*sample_dict(), "extra", ""])


@st.composite
def mutated_batches(draw: st.DrawFn) -> dict:
    rows = [sample_dict(gpu=g) for g in range(draw(st.integers(0, 4)))]
    for row in rows:
        for _ in range(draw(st.integers(0, 3))):
            row[draw(field_names)] = draw(json_values)
    batch: dict = {"node": "node-0", "samples": rows}
    if draw(st.booleans()):
        batch[draw(st.sampled_from(["node", "schema_version", "events", "agent", "x"]))] = draw(
            json_values
        )
    return batch


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with TestClient(create_app(make_settings(f"sqlite:///{tmp / 'db'}", tmp))) as c:
        yield c


def check(client: TestClient, content: bytes) -> None:
    r = client.post("/v1/ingest", content=content, headers=INGEST)
    assert r.status_code in (200, 400, 413, 415, 422), r.text
    body = r.json()
    if r.status_code != 200:
        assert body["error"]["code"] and body["error"]["message"]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=mutated_batches())
def test_mutated_batches_never_break_ingest(client: TestClient, batch: dict) -> None:
    check(client, json.dumps(batch).encode())


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bodies_never_break_ingest(client: TestClient, body: bytes) -> None:
    check(client, body)
    assert client.get("/healthz").status_code == 200
