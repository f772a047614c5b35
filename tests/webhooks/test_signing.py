"""Our signatures verify with the reference implementation (the ``standardwebhooks`` package)."""

from __future__ import annotations

import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks import Webhook, WebhookVerificationError

from api.webhooks.signing import generate_secret, signature_headers, verify

_JSON_BODIES = st.dictionaries(
    st.text(max_size=12),
    st.one_of(
        st.integers(-(2**53), 2**53), st.floats(allow_nan=False, allow_infinity=False), st.text()
    ),
    max_size=6,
).map(orjson.dumps)


@settings(max_examples=50, deadline=None)
@given(body=_JSON_BODIES, msg_id=st.from_regex(r"msg_[0-9a-f]{12,28}", fullmatch=True))
def test_reference_library_verifies_our_signatures(body: bytes, msg_id: str) -> None:
    secret = generate_secret()
    headers = signature_headers([secret], msg_id, int(time.time()), body)
    Webhook(secret).verify(body, headers)
    assert verify(secret, headers, body, now_s=time.time())


def test_reference_signature_equals_ours() -> None:
    secret, body, now = generate_secret(), b'{"type":"gpu.failed"}', int(time.time())
    from datetime import UTC, datetime

    theirs = Webhook(secret).sign("msg_1", datetime.fromtimestamp(now, UTC), body.decode())
    assert signature_headers([secret], "msg_1", now, body)["webhook-signature"] == theirs


def test_tampering_wrong_secret_and_old_timestamps_fail() -> None:
    secret, body, now = generate_secret(), b'{"a":1}', int(time.time())
    headers = signature_headers([secret], "msg_x", now, body)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(b'{"a":2}', headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(generate_secret()).verify(body, headers)
    old = signature_headers([secret], "msg_x", now - 3600, body)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body, old)
    assert not verify(secret, old, body, now_s=now)
    assert not verify(secret, headers, b"other", now_s=now)


def test_two_secrets_during_rotation_each_verify() -> None:
    old, new, body = generate_secret(), generate_secret(), b"{}"
    headers = signature_headers([new, old], "msg_r", int(time.time()), body)
    assert len(headers["webhook-signature"].split(" ")) == 2
    Webhook(old).verify(body, headers)
    Webhook(new).verify(body, headers)
