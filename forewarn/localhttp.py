"""A JSON request handler for the small local control endpoints (standard library only).

The simulator's failure-injection API and the job agent's migration endpoint are a few routes
each, bound to localhost, in processes that must not carry the service's web stack. They share
this base: quiet logging, JSON bodies with a size bound, and errors from the project's tree
answered as ``{"error": {...}}`` with their status.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from forewarn.errors import ForewarnError, InvalidInput

__all__ = ["JsonHandler"]

MAX_BODY_BYTES = 1 << 20


class JsonHandler(BaseHTTPRequestHandler):
    """Base handler: subclasses implement ``do_GET``/``do_POST`` with the helpers below."""

    server_version = "forewarn"

    def log_message(self, format: str, *args: Any) -> None:  # quiet by default
        pass

    def send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, exc: ForewarnError) -> None:
        self.send_json(exc.status, exc.to_json())

    def read_json(self) -> Any:
        """The request body as JSON (``{}`` when empty).

        Raises:
            InvalidInput: the body is over 1 MiB or is not JSON.
        """
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise InvalidInput(f"body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
        try:
            return json.loads(self.rfile.read(length) or b"{}")
        except ValueError as exc:
            raise InvalidInput(f"body is not JSON: {exc}") from None
