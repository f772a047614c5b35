"""Schemathesis against the OpenAPI document, on SQLite and on PostgreSQL: every operation,
``EXAMPLES`` examples each, valid and invalid ones (NUL bytes allowed in generated strings),
an admin token.

No answer may be a 5xx, every status code and content type must be one the operation
documents, every documented response and header must match its schema, a method an operation
does not have must be 405 with the path's methods in ``Allow``, a valid request must be
accepted and an invalid one refused (but where ``REFUSED_VALID`` and ``ACCEPTED_INVALID`` say
why not).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    allow_header_conformance,
    content_type_conformance,
    ignored_auth,
    missing_required_header,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from api.app import create_app
from api.settings import Settings
from store import Store

pytestmark = pytest.mark.slow

ADMIN = "fuzz-admin-token-0123456789"
EXAMPLES = 30


def _settings(database_url: str, data_dir: Path) -> Settings:
    return Settings(
        database_url=database_url,
        data_dir=data_dir,
        admin_token=ADMIN,
        writer_process=False,
        control_enabled=False,
        webhook_dispatch=False,
    )


class _Backend:
    """The ASGI app the fuzzer calls: the app of the backend under test (set per test)."""

    def __init__(self) -> None:
        _dir = Path(tempfile.mkdtemp(prefix="forewarn-fuzz-"))
        # Serves the OpenAPI document at collection; no request reaches its (absent) store.
        self.app: Any = create_app(_settings(f"sqlite:///{_dir / 'unused.db'}", _dir))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


BACKEND = _Backend()
schema = schemathesis.openapi.from_asgi("/openapi.json", BACKEND)
schema.config.generation.update(  # NUL in strings, as sent; requests valid and not
    allow_x00=True, codec="utf-8", modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
)
# The job agents' long-poll waits up to 30 s by design, past any sensible request timeout of a
# fuzzer; its tests are the control loop's (tests/control).
schema = schema.exclude(path="/v1/jobs/{job_id}/commands")


def serve(url: str, data_dir: Path) -> Iterator[None]:
    """Point the fuzzer at an app on the database at ``url``, opened and migrated once for
    every operation (what one operation's examples leave, another's meet)."""
    store = Store.open(url)
    before = BACKEND.app
    BACKEND.app = create_app(_settings(url, data_dir), store=store)
    yield
    BACKEND.app = before
    store.close()


@pytest.fixture(scope="module")
def sqlite_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    data_dir = tmp_path_factory.mktemp("fuzz")
    yield from serve(f"sqlite:///{data_dir / 'forewarn.db'}", data_dir)


# Requests the document calls valid that are refused: a rule it cannot state (between two
# fields, against the clock, a name that must resolve, a cursor only this service makes).
REFUSED_VALID = {
    "GET /v1/events": "since after until",
    "GET /v1/failures": "since after until",
    "GET /v1/gpus/{node}/{gpu}/risk": "since after until",
    "GET /v1/gpus/{node}/{gpu}/samples": "since after until",
    "GET /v1/gpus": "a cursor this service did not give out",
    "GET /v1/nodes": "a cursor this service did not give out",
    "GET /v1/risk": "a cursor this service did not give out",
    "PUT /v1/policy": "straggler_clear_margin not below straggler_margin",
    "POST /v1/failures": "a ts in the future",
    "POST /v1/webhooks": "a URL whose host does not resolve, or is internal",
    "PATCH /v1/webhooks/{webhook_id}": "a URL whose host does not resolve, or is internal",
    "POST /v1/ingest": "its body is not in the document (it reads its own)",
    "POST /v1/jobs": "two ranks on one slot",
    "POST /v1/jobs/{job_id}/heartbeat": "timing columns of unequal length",
    "POST /v1/migrations/{migration_id}/progress": "the body's migration_id unlike the path's",
    # an integer a little past 2**62 (forewarn.wire.MAX_INT), which the fuzzer compares as a
    # float, equal to 2**62
    "POST /v1/migrations/reports": "steps_lost of 2**62 + 95",
}
# Requests the document calls invalid that are accepted: pydantic's lax mode in the wire
# models (forewarn/wire.py) and the policy reads 0 as false, false as 0, a number as a time.
ACCEPTED_INVALID = {
    "POST /v1/failures",
    "POST /v1/jobs",
    "POST /v1/jobs/{job_id}/heartbeat",
    "POST /v1/migrations/reports",
    "POST /v1/migrations/{migration_id}/progress",
    "PUT /v1/policy",
}


def validate(case: schemathesis.Case) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Bearer {ADMIN}"},
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_headers_conformance,
            response_schema_conformance,
            missing_required_header,
            ignored_auth,
            unsupported_method,
            allow_header_conformance,
            *([] if case.operation.label in REFUSED_VALID else [positive_data_acceptance]),
            *([] if case.operation.label in ACCEPTED_INVALID else [negative_data_rejection]),
        ],
    )


# PostgreSQL: tests/api/test_openapi_fuzz_postgres.py (a file of its own, so that the suite's
# workers run the two backends side by side).
@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx_or_off_schema(
    case: schemathesis.Case, sqlite_backend: None
) -> None:
    validate(case)


def test_a_method_an_operation_lacks_is_405_with_allow(tmp_path: Path) -> None:
    """What schemathesis' coverage phase checks (the pytest runner has none): every path of
    the document, called with a method it does not have, answers 405 and says which it has."""
    from fastapi.testclient import TestClient

    app = create_app(_settings(f"sqlite:///{tmp_path / 'api.db'}", tmp_path))
    headers = {"Authorization": f"Bearer {ADMIN}"}
    paths = app.openapi()["paths"]
    pattern = {p: re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", p) + "$") for p in paths}
    with TestClient(app) as client:
        for path in paths:
            concrete = re.sub(r"\{[^}]+\}", "0", path)
            for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
                if any(  # another operation answers it (GET /v1/migrations/{id} for .../reports)
                    method.lower() in other and pattern[p].match(concrete)
                    for p, other in paths.items()
                ):
                    continue
                r = client.request(method, concrete, headers=headers)
                assert r.status_code == 405, (method, path, r.status_code)
                allowed = {m.strip() for m in r.headers["allow"].split(",")}
                assert allowed and method not in allowed, (method, path, allowed)
                # the methods of this path's operations, not of a neighbour's whose parameter
                # matches it too (/v1/webhooks/event-types beside /v1/webhooks/{webhook_id})
                documented = {m.upper() for m in paths[path]} | {"HEAD"}
                assert allowed <= documented, (method, path, allowed, documented)
