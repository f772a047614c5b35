"""The project's error tree.

::

    ForewarnError                      root; carries a stable ``code`` and ``retryable``
    ├── InvalidInput                   the caller sent something we refuse (4xx)
    │   └── PayloadTooLarge
    ├── NotFound
    ├── Conflict                       the request clashes with current state
    ├── Unauthorized / Forbidden
    ├── SourceUnavailable              a telemetry source (NVML, AMD SMI, a URL) cannot be read
    ├── ServiceUnavailable             the Forewarn service cannot be reached (retryable)
    ├── StoreUnavailable               the database cannot be reached (retryable)
    └── MigrationError                 a migration cannot proceed
        ├── NoSpareAvailable
        └── StateNotReplicated         rank-unique state has no healthy replica

Third-party errors are converted at the boundary (an ``NVMLError`` becomes
``SourceUnavailable``); one FastAPI handler turns any of these into JSON
``{"error": {"code", "message", "retryable", "details"}}``.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "Conflict",
    "Forbidden",
    "ForewarnError",
    "InvalidInput",
    "MigrationError",
    "NoSpareAvailable",
    "NotFound",
    "PayloadTooLarge",
    "ServiceUnavailable",
    "SourceUnavailable",
    "StateNotReplicated",
    "StoreUnavailable",
    "Unauthorized",
]


class ForewarnError(Exception):
    """Root of every error the project raises on purpose.

    Attributes:
        code: stable machine-readable identifier, part of the API contract.
        status: HTTP status the API answers with.
        retryable: whether the same call may succeed later without changes.
        details: structured data about the failure (JSON-serialisable).
    """

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.details is not None:
            body["details"] = self.details
        return {"error": body}


class InvalidInput(ForewarnError):
    code = "invalid_input"
    status = 422


class PayloadTooLarge(InvalidInput):
    code = "payload_too_large"
    status = 413


class NotFound(ForewarnError):
    code = "not_found"
    status = 404


class Conflict(ForewarnError):
    code = "conflict"
    status = 409


class Unauthorized(ForewarnError):
    code = "unauthorized"
    status = 401


class Forbidden(ForewarnError):
    code = "forbidden"
    status = 403


class SourceUnavailable(ForewarnError):
    code = "source_unavailable"
    status = 503
    retryable = True


class ServiceUnavailable(ForewarnError):
    """The service cannot be reached or answered 429/5xx; the same request may succeed later."""

    code = "service_unavailable"
    status = 503
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreUnavailable(ForewarnError):
    code = "store_unavailable"
    status = 503
    retryable = True


class MigrationError(ForewarnError):
    code = "migration_error"
    status = 409


class NoSpareAvailable(MigrationError):
    code = "no_spare_available"
    retryable = True


class StateNotReplicated(MigrationError):
    code = "state_not_replicated"
