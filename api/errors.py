"""One place that turns errors into JSON: ``{"error": {"code", "message", "retryable", …}}``.

Codes are part of the API contract: clients branch on ``code``, never on ``message``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from forewarn.errors import ForewarnError

__all__ = ["error_body", "install_error_handlers"]

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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ForewarnError)
    async def _forewarn(_: Request, exc: ForewarnError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
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
        return JSONResponse(error_body(code, str(exc.detail)), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body("internal", "internal error", retryable=True), 500)
