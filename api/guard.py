"""The request guard: what every request passes before a route sees a byte of its body.

FastAPI reads and parses a route's JSON body before it solves the route's dependencies, so a
token checked by a dependency is checked after the body was parsed: a client with no token
could make the service read and parse as much as it sends. This pure ASGI middleware runs
first, in this order:

1. the route is found and, when it declares a scope (:func:`api.deps.require`), the token is
   checked: 401 without a known token, 403 without the scope — before the body is read;
2. the path and the query string: a NUL character, or a segment or value longer than
   :data:`MAX_STRING_CHARS`, is 422 (PostgreSQL cannot store a NUL, and a 10 MB identifier is
   not one);
3. the body, on every route but ingest (which reads its own, with its own limits:
   :mod:`api.ingest`): at most ``max_request_body_bytes`` (413, counted as it arrives), then
   parsed exactly once here: not JSON is 400 ``malformed_json``, a repeated key 422
   ``repeated_key``, nesting deeper than :data:`MAX_JSON_DEPTH`, a string with a NUL or a lone
   surrogate or longer than :data:`MAX_STRING_CHARS`, a number that is not finite or an
   integer outside 64 bits is 422 ``invalid_input``.

The route then gets the body as it was read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Router, compile_path

from api.deps import authorize, scope_of
from api.errors import error_body
from forewarn.errors import ForewarnError, InvalidInput, PayloadTooLarge

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_STRING_CHARS",
    "MalformedJson",
    "RepeatedKey",
    "RequestGuard",
    "check_depth",
    "check_json",
    "check_text",
    "check_values",
    "document_guard",
    "parse_exact",
]

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects a request body may have (the API's bodies use 4)."""

MAX_STRING_CHARS = 8192
"""Longest string a body, a query parameter or a path segment may hold."""

_INT64 = 2**63 - 1
_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")
"""NUL (PostgreSQL cannot store it in text) and lone surrogates (not encodable as UTF-8)."""

_UNGUARDED_BODIES = frozenset({"/v1/ingest"})
"""Routes that read their own body, with their own limits."""


class MalformedJson(InvalidInput):
    code = "malformed_json"
    status = 400


class RepeatedKey(InvalidInput):
    code = "repeated_key"


