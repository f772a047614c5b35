"""One delivery attempt: a signed POST to a checked, pinned address, bounded in every way.

The attempt connects to the address the guard checked (never re-resolving the name), does not
follow redirects, gives up after ``timeout_s`` in all (connect, send, a slow-dripping answer),
and reads at most ``max_response_bytes`` of the answer. Its outcome is an
:class:`AttemptResult`; nothing here raises for a receiver's misbehaviour.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from dataclasses import dataclass

import httpx

from api.webhooks.guard import TargetGuard, TargetRefused

__all__ = ["AttemptResult", "Sender", "parse_retry_after"]

USER_AGENT = "Forewarn-Webhooks/1"


@dataclass(frozen=True)
class AttemptResult:
    ok: bool
    status_code: int | None
    error: str | None
    latency_ms: int
    retry_after_s: float | None = None


def parse_retry_after(value: str | None, *, now_s: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now_s)


class Sender:
    """Sends attempts over one pooled HTTP client.

    Args:
        guard: checks and pins each target.
        timeout_s: the whole attempt, from DNS to the last byte read.
        max_response_bytes: the most of a response body read (the rest is dropped).
        transport: an httpx transport (tests); default a real network one.
    """

    def __init__(
        self,
        guard: TargetGuard,
        *,
        timeout_s: float,
        max_response_bytes: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.guard = guard
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
            transport=transport,
            trust_env=False,  # a proxy from the environment would bypass the pinning
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(self, url: str, headers: dict[str, str], body: bytes) -> AttemptResult:
        started = time.monotonic()

        def elapsed_ms() -> int:
            return int((time.monotonic() - started) * 1000)

        try:
            async with asyncio.timeout(self.timeout_s):
                target = await self.guard.resolve(url)
                request_headers = {
                    **headers,
                    "content-type": "application/json",
                    "user-agent": USER_AGENT,
                    "host": target.host_header(),
                }
                extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
                async with self._client.stream(
                    "POST",
                    target.connect_url(),
                    content=body,
                    headers=request_headers,
                    extensions=extensions,
                ) as response:
                    read = 0
                    async for chunk in response.aiter_raw():
                        read += len(chunk)
                        if read >= self.max_response_bytes:
                            break
                    status = response.status_code
                    retry_after = parse_retry_after(
                        response.headers.get("retry-after"), now_s=time.time()
                    )
        except TargetRefused as exc:
            return AttemptResult(False, None, f"target refused: {exc.message}", elapsed_ms())
        except TimeoutError:
            return AttemptResult(False, None, f"timed out after {self.timeout_s:g} s", elapsed_ms())
        except httpx.TimeoutException:
            return AttemptResult(False, None, f"timed out after {self.timeout_s:g} s", elapsed_ms())
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            return AttemptResult(False, None, f"{type(exc).__name__}: {reason}", elapsed_ms())
        except OSError as exc:
            return AttemptResult(False, None, f"{type(exc).__name__}: {exc}", elapsed_ms())
        if 200 <= status < 300:
            return AttemptResult(True, status, None, elapsed_ms())
        if 300 <= status < 400:
            error = f"HTTP {status}: redirects are not followed"
        else:
            error = f"HTTP {status}"
        return AttemptResult(False, status, error, elapsed_ms(), retry_after)
