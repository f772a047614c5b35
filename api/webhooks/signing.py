"""Standard Webhooks signatures: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature``.

The signed content is ``{id}.{timestamp}.{body}``; the signature is ``v1,`` + base64 of its
HMAC-SHA256 under the secret's key. A secret is ``whsec_`` + base64 of 24 random bytes (the
key is the decoded bytes). During a rotation's grace period a delivery carries one signature
per secret, space-separated; a receiver accepts a delivery when any of them verifies. See
https://www.standardwebhooks.com/ — the tests check these headers with the reference
``standardwebhooks`` package.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable

__all__ = [
    "SECRET_PREFIX",
    "generate_secret",
    "secret_key",
    "sign",
    "signature_headers",
    "verify",
]

SECRET_PREFIX = "whsec_"


def generate_secret() -> str:
    """A new signing secret, ``whsec_`` + base64 of 24 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_...`` secret."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature of ``body`` sent as ``msg_id`` at ``timestamp`` (s)."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_headers(
    secrets_: Iterable[str], msg_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The three headers of one delivery attempt, signed with every secret given."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(s, msg_id, timestamp, body) for s in secrets_),
    }


def verify(
    secret: str,
    headers: dict[str, str],
    body: bytes,
    *,
    now_s: float,
    tolerance_s: float = 300.0,
) -> bool:
    """Whether ``headers`` carry a valid signature of ``body`` under ``secret``, in time.

    ``headers`` keys are lower-case. A timestamp further than ``tolerance_s`` from ``now_s``
    fails, which stops replays of an old delivery.
    """
    try:
        msg_id = headers["webhook-id"]
        timestamp = int(headers["webhook-timestamp"])
        offered = headers["webhook-signature"].split()
    except (KeyError, ValueError):
        return False
    if abs(now_s - timestamp) > tolerance_s:
        return False
    expected = sign(secret, msg_id, timestamp, body)
    return any(hmac.compare_digest(expected, candidate) for candidate in offered)
