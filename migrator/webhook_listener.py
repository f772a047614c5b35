"""The job agent's webhook receiver: migration commands pushed by the service, verified.

``forewarn launch --service URL --webhook-listen HOST:PORT`` starts one beside the
:class:`~migrator.service_link.ServiceLink`. On start it subscribes its job to
``migration.requested`` (``POST /v1/webhooks`` with ``job_id`` = its job; the token needs the
``admin`` scope) and listens on HOST:PORT. Each delivery is

1. verified: a Standard Webhooks signature under the subscription's secret, signed within
   ``tolerance_s`` of now (older ones are replays) — else 401;
2. de-duplicated by ``webhook-id`` (deliveries are at least once) — a repeat answers 200;
3. turned into a :class:`~forewarn.wire.MigrationCommand` and handed to the service link's
   command path, the very one the long-poll uses (which acknowledges it to the service, and
   ignores a command it already took by the other path).

When the agent cannot take the command yet (starting, another migration in flight) the answer
is 503 with ``Retry-After``, and the service delivers again. The long-poll keeps running: if
the service cannot reach this port, or the subscription is refused, commands still arrive,
one poll later. On stop the subscription is deleted.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from forewarn.wire import MigrationCommand, MigrationReason, Placement

__all__ = ["WebhookListener", "attach_listener", "verify_delivery"]

log = logging.getLogger(__name__)

PATH = "/forewarn/webhook"
MAX_BODY_BYTES = 1 << 20


def verify_delivery(
    secret: str, headers: Any, body: bytes, *, now_s: float, tolerance_s: float
) -> bool:
    """Standard Webhooks: one of the ``v1,`` signatures is HMAC-SHA256(``id.ts.body``)."""
    msg_id = headers.get("webhook-id") or ""
    stamp = headers.get("webhook-timestamp") or ""
    if not msg_id or not stamp.isdigit() or abs(now_s - int(stamp)) > tolerance_s:
        return False
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(digest).decode()
    return any(
        hmac.compare_digest(expected, s) for s in (headers.get("webhook-signature") or "").split()
    )


def command_of(payload: dict[str, Any]) -> MigrationCommand:
    """The command a ``migration.requested`` event stands for."""
    data = payload["data"]
    trigger = data.get("trigger") or "planned"
    reason = trigger if trigger in {r.value for r in MigrationReason} else "planned"
    target = data.get("target") or {}
    placement = None
    if target.get("node"):
        placement = Placement(
            rank=data["rank"],
            node=target["node"],
            gpu=target.get("gpu"),
            slot=target.get("slot"),
            role="spare",
        )
    requested = datetime.fromisoformat(payload["timestamp"].replace("Z", "+00:00"))
    return MigrationCommand(
        migration_id=data["migration_id"],
        job_id=data["job_id"],
        rank=data["rank"],
        reason=MigrationReason(reason),
        requested_at=requested.astimezone(UTC),
        detail=data.get("detail"),
        trigger=trigger,
        target=placement,
    )


class WebhookListener:
    """Receives ``migration.requested`` for one job and hands each command to the link.

    Args:
        link: the job's :class:`~migrator.service_link.ServiceLink` (its command path).
        listen: ``HOST:PORT`` to bind (port 0: any free one).
        service_url: the service, for the subscription.
        token: a bearer token with the ``admin`` scope (to subscribe).
        job_id: the job; only its events are subscribed to and accepted.
        advertise: ``HOST[:PORT]`` the service should call (default: the bound address, or
            this host's name when bound to every interface).
        tolerance_s: how far a delivery's signing time may be from now.
        timeout_s: bound on the subscribe/unsubscribe requests.
    """

    def __init__(
        self,
        link: Any,
        *,
        listen: str,
        service_url: str,
        token: str | None,
        job_id: str,
        advertise: str | None = None,
        tolerance_s: float = 300.0,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        host, _, port = listen.rpartition(":")
        self.link = link
        self.bind = (host or "127.0.0.1", int(port or 0))
        self.advertise = advertise
        self.job_id = job_id
        self.tolerance_s = tolerance_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            base_url=service_url.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            transport=transport,
        )
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.webhook_id: str | None = None
        self.secret: str | None = None
        self.handled: list[str] = []
        """Event ids whose command this listener handed to the link (for reports and tests)."""

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.server_address[1]
        if self.advertise:
            host, _, given = self.advertise.partition(":")
            return f"http://{host}:{given or port}{PATH}"
        host = self.bind[0]
        if host in ("", "0.0.0.0", "::"):
            host = socket.getfqdn()
        return f"http://{host}:{port}{PATH}"

    def start(self) -> bool:
        """Listen and subscribe; False (long-poll only) when the service refuses."""
        self._server = ThreadingHTTPServer(self.bind, self._handler())
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, name="webhook-listener", daemon=True
        ).start()
        try:
            response = self._client.post(
                "/v1/webhooks",
                json={
                    "url": self.url,
                    "event_types": ["migration.requested"],
                    "job_id": self.job_id,
                    "description": f"forewarn launch --webhook-listen (job {self.job_id})",
                },
            )
        except httpx.HTTPError as exc:
            log.warning("webhook subscription failed (%s); commands arrive by long-poll", exc)
            return False
        if response.status_code != 201:
            log.warning(
                "the service refused the webhook subscription (%s: %s); commands arrive by "
                "long-poll",
                response.status_code,
                response.text[:300],
            )
            return False
        body = response.json()
        self.webhook_id, self.secret = body["id"], body["secret"]
        log.info("subscribed %s to migration.requested for job %s", self.url, self.job_id)
        return True

    def stop(self) -> None:
        """Unsubscribe (best effort) and stop listening."""
        if self.webhook_id is not None:
            try:
                self._client.delete(f"/v1/webhooks/{self.webhook_id}")
            except httpx.HTTPError as exc:
                log.warning("could not delete webhook %s: %s", self.webhook_id, exc)
            self.webhook_id = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._client.close()

    def handle(self, headers: Any, body: bytes) -> tuple[int, dict[str, str]]:
        """One delivery -> (status, extra headers)."""
        secret = self.secret
        if secret is None or not verify_delivery(
            secret, headers, body, now_s=time.time(), tolerance_s=self.tolerance_s
        ):
            return 401, {}
        msg_id = headers["webhook-id"]
        with self._lock:
            if msg_id in self._seen:
                return 200, {}
        try:
            payload = json.loads(body)
            if payload.get("type") != "migration.requested":
                return 204, {}  # e.g. webhook.test: nothing to do
            command = command_of(payload)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("webhook %s: not a migration command (%s)", msg_id, exc)
            return 400, {}
        if command.job_id != self.job_id:
            return 204, {}
        if not self.link.deliver(command):  # the long poll's own path: submit, acknowledge
            return 503, {"Retry-After": "1"}  # the agent cannot take it yet: deliver again
        with self._lock:
            self._seen[msg_id] = None
            if len(self._seen) > 10_000:
                self._seen.popitem(last=False)
            self.handled.append(msg_id)
        return 200, {}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        listener = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "forewarn-agent"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                extra: dict[str, str] = {}
                if self.path.split("?")[0] != PATH:
                    status, extra = 404, {}
                elif length > MAX_BODY_BYTES:
                    status, extra = 413, {}
                else:
                    status, extra = listener.handle(self.headers, self.rfile.read(length))
                self.send_response(status)
                for key, value in extra.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


def attach_listener(link: Any, listen: str, **kwargs: Any) -> WebhookListener:
    """Start a :class:`WebhookListener` with ``link`` and stop it with it (see the module)."""
    listener = WebhookListener(link, listen=listen, **kwargs)
    start, stop = link.start, link.stop

    def start_both(agent: Any) -> None:
        start(agent)
        listener.start()

    def stop_both(agent: Any) -> None:
        listener.stop()
        stop(agent)

    link.start, link.stop = start_both, stop_both
    return listener
