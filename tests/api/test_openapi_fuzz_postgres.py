"""The OpenAPI fuzz test of :mod:`tests.api.test_openapi_fuzz` on PostgreSQL (that module has
the document, the checks and their exceptions; this one the database)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.api.test_openapi_fuzz import EXAMPLES, schema, serve, validate
from tests.conftest import reset_postgres

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture(scope="module")
def postgres_backend(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    reset_postgres(postgres_url)
    yield from serve(postgres_url, tmp_path_factory.mktemp("fuzz"))


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx_or_off_schema(
    case: schemathesis.Case, postgres_backend: None
) -> None:
    validate(case)
