"""The live simulator's control API: inject a failure on demand, see what the fleet is doing.

A small HTTP server on localhost (stdlib ``http.server``, one thread), for demos and tests:

- ``POST /inject`` with ``{"node": "sim-node-0003", "gpu": 2, "kind": "memory"}`` and an
  optional ``"lead_s"`` (wall seconds to the failure, precursors over that span; omitted: drawn
  from the kind's lead-time distribution, none for kinds without warning) answers
  ``{"node", "gpu", "kind", "fails_in_s"}``;
- ``GET /status``: GPUs up, degrading, failures so far, speed, lemon nodes;
- ``GET /failures``: the ground truth so far (one object per GPU failure);
- ``GET /healthz``.

Errors are ``{"error": {"code", "message", ...}}`` (409 ``conflict`` for a GPU out of
service) with the status of the
:mod:`forewarn.errors` class. It binds to 127.0.0.1 by default: it has no authentication.
"""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler

from forewarn.errors import ForewarnError, InvalidInput, NotFound
from forewarn.localhttp import BackgroundServer, JsonHandler
from sim.source import SimulatedSource

__all__ = ["ControlServer"]


class ControlServer(BackgroundServer):
    """Serves the control API of ``source`` on ``host:port`` (port 0: any free port)."""

    thread_name = "forewarn-sim-control"

    def __init__(self, source: SimulatedSource, host: str = "127.0.0.1", port: int = 0) -> None:
        self.source = source
        super().__init__(_handler(source), host, port)

    @property
    def url(self) -> str:
        return self.base_url


def _handler(source: SimulatedSource) -> type[BaseHTTPRequestHandler]:
    class Handler(JsonHandler):
        server_version = "forewarn-sim"

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self.send_json(200, {"ok": True})
            elif self.path == "/status":
                self.send_json(200, source.status())
            elif self.path == "/failures":
                self.send_json(200, {"data": source.failures()})
            else:
                self.send_error_json(NotFound(f"no route {self.path}"))

        def do_POST(self) -> None:
            if self.path != "/inject":
                self.send_error_json(NotFound(f"no route {self.path}"))
                return
            try:
                body = self.read_json()
                if not isinstance(body, dict) or not {"node", "gpu", "kind"} <= body.keys():
                    raise InvalidInput('expected {"node", "gpu", "kind"} and optional "lead_s"')
                lead = body.get("lead_s")
                result = source.inject(
                    body["node"],
                    int(body["gpu"]),
                    str(body["kind"]),
                    None if lead is None else float(lead),
                )
            except ForewarnError as exc:
                self.send_error_json(exc)
                return
            except (ValueError, TypeError) as exc:
                self.send_error_json(InvalidInput(f"bad inject request: {exc}"))
                return
            self.send_json(200, result)

    return Handler
