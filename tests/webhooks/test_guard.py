"""The target guard: internal addresses refused unless allow-listed, checked after DNS, pinned."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from api.webhooks.guard import TargetGuard, TargetRefused
from api.webhooks.sender import Sender


def resolve(guard: TargetGuard, url: str) -> Any:
    return asyncio.run(guard.resolve(url))


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.1.2.3/",
        "http://192.168.0.10:8080/",
        "http://172.16.0.1/",
        "http://100.100.100.200/",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://[fe80::1]/",
        "http://0.0.0.0/",
        "http://localhost:9/",
        "http://metadata.google.internal/",
    ],
)
def test_internal_targets_are_refused(url: str) -> None:
    with pytest.raises(TargetRefused):
        resolve(TargetGuard("", require_https=False), url)


def test_allow_list_lets_them_through() -> None:
    guard = TargetGuard("127.0.0.1, 169.254.169.254/32, 10.0.0.0/8", require_https=False)
    assert resolve(guard, "http://127.0.0.1:8080/x").ip == "127.0.0.1"
    assert resolve(guard, "http://169.254.169.254/").ip == "169.254.169.254"
    assert resolve(guard, "http://10.9.9.9/").ip == "10.9.9.9"
    with pytest.raises(TargetRefused):
        resolve(guard, "http://192.168.1.1/")
    assert resolve(TargetGuard("localhost", require_https=False), "http://localhost:9/").ip


def test_form_and_production_rules() -> None:
    production = TargetGuard("", require_https=True)
    for bad in ("ftp://example.com/", "http:///x", "https://user:pw@example.com/", "nonsense"):
        with pytest.raises(TargetRefused):
            production.check_url(bad)
    with pytest.raises(TargetRefused, match="https"):
        production.check_url("http://hooks.example.com/")
    assert production.check_url("https://hooks.example.com/a") == (
        "https",
        "hooks.example.com",
        443,
    )
    allowed = TargetGuard("hooks.internal,127.0.0.1", require_https=True)
    assert allowed.check_url("http://hooks.internal:81/")[2] == 81
    assert allowed.check_url("http://127.0.0.1:81/")[0] == "http"


class _Body(httpx.AsyncByteStream):
    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield b"ok"


class _Resolver:
    """Stands in for DNS: answers for one name, in order, one answer per lookup."""

    def __init__(self, answers: list[list[str]]) -> None:
        self.answers = answers
        self.lookups = 0

    async def getaddrinfo(self, host: str, port: int, **_: Any) -> list[Any]:
        answer = self.answers[min(self.lookups, len(self.answers) - 1)]
        self.lookups += 1
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]


def test_every_resolved_address_must_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = _Resolver([["93.184.216.34", "127.0.0.1"]])

    async def run() -> None:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "getaddrinfo", resolver.getaddrinfo)
        with pytest.raises(TargetRefused, match=r"127\.0\.0\.1"):
            await TargetGuard("", require_https=False).resolve("http://rebind.example/")

    asyncio.run(run())


def test_the_connection_goes_to_the_checked_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that answers a public address, then loopback (rebinding): one lookup per attempt,
    the connection to the address checked, the name kept in Host and SNI."""
    resolver = _Resolver([["93.184.216.34"], ["127.0.0.1"]])
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204, stream=_Body())

    async def run() -> list[Any]:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "getaddrinfo", resolver.getaddrinfo)
        sender = Sender(
            TargetGuard("", require_https=False),
            timeout_s=2,
            max_response_bytes=1024,
            transport=httpx.MockTransport(handler),
        )
        try:
            first = await sender.send("https://rebind.example/hook?a=1", {}, b"{}")
            second = await sender.send("https://rebind.example/hook?a=1", {}, b"{}")
        finally:
            await sender.aclose()
        return [first, second]

    first, second = asyncio.run(run())
    assert first.ok and resolver.lookups == 2
    (request,) = seen  # the second lookup answered loopback: refused before connecting
    assert request.url.host == "93.184.216.34" and request.url.query == b"a=1"
    assert request.headers["host"] == "rebind.example"
    assert request.extensions["sni_hostname"] == "rebind.example"
    assert not second.ok and "target refused" in (second.error or "")


def test_redirects_are_not_followed() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        return httpx.Response(302, headers={"location": "http://169.254.169.254/"}, stream=_Body())

    async def run() -> Any:
        sender = Sender(
            TargetGuard("127.0.0.1", require_https=False),
            timeout_s=2,
            max_response_bytes=1024,
            transport=httpx.MockTransport(handler),
        )
        try:
            return await sender.send("http://127.0.0.1:9/hook", {}, b"{}")
        finally:
            await sender.aclose()

    result = asyncio.run(run())
    assert not result.ok and result.status_code == 302 and "not followed" in (result.error or "")
    assert calls == ["http://127.0.0.1:9/hook"]
