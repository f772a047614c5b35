"""Prometheus metrics of one app instance (its own registry: no global state at import)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

__all__ = [
    "PER_GPU_FAMILIES",
    "IngestCounters",
    "Metrics",
    "MetricsView",
    "TimingMiddleware",
    "control_families",
]

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

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        per_gpu: bool,
        max_gpu_series: int,
        extra: Iterable[Metric] = (),
    ) -> None:
        self.registry = registry
        self.per_gpu = per_gpu
        self.max_gpu_series = max_gpu_series
        self.extra = list(extra)

    def collect(self) -> Any:
        for family in (*self.registry.collect(), *self.extra):
            if family.name in PER_GPU_FAMILIES:
                if not self.per_gpu:
                    continue
                if len(family.samples) > self.max_gpu_series:
                    top = sorted(family.samples, key=lambda s: s.value, reverse=True)
                    family.samples = top[: self.max_gpu_series]
            yield family


def control_families(
    status: dict[str, Any], *, leads: bool, risks: Iterable[tuple[str, int, float]]
) -> list[Metric]:
    """The control loop's families, from the status it published (:func:`store.control.
    read_status`) and the stored scores: ``forewarn_control_leader`` (1 on the replica whose
    loop leads), and on that replica ``forewarn_scorer_tick_seconds`` (its loop's ticks),
    ``forewarn_control_behind`` (its last tick read its limit of samples) and
    ``forewarn_gpu_risk{node,gpu}`` (``risks``: each scored GPU's latest risk)."""
    leader = GaugeMetricFamily(
        "forewarn_control_leader", "1 if this replica runs the control loop."
    )
    leader.add_metric([], 1.0 if leads else 0.0)
    if not leads:
        return [leader]
    durations = status.get("durations") or {}
    buckets, seen = [], 0
    for bound, count in zip(durations.get("le", []), durations.get("per", []), strict=False):
        seen += int(count)
        buckets.append((repr(float(bound)), seen))
    buckets.append(("+Inf", int(durations.get("count", 0))))
    ticks = HistogramMetricFamily(
        "forewarn_scorer_tick_seconds",
        "Duration of one control-loop tick (read, score, decide, write).",
        buckets=buckets,
        sum_value=float(durations.get("sum", 0.0)),
    )
    behind = GaugeMetricFamily(
        "forewarn_control_behind",
        "1 if the loop's last tick read its limit of samples: it scores the fleet late.",
    )
    behind.add_metric([], 1.0 if status.get("behind") else 0.0)
    risk = GaugeMetricFamily(
        "forewarn_gpu_risk", "Latest risk score per GPU.", labels=["node", "gpu"]
    )
    for node, gpu, value in risks:
        if value is not None:
            risk.add_metric([node, str(gpu)], float(value))
    return [leader, ticks, behind, risk, *_sharing_families(status.get("partition"))]


def _sharing_families(partition: Any) -> list[Metric]:
    """With partitioned scoring (docs/control.md): the live loops sharing it, the buckets each
    gained and still warms, and each follower's last tick and how old its scores were at the
    leader's last tick."""
    if not isinstance(partition, dict):
        return []
    members = GaugeMetricFamily(
        "forewarn_scoring_members", "Control loops sharing the fleet's scoring (live)."
    )
    members.add_metric([], float(len(partition.get("members") or [])))
    warming = GaugeMetricFamily(
        "forewarn_scoring_warming_buckets",
        "Buckets a loop gained and still warms (their GPUs are not scored yet).",
        labels=["member"],
    )
    warming.add_metric([str(partition.get("member", ""))], float(partition.get("warming") or 0))
    age = GaugeMetricFamily(
        "forewarn_scoring_follower_age_seconds",
        "Age of each follower's newest scores at the leader's last tick.",
        labels=["member"],
    )
    tick = GaugeMetricFamily(
        "forewarn_scoring_follower_tick_seconds",
        "Duration of each follower's last whole tick (read, score, publish).",
        labels=["member"],
    )
    for member, seen in (partition.get("followers") or {}).items():
        if not isinstance(seen, dict):
            continue
        for family, key in ((age, "age_s"), (tick, "tick_s"), (warming, "warming")):
            if isinstance(seen.get(key), int | float):
                family.add_metric([str(member)], float(seen[key]))
    return [members, warming, age, tick]
