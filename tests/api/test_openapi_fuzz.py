"""Schemathesis against the OpenAPI document: every operation, bounded examples, an admin
token. No answer may be a 5xx, and every documented response must match its schema."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from api.app import create_app
from api.settings import Settings
from store import Store

pytestmark = pytest.mark.slow

ADMIN = "fuzz-admin-token-0123456789"
_DIR = Path(tempfile.mkdtemp(prefix="forewarn-fuzz-"))
_STORE = Store.open(f"sqlite:///{_DIR / 'fuzz.db'}")
_APP = create_app(
    Settings(
        database_url=f"sqlite:///{_DIR / 'fuzz.db'}",
        data_dir=_DIR,
        admin_token=ADMIN,
        writer_process=False,
        control_enabled=False,
        webhook_dispatch=False,
    ),
    store=_STORE,
)
# The job agents' long-poll waits up to 30 s by design, past any sensible request timeout of a
# fuzzer; its tests are the control loop's (tests/control).
schema = schemathesis.openapi.from_asgi("/openapi.json", _APP).exclude(
    path="/v1/jobs/{job_id}/commands"
)


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx_or_off_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Bearer {ADMIN}"},
        checks=[not_a_server_error, response_schema_conformance],
    )
