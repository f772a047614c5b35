"""The live simulator's control API: inject a failure on demand, see what the fleet is doing.

A small HTTP server on localhost (stdlib ``http.server``, one thread), for demos and tests:

- ``POST /inject`` with ``{"node": "sim-node-0003", "gpu": 2, "kind": "memory"}`` and an
  optional ``"lead_s"`` (wall seconds to the failure, precursors over that span; omitted: drawn
  from the kind's lead-time distribution, none for kinds without warning) answers
  ``{"node", "gpu", "kind", "fails_in_s"}``;
- ``POST /slow`` with ``{"node", "gpu", "kind"}`` (``thermal``, ``power_cap``, ``power_brake``,
  ``pcie``) and optional ``"duration_s"`` and ``"factor"`` makes the GPU a straggler, never a
  failure (``SimulatedSource.slow``), answering the episode's record;
- ``GET /status``: GPUs up, degrading, slowed, failures so far, speed, lemon nodes;
- ``GET /failures``: the ground truth so far (one object per GPU failure);
- ``GET /slowdowns``: the straggler episodes so far (one object each);
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
            elif self.path == "/slowdowns":
                self.send_json(200, {"data": source.slowdowns()})
            else:
                self.send_error_json(NotFound(f"no route {self.path}"))

        def do_POST(self) -> None:
            if self.path not in ("/inject", "/slow"):
                self.send_error_json(NotFound(f"no route {self.path}"))
                return
            what = self.path[1:]
            try:
                body = self.read_json()
                if not isinstance(body, dict) or not {"node", "gpu", "kind"} <= body.keys():
                    extra = '"lead_s"' if what == "inject" else '"duration_s", "factor"'
                    raise InvalidInput(f'expected {{"node", "gpu", "kind"}} and optional {extra}')
                node, gpu, kind = body["node"], int(body["gpu"]), str(body["kind"])
                if what == "inject":
                    result = source.inject(node, gpu, kind, _number(body.get("lead_s")))
                else:
                    duration, factor = _number(body.get("duration_s")), _number(body.get("factor"))
                    result = source.slow(node, gpu, kind, duration, factor)
            except ForewarnError as exc:
                self.send_error_json(exc)
                return
            except (ValueError, TypeError) as exc:
                self.send_error_json(InvalidInput(f"bad {what} request: {exc}"))
                return
            self.send_json(200, result)

    return Handler


def _number(value: object) -> float | None:
    """An optional number of a request body (None stays None; anything else must be one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)
