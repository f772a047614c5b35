"""Prometheus metrics of one app instance (its own registry: no global state at import)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["PER_GPU_FAMILIES", "IngestCounters", "Metrics", "MetricsView", "TimingMiddleware"]

PER_GPU_FAMILIES = frozenset({"forewarn_gpu_risk"})
"""Families with a series per GPU: they name nodes and say which GPUs are failing."""


class IngestCounters(NamedTuple):
    """The ingest metrics' labelled children, looked up once per app rather than per batch."""

    batches_2xx: Any
    batches_4xx: Any
    stored: Any
    duplicate: Any
    rejected: Any
    events_stored: Any
    events_duplicate: Any
    events_rejected: Any


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.samples = Counter(
            "forewarn_ingest_samples",
            "GPU samples received, by outcome (stored, duplicate, rejected).",
            ["outcome"],
            registry=self.registry,
        )
        self.events = Counter(
            "forewarn_ingest_events",
            "Events received, by outcome (stored, duplicate, rejected).",
            ["outcome"],
            registry=self.registry,
        )
        self.batches = Counter(
            "forewarn_ingest_batches",
            "Ingest requests, by status class.",
            ["status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "forewarn_http_request_duration_seconds",
            "HTTP request latency by route.",
            ["method", "route", "status"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.gpus = Gauge(
            "forewarn_gpus_known", "GPUs with at least one stored sample.", registry=self.registry
        )
        self.ingest = IngestCounters(
            self.batches.labels("2xx"),
            self.batches.labels("4xx"),
            *(self.samples.labels(k) for k in ("stored", "duplicate", "rejected")),
            *(self.events.labels(k) for k in ("stored", "duplicate", "rejected")),
        )


class TimingMiddleware:
    """Pure ASGI middleware timing every HTTP request by its route template."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def record_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.latency.labels(scope["method"], path, str(status["code"])).observe(
                time.perf_counter() - start
            )


class MetricsView:
    """What one ``/metrics`` answer shows of a registry (``generate_latest`` takes it).

    Args:
        registry: the app's registry.
        per_gpu: include the :data:`PER_GPU_FAMILIES` (a ``read`` token asked).
        max_gpu_series: at most this many series of each per-GPU family, the highest values.
    """

    def __init__(self, registry: CollectorRegistry, *, per_gpu: bool, max_gpu_series: int) -> None:
        self.registry = registry
        self.per_gpu = per_gpu
        self.max_gpu_series = max_gpu_series

    def collect(self) -> Any:
        for family in self.registry.collect():
            if family.name in PER_GPU_FAMILIES:
                if not self.per_gpu:
                    continue
                if len(family.samples) > self.max_gpu_series:
                    top = sorted(family.samples, key=lambda s: s.value, reverse=True)
                    family.samples = top[: self.max_gpu_series]
            yield family
