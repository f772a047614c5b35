"""``examples/webhook_receiver.py`` verifies, de-duplicates and acts on real deliveries."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from api.webhooks.signing import generate_secret, signature_headers
from store import Store
from store.outbox import emit_event
from tests.conftest import free_port
from tests.webhooks.conftest import make_dispatcher, run_dispatchers, subscribe

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "webhook_receiver.py"


def test_example_receiver(store: Store, tmp_path: Path) -> None:
    port = free_port()
    hook = subscribe(store, f"http://127.0.0.1:{port}/")
    out = (tmp_path / "receiver.out").open("wb")
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "FOREWARN_WEBHOOK_SECRET": hook["secret"]},
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while "listening" not in (tmp_path / "receiver.out").read_text():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        with store.begin() as connection:
            data = {"node": "gpu-node-3", "gpu": 1, "cause": "Xid 79"}
            event_id = emit_event(connection, "gpu.failed", data, node="gpu-node-3")
        run_dispatchers(
            [make_dispatcher(store)],
            lambda: f"gpu.failed {event_id}" in (tmp_path / "receiver.out").read_text(),
        )
        # a replay of the same id is accepted and not acted on twice; a forgery is refused
        body = b'{"type":"gpu.failed","timestamp":"2026-12-03T00:00:00.000Z","data":{}}'
        headers = signature_headers([hook["secret"]], event_id, int(time.time()), body)
        assert httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=headers).is_success
        forged = signature_headers([generate_secret()], "msg_x", int(time.time()), body)
        assert (
            httpx.post(f"http://127.0.0.1:{port}/", content=body, headers=forged).status_code == 401
        )
    finally:
        process.terminate()
        process.wait(timeout=10)
        out.close()
    text = (tmp_path / "receiver.out").read_text()
    assert text.count(event_id) == 1
    assert "would run: kubectl cordon gpu-node-3" in text
