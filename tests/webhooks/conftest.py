"""A real HTTP receiver on a real port, scripted to fail, stall or accept; dispatcher helpers."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from api.webhooks import DispatchConfig, Dispatcher, TargetGuard
from api.webhooks.sender import Sender
from store import Store
from store import webhooks as wstore
from store.outbox import emit_event
from tests.conftest import free_port


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float
    answered: int | None
    path: str = ""


@dataclass
class Receiver:
    """Answers each POST with the next scripted behaviour (default 200) and records it.

    Behaviours: ``200``/``500``/any status, ``("sleep", s)`` (answer 200 after ``s``),
    ``("status", code, headers)``, ``"hold"`` (wait until :meth:`release`), ``"huge"``
    (200 with an endless body).
    """

    port: int
    script: queue.Queue[Any] = field(default_factory=queue.Queue)
    received: list[Received] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def plan(self, *behaviours: Any) -> None:
        for behaviour in behaviours:
            self.script.put(behaviour)

    def release(self) -> None:
        self.released.set()

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    behaviour = receiver.script.get_nowait()
                except queue.Empty:
                    behaviour = 200
                record = Received(
                    {k.lower(): v for k, v in self.headers.items()},
                    body,
                    time.time(),
                    None,
                    self.path,
                )
                receiver.received.append(record)
                status, headers = 200, {}
                if behaviour == "hold":
                    receiver.released.wait(30)
                    return self._close()
                if behaviour == "huge":
                    self.send_response(200)
                    self.send_header("content-length", str(1 << 30))
                    self.end_headers()
                    with contextlib.suppress(OSError):
                        for _ in range(1 << 14):
                            self.wfile.write(b"x" * 65536)
                    return None
                if isinstance(behaviour, tuple) and behaviour[0] == "sleep":
                    time.sleep(behaviour[1])
                elif isinstance(behaviour, tuple) and behaviour[0] == "status":
                    status, headers = behaviour[1], behaviour[2]
                elif isinstance(behaviour, int):
                    status = behaviour
                record.answered = status
                with contextlib.suppress(OSError):
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                return None

            def _close(self) -> None:
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.released.set()
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def ids(self, *, answered: int | None = 200) -> list[str]:
        return [r.headers["webhook-id"] for r in self.received if r.answered == answered]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A receiver on a reserved port; call ``start()`` (until then: connection refused)."""
    made = Receiver(free_port())
    yield made
    made.stop()


FAST = DispatchConfig(
    timeout_s=1.0,
    retry_base_s=0.05,
    retry_max_s=0.2,
    horizon_s=60.0,
    disable_after=50,
    poll_interval_s=0.02,
    lease_s=10.0,
    gap_grace_s=0.5,
)
"""Pacing for tests: retries in tens of milliseconds."""


def make_dispatcher(
    store: Store,
    config: DispatchConfig = FAST,
    *,
    allow: str = "127.0.0.1",
    owner: str | None = None,
) -> Dispatcher:
    guard = TargetGuard(allow, require_https=False)
    sender = Sender(guard, timeout_s=config.timeout_s, max_response_bytes=config.max_response_bytes)
    return Dispatcher(store.engine, sender, config, owner=owner)


def subscribe(store: Store, url: str, **kwargs: Any) -> dict[str, Any]:
    from api.webhooks.rules import new_webhook_id
    from api.webhooks.signing import generate_secret

    kwargs.setdefault("event_types", ["*"])
    with store.begin() as connection:
        return dict(
            wstore.create_webhook(
                connection,
                webhook_id=new_webhook_id(),
                now_ms=int(time.time() * 1000),
                url=url,
                secret=generate_secret(),
                **kwargs,
            )
        )


def emit(store: Store, type_: str = "migration.requested", **data: Any) -> str:
    job_id = data.pop("job_id", None)
    node = data.pop("node", None)
    with store.begin() as connection:
        return emit_event(connection, type_, data, job_id=job_id, node=node)


def run_dispatchers(
    dispatchers: list[Dispatcher],
    until: Callable[[], bool],
    *,
    timeout_s: float = 30.0,
    during: Callable[[], None] | None = None,
) -> None:
    """Run ``dispatchers`` until ``until()`` holds (polled); fail after ``timeout_s``."""

    async def main() -> None:
        tasks = [asyncio.create_task(d.run()) for d in dispatchers]
        try:
            deadline = time.monotonic() + timeout_s
            while not until():
                if time.monotonic() > deadline:
                    raise AssertionError("condition not reached in time")
                for task in tasks:
                    if task.done():
                        task.result()
                if during is not None:
                    await asyncio.to_thread(during)
                await asyncio.sleep(0.02)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
