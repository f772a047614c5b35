"""The demo's own webhook receiver: the deliveries its story causes, verified and kept.

The demo subscribes it (``POST /v1/webhooks``, every event type) once the service is up, so
the dashboard's Webhooks page shows the deliveries the demo's migrations caused and the
summary counts them. It checks each delivery's Standard Webhooks signature as a real
receiver must (``examples/webhook_receiver.py`` is the one to copy from), answers 204 and
writes one line per delivery to ``demo-webhooks.log``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["Receiver", "verify"]

MAX_BODY = 1 << 20


def verify(secret: str, headers: Any, body: bytes) -> bool:
    """Standard Webhooks: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""
    msg_id = headers.get("webhook-id", "")
    timestamp = headers.get("webhook-timestamp", "")
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(digest).decode()
    return any(
        hmac.compare_digest(expected, s) for s in headers.get("webhook-signature", "").split()
    )


class Receiver:
    """An HTTP server on ``host`` (a free port) in a thread; ``close()`` stops it."""

    def __init__(self, log_path: Path, host: str = "127.0.0.1") -> None:
        self.log_path = log_path
        self.secret: str | None = None
        """The subscription's secret, set once the demo subscribed."""
        self.verified: Counter[str] = Counter()
        """Deliveries whose signature held, by event type."""
        self.refused = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(min(length, MAX_BODY))
                ok = receiver.secret is not None and verify(receiver.secret, self.headers, body)
                receiver.record(body, self.headers.get("webhook-id", ""), ok)
                self.send_response(204 if ok else 401)
                self.end_headers()

            def log_message(self, *_: Any) -> None:  # one line per delivery is ours to write
                return

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_port}/"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def record(self, body: bytes, msg_id: str, ok: bool) -> None:
        try:
            kind = str(json.loads(body).get("type", "?"))
        except (ValueError, AttributeError):
            kind = "?"
        with self._lock:
            if ok:
                self.verified[kind] += 1
            else:
                self.refused += 1
            with self.log_path.open("a") as log:
                log.write(f"{kind} {msg_id} {'verified' if ok else 'REFUSED: bad signature'}\n")

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.verified)

    def close(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
