"""The job agent's webhook receiver: verification, de-duplication, and a migration it fires."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.webhooks.signing import generate_secret, signature_headers
from migrator.webhook_listener import PATH, WebhookListener, attach_listener

ROOT = Path(__file__).resolve().parents[2]


class FakeLink:
    """The command path of a ServiceLink: ``deliver`` says whether the command was taken."""

    def __init__(self, busy: int = 0) -> None:
        self._seen: set[str] = set()
        self.delivered: list[Any] = []
        self.busy = busy

    def deliver(self, command: Any) -> bool:
        if command.migration_id in self._seen:
            return True
        if self.busy:
            self.busy -= 1  # e.g. Conflict from the agent: not taken, not seen
            return False
        self.delivered.append(command)
        self._seen.add(command.migration_id)
        return True


def _service(secret: str, calls: list[httpx.Request]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if request.method == "POST":
            return httpx.Response(201, json={"id": "wh_1", "secret": secret})
        return httpx.Response(204)

    return httpx.MockTransport(answer)


def _requested(job: str, migration_id: str = "mig_1") -> bytes:
    import orjson

    return orjson.dumps(
        {
            "type": "migration.requested",
            "timestamp": "2026-12-03T06:40:00.180Z",
            "data": {
                "migration_id": migration_id,
                "job_id": job,
                "rank": 1,
                "trigger": "preventive",
                "state": "requested",
                "risk": 0.9,
                "reasons": ["row remap pending"],
                "source": {"node": "n0", "gpu": 1},
                "target": {"node": "n1", "gpu": 0, "slot": 2},
            },
        }
    )


def test_listener_verifies_deduplicates_and_asks_for_retries() -> None:
    secret, calls = generate_secret(), []
    link = FakeLink(busy=1)
    listener = WebhookListener(
        link,
        listen="127.0.0.1:0",
        service_url="http://forewarn.test",
        token="t",
        job_id="job-a",
        transport=_service(secret, calls),
    )
    assert listener.start()
    try:
        subscription = calls[0].read()
        assert b'"job_id":"job-a"' in subscription and b"migration.requested" in subscription
        url = listener.url
        assert url.endswith(PATH)
        body = _requested("job-a")

        def post(headers: dict[str, str], content: bytes = body) -> int:
            return httpx.post(url, content=content, headers=headers).status_code

        now = int(time.time())
        good = signature_headers([secret], "msg_a", now, body)
        assert post(signature_headers([generate_secret()], "msg_a", now, body)) == 401
        assert post(signature_headers([secret], "msg_a", now - 3600, body)) == 401
        assert post({**good, "webhook-signature": good["webhook-signature"]}, b"{}") == 401
        assert post(good) == 503  # the agent was busy: the service will deliver again
        assert post(good) == 200
        assert post(good) == 200  # a repeat of the same webhook-id: not handed over again
        other = _requested("job-b", "mig_2")
        assert post(signature_headers([secret], "msg_b", now, other), other) == 204
        (command,) = link.delivered
        assert command.migration_id == "mig_1" and command.rank == 1
        assert command.reason.value == "preventive" and command.target.slot == 2
        assert listener.handled == ["msg_a"]
    finally:
        listener.stop()
    assert calls[-1].method == "DELETE" and calls[-1].url.path == "/v1/webhooks/wh_1"


def test_a_refused_subscription_leaves_the_long_poll() -> None:
    refuse = httpx.MockTransport(lambda r: httpx.Response(403, json={"error": {}}))
    listener = WebhookListener(
        FakeLink(),
        listen="127.0.0.1:0",
        service_url="http://x",
        token="t",
        job_id="j",
        transport=refuse,
    )
    try:
        assert not listener.start()
    finally:
        listener.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_migration_fired_by_webhook_is_bitwise_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real service, a real job agent whose long-poll is switched off: the command arrives
    only as a webhook, the migration completes, and the run equals one without it."""
    from migrator.agent import Agent, AgentConfig
    from migrator.service_link import ServiceLink
    from tests.conftest import start_service
    from tests.migrator.harness import Run, assert_same, launch

    class WebhookOnlyLink(ServiceLink):
        def _poll_loop(self) -> None:
            self._stop.wait()

    for key, value in {
        "FOREWARN_WEBHOOK_ALLOW": "127.0.0.1",
        "FOREWARN_WEBHOOK_RETRY_BASE_S": "0.05",
        "FOREWARN_WEBHOOK_RETRY_MAX_S": "0.2",
        "FOREWARN_WEBHOOK_POLL_INTERVAL_S": "0.05",
    }.items():
        monkeypatch.setenv(key, value)
    steps = 60
    base = launch(tmp_path / "base", steps=steps)
    service = start_service(
        f"sqlite:///{tmp_path / 'svc.db'}", tmp_path / "service.log", timeout_s=120
    )
    try:
        out = tmp_path / "webhook"
        script = ROOT / "tests" / "control" / "train_paced.py"
        cfg = AgentConfig(
            command=[
                sys.executable,
                str(script),
                "--out",
                str(out),
                "--steps",
                str(steps),
                "--mode",
                "ddp",
                "--pace-s",
                "0.05",
            ],
            nproc=2,
            spares=1,
            timeout_s=10.0,
            job_id="job-wh",
            log_dir=out / "logs",
            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        )
        link = WebhookOnlyLink(service.url, token=service.admin_token, job_id="job-wh")
        link.preflight()
        listener = attach_listener(
            link,
            "127.0.0.1:0",
            service_url=service.url,
            token=service.admin_token,
            job_id="job-wh",
        )
        agent = Agent(cfg, link=link)
        result: dict[str, int] = {}
        runner = threading.Thread(target=lambda: result.update(code=agent.run()))
        runner.start()
        admin = {"Authorization": f"Bearer {service.admin_token}"}
        deadline = time.monotonic() + 60
        while True:  # until the job is registered and the webhook subscribed
            assert time.monotonic() < deadline, service.log()
            if listener.webhook_id is not None:
                made = httpx.post(
                    f"{service.url}/v1/migrations",
                    json={"job_id": "job-wh", "rank": 1, "detail": "via webhook"},
                    headers=admin,
                    timeout=10,
                )
                if made.status_code == 201:
                    break
            time.sleep(0.05)
        migration_id = made.json()["id"]
        runner.join(timeout=240)
        assert not runner.is_alive()
        final = httpx.get(f"{service.url}/v1/migrations/{migration_id}", headers=admin).json()
    finally:
        service.stop()
    assert listener.handled, "the command did not come by webhook"
    assert final["state"] == "completed", final
    run = Run(out, result["code"], list(agent.reports), agent)
    assert len(run.reports) == 1 and run.reports[0].outcome == "completed"
    assert_same(base, run)
