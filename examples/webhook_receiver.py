"""A Forewarn webhook receiver to copy from: verify, de-duplicate, answer fast, then act.

Standard library only. It checks each delivery's Standard Webhooks signature and timestamp,
drops repeats by ``webhook-id`` (deliveries are at least once), answers 204 at once and acts in
a worker thread:

- ``risk.threshold_crossed``, ``gpu.failed``: cordon the GPU's Kubernetes node
  (``kubectl cordon NODE``; printed unless ``--kubectl`` is given);
- every event: one line to stdout, and to a chat webhook if ``--chat-url`` is given (a
  Slack-compatible ``{"text": ...}`` POST).

Run::

    export FOREWARN_WEBHOOK_SECRET=whsec_...      # from POST /v1/webhooks
    python examples/webhook_receiver.py --host 0.0.0.0 --port 9000 [--kubectl] [--chat-url URL]

(it binds 127.0.0.1 unless told otherwise: ``--host 0.0.0.0`` for a service on another
machine)

and subscribe it (the service must allow-list a private address: FOREWARN_WEBHOOK_ALLOW)::

    curl -X POST $FOREWARN/v1/webhooks -H "Authorization: Bearer $ADMIN_TOKEN" \\
         -H 'content-type: application/json' -d '{"url": "http://10.0.0.5:9000/"}'
"""

from __future__ import annotations

import argparse
import base64
import collections
import hashlib
import hmac
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOLERANCE_S = 300  # refuse deliveries signed further than this from now (replays)
MAX_BODY = 1 << 20


def verify(secret: str, headers: Any, body: bytes) -> bool:
    """Standard Webhooks: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""
    msg_id = headers.get("webhook-id", "")
    timestamp = headers.get("webhook-timestamp", "")
    if not msg_id or not timestamp.isdigit() or abs(time.time() - int(timestamp)) > TOLERANCE_S:
        return False
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(digest).decode()
    offered = headers.get("webhook-signature", "").split()
    return any(hmac.compare_digest(expected, s) for s in offered)


class Seen:
    """The most recent ``size`` event ids (a restart forgets them: make actions idempotent)."""

    def __init__(self, size: int = 100_000) -> None:
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def first_time(self, msg_id: str) -> bool:
        with self._lock:
            if msg_id in self._ids:
                return False
            self._ids[msg_id] = None
            if len(self._ids) > self._size:
                self._ids.popitem(last=False)
            return True


def act(event: dict[str, Any], msg_id: str, args: argparse.Namespace) -> None:
    kind, data = event["type"], event["data"]
    line = f"{event['timestamp']} {kind} {msg_id} {json.dumps(data, sort_keys=True)}"
    print(line, flush=True)
    if kind in ("risk.threshold_crossed", "gpu.failed") and data.get("node"):
        command = ["kubectl", "cordon", data["node"]]
        if args.kubectl:
            subprocess.run(command, check=False, timeout=30)
        else:
            print("would run:", " ".join(command), flush=True)
    if args.chat_url:
        request = urllib.request.Request(
            args.chat_url,
            data=json.dumps({"text": f"Forewarn: {kind} {json.dumps(data)}"}).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except OSError as exc:
            print(f"chat post failed: {exc}", file=sys.stderr, flush=True)


def serve(args: argparse.Namespace, secret: str) -> None:
    seen, work = Seen(), queue.Queue()  # type: ignore[var-annotated]

    def worker() -> None:
        while True:
            event, msg_id = work.get()
            try:
                act(event, msg_id, args)
            except Exception as exc:  # one bad action must not stop the receiver
                print(f"action failed for {msg_id}: {exc}", file=sys.stderr, flush=True)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_BODY:
                return self._answer(413)
            body = self.rfile.read(length)
            if not verify(secret, self.headers, body):
                return self._answer(401)
            msg_id = self.headers["webhook-id"]
            if seen.first_time(msg_id):
                work.put((json.loads(body), msg_id))
            return self._answer(204)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

    threading.Thread(target=worker, daemon=True).start()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"listening on http://{args.host}:{server.server_port}/", flush=True)
    server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default %(default)s; 0.0.0.0 for "
        "a service on another machine)"
    )
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--kubectl", action="store_true", help="really run kubectl cordon")
    parser.add_argument("--chat-url", help="a Slack-compatible incoming-webhook URL")
    args = parser.parse_args()
    secret = os.environ.get("FOREWARN_WEBHOOK_SECRET", "")
    if not secret.startswith("whsec_"):
        print("set FOREWARN_WEBHOOK_SECRET to the subscription's whsec_... secret", file=sys.stderr)
        return 2
    serve(args, secret)
    return 0


if __name__ == "__main__":
    sys.exit(main())
