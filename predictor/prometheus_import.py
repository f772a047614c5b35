"""A fleet's own history: dcgm-exporter series kept in Prometheus, turned into a dataset.

``import_prometheus(url, out_dir, since_ms=, until_ms=)`` asks Prometheus' HTTP API
(``GET /api/v1/query_range``) for every ``DCGM_FI_*`` series the collector's dcgm-exporter
source knows (:data:`collector.dcgm_exporter.DCGM_FIELDS`, plus ``DCGM_FI_DEV_FB_FREE``,
``DCGM_FI_DEV_FB_RESERVED`` and ``DCGM_FI_DEV_XID_ERRORS``), joins them by
(``Hostname``, ``gpu``) label — ``instance`` without its port when a series has no
``Hostname`` — and writes a dataset in the one format of :mod:`forewarn.datasets`: one sample
row per GPU and evaluation step (``step``), counters as nullable integers, fields the exporter
does not export as nulls; Xid changes as ``xid`` events; failures from a labels CSV
(:func:`sim.csv_import.read_failures_csv`'s columns) or, without one, from the heuristic of
:mod:`predictor.heuristic_labels`. The manifest records the query and the label source.

The time range is fetched in chunks of at most ``max_points`` (11,000, Prometheus' limit)
steps and, once the first (short) chunk has shown how many GPUs there are, at most about
``rows_per_chunk`` sample rows (GPUs x steps); each chunk becomes one Parquet part, so memory
is bounded by one chunk whatever the range.
The values are Prometheus' evaluations at each step: the last scrape at most 5 minutes
(Prometheus' lookback) before it, so a ``step`` shorter than the scrape interval repeats
readings. ``transport`` takes an ``httpx`` transport (tests: ``httpx.MockTransport``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd

from collector.dcgm_exporter import DCGM_FIELDS
from forewarn import __version__
from forewarn.datasets import FAILURE_COLUMNS, SAMPLE_COLUMNS, sample_dtypes
from forewarn.errors import InvalidInput, NotFound, SourceUnavailable
from predictor.heuristic_labels import HeuristicRules, LabelTracker
from sim.csv_import import read_failures_csv
from sim.dataset import write_parquet_frame

__all__ = ["MAX_POINTS", "ROWS_PER_CHUNK", "SERIES", "ImportResult", "chunks", "import_prometheus"]

MAX_POINTS = 11_000
"""Prometheus refuses a range query of more points per series than this."""
ROWS_PER_CHUNK = 500_000
"""Sample rows (GPUs x steps) fetched and joined at a time: bounds the importer's memory."""
FIRST_CHUNK_STEPS = 100
"""The first request's steps, short: it tells how many GPUs there are."""
SERIES: tuple[str, ...] = (
    *DCGM_FIELDS,
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_XID_ERRORS",
)
"""Every series asked for, in the collector's order (of two names for a field, the first)."""
_PRIORITY = {name: i for i, name in enumerate(SERIES)}


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_prometheus` wrote."""

    path: Path
    samples: int
    events: int
    failures: int
    manifest: dict[str, Any]


def chunks(
    since_ms: int, until_ms: int, step_ms: int, steps: Callable[[], int]
) -> Iterator[tuple[int, int]]:
    """(start, end) in ms of each request, aligned on ``since + k * step``, together covering
    ``[since, until]`` with no step twice; ``steps()``, asked before each request, says how
    many steps it may hold (so later requests can grow or shrink)."""
    if step_ms <= 0:
        raise InvalidInput("step must be positive")
    start = since_ms
    while start <= until_ms:
        n = steps()
        if n < 1:
            raise InvalidInput("a request must hold at least one step")
        end = min(start + step_ms * (n - 1), until_ms)
        yield start, end
        start = end + step_ms


class _Prometheus:
    def __init__(self, url: str, timeout_s: float, transport: httpx.BaseTransport | None):
        self.url = url.rstrip("/")
        self.requests = 0
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s), transport=transport)

    def query_range(self, query: str, start_ms: int, end_ms: int, step_ms: int) -> list[Any]:
        params = {
            "query": query,
            "start": f"{start_ms / 1000:.3f}",
            "end": f"{end_ms / 1000:.3f}",
            "step": f"{step_ms / 1000:g}s",
        }
        self.requests += 1
        try:
            r = self._http.get(f"{self.url}/api/v1/query_range", params=params)
        except httpx.HTTPError as exc:
            raise SourceUnavailable(f"cannot reach Prometheus at {self.url}: {exc}") from None
        try:
            body = r.json()
        except ValueError:
            raise InvalidInput(
                f"{self.url} answered {r.status_code} without Prometheus JSON: {r.text[:200]!r}"
            ) from None
        if r.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
            err = body.get("error", body) if isinstance(body, dict) else body
            raise InvalidInput(f"Prometheus refused {query!r} ({r.status_code}): {err}")
        data = body.get("data") or {}
        if data.get("resultType") != "matrix":
            raise InvalidInput(f"Prometheus answered {data.get('resultType')!r}, not a matrix")
        return list(data.get("result") or [])

    def close(self) -> None:
        self._http.close()


def _node(labels: dict[str, str]) -> str | None:
    host = labels.get("Hostname")
    if host:
        return host
    instance = labels.get("instance", "")
    return instance.rsplit(":", 1)[0] if instance else None


def _long(prom: _Prometheus, selector: str, start: int, end: int, step: int) -> pd.DataFrame:
    """Every point of every series in one chunk: node, gpu, uuid, series, ts_ms, value."""
    parts = []
    for name in SERIES:
        for series in prom.query_range(f"{name}{selector}", start, end, step):
            labels = series.get("metric") or {}
            gpu, node = str(labels.get("gpu", "")), _node(labels)
            if not gpu.isdigit() or int(gpu) > 255 or not node:
                continue
            points = series.get("values") or []
            if not points:
                continue
            arr = np.asarray(points, dtype=object)
            ts = np.round(arr[:, 0].astype(np.float64) * 1000).astype(np.int64)
            values = pd.to_numeric(pd.Series(arr[:, 1]), errors="coerce").to_numpy(np.float64)
            keep = np.isfinite(values)
            parts.append(
                pd.DataFrame(
                    {
                        "node": node,
                        "gpu": int(gpu),
                        "uuid": labels.get("UUID") or "",
                        "series": name,
                        "ts_ms": ts[keep],
                        "value": values[keep],
                    }
                )
            )
    if not parts:
        return pd.DataFrame(columns=["node", "gpu", "uuid", "series", "ts_ms", "value"])
    return pd.concat(parts, ignore_index=True)


def _wide(long: pd.DataFrame) -> pd.DataFrame:
    """One row per (node, gpu, ts_ms) in the dataset's columns and dtypes."""
    hw = long[long["series"].isin(list(DCGM_FIELDS))].copy()
    hw["field"] = hw["series"].map({k: v[0] for k, v in DCGM_FIELDS.items()})
    hw["prio"] = hw["series"].map(_PRIORITY)
    hw = hw.sort_values("prio", kind="stable").drop_duplicates(
        ["node", "gpu", "ts_ms", "field"], keep="first"
    )
    keys = long[["node", "gpu", "ts_ms"]].drop_duplicates()
    wide = hw.pivot(index=["node", "gpu", "ts_ms"], columns="field", values="value")
    extra = long[long["series"].isin(["DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED"])]
    extra = extra.drop_duplicates(["node", "gpu", "ts_ms", "series"]).pivot(
        index=["node", "gpu", "ts_ms"], columns="series", values="value"
    )
    out = keys.set_index(["node", "gpu", "ts_ms"]).join(wide).join(extra).reset_index()
    if "DCGM_FI_DEV_FB_FREE" in out and "mem_used_mib" in out:
        total = out["mem_used_mib"] + out["DCGM_FI_DEV_FB_FREE"]
        if "DCGM_FI_DEV_FB_RESERVED" in out:
            total = total + out["DCGM_FI_DEV_FB_RESERVED"].fillna(0.0)
        out["mem_total_mib"] = (
            out["mem_total_mib"].fillna(total) if "mem_total_mib" in out else total
        )
    uuid = long[long["uuid"] != ""].drop_duplicates(["node", "gpu"]).set_index(["node", "gpu"])
    out = out.join(uuid["uuid"], on=["node", "gpu"])
    frame = pd.DataFrame(index=out.index)
    for col, dtype in sample_dtypes().items():
        if col == "vendor":
            frame[col] = "nvidia"
        elif col not in out:
            empty = np.nan if dtype == "float64" else None if dtype == "str" else pd.NA
            frame[col] = pd.Series(empty, index=out.index, dtype=dtype)
        elif dtype == "boolean":
            frame[col] = (out[col] != 0).astype("boolean").mask(out[col].isna())
        elif dtype == "Int64":
            frame[col] = out[col].round().astype("Int64")
        else:
            frame[col] = out[col]
    frame = frame.astype(sample_dtypes())[list(SAMPLE_COLUMNS)]
    return frame.sort_values(["ts_ms", "node", "gpu"], kind="stable").reset_index(drop=True)


def import_prometheus(
    url: str,
    out_dir: str | Path,
    *,
    since_ms: int,
    until_ms: int,
    step_s: float = 15.0,
    selector: str = "",
    labels_csv: str | Path | None = None,
    rules: HeuristicRules | None = None,
    max_points: int = MAX_POINTS,
    rows_per_chunk: int = ROWS_PER_CHUNK,
    timeout_s: float = 60.0,
    transport: httpx.BaseTransport | None = None,
) -> ImportResult:
    """Write the dataset of ``[since_ms, until_ms]`` to ``out_dir``.

    Args:
        url: Prometheus' base URL, e.g. ``http://prometheus:9090``.
        out_dir: the dataset directory (created; its sample parts are replaced).
        since_ms, until_ms: the range, ms since the epoch (UTC).
        step_s: query resolution, seconds (one sample row per GPU and step).
        selector: label matchers added to every series, e.g. ``{job="dcgm"}``.
        labels_csv: failures CSV (``node,gpu,ts,kind,...``); None: the heuristic.
        rules: the heuristic's knobs (None: :class:`HeuristicRules` defaults).
        max_points: at most this many steps per request (Prometheus refuses over 11,000).
        rows_per_chunk: about this many sample rows (GPUs x steps) per chunk (memory).
        timeout_s: limit for one request, seconds.
        transport: an httpx transport (tests); default: the network.

    Raises:
        InvalidInput: a bad range or step, a query Prometheus refuses, a bad labels CSV.
        SourceUnavailable: Prometheus cannot be reached.
        NotFound: no DCGM series with ``gpu`` and ``Hostname``/``instance`` labels in the range.
    """
    step_ms = round(step_s * 1000)
    if step_ms < 1:
        raise InvalidInput("--step must be positive")
    if until_ms <= since_ms:
        raise InvalidInput("--until must be after --since")
    if selector and not (selector.startswith("{") and selector.endswith("}")):
        raise InvalidInput('--selector must be label matchers in braces, e.g. {job="dcgm"}')
    out = Path(out_dir)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    for old in (out / "samples").glob("part-*.parquet"):
        old.unlink()
    tracker = LabelTracker(rules, step_ms=step_ms)
    prom = _Prometheus(url, timeout_s, transport)
    part, n_samples, events, found = 0, 0, [], set()
    gpus: dict[tuple[str, int], str] = {}
    first_ts = last_ts = None
    part_empty = [0]  # requests that came back empty before any GPU was seen

    def steps() -> int:
        if not gpus:  # nothing seen yet: short requests, doubling while they come back empty
            return min(max_points, FIRST_CHUNK_STEPS * 2 ** min(part_empty[0], 10))
        return max(1, min(max_points, rows_per_chunk // len(gpus)))

    try:
        for start, end in chunks(since_ms, until_ms, step_ms, steps):
            long = _long(prom, selector, start, end, step_ms)
            if not len(long):
                part_empty[0] += 1
                continue
            found.update(long["series"].unique().tolist())
            xid = long[long["series"] == "DCGM_FI_DEV_XID_ERRORS"]
            samples = _wide(long[long["series"] != "DCGM_FI_DEV_XID_ERRORS"])
            events.append(tracker.observe(samples, xid))
            if not len(samples):
                continue
            for node, gpu, uuid in (
                samples[["node", "gpu", "uuid"]].drop_duplicates().itertuples(index=False)
            ):
                u = "" if pd.isna(uuid) else str(uuid)
                if u or (node, gpu) not in gpus:
                    gpus[(str(node), int(gpu))] = u
            write_parquet_frame(samples, out / "samples" / f"part-{part:05d}.parquet")
            part += 1
            n_samples += len(samples)
            first_ts = int(samples["ts_ms"].min()) if first_ts is None else first_ts
            last_ts = int(samples["ts_ms"].max())
    finally:
        prom.close()
    if not n_samples or first_ts is None or last_ts is None:
        raise NotFound(
            f"Prometheus at {url} holds no DCGM_FI_DEV_* series with gpu and Hostname labels "
            f"between {_iso(since_ms)} and {_iso(until_ms)}"
            + (f" matching {selector}" if selector else ""),
            details={"series_found": sorted(found)},
        )
    ev = pd.concat(events, ignore_index=True).sort_values(["ts_ms", "node", "gpu"], kind="stable")
    if labels_csv is not None:
        failures = read_failures_csv(labels_csv)
        keys = [(str(n), int(g)) for n, g in zip(failures["node"], failures["gpu"], strict=True)]
        failures["uuid"] = pd.Series([gpus.get(k, "") for k in keys], dtype="str")
        label_info: dict[str, Any] = {
            "source": "csv",
            "path": str(labels_csv),
            "unknown_gpus": sum(k not in gpus for k in keys),
        }
    else:
        failures = tracker.failures(gpus)
        label_info = tracker.rules.describe()
    failures = failures[list(FAILURE_COLUMNS)]
    write_parquet_frame(ev.reset_index(drop=True), out / "events.parquet")
    write_parquet_frame(failures, out / "failures.parquet")
    per_node = pd.Series([n for n, _ in gpus]).value_counts()
    manifest: dict[str, Any] = {
        "format": "forewarn-dataset",
        "version": 1,
        "generator": f"forewarn prometheus-import {__version__}",
        "seed": 0,
        "gpus": len(gpus),
        "nodes": int(per_node.size),
        "gpus_per_node": int(per_node.max()),
        "start_ms": first_ts,
        "end_ms": last_ts,
        "interval_s": step_ms / 1000.0,
        "params": {},
        "source": {
            "prometheus": url,
            "since": _iso(since_ms),
            "until": _iso(until_ms),
            "step_s": step_ms / 1000.0,
            "selector": selector,
            "series": sorted(found),
            "requests": prom.requests,
            "max_points": max_points,
        },
        "labels": label_info,
        "counts": {"samples": n_samples, "events": len(ev), "failures": len(failures)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return ImportResult(out, n_samples, len(ev), len(failures), manifest)


def _iso(ms: int) -> str:
    return pd.Timestamp(ms, unit="ms", tz="UTC").isoformat()
