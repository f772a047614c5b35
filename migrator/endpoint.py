"""The agent's local command endpoint (HTTP/JSON) and its client.

``forewarn launch`` serves a small HTTP endpoint beside the job (stdlib ``http.server``, on
the agent's host, an ephemeral port by default) and writes its address to a job file,
``$FOREWARN_RUN_DIR/<job-id>.<launcher-pid>.json`` (default ``$XDG_RUNTIME_DIR/forewarn`` or
the temp directory). ``forewarn migrate --job ID`` finds it there; the service will use the same
routes through ``JobRegistration.agent_url``.

Routes::

    POST /v1/migrations          {"rank", "reason"?, "job_id"?, "migration_id"?, "detail"?}
                                 -> 202 {"migration_id", "status": "accepted"}
    GET  /v1/migrations          -> {"data": [MigrationReport...], "count"}
    GET  /v1/migrations/{id}     -> MigrationReport | 202 {"status": "in_progress"} | 404
    GET  /v1/job                 -> JobRegistration + {"status", "message", "generation"}

Errors are ``{"error": {"code", "message", "retryable", "details"}}`` with the status of the
:mod:`forewarn.errors` class (409 conflict / no spare, 422 invalid input, 404).
"""

from __future__ import annotations

import glob
import json
import os
import re
import tempfile
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

from forewarn.errors import Conflict, ForewarnError, InvalidInput, NotFound
from forewarn.localhttp import JsonHandler
from forewarn.wire import JobRegistration, MigrationReport

__all__ = ["EndpointAgent", "job_file", "read_job_file", "serve", "write_job_file"]


class _InFlight(Protocol):
    migration_id: str


class EndpointAgent(Protocol):
    """What the endpoint asks of the job agent it serves (:class:`migrator.agent.Agent` is
    one; the agent imports this module, never the other way round)."""

    @property
    def status(self) -> str: ...

    @property
    def message(self) -> str: ...

    @property
    def gen(self) -> int: ...

    @property
    def inflight(self) -> _InFlight | None: ...

    @property
    def reports(self) -> Sequence[MigrationReport]: ...

    def registration(self) -> JobRegistration: ...

    def submit(
        self,
        *,
        rank: int,
        reason: str = "planned",
        migration_id: str | None = None,
        job_id: str | None = None,
        detail: str | None = None,
    ) -> str:
        """Accept a planned or preventive move of ``rank``; returns its migration id."""
        ...


def run_dir() -> Path:
    base = os.environ.get("FOREWARN_RUN_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / "forewarn"


def job_file(job_id: str, pid: int | None = None) -> Path:
    """The job file of ``job_id`` written by the launcher process ``pid`` (default: this one).

    Keyed by job id *and* launcher pid: two jobs started with the same (default) id on one
    host each keep their own file.
    """
    return run_dir() / f"{job_id}.{os.getpid() if pid is None else pid}.json"


def write_job_file(job_id: str, info: dict[str, Any]) -> Path:
    path = job_file(job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    tmp.replace(path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def read_job_file(job_id: str) -> dict[str, Any]:
    """The job file of the running job ``job_id`` on this host.

    Raises:
        NotFound: no launcher of that job is running here.
        Conflict: several are (pass the agent's URL instead).
    """
    pattern = re.compile(re.escape(job_id) + r"\.(\d+)\.json")
    found = []
    base = run_dir()
    for path in sorted(base.glob(f"{glob.escape(job_id)}.*.json")):
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        if not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)  # left by a launcher that was killed
            continue
        try:
            found.append(dict(json.loads(path.read_text())))
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    if not found:
        raise NotFound(f"no running job {job_id!r} on this host (no job file in {base})")
    if len(found) > 1:
        urls = ", ".join(str(f.get("agent_url")) for f in found)
        raise Conflict(
            f"{len(found)} running jobs are named {job_id!r} on this host ({urls}); "
            "give the agent's URL (--agent)"
        )
    return found[0]


def _handler(agent: EndpointAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(JsonHandler):
        def do_GET(self) -> None:
            try:
                if self.path == "/v1/job":
                    body = agent.registration().model_dump(mode="json")
                    body.update(status=agent.status, message=agent.message, generation=agent.gen)
                    self.send_json(200, body)
                elif self.path == "/v1/migrations":
                    data = [r.model_dump(mode="json") for r in agent.reports]
                    self.send_json(200, {"data": data, "count": len(data)})
                elif self.path.startswith("/v1/migrations/"):
                    mid = self.path.rsplit("/", 1)[1]
                    for r in agent.reports:
                        if r.migration_id == mid:
                            self.send_json(200, r.model_dump(mode="json"))
                            return
                    m = agent.inflight
                    if m is not None and m.migration_id == mid:
                        self.send_json(202, {"migration_id": mid, "status": "in_progress"})
                        return
                    raise NotFound(f"no migration {mid!r}")
                else:
                    raise NotFound(f"no route {self.path}")
            except ForewarnError as exc:
                self.send_error_json(exc)

        def do_POST(self) -> None:
            try:
                if self.path != "/v1/migrations":
                    raise NotFound(f"no route {self.path}")
                body = self.read_json()
                try:
                    rank = int(body["rank"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise InvalidInput(f"expected JSON with an integer 'rank' ({exc})") from None
                mid = agent.submit(
                    rank=rank,
                    reason=str(body.get("reason", "planned")),
                    migration_id=body.get("migration_id"),
                    job_id=body.get("job_id"),
                    detail=body.get("detail"),
                )
                self.send_json(202, {"migration_id": mid, "status": "accepted"})
            except ValueError as exc:
                self.send_error_json(InvalidInput(str(exc)))
            except ForewarnError as exc:
                self.send_error_json(exc)

    return Handler


def serve(agent: EndpointAgent, host: str, port: int) -> ThreadingHTTPServer:
    """Serve the agent's endpoint in a daemon thread; the caller shuts it down."""
    server = ThreadingHTTPServer((host, port), _handler(agent))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="forewarn-agent-http", daemon=True).start()
    return server
