"""What the predictor catches: recall and lead time by failure kind, and its false-alarm rate.

Read from a model card (``models/*.json``, written by ``forewarn train``, else the shipped one),
else the stated defaults below. Recall by kind is pooled over every held-out set the card
reports (the validation split and each evaluation fleet): caught / failures. Lead time by kind
is the validation split's median. The false-alarm rate is the highest any held-out set
reports (the conservative choice). A failure counts as caught only if it was alarmed at least
the card's ``lead_min_s`` (2 min) ahead, which is more than a migration needs.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROFILE", "KINDS", "PredictorProfile", "find_card", "from_card"]

KINDS = ("memory", "thermal", "nvlink", "pcie", "power_loss", "gpu_lost", "other")


@dataclass(frozen=True)
class PredictorProfile:
    """Per-kind recall (0-1) and median lead (s), false alarms per 1,000 GPU-days, source."""

    recall: Mapping[str, float]
    lead_median_s: Mapping[str, float | None]
    false_alarms_per_1000_gpu_days: float
    source: str
    notes: tuple[str, ...] = field(default=())

    def with_recall(self, overrides: Mapping[str, float]) -> PredictorProfile:
        unknown = set(overrides) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown failure kinds {sorted(unknown)} (known: {KINDS})")
        recall = {**self.recall, **overrides}
        return replace(self, recall=recall, source=self.source + " (recall overridden)")


# Stated defaults, used when no model card is found: the shape of what the shipped model
# measured (warning-less kinds are never caught).
DEFAULT_PROFILE = PredictorProfile(
    recall={
        "memory": 0.75,
        "thermal": 0.5,
        "nvlink": 0.8,
        "pcie": 0.6,
        "power_loss": 0.0,
        "gpu_lost": 0.0,
        "other": 0.0,
    },
    lead_median_s={
        "memory": 3600.0,
        "thermal": 180.0,
        "nvlink": 3600.0,
        "pcie": 1200.0,
        "power_loss": None,
        "gpu_lost": None,
        "other": None,
    },
    false_alarms_per_1000_gpu_days=2.0,
    source="stated defaults (no model card found)",
)


def find_card(start: Path | None = None) -> Path | None:
    """The newest model card in ``./models``, else the card of the model shipped with the
    predictor (``predictor/shipped/``, found without importing the predictor)."""
    dirs = [Path.cwd() / "models"]
    if start is not None:
        dirs += [p / "models" for p in start.resolve().parents]
    spec = importlib.util.find_spec("predictor")
    for location in (spec.submodule_search_locations or []) if spec else []:
        dirs.append(Path(location) / "shipped")
    for d in dirs:
        card = _newest_card(d)
        if card is not None:
            return card
    return None


def _newest_card(directory: Path) -> Path | None:
    cards = sorted(directory.glob("*.json")) if directory.is_dir() else []
    cards = [c for c in cards if _is_card(c)]
    return cards[-1] if cards else None


def _is_card(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("format") == "forewarn-model"
    except (OSError, ValueError):
        return False


def _false_alarm_rate(m: dict[str, Any]) -> float:
    """False alarms per 1,000 GPU-days that cost a pause for nothing: those on GPUs that did
    not fail within a day, where the set reports them (an early alarm moves a rank off a GPU
    that fails soon after; training fleets fail ten times as often as a real one, so their
    validation split is full of early alarms), else every false alarm."""
    rate = m.get("false_alarms_not_early_per_1000_gpu_days")
    if rate is None:
        rate = m.get("false_alarms_per_1000_gpu_days", 0.0)
    return float(rate)


def from_card(path: str | Path) -> PredictorProfile:
    """The profile measured on a model card's held-out sets (a card file or a directory)."""
    p = Path(path)
    if p.is_dir():
        found = _newest_card(p)
        if found is None:
            raise FileNotFoundError(f"no model card in {p}")
        p = found
    card: dict[str, Any] = json.loads(p.read_text())
    metrics = card.get("metrics", {})
    sets: list[tuple[str, dict[str, Any]]] = []
    if "validation" in metrics:
        sets.append(("validation", metrics["validation"]["model"]))
    for name, ev in metrics.get("evaluation", {}).items():
        sets.append((name, ev["model"]))
    if not sets:
        raise ValueError(f"{p}: the card reports no held-out metrics")
    caught = dict.fromkeys(KINDS, 0)
    failures = dict.fromkeys(KINDS, 0)
    for _, m in sets:
        for kind, b in m.get("by_kind", {}).items():
            if kind in caught:
                caught[kind] += int(b.get("caught", 0))
                failures[kind] += int(b.get("failures", 0))
    recall = {k: (caught[k] / failures[k] if failures[k] else 0.0) for k in KINDS}
    validation = metrics.get("validation", {}).get("model", {})
    overall_lead = validation.get("lead_time_median_s")
    lead = {
        k: (
            validation.get("by_kind", {}).get(k, {}).get("lead_time_median_s")
            if recall[k] > 0
            else None
        )
        for k in KINDS
    }
    lead = {k: (v if v is not None or recall[k] == 0 else overall_lead) for k, v in lead.items()}
    fa = max(_false_alarm_rate(m) for _, m in sets)
    notes = (
        f"recall pooled over {len(sets)} held-out sets: " + ", ".join(n for n, _ in sets),
        "failures per kind (caught/all): "
        + ", ".join(f"{k} {caught[k]}/{failures[k]}" for k in KINDS),
        "false alarms: the highest rate any held-out set reports, on GPUs that did not fail "
        "within a day",
    )
    return PredictorProfile(recall, lead, fa, source=str(p), notes=notes)
