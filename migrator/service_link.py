"""The job agent's link to the Forewarn service: register, heartbeat, receive commands, report.

One :class:`ServiceLink` per job agent, passed to :class:`migrator.agent.Agent` as its
collaborator. It

- checks at start that the service answers and that its token may act on jobs
  (:meth:`preflight`): a refused token (401/403) or any other refusal is a clear error before
  a single rank starts, never a warning lost in a log;
- registers the job and its placement (``POST /v1/jobs``), again whenever the placement
  changes, and heartbeats (``POST /v1/jobs/{id}/heartbeat``) with the ranks' step timing
  (:meth:`Agent.timings <migrator.agent.Agent.timings>`, as ``JobHeartbeat.timings``);
- long-polls ``GET /v1/jobs/{id}/commands`` and hands each new command to
  :meth:`Agent.submit` — the service learns of a command's acceptance within one poll;
- reports each transition: ``acknowledged`` (the agent assigned a spare), ``transferring``
  (the ranks agreed on the handover step), then the agent's :class:`MigrationReport`
  (``completed`` or ``failed``).

Every request carries ``Authorization: Bearer <token>``; the token needs the ``operate`` scope.
Reports are queued and sent by a background thread, retried until the service takes them, so
the agent's supervision loop never waits on the network.

``placement`` maps the agent's process slots to fleet GPUs (``--placement``): on a simulated
fleet, slot ``i`` "runs on" ``placement[i]``, and the service scores that GPU for that rank.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import httpx

from forewarn.errors import Forbidden, ForewarnError, InvalidInput, ServiceUnavailable, Unauthorized
from forewarn.wire import (
    JobHeartbeat,
    JobRegistration,
    MigrationCommand,
    MigrationProgress,
    MigrationReport,
    Placement,
)

__all__ = ["Outbox", "ServiceLink", "ServiceRefused", "parse_placement"]

log = logging.getLogger(__name__)

# The agent asks for planned or preventive moves; a manual or service-side unplanned request
# is a planned move of a live rank (a dead rank is the agent's own recovery).
_AGENT_REASON = {"preventive": "preventive", "planned": "planned", "manual": "planned"}


class ServiceRefused(ForewarnError):
    """The service refused the job agent (bad token, missing scope, invalid registration)."""

    code = "service_refused"
    status = 502


def parse_placement(text: str) -> list[tuple[str, int]]:
    """``"node-a:0,node-a:1,node-b:3"`` -> [(node, gpu), …], one per slot (ranks, then spares).

    Raises:
        InvalidInput: an entry is not ``node:gpu``.
    """
    out: list[tuple[str, int]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        node, sep, gpu = item.rpartition(":")
        if not sep or not node or not gpu.isdigit():
            raise InvalidInput(f"placement entry {item!r} is not node:gpu")
        out.append((node, int(gpu)))
    return out


class ServiceLink:
    """The agent's collaborator that talks to the service (see the module docstring).

    Args:
        url: the service's base URL.
        token: bearer token with the ``operate`` scope.
        job_id: the job's name.
        placement: fleet GPU of each slot (index = slot); slots past its end keep the agent's.
        poll_s: how long one long-poll of the command queue waits on the service.
        heartbeat_s: interval of heartbeats (and of retries of queued reports).
        timeout_s: bound on every request besides the long-poll's own wait.
        transport: an httpx transport (tests); default a real connection.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        job_id: str,
        placement: list[tuple[str, int]] | None = None,
        poll_s: float = 10.0,
        heartbeat_s: float = 5.0,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.job_id = job_id
        self.placement = placement or []
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._client = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        self._poll_client = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=poll_s + timeout_s,
            transport=transport,
        )
        self._outbox: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._seen: set[str] = set()
        self._agent: Any = None

    # -- start ------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Fail now, clearly, if the service cannot take this job.

        Raises:
            ServiceRefused: the token is refused or lacks the ``operate`` scope.
            ServiceUnavailable: the service does not answer.
        """
        try:
            response = self._client.get("/v1/token")
        except httpx.HTTPError as exc:
            raise ServiceUnavailable(
                f"the service at {self._client.base_url} does not answer: {exc}"
            ) from exc
        self._raise_for(response, "checking the token")
        scopes = set(response.json().get("scopes", []))
        if "operate" not in scopes:
            raise ServiceRefused(
                f"the token has scopes {sorted(scopes)}; a job agent needs 'operate'"
            )

    def register(self, registration: JobRegistration) -> None:
        """Register (or re-register) the job; the first call is synchronous and must succeed.

        Raises:
            ServiceRefused: the service refused the registration (first call only; later
                ones are queued and retried).
        """
        body = self._mapped_registration(registration).model_dump(mode="json")
        if self._agent is None:
            try:
                response = self._client.post("/v1/jobs", json=body)
            except httpx.HTTPError as exc:
                raise ServiceUnavailable(f"registering the job: {exc}") from exc
            self._raise_for(response, "registering the job")
        else:
            self._outbox.put(("/v1/jobs", body))

    def start(self, agent: Any) -> None:
        """Begin heartbeats, the command long-poll and the report sender for ``agent``."""
        self._agent = agent
        for name, target in (
            ("service-commands", self._poll_loop),
            ("service-reports", self._send_loop),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, agent: Any) -> None:
        """Send a last heartbeat and what is queued (bounded), then stop the threads."""
        self._outbox.put((f"/v1/jobs/{self.job_id}/heartbeat", self._heartbeat(agent)))
        deadline = time.monotonic() + self.timeout_s
        while not self._outbox.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.poll_s + self.timeout_s)
        self._client.close()
        self._poll_client.close()

    # -- reports (called by the agent, under its lock: queue only) ---------------------------

    def progress(
        self, migration_id: str, state: str, *, step: int | None = None, error: str | None = None
    ) -> None:
        body = MigrationProgress(
            migration_id=migration_id,
            job_id=self.job_id,
            state=state,  # type: ignore[arg-type]
            step=step,
            error=error,
        )
        self._outbox.put((f"/v1/migrations/{migration_id}/progress", body.model_dump(mode="json")))

    def report(self, report: MigrationReport) -> None:
        mapped = report.model_copy(
            update={"source": self._map(report.source), "target": self._map(report.target)}
        )
        self._outbox.put(("/v1/migrations/reports", mapped.model_dump(mode="json")))
        if self._agent is not None and report.outcome == "completed":
            self.register(self._agent.registration())

    # -- internals --------------------------------------------------------------------------

    def _map(self, placement: Placement | None) -> Placement | None:
        if placement is None or placement.slot is None or placement.slot >= len(self.placement):
            return placement
        node, gpu = self.placement[placement.slot]
        return placement.model_copy(update={"node": node, "gpu": gpu})

    def _mapped_registration(self, registration: JobRegistration) -> JobRegistration:
        placement = [self._map(p) for p in registration.placement]
        return registration.model_copy(update={"placement": placement})

    def _heartbeat(self, agent: Any) -> dict[str, Any]:
        """The heartbeat's body: the job's status and its ranks' step timing."""
        try:
            timings = agent.timings()
        except (RuntimeError, OSError) as exc:  # the key-value store is going away with the job
            log.warning("no step timing for the heartbeat: %s", exc)
            timings = None
        beat = JobHeartbeat(
            status=agent.status,
            generation=agent.gen,
            message=agent.message or None,
            timings=timings,
        )
        return beat.model_dump(mode="json")

    def _raise_for(self, response: httpx.Response, doing: str) -> None:
        if response.status_code < 400:
            return
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        text = f"the service refused {doing} ({response.status_code}): {message}"
        if response.status_code == 401:
            raise ServiceRefused(text, details={"cause": Unauthorized.code})
        if response.status_code == 403:
            raise ServiceRefused(text, details={"cause": Forbidden.code})
        if response.status_code >= 500:
            raise ServiceUnavailable(text)
        raise ServiceRefused(text)

    def _send_loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_beat and self._agent is not None:
                self._outbox.put(
                    (f"/v1/jobs/{self.job_id}/heartbeat", self._heartbeat(self._agent))
                )
                next_beat = time.monotonic() + self.heartbeat_s
            try:
                path, body = self._outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            while not self._stop.is_set():
                try:
                    response = self._client.post(path, json=body)
                    if response.status_code < 500:
                        if response.status_code >= 400:
                            log.warning("the service refused %s: %s", path, response.text[:300])
                        break
                except httpx.HTTPError as exc:
                    log.warning("could not reach the service (%s); retrying", exc)
                time.sleep(min(1.0, self.heartbeat_s))

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                response = self._poll_client.get(
                    f"/v1/jobs/{self.job_id}/commands", params={"wait_s": self.poll_s}
                )
                if response.status_code != 200:
                    log.warning(
                        "command poll answered %s: %s", response.status_code, response.text[:300]
                    )
                    self._stop.wait(1.0)
                    continue
                commands = [MigrationCommand.model_validate(c) for c in response.json()["data"]]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.warning("command poll failed (%s); retrying", exc)
                self._stop.wait(1.0)
                continue
            for command in commands:
                self.deliver(command)

    def deliver(self, command: MigrationCommand) -> bool:
        """Hand ``command`` to the agent once (the long poll and the webhook listener both
        come here). True when it is settled: acknowledged, refused for good (reported as
        failed), or seen before; False when the agent cannot take it yet (not started,
        another move in flight, the job starting) and it should be delivered again."""
        if command.migration_id in self._seen:
            return True
        if self._agent is None:
            return False
        trigger = command.trigger or command.reason.value
        reason = _AGENT_REASON.get(trigger, "planned")
        slot = command.target.slot if command.target is not None else None
        try:
            self._agent.submit(
                rank=command.rank,
                reason=reason,
                migration_id=command.migration_id,
                job_id=command.job_id,
                detail=command.detail,
                spare_slot=slot,
            )
        except ForewarnError as exc:
            if exc.retryable or exc.code == "conflict":
                return False  # another move in flight, or the job is starting: retried
            self._seen.add(command.migration_id)
            self.progress(command.migration_id, "failed", error=f"{exc.code}: {exc.message}")
            return True
        self._seen.add(command.migration_id)
        self.progress(command.migration_id, "acknowledged")
        return True


class Outbox:
    """Posts to the service from a thread of its own, for an agent without a link.

    ``forewarn launch --service URL`` without a token's link still tells the service of the
    job and its migrations; the agent calls :meth:`post` under its lock, which only queues,
    so a service that is down, or that accepts the connection and never answers, cannot
    stall the agent's watch loop (failure detection). Each post is tried once, bounded by
    ``timeout_s``; a failed one is logged and dropped.

    Args:
        url: the service's base URL.
        timeout_s: bound on each request (connect and answer).
        transport: an httpx transport (tests); default a real connection.
    """

    def __init__(
        self, url: str, *, timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport)
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._send_loop, name="service-outbox", daemon=True)
        self._thread.start()

    def post(self, path: str, body: dict[str, Any]) -> None:
        """Queue one POST of ``body`` to ``path``; returns at once."""
        self._queue.put((path, body))

    def close(self, *, drain_s: float = 5.0) -> None:
        """Send what is queued (at most ``drain_s`` more seconds), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=drain_s)
        self._client.close()

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            path, body = item
            try:
                self._client.post(path, json=body)
            except httpx.HTTPError as exc:  # the job must not stop because the service is down
                log.warning("could not reach the service at %s: %s", self.url, exc)
