"""A real ``forewarn serve`` SIGKILLed mid-delivery delivers everything after its restart."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from standardwebhooks import Webhook

from store import Store
from tests.conftest import start_service
from tests.webhooks.conftest import Receiver, emit

FAST_SERVICE = {
    "FOREWARN_WEBHOOK_ALLOW": "127.0.0.1",
    "FOREWARN_WEBHOOK_RETRY_BASE_S": "0.05",
    "FOREWARN_WEBHOOK_RETRY_MAX_S": "0.2",
    "FOREWARN_WEBHOOK_TIMEOUT_S": "4",
    "FOREWARN_WEBHOOK_LEASE_S": "12",
    "FOREWARN_WEBHOOK_POLL_INTERVAL_S": "0.05",
}


def _wait(condition, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(360)  # two service starts, which take long on a loaded machine
def test_sigkill_mid_delivery_then_restart_delivers_with_the_same_ids(
    database_url: str, tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in FAST_SERVICE.items():
        monkeypatch.setenv(key, value)
    service = start_service(database_url, tmp_path / "service.log", timeout_s=120)
    try:
        created = httpx.post(
            f"{service.url}/v1/webhooks",
            json={"url": receiver.url, "event_types": ["migration.requested", "gpu.failed"]},
            headers={"Authorization": f"Bearer {service.admin_token}"},
            timeout=10,
        )
        assert created.status_code == 201, created.text
        secret = created.json()["secret"]
        receiver.plan("hold")  # the first attempt is in flight when the service dies
        receiver.start()
        store = Store.open(database_url)
        try:
            ids = [emit(store, "migration.requested", job_id="job-k", rank=i) for i in range(5)]
        finally:
            store.close()
        _wait(lambda: len(receiver.received) >= 1)
        service.process.kill()
        service.process.wait(timeout=10)
        receiver.release()
        assert receiver.received[0].headers["webhook-id"] == ids[0]
        assert receiver.ids() == []

        service = start_service(database_url, tmp_path / "service.log", timeout_s=120)
        _wait(lambda: len(receiver.ids()) == len(ids))
    finally:
        service.stop()
    assert receiver.ids() == ids  # each logical event answered once, in order
    assert [r.headers["webhook-id"] for r in receiver.received][:2] == [ids[0], ids[0]]
    verifier = Webhook(secret)
    for record in receiver.received:
        verifier.verify(record.body, record.headers)