def check_text(value: str, where: str) -> None:
    """Refuse (422) a string with a NUL or a lone surrogate, or longer than the limit."""
    if len(value) > MAX_STRING_CHARS:
        raise InvalidInput(f"{where}: longer than {MAX_STRING_CHARS} characters")
    found = _BAD_CHAR.search(value)
    if found is not None:
        what = "a NUL character" if found.group() == "\x00" else "a lone surrogate"
        raise InvalidInput(f"{where}: holds {what}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKey(f"key '{key[:64]}' is repeated in one object")
            seen.add(key)
    return out


def _refuse_constant(name: str) -> Any:
    raise InvalidInput(f"body: {name} is not a JSON number")


def _depth(raw: bytes) -> int:
    """The deepest nesting of ``raw``, a JSON text, counted outside its strings."""
    bare = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", raw)
    depth = deepest = 0
    for byte in bare.translate(None, b' \t\r\n,:0123456789.eE+-truefalsn"'):
        if byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def check_depth(raw: bytes) -> None:
    """Refuse (422) a JSON text nested deeper than :data:`MAX_JSON_DEPTH`."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth(raw) > MAX_JSON_DEPTH:
        raise InvalidInput(f"body: nested deeper than {MAX_JSON_DEPTH} levels")


def check_values(value: Any, *, numbers: bool = True) -> None:
    """Refuse (422) a decoded body holding a string that :func:`check_text` refuses, or (with
    ``numbers``) a number that is not finite or an integer outside 64 bits."""
    stack: list[tuple[Any, str]] = [(value, "body")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            check_text(item, where)
        elif isinstance(item, dict):
            for key, inner in item.items():
                check_text(key, f"{where} key")
                stack.append((inner, f"{where}.{key[:64]}"))
        elif isinstance(item, list):
            stack.extend((inner, f"{where}[{i}]") for i, inner in enumerate(item))
        elif not numbers or isinstance(item, bool):
            continue
        elif isinstance(item, int) and not -_INT64 - 1 <= item <= _INT64:
            raise InvalidInput(f"{where}: integer outside 64 bits")
        elif isinstance(item, float) and not math.isfinite(item):
            raise InvalidInput(f"{where}: number out of range")


def parse_exact(raw: bytes, *, constants: bool = False) -> Any:
    """Parse JSON exactly: a repeated key refused (422 ``repeated_key``), anything not JSON 400
    ``malformed_json``; ``NaN``/``Infinity`` tokens read as floats only with ``constants``."""
    check_depth(raw)
    hook = float if constants else _refuse_constant
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=hook)
    except ForewarnError:
        raise
    except (ValueError, RecursionError) as exc:
        raise MalformedJson(f"body is not valid JSON: {exc}") from None


def check_json(raw: bytes) -> Any:
    """Parse a request body exactly and check every value in it; see the module docstring."""
    value = parse_exact(raw)
    check_values(value)
    return value


class _Route(NamedTuple):
    path: str
    methods: frozenset[str]
    pattern: re.Pattern[str]
    scope: str | None
    """The scope the route's token must hold; None: an open route."""
    body: bool
    """Whether the route takes a JSON body."""


def _required_scope(dependant: Any, extra: list[Any]) -> str | None:
    for dependency in extra:
        found = scope_of(dependency.dependency)
        if found is not None:
            return found
    pending = list(dependant.dependencies)
    while pending:
        inner = pending.pop()
        found = scope_of(inner.call)
        if found is not None:
            return found
        pending.extend(inner.dependencies)
    return None


def _flatten(routes: list[Any], prefix: str = "", extra: tuple[Any, ...] = ()) -> Iterator[_Route]:
    """Every API route of the app, with the prefixes and dependencies of the routers that
    include it (FastAPI keeps an included router as one entry)."""
    for route in routes:
        if isinstance(route, APIRoute):
            path = prefix + route.path
            yield _Route(
                path=path,
                methods=frozenset(route.methods or ()),
                pattern=compile_path(path)[0],
                scope=_required_scope(route.dependant, [*extra, *route.dependencies]),
                body=bool(route.dependant.body_params),
            )
        elif hasattr(route, "original_router"):  # an included router (FastAPI >= 0.160)
            context = route.include_context
            yield from _flatten(
                route.original_router.routes,
                prefix + context.prefix,
                (*extra, *context.dependencies),
            )


def _method_not_allowed(allowed: frozenset[str]) -> JSONResponse:
    body = error_body("method_not_allowed", "Method Not Allowed")
    return JSONResponse(body, 405, headers={"Allow": ", ".join(sorted(allowed))})


def _refusal(exc: ForewarnError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.to_json(), exc.status, headers=headers)


class RequestGuard:
    """Pure ASGI middleware: authenticate, then bound and check, then hand over the body."""

    def __init__(self, app: Any, router: Router, max_body_bytes: int) -> None:
        self.app = app
        self.router = router
        self.max_body_bytes = max_body_bytes
        self._routes: list[_Route] | None = None

    def _table(self) -> list[_Route]:
        if self._routes is None:  # built at the first request: every route is there by then
            self._routes = list(_flatten(self.router.routes))
        return self._routes

    def _route_of(self, scope: dict[str, Any]) -> _Route | None:
        path, method = scope["path"], scope["method"]
        for route in self._table():
            if method in route.methods and route.pattern.match(path):
                return route
        return None

    def _methods_of(self, path: str) -> frozenset[str]:
        """The methods of the resource ``path`` names, for a 405's ``Allow``: those of every
        route whose path matches it with the fewest parameters. A path may be served by
        several routes (Starlette's ``Allow`` names those of the first only); where one names
        it literally (``POST /v1/migrations/reports``) a route with a parameter that also
        matches (``GET /v1/migrations/{migration_id}``) serves another resource, one that
        does not exist (``GET /v1/migrations/reports`` is a 404)."""
        matching = [r for r in self._table() if r.pattern.match(path)]
        fewest = min((r.path.count("{") for r in matching), default=0)
        return frozenset(m for r in matching if r.path.count("{") == fewest for m in r.methods)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route_of(scope)
        try:
            for segment in scope["path"].split("/"):  # a segment: at most one parameter
                check_text(segment, "path")
            for name, value in Request(scope).query_params.multi_items():
                check_text(name, "query")
                check_text(value, f"query.{name[:64]}")
            if route is None and (allowed := self._methods_of(scope["path"])):
                await _method_not_allowed(allowed)(scope, receive, send)
                return
            if route is not None and route.scope is not None:
                await authorize(Request(scope), route.scope)
            if route is None or route.path in _UNGUARDED_BODIES:
                await self.app(scope, receive, send)
                return
            raw = await self._read(scope, receive)
            if raw and route.body:
                check_json(raw)
        except ForewarnError as exc:
            await _refusal(exc)(scope, receive, send)
            return

        delivered = False

        async def replay() -> Any:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope: Any, receive: Any) -> bytes:
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise PayloadTooLarge(f"body of {int(value)} bytes exceeds the {limit}-byte limit")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


_NO_NUL = "^[^\\u0000]*$"
"""What :func:`check_text` lets through, as a JSON schema pattern (lone surrogates cannot be
written in UTF-8 JSON at all)."""


def _no_nul(node: Any, max_length: int | None = None) -> None:
    """Add to every string schema under ``node`` that the guard refuses a NUL in it (and, for
    a parameter, more than ``max_length`` characters), to every integer one 64 bits."""
    if isinstance(node, dict):
        if node.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(node):
            node["pattern"] = _NO_NUL
        if node.get("type") == "integer":  # check_values: an integer outside 64 bits is 422
            node["minimum"] = max(node.get("minimum", -_INT64 - 1), -_INT64 - 1)
            node["maximum"] = min(node.get("maximum", _INT64), _INT64)
        if node.get("type") == "string" and max_length is not None:
            node["maxLength"] = min(node.get("maxLength", max_length), max_length)
        for value in node.values():
            _no_nul(value, max_length)
    elif isinstance(node, list):
        for item in node:
            _no_nul(item, max_length)


def document_guard(app: Any) -> None:
    """Say in the OpenAPI document what the guard refuses in every string of a request and a
    stored record: a NUL; and in a parameter more than :data:`MAX_STRING_CHARS` characters;
    an integer outside 64 bits."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        document: dict[str, Any] = build()
        _no_nul(document.get("components", {}).get("schemas", {}))
        for item in document.get("paths", {}).values():
            for operation in item.values():
                parameters = operation.get("parameters", [])
                for parameter in parameters:
                    _no_nul(parameter.get("schema"), MAX_STRING_CHARS)
                _no_nul(operation.get("requestBody"))
        return document

    app.openapi = openapi
