"""One place that turns errors into JSON: ``{"error": {"code", "message", "retryable", …}}``.

Codes are part of the API contract: clients branch on ``code``, never on ``message``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from forewarn.errors import ForewarnError, StoreUnavailable

__all__ = [
    "ERROR_SCHEMA",
    "RETRY_AFTER_S",
    "CatchAll",
    "document_errors",
    "error_body",
    "install_error_handlers",
    "store_unavailable",
]

log = logging.getLogger("forewarn.api")

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
}


def error_body(code: str, message: str, *, retryable: bool = False, details=None) -> dict:  # type: ignore[no-untyped-def]
    body: dict = {"code": code, "message": message, "retryable": retryable}
    if details is not None:
        body["details"] = details
    return {"error": body}


RETRY_AFTER_S = 5
"""What a 503 asks a client to wait before trying again (``Retry-After``)."""


def store_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is the database refusing, dropping or locking — worth a retry later."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    if isinstance(exc, OperationalError | InterfaceError | sqlite3.OperationalError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, DBAPIError):
        exc = exc.orig or exc
    try:
        import psycopg.errors
    except ImportError:  # pragma: no cover - a server dependency
        return False
    # UndefinedTable: the database was recreated empty, unavailable until migrated, as dropped.
    return isinstance(
        exc, psycopg.OperationalError | psycopg.InterfaceError | psycopg.errors.UndefinedTable
    )


def _driver_errors() -> tuple[type[Exception], ...]:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - a server dependency
        return ()
    return (psycopg.OperationalError, psycopg.InterfaceError)


def _unavailable(exc: BaseException) -> JSONResponse:
    # The driver's message names hosts, ports, files and users: it goes to the log only.
    log.warning("database unavailable: %s: %s", type(exc).__name__, exc)
    body = error_body(
        "store_unavailable", "the database is unavailable; try again later", retryable=True
    )
    return JSONResponse(body, 503, headers={"Retry-After": str(RETRY_AFTER_S)})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ForewarnError)
    async def _forewarn(_: Request, exc: ForewarnError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.status == 503:
            if isinstance(exc, StoreUnavailable):
                return _unavailable(exc)
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        first = details[0] if details else {"loc": [], "msg": "invalid request"}
        message = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        return JSONResponse(error_body("invalid_input", message, details=details), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        # The exception's headers are part of the answer: a 405's Allow (RFC 9110).
        return JSONResponse(error_body(code, str(exc.detail)), exc.status_code, headers=exc.headers)

    async def _database(_: Request, exc: Exception) -> JSONResponse:
        if store_unavailable(exc):
            return _unavailable(exc)
        log.exception("unhandled database error", exc_info=exc)
        return JSONResponse(error_body("internal", "internal error", retryable=True), 500)

    # Database errors are handled by class (not by the catch-all below, which Starlette
    # re-raises into the server's log after answering): a database that is down is an
    # expected state with its own answer.
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    for error_class in (*_driver_errors(), DBAPIError, sqlite3.OperationalError):
        app.add_exception_handler(error_class, _database)


class CatchAll:
    """Pure ASGI middleware answering any exception a route let through: 503 for a database
    that is down, else 500 ``internal``, logged.

    Not Starlette's ``exception_handler(Exception)``: that answers, then re-raises into the
    server, which closes the connection, so a client's next request on it was reset.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:  # nothing can be answered any more: the server closes the connection
                raise
            if store_unavailable(exc):
                response = _unavailable(exc)
            else:
                log.exception("unhandled error", exc_info=exc)
                response = JSONResponse(error_body("internal", "internal error"), 500)
            await response(scope, receive, send)


ERROR_SCHEMA = {
    "title": "ErrorBody",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "retryable"],
            "properties": {
                "code": {"type": "string", "description": "Stable; branch on it."},
                "message": {"type": "string"},
                "retryable": {"type": "boolean"},
                "details": {"description": "Per-field errors, or what the code is about."},
            },
        }
    },
}
"""The JSON schema of every error answer (``{"error": {...}}``; ingest's 422 adds ``result``)."""


def _error_codes(path: str, method: str, operation: dict[str, Any]) -> dict[int, str]:
    """The error statuses an operation can answer, from what every route shares: the guard
    (token, body), validation, the database, and the resource its path names."""
    codes = {
        401: "Missing or unknown token",
        403: "The token lacks the operation's scope",
        422: "Invalid input (`error.details` lists each problem)",
        503: "The database is unavailable (retryable; `Retry-After`)",
    }
    if "requestBody" in operation or path == "/v1/ingest":
        codes[400] = "The body is not JSON"
        codes[413] = "The body is too large"
    names = "{" in path or (method != "get" and path.startswith("/v1/migrations"))
    if names:  # a path parameter, or a migration or job named in the body
        codes[404] = "No such resource"
    if method != "get" and names:
        codes[409] = "The resource's state does not allow it"
    return codes


def document_errors(app: FastAPI) -> None:
    """Declare in the OpenAPI document, on every ``/v1`` operation, the error answers it can
    give and their one schema (a client, or a fuzzer, finds no undocumented status)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        document = build()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas["ErrorBody"] = ERROR_SCHEMA
        content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        for path, item in document.get("paths", {}).items():
            if not path.startswith("/v1/"):
                continue
            for method, operation in item.items():
                responses = operation.setdefault("responses", {})
                for status, why in _error_codes(path, method, operation).items():
                    declared = responses.setdefault(str(status), {"description": why})
                    declared["content"] = content  # FastAPI's default 422 shape is not ours
        return document

    app.openapi = openapi  # type: ignore[method-assign]
