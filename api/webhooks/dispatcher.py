"""The dispatcher: delivers the outbox to webhook subscriptions, in order, at least once.

Every service replica runs one :class:`Dispatcher` as a background task. Each tick it

1. finds how far the outbox is complete (``safe_seq``): on PostgreSQL a transaction may commit
   event 11 before event 10, so a gap in ``seq`` is waited on for ``gap_grace_s`` before it is
   passed; its ``seq`` values are watched for ``late_window_s`` more, and an event that
   commits into one after all is still queued (out of order) for the subscriptions that want
   it;
2. takes its lease on every enabled subscription no live replica holds, and renews its leases
   a third of the way through them (:func:`store.webhooks.claim_webhooks`), so a subscription
   is served by one replica and an event is delivered by one of them; a crashed replica's
   leases expire after ``lease_s``;
3. runs one worker per held subscription. A worker queues the subscription's new events as
   deliveries (moving its cursor in the same transaction) and sends them in event order,
   stopping at the first that fails: it is retried after an exponential backoff with jitter
   (at least what ``Retry-After`` asks), until ``horizon_s`` after it was queued, then given
   up. ``disable_after`` consecutive failed attempts disable the subscription and announce
   ``webhook.disabled``.

An attempt is recorded only after it ends, so an attempt cut short by a crash is made again
after the restart, with the same ``webhook-id`` (the event id): receivers de-duplicate on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import Engine

from api.routes._common import now_ms as wall_ms
from api.webhooks.rules import disable_reason, wants
from api.webhooks.sender import AttemptResult, Sender
from api.webhooks.signing import signature_headers
from forewarn.threads import to_thread_to_end
from store import webhooks as wstore
from store.outbox import emit_event, event_payload

__all__ = ["DispatchConfig", "Dispatcher", "next_attempt_ms"]

log = logging.getLogger("forewarn.webhooks")


@dataclass(frozen=True)
class DispatchConfig:
    """How deliveries are paced and bounded (see ``api.settings.Settings`` ``webhook_*``)."""

    timeout_s: float = 10.0
    max_response_bytes: int = 64 * 1024
    retry_base_s: float = 5.0
    retry_max_s: float = 3600.0
    horizon_s: float = 86400.0
    disable_after: int = 30
    poll_interval_s: float = 0.2
    lease_s: float = 30.0
    gap_grace_s: float = 10.0
    late_window_s: float = 600.0
    batch: int = 100
    record_batch: int = 50

    @classmethod
    def from_settings(cls, settings: Any) -> DispatchConfig:
        return cls(
            timeout_s=settings.webhook_timeout_s,
            max_response_bytes=settings.webhook_max_response_bytes,
            retry_base_s=settings.webhook_retry_base_s,
            retry_max_s=settings.webhook_retry_max_s,
            horizon_s=settings.webhook_retry_horizon_s,
            disable_after=settings.webhook_disable_after_failures,
            poll_interval_s=settings.webhook_poll_interval_s,
            lease_s=settings.webhook_lease_s,
        )


def next_attempt_ms(
    *,
    attempts: int,
    now_ms: int,
    queued_ms: int,
    config: DispatchConfig,
    retry_after_s: float | None = None,
    rng: Callable[[], float] = random.random,
) -> int | None:
    """When to retry after ``attempts`` failed attempts; None once past the horizon.

    The delay doubles from ``retry_base_s`` up to ``retry_max_s`` and is drawn uniformly from
    its upper half (jitter spreads receivers' recoveries); ``Retry-After`` raises it.
    """
    ceiling = min(config.retry_max_s, config.retry_base_s * 2 ** max(0, attempts - 1))
    delay_s = ceiling * (0.5 + 0.5 * rng())
    if retry_after_s is not None:
        delay_s = max(delay_s, min(retry_after_s, config.horizon_s))
    when = now_ms + int(delay_s * 1000)
    if when - queued_ms > config.horizon_s * 1000:
        return None
    return when


class Dispatcher:
    """Delivers webhook events from the outbox; run :meth:`run` as a task.

    Args:
        engine: the store's database.
        sender: sends attempts (carries the target guard, timeout and response cap).
        config: pacing and bounds.
        owner: this replica's lease name; default random.
    """

    def __init__(
        self,
        engine: Engine,
        sender: Sender,
        config: DispatchConfig,
        *,
        owner: str | None = None,
    ) -> None:
        self.engine = engine
        self.sender = sender
        self.config = config
        self.owner = owner or f"dispatch-{secrets.token_hex(6)}"
        self.safe_seq: int | None = None
        self._gaps: dict[int, float] = {}
        self._renew_at = 0.0  # monotonic time of the next lease renewal
        self._lease_deadline = 0.0  # our leases are surely valid until then (monotonic)
        self._late: dict[int, float] = {}  # seqs passed over while uncommitted -> when
        self._held: dict[str, wstore.Webhook] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}

    # The tick ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Tick until cancelled; then stop workers and release leases."""
        try:
            while True:
                try:
                    await self.tick()
                except Exception:  # the database may be away; try again next tick
                    log.exception("webhook dispatcher tick failed")
                await asyncio.sleep(self.config.poll_interval_s)
        finally:
            await self.stop()

    async def tick(self) -> None:
        advanced = await to_thread_to_end(self._advance_safe_seq)
        held = await to_thread_to_end(self._claim)
        self._held = {w["id"]: w for w in held}
        if self._late:
            await to_thread_to_end(self._queue_late)
        for webhook_id in list(self._workers):
            if webhook_id not in self._held or self._workers[webhook_id].done():
                task = self._workers.pop(webhook_id)
                self._wake.pop(webhook_id, None)
                if not task.done():
                    task.cancel()
        for webhook_id in self._held:
            if webhook_id not in self._workers:
                self._wake[webhook_id] = asyncio.Event()
                self._workers[webhook_id] = asyncio.create_task(
                    self._work(webhook_id), name=f"webhook-{webhook_id}"
                )
            elif advanced:
                self._wake[webhook_id].set()

    async def stop(self) -> None:
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        self._workers.clear()
        with contextlib.suppress(Exception):
            await to_thread_to_end(self._release)
        await self.sender.aclose()

    def _release(self) -> None:
        with self.engine.begin() as connection:
            wstore.release_webhooks(connection, owner=self.owner)

    def _claim(self) -> list[wstore.Webhook]:
        """Renew the leases a third of the way through them, take free subscriptions as
        they appear; otherwise only read what is held (an idle service writes nothing)."""
        now = time.monotonic()
        with self.engine.connect() as connection:
            if now < self._renew_at and not wstore.claimable(connection, now_ms=wall_ms()):
                return wstore.held_webhooks(connection, owner=self.owner)
        with self.engine.begin() as connection:
            held = wstore.claim_webhooks(
                connection,
                owner=self.owner,
                lease_ms=int(self.config.lease_s * 1000),
                now_ms=wall_ms(),
            )
        self._renew_at = now + self.config.lease_s / 3
        self._lease_deadline = now + self.config.lease_s
        return held

    def _advance_safe_seq(self) -> bool:
        """Move ``safe_seq`` over every committed event with no open gap below it."""
        with self.engine.connect() as connection:
            if self.safe_seq is None:
                cursors = [
                    w["cursor_seq"] for w in wstore.list_webhooks(connection) if w["enabled"]
                ]
                self.safe_seq = min(cursors) if cursors else wstore.max_outbox_seq(connection)
            seqs = wstore.outbox_seqs_after(connection, self.safe_seq)
        before, now = self.safe_seq, time.monotonic()
        for seq in seqs:
            if seq != self.safe_seq + 1:
                first_seen = self._gaps.setdefault(self.safe_seq + 1, now)
                if now - first_seen < self.config.gap_grace_s:
                    break  # an earlier transaction may still commit into the gap
                log.info("outbox seq %d..%d not committed; passed", self.safe_seq + 1, seq - 1)
                if seq - self.safe_seq <= 10_000:
                    self._late.update(dict.fromkeys(range(self.safe_seq + 1, seq), now))
            self.safe_seq = seq
        self._gaps = {k: v for k, v in self._gaps.items() if k > self.safe_seq}
        return self.safe_seq != before

    def _queue_late(self) -> None:
        now = time.monotonic()
        self._late = {s: t for s, t in self._late.items() if now - t < self.config.late_window_s}
        with self.engine.connect() as connection:
            events = wstore.events_by_seq(connection, sorted(self._late))
        if not events:
            return
        for webhook in self._held.values():
            wanted = [e for e in events if wants(webhook, e)]
            with self.engine.begin() as connection:
                wstore.queue_late(connection, webhook, wanted, owner=self.owner, now_ms=wall_ms())
        for event in events:
            self._late.pop(event["seq"], None)
            log.info("outbox event %s committed late; queued", event["id"])

    # A subscription's worker ------------------------------------------------------------

    async def _work(self, webhook_id: str) -> None:
        wake = self._wake[webhook_id]
        while webhook_id in self._held:
            wake.clear()
            try:
                wait_s = await self._serve(webhook_id)
            except Exception:
                log.exception("webhook %s: delivery round failed", webhook_id)
                wait_s = self.config.poll_interval_s * 5
            if wait_s is None:
                return  # lease lost or subscription disabled
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=max(wait_s, 0.0))

    async def _serve(self, webhook_id: str) -> float | None:
        """One round: queue new events, send what is due. Returns seconds to wait, or None."""
        webhook = self._held.get(webhook_id)
        if webhook is None:
            return None
        if self.safe_seq is not None and self.safe_seq > webhook["cursor_seq"]:
            await to_thread_to_end(self._fan_out, webhook, self.safe_seq)
        due = await to_thread_to_end(self._due, webhook_id)
        idle_s = max(self.config.lease_s / 3, self.config.poll_interval_s)
        accepted: list[wstore.Success] = []  # recorded in batches: one commit, not one each
        try:
            for delivery in due:
                now_ms = wall_ms()
                if delivery["next_attempt_ms"] > now_ms:
                    return min((delivery["next_attempt_ms"] - now_ms) / 1000, idle_s)
                current = self._held.get(webhook_id)
                if current is None:
                    return None
                if time.monotonic() + self.config.timeout_s >= self._lease_deadline:
                    # the lease could lapse during this attempt and another replica send it
                    # too: wait for the renewal instead
                    return self.config.poll_interval_s
                result = await self._attempt(current, delivery)
                if result.ok:
                    accepted.append(
                        wstore.Success(
                            **delivery,
                            attempt_ms=wall_ms() - result.latency_ms,
                            latency_ms=result.latency_ms,
                            status_code=result.status_code,
                        )
                    )
                    full = len(accepted) >= self.config.record_batch
                    if full and not await self._flush(accepted):
                        return None
                    continue
                if not await self._flush(accepted):
                    return None
                outcome, disabled = await to_thread_to_end(self._record, current, delivery, result)
                if not outcome["held"] or disabled:
                    if disabled:
                        log.warning(
                            "webhook %s disabled after %d failures", webhook_id, outcome["failures"]
                        )
                        self._held.pop(webhook_id, None)
                    return None
                return 0.0  # the next round waits for this delivery's retry time
        finally:
            # also when cancelled: what was accepted is recorded (else it is sent again)
            await asyncio.shield(self._flush(accepted))
        return idle_s if len(due) < self.config.batch else 0.0

    async def _flush(self, accepted: list[wstore.Success]) -> bool:
        if not accepted:
            return True
        batch = list(accepted)
        accepted.clear()

        def write() -> bool:
            with self.engine.begin() as connection:
                return wstore.record_successes(connection, batch, owner=self.owner)

        return await to_thread_to_end(write)

    def _fan_out(self, webhook: wstore.Webhook, up_to_seq: int) -> None:
        with self.engine.connect() as connection:
            events, new_cursor = wstore.events_to_fan_out(connection, webhook, up_to_seq=up_to_seq)
        wanted = [e for e in events if wants(webhook, e)]
        with self.engine.begin() as connection:
            wstore.queue_deliveries(
                connection,
                webhook,
                wanted,
                owner=self.owner,
                new_cursor=new_cursor,
                now_ms=wall_ms(),
            )

    def _due(self, webhook_id: str) -> list[wstore.DueDelivery]:
        with self.engine.connect() as connection:
            return wstore.due_deliveries(connection, webhook_id, limit=self.config.batch)

    async def _attempt(
        self, webhook: wstore.Webhook, delivery: wstore.DueDelivery
    ) -> AttemptResult:
        event = {
            "type": delivery["event_type"],
            "ts_ms": delivery["event_ts_ms"],
            "data": orjson.loads(delivery["event_data"]),
        }
        body = orjson.dumps(event_payload(event))
        now_s = time.time()
        keys = [webhook["secret"]]
        if webhook["previous_secret"] and (webhook["previous_secret_until_ms"] or 0) > now_s * 1000:
            keys.append(webhook["previous_secret"])
        headers = signature_headers(keys, delivery["event_id"], int(now_s), body)
        return await self.sender.send(webhook["url"], headers, body)

    def _record(
        self, webhook: wstore.Webhook, delivery: wstore.DueDelivery, result: AttemptResult
    ) -> tuple[wstore.AttemptOutcome, bool]:
        """Store the failed or given-up attempt; disable the subscription in the same
        transaction when its failures reach ``disable_after`` (announced as
        ``webhook.disabled``). Returns what was recorded and whether it disabled it."""
        now_ms = wall_ms()
        retry_at = None
        if not result.ok:
            retry_at = next_attempt_ms(
                attempts=delivery["attempts"] + 1,
                now_ms=now_ms,
                queued_ms=delivery["created_ms"],
                config=self.config,
                retry_after_s=result.retry_after_s,
            )
        with self.engine.begin() as connection:
            outcome = wstore.record_attempt(
                connection,
                delivery,
                owner=self.owner,
                ok=result.ok,
                status_code=result.status_code,
                error=result.error,
                latency_ms=result.latency_ms,
                attempt_ms=now_ms - result.latency_ms,
                next_attempt_ms=retry_at,
            )
            reason = disable_reason(
                ok=result.ok,
                failures=outcome["failures"],
                disable_after=self.config.disable_after,
                error=result.error,
            )
            if outcome["held"] and reason is not None:
                wstore.disable_webhook(connection, webhook["id"], reason=reason, now_ms=now_ms)
                emit_event(
                    connection,
                    "webhook.disabled",
                    {
                        "webhook_id": webhook["id"],
                        "consecutive_failures": outcome["failures"],
                        "last_error": result.error,
                        "last_status_code": result.status_code,
                    },
                )
        delivery["attempts"] += 1
        if retry_at is not None:
            delivery["next_attempt_ms"] = retry_at
        return outcome, outcome["held"] and reason is not None
