"""A JSON request handler for the small local control endpoints (standard library only).

The simulator's failure-injection API and the job agent's migration endpoint are a few routes
each, bound to localhost, in processes that must not carry the service's web stack. They share
this base: quiet logging, JSON bodies with a size bound, and errors from the project's tree
answered as ``{"error": {...}}`` with their status; and :class:`BackgroundServer`, which
serves such a handler from a daemon thread.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from forewarn.errors import ForewarnError, InvalidInput

__all__ = ["BackgroundServer", "JsonHandler"]

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


class BackgroundServer:
    """A ``ThreadingHTTPServer`` for ``handler`` on ``host:port`` (port 0: any free port),
    served from a daemon thread between :meth:`start` and :meth:`close`."""

    thread_name = "forewarn-local-http"

    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str, port: int) -> None:
        self._host = host
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self._server.server_port}"

    def start(self) -> Self:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5.0)
            self._thread = None
        self._server.server_close()
