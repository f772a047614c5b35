"""Every route of the OpenAPI spec refuses a missing, wrong or under-scoped token.

The test walks ``app.openapi()`` and, for each operation, finds the scope its route declares
with ``api.deps.require`` (on the route or its router). A route that declares none fails here
unless it is listed in ``OPEN`` with the reason it may be called by anyone (or in
``ANY_TOKEN``, for the one route any valid token may call): so a new route without a scope
fails the suite until someone decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from api.app import create_app
from api.deps import scope_of
from api.settings import Settings

OPEN = {
    ("GET", "/healthz"): "liveness for the orchestrator: says only that the process is up",
    ("GET", "/readyz"): "readiness for load balancers: ready or not, no database details",
    ("GET", "/metrics"): "Prometheus scrapes it; request and fleet counters, no secrets; "
    "per-GPU series (node names, risks) only with a read token (SECURITY.md)",
}

ANY_TOKEN = {
    ("GET", "/v1/token"): "tells the caller which scopes its own token holds: any valid token",
}

SCOPES = ("ingest", "read", "operate", "admin")
# One token per scope set: each scope alone, and "everything but X" for the under-scoped case.
TOKENS = {f"only-{s}-token-0123456789": [s] for s in SCOPES} | {
    f"all-but-{s}-token-0123456789": [o for o in SCOPES if o not in (s, "admin")] for s in SCOPES
}


def _declared_scopes(route: APIRoute, extra: list[Any]) -> set[str]:
    """Scopes asked for by the route's dependencies, its routers' and theirs, recursively."""
    found = {scope_of(d.dependency) for d in [*extra, *route.dependencies]} - {None}

    def walk(dependant: Any) -> None:
        for sub in dependant.dependencies:
            if scope_of(sub.call) is not None:
                found.add(scope_of(sub.call))
            walk(sub)

    walk(route.dependant)
    return found  # type: ignore[return-value]


def _routes(routes: list[Any], prefix: str = "", extra: tuple[Any, ...] = ()) -> Iterator[Any]:
    for route in routes:
        if isinstance(route, APIRoute):
            yield prefix + route.path_format, route, list(extra)
        elif hasattr(route, "original_router"):  # an included router (FastAPI >= 0.160)
            context = route.include_context
            yield from _routes(
                route.original_router.routes,
                prefix + context.prefix,
                (*extra, *context.dependencies),
            )


def _operations(app: Any) -> Iterator[tuple[str, str, set[str] | None]]:
    """(method, path, scopes) of every operation in the OpenAPI spec."""
    routes = {}
    for path, route, extra in _routes(app.routes):
        for method in route.methods:
            routes[(method, path)] = (route, extra)
    for path, item in app.openapi()["paths"].items():
        for method in item:
            route, extra = routes[(method.upper(), path)]
            yield method.upper(), path, _declared_scopes(route, extra)


def _url(path: str) -> str:
    values = {"gpu": "0", "rank": "0"}
    return re.sub(r"\{([^}:]+)(:[^}]*)?\}", lambda m: values.get(m.group(1), "x-1"), path)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    tmp: Path = tmp_path_factory.mktemp("scopes")
    settings = Settings(
        database_url=f"sqlite:///{tmp / 'scopes.db'}",
        data_dir=tmp,
        tokens=TOKENS,
        writer_process=False,
        control_enabled=False,
        webhook_dispatch=False,
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_every_route_declares_a_scope_or_is_deliberately_open(client: TestClient) -> None:
    missing = []
    for method, path, scopes in _operations(client.app):
        if (method, path) in OPEN or (method, path) in ANY_TOKEN:
            assert not scopes, f"{method} {path} is listed as open but asks for {scopes}"
        elif len(scopes) != 1:
            missing.append(f"{method} {path}: {sorted(scopes) or 'no scope'}")
    assert not missing, "routes without exactly one scope:\n" + "\n".join(missing)


def test_missing_wrong_and_under_scoped_tokens_are_refused(client: TestClient) -> None:
    checked = 0
    for method, path, scopes in _operations(client.app):
        if (method, path) in OPEN:
            assert client.request(method, _url(path)).status_code < 400, path
            continue
        url = _url(path)
        if (method, path) in ANY_TOKEN:
            assert client.request(method, url).status_code == 401
            bad = {"Authorization": "Bearer not-a-token"}
            assert client.request(method, url, headers=bad).status_code == 401
            continue
        (scope,) = scopes
        missing = client.request(method, url)
        assert missing.status_code == 401, f"{method} {path} without a token: {missing.text}"
        assert missing.headers.get("www-authenticate") == "Bearer"
        wrong = client.request(method, url, headers={"Authorization": "Bearer not-a-token"})
        assert wrong.status_code == 401, f"{method} {path} with an unknown token"
        under = {"Authorization": f"Bearer all-but-{scope}-token-0123456789"}
        refused = client.request(method, url, headers=under)
        assert refused.status_code == 403, f"{method} {path} without '{scope}': {refused.text}"
        assert refused.json()["error"]["code"] == "forbidden"
        allowed = {"Authorization": f"Bearer only-{scope}-token-0123456789"}
        assert client.request(method, url, headers=allowed).status_code not in (401, 403), (
            f"{method} {path} refused its own scope '{scope}'"
        )
        checked += 1
    assert checked >= 10


def test_every_v1_read_route_declares_the_shape_of_its_answer(client: TestClient) -> None:
    """``/docs`` shows what each read answers (``response_model``), so clients can be generated."""
    spec = client.app.openapi()  # type: ignore[attr-defined]
    shapeless = []
    for path, operations in spec["paths"].items():
        if not path.startswith("/v1/") or "get" not in operations:
            continue
        ok = next(r for code, r in operations["get"]["responses"].items() if code.startswith("2"))
        schema = ok.get("content", {}).get("application/json", {}).get("schema")
        if not schema:
            shapeless.append(path)
    assert shapeless == []
