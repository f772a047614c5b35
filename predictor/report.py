"""The evaluation report: a model and the rule baseline on the same replay, side by side.

:func:`evaluate_dataset` replays a dataset through the live feature path, scores every up GPU
at every step with the model and the baseline, and returns the figures of both
(:func:`predictor.evaluate.metrics`), their recall/false-alarm curves, and the model's recall
at the baseline's own false-alarm rate (the fair comparison). :func:`plot_curves` draws the
curves to a PNG; :func:`format_table` prints the per-kind table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from predictor import baseline, evaluate
from predictor.budget import AlarmBudget, logit, replay
from predictor.dataset import Dataset
from predictor.features import FEATURE_NAMES, FEATURES, RULES
from predictor.floor import FLOOR_SCORE, floor_hits
from predictor.floor_budget import FloorBudget, floor_mask
from predictor.floor_budget import replay as replay_floor
from predictor.model import RiskModel
from predictor.scored import Scored, score_dataset

CAUSES: tuple[str, ...] = tuple(sorted({f.subject for f in FEATURES}))
"""What an alarm is blamed on: the subject of the feature that pushed its score up most."""
_SUBJECT = np.array([CAUSES.index(f.subject) for f in FEATURES])

__all__ = [
    "UNION_RULES",
    "Report",
    "evaluate_dataset",
    "format_table",
    "live_budget_metrics",
    "plot_curves",
]

UNION_RULES: tuple[str, ...] = ("remap",)
"""The rules whose alarms are added to the model's (``union``): a row remap pending or failed
is a hardware fact that fires hours before most memory failures, on few healthy GPUs."""


@dataclass
class Report:
    summary: dict[str, Any]
    model_curve: pd.DataFrame
    baseline_curve: pd.DataFrame
    scored: Scored


def _best_recall_within(points: pd.DataFrame, max_fa: float) -> dict[str, Any]:
    ok = points[points["false_alarms_per_1000_gpu_days"] <= max_fa + 1e-9]
    if not len(ok):
        return {"recall": 0.0, "recall_with_precursors": 0.0, "threshold": None}
    best = ok.sort_values(["recall_with_precursors", "recall"], ascending=False).iloc[0]
    return {
        "recall": float(best["recall"]),
        "recall_with_precursors": float(best["recall_with_precursors"]),
        "threshold": float(best["threshold"]),
        "false_alarms_per_1000_gpu_days": float(best["false_alarms_per_1000_gpu_days"]),
    }


def raw_threshold(model: RiskModel) -> float:
    """The card's alarm threshold on the booster's own scale (the budget's fallback)."""
    raw = model.card.get("raw_threshold")
    if raw is not None:
        return float(raw)
    x, y = model.calibration_x, model.calibration_y
    if len(x) and y.max() >= model.threshold:
        return float(x[int(np.argmax(y >= model.threshold))])
    return float(model.threshold)


def _scorers(model: RiskModel, cause_floor: float) -> dict[str, Callable[[np.ndarray], Any]]:
    """The booster's score, and the cause of every score above ``cause_floor`` (the subject
    of the feature with the largest attribution), sharing one prediction per batch."""
    last: dict[str, Any] = {}

    def raw(x: np.ndarray) -> np.ndarray:
        last["x"], last["raw"] = x, model.raw(x)
        return np.asarray(last["raw"])

    def cause(x: np.ndarray) -> np.ndarray:
        r = last["raw"] if last.get("x") is x else model.raw(x)
        out = np.full(len(x), np.nan)
        hot = np.flatnonzero(r >= cause_floor)
        cap = max(len(x) // 50, 1)  # attributions cost: at most the top 2 % of a batch
        if len(hot) > cap:
            hot = hot[np.argsort(r[hot])[-cap:]]
        if len(hot):
            contrib = model.contributions(x[hot])[:, :-1]
            out[hot] = _SUBJECT[np.argmax(contrib, axis=1)]
        return out

    def floor(x: np.ndarray) -> np.ndarray:  # the tripped rules (> 0: any), floor_mask's bits
        return floor_mask(floor_hits(x)).astype(np.float64)

    out: dict[str, Callable[[np.ndarray], Any]] = {
        "model_raw": raw,
        "cause": cause,
        "floor": floor,
    }
    for r in RULES:
        out[f"rule_{r}"] = _column(FEATURE_NAMES.index(f"rule_{r}"))
    return out


def _column(i: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: x[:, i]


def _at_rate(table: evaluate.ScoreTable, column: str, curve: pd.DataFrame, fa: float) -> Any:
    """Figures of ``column`` at its best threshold within ``fa`` false alarms (None: none)."""
    ok = curve[curve["false_alarms_per_1000_gpu_days"] <= fa + 1e-9]
    if not len(ok):
        return None
    thr = evaluate.choose_threshold(ok, fa)
    return evaluate.metrics(table, column, thr)


def evaluate_dataset(
    dataset: Dataset,
    model: RiskModel,
    *,
    threshold: float | None = None,
    budget: float | None = 2.0,
    union_rules: tuple[str, ...] = UNION_RULES,
    step_s: float = 60.0,
    params: evaluate.Params | None = None,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Model and baseline figures on one dataset: the model at its card's threshold (or
    ``threshold``), and with ``budget`` false alarms per 1,000 GPU-days met live by an
    :class:`AlarmBudget` (each step judged by the threshold known before it), beside the
    same budget in hindsight and the rules at the same false-alarm rate; and the *union* —
    an alarm when the model (live budget) or one of ``union_rules`` fires — beside the best
    rule setting (any rule, 2+ rules, ..., or one rule alone) within the union's rate."""
    params = params or evaluate.Params()
    thr = model.threshold if threshold is None else float(threshold)
    raw_thr = raw_threshold(model)
    scored = score_dataset(
        dataset,
        _scorers(model, 0.5 * raw_thr),
        step_s=step_s,
        horizon_s=params.horizon_s,
        progress=progress,
    )
    scored.rows["model"] = model.calibrate(scored.rows["model_raw"].to_numpy())
    hit = scored.rows["floor"].to_numpy() > 0
    scored.rows["model_floor"] = np.where(
        hit, np.fmax(scored.rows["model"].to_numpy(), thr), scored.rows["model"].to_numpy()
    )
    table = evaluate.ScoreTable(scored.rows, scored.failures, step_s=step_s, params=params)
    m = evaluate.metrics(table, "model", thr, cause="cause", causes=CAUSES)
    m_floor = evaluate.metrics(table, "model_floor", thr)
    b = evaluate.metrics(table, "baseline", baseline.THRESHOLD)
    m_curve = evaluate.curve(table, "model")
    raw_curve = evaluate.curve(table, "model_raw")
    b_curve = evaluate.curve(table, "baseline", np.array([1.0, 2.0, 3.0, 4.0]))
    fa_base = b["false_alarms_per_1000_gpu_days"] or 0.0
    at_base = _at_rate(table, "model_raw", raw_curve, fa_base)
    summary = {
        "model": m,
        "model_floor": m_floor,
        "baseline": b,
        "threshold": thr,
        "model_at_baseline_false_alarm_rate": _best_recall_within(m_curve, fa_base),
        "model_at_baseline_false_alarm_rate_by_kind": None
        if at_base is None
        else at_base["by_kind"],
        "dataset": {
            "path": str(dataset.path),
            "seed": dataset.manifest.get("seed"),
            "gpus": dataset.manifest.get("gpus"),
            "days": (dataset.end_ms - dataset.start_ms) / 86_400_000,
            "interval_s": dataset.manifest.get("interval_s"),
        },
        "step_s": step_s,
        "model_card": {k: model.card.get(k) for k in ("created_at", "forewarn_version")},
    }
    if budget is not None:
        summary.update(_budget_figures(table, scored, raw_curve, b_curve, budget, raw_thr))
        summary.update(_union_figures(table, union_rules))
        summary.update(_floor_figures(table, scored, budget, raw_thr))
    return Report(summary, m_curve, b_curve, scored)


def _budget_figures(
    table: evaluate.ScoreTable,
    scored: Scored,
    raw_curve: pd.DataFrame,
    b_curve: pd.DataFrame,
    budget: float,
    fallback: float,
) -> dict[str, Any]:
    at_budget = live_budget_metrics(table, scored.failures, AlarmBudget(budget, fallback=fallback))
    hindsight_thr = evaluate.choose_threshold(raw_curve, budget)
    hindsight = evaluate.metrics(table, "model_raw", hindsight_thr)
    realised = at_budget["false_alarms_per_1000_gpu_days"] or 0.0
    rules = _at_rate(table, "baseline", b_curve, max(realised, budget))
    return {
        "budget": budget,
        "model_at_budget": at_budget,
        "model_at_budget_hindsight": hindsight,
        "baseline_at_budget": rules,
    }


def live_budget_metrics(
    table: evaluate.ScoreTable, failures: pd.DataFrame, live: AlarmBudget
) -> dict[str, Any]:
    """The model met live by the fresh budget ``live``: its rows replayed in time order, each
    step judged by the threshold known before it, failed GPUs discarded as they fail. Adds the
    margin column ``model_budget`` (logit of the score less that of the threshold) to
    ``table.rows``."""
    rows = table.rows
    f = failures[failures["slot"] >= 0]
    thr = replay(
        live,
        rows["ts_ms"].to_numpy(),
        rows["slot"].to_numpy(),
        rows["model_raw"].to_numpy(),
        failures=(f["ts_ms"].to_numpy(np.int64), f["slot"].to_numpy(np.int64)),
    )
    rows["model_budget"] = logit(rows["model_raw"].to_numpy()) - logit(thr)
    at_budget = evaluate.metrics(table, "model_budget", 0.0, cause="cause", causes=CAUSES)
    at_budget["threshold_final"] = live.threshold
    at_budget["budget"] = live.summary()
    return at_budget


def _floor_figures(
    table: evaluate.ScoreTable, scored: Scored, budget: float, fallback: float
) -> dict[str, Any]:
    """The model with the rules as a floor (:mod:`predictor.floor`), met live by the budget:
    the budget observes a floored row at :data:`FLOOR_SCORE` (the rules' false alarms use up
    the budget too), and a floored row is alarmed at any threshold; a rule whose own false
    alarms exceed the budget stops being a floor as the live loop's :class:`FloorBudget`
    decides, replayed in time order. Beside it the rules at the same operating point (the
    best rule setting within its realised false-alarm rate) and at their own (any rule),
    caught per failure kind."""
    rows = table.rows
    raw = rows["model_raw"].to_numpy()
    f = scored.failures[scored.failures["slot"] >= 0]
    failures = (f["ts_ms"].to_numpy(np.int64), f["slot"].to_numpy(np.int64))
    masks = rows["floor"].to_numpy().astype(np.int64)
    rules = FloorBudget(budget)
    active, released, forgot = replay_floor(
        rules, rows["ts_ms"].to_numpy(), rows["slot"].to_numpy(), masks, failures=failures
    )
    hit = (masks & active) != 0
    live = AlarmBudget(budget, fallback=fallback)
    thr = replay(
        live,
        rows["ts_ms"].to_numpy(),
        rows["slot"].to_numpy(),
        np.where(hit, FLOOR_SCORE, raw),
        failures=(np.r_[failures[0], released[0]], np.r_[failures[1], released[1]]),
        forget=(forgot[0], forgot[1], FLOOR_SCORE),
    )
    margin = logit(raw) - logit(thr)
    rows["model_floor_budget"] = np.where(hit, np.fmax(margin, 0.0), margin)
    at_budget = evaluate.metrics(table, "model_floor_budget", 0.0, cause="cause", causes=CAUSES)
    at_budget["threshold_final"] = live.threshold
    at_budget["floor_budget"] = rules.summary()
    fa = at_budget["false_alarms_per_1000_gpu_days"] or 0.0
    within = [
        (n, m)
        for n, m in _rule_settings(table)
        if (m["false_alarms_per_1000_gpu_days"] or 0.0) <= fa + 1e-9
    ]
    rules_at = None
    if within:
        name, best = max(
            within,
            key=lambda nm: (nm[1]["recall_with_precursors"] or 0.0, nm[1]["recall"] or 0.0),
        )
        rules_at = {**best, "setting": name}
    rules_own = evaluate.metrics(table, "baseline", baseline.THRESHOLD)
    kinds = sorted(set(at_budget["by_kind"]) | set(rules_own["by_kind"]))
    by_kind = {
        k: {
            "failures": at_budget["by_kind"].get(k, {}).get("failures", 0),
            "model_floor": at_budget["by_kind"].get(k, {}).get("caught", 0),
            "rules_at_rate": None
            if rules_at is None
            else rules_at["by_kind"].get(k, {}).get("caught", 0),
            "rules": rules_own["by_kind"].get(k, {}).get("caught", 0),
        }
        for k in kinds
    }
    below = [
        k for k, d in by_kind.items() if d["model_floor"] < max(d["rules"], d["rules_at_rate"] or 0)
    ]
    return {
        "model_floor_at_budget": at_budget,
        "baseline_at_floor_rate": rules_at,
        "floor_vs_rules_by_kind": by_kind,
        "floor_kinds_below_rules": below,
    }


def _rule_settings(table: evaluate.ScoreTable) -> list[tuple[str, dict[str, Any]]]:
    """Every operating point of the rules: 1..4 rules firing, and each rule alone."""
    out = [(f"{k}+ rules", evaluate.metrics(table, "baseline", float(k))) for k in (1, 2, 3, 4)]
    return out + [(f"rule {r}", evaluate.metrics(table, f"rule_{r}", 1.0)) for r in RULES]


def _union_figures(table: evaluate.ScoreTable, union_rules: tuple[str, ...]) -> dict[str, Any]:
    rows = table.rows
    hit = np.zeros(len(rows), dtype=bool)
    for r in union_rules:
        hit |= rows[f"rule_{r}"].to_numpy() > 0
    rows["union"] = np.where(hit, 1.0, np.minimum(rows["model_budget"].to_numpy(), 0.5))
    union = evaluate.metrics(table, "union", 0.0)
    union["rules"] = list(union_rules)
    settings = _rule_settings(table)
    fa = union["false_alarms_per_1000_gpu_days"] or 0.0

    def key(m: dict[str, Any]) -> tuple[float, float]:
        return (m["recall_with_precursors"] or 0.0, m["recall"] or 0.0)

    within = [(n, m) for n, m in settings if (m["false_alarms_per_1000_gpu_days"] or 0) <= fa]
    best = max(within, key=lambda nm: key(nm[1])) if within else None
    rules_at = None
    if best is not None:
        rules_at = {**best[1], "setting": best[0]}
    return {
        "union": union,
        "baseline_at_union_rate": rules_at,
        "rule_settings": {
            n: {
                "false_alarms_per_1000_gpu_days": m["false_alarms_per_1000_gpu_days"],
                "recall_with_precursors": m["recall_with_precursors"],
                "by_kind": {k: d["caught"] for k, d in m["by_kind"].items()},
            }
            for n, m in settings
        },
    }


def _pct(v: float | None) -> str:
    return "   -" if v is None else f"{100 * v:5.1f}%"


def _s(v: float | None) -> str:
    return "     -" if v is None else f"{v:6.0f}"


def _num(v: float | None, width: int, digits: int) -> str:
    if v is None or not np.isfinite(v):
        return f"{'-':>{width}}"
    return f"{v:{width}.{digits}f}"


def format_table(summary: dict[str, Any]) -> str:
    """The report as text: headline figures, then one line per failure kind."""
    m, b = summary["model"], summary["baseline"]
    lines = [
        f"threshold {summary['threshold']:.4f}   lead >= {m['lead_min_s']:.0f} s, "
        f"horizon {m['horizon_s']:.0f} s   {m['gpu_days']:.0f} GPU-days, "
        f"{m['failures']} failures ({m['failures_with_precursors']} with precursors)",
        "",
        f"{'':10} {'recall':>7} {'w/ prec':>7} {'lead med s':>10} {'lead p10 s':>10} "
        f"{'FA/1k GPU-d':>11} {'PR-AUC':>7}",
    ]
    for name, d in (("model", m), ("baseline", b)):
        lines.append(
            f"{name:10} {_pct(d['recall']):>7} {_pct(d['recall_with_precursors']):>7} "
            f"{_s(d['lead_time_median_s']):>10} {_s(d['lead_time_p10_s']):>10} "
            f"{_num(d['false_alarms_per_1000_gpu_days'], 11, 2)} {_num(d['pr_auc'], 7, 3)}"
        )
    at = summary["model_at_baseline_false_alarm_rate"]
    lines += [
        "",
        f"model at the baseline's false-alarm rate: recall {_pct(at['recall'])}, "
        f"with precursors {_pct(at['recall_with_precursors'])}",
        "",
        f"{'kind':12} {'failures':>8} {'w/ prec':>7} {'model':>13} {'baseline':>13}",
    ]
    for kind in sorted(set(m["by_kind"]) | set(b["by_kind"])):
        mk, bk = m["by_kind"].get(kind, {}), b["by_kind"].get(kind, {})
        lines.append(
            f"{kind:12} {mk.get('failures', 0):8d} {mk.get('with_precursors', 0):7d} "
            f"{mk.get('caught', 0):4d} {_pct(mk.get('recall')):>8} "
            f"{bk.get('caught', 0):4d} {_pct(bk.get('recall')):>8}"
        )
    lines += ["", "failures with precursors, by how long their precursors ran (model):"]
    for name, d in m.get("recall_by_precursor_lead", {}).items():
        lines.append(f"  {name:12} {d['caught']:4d} / {d['failures']:<4d} {_pct(d['recall'])}")
    ahead = m.get("caught_at_least_ahead", {})
    if ahead:
        lines.append(
            "caught at least this far ahead: "
            + ", ".join(f"{k} {_pct(v).strip()}" for k, v in ahead.items())
        )
    if "model_at_budget" in summary:
        lines += ["", *_budget_lines(summary)]
    judged = summary.get("model_at_budget") or m
    causes = judged.get("false_alarms_by_cause", {})
    if causes:
        lines += ["", "false alarms by cause (the signal that pushed the score most):"]
        lines += [f"  {k:28} {v:5d}" for k, v in causes.items()]
        early = judged.get("false_alarms_early", 0)
        lines.append(f"  of them early (the GPU failed within a day) {early:5d}")
    return "\n".join(lines)


def _budget_lines(summary: dict[str, Any]) -> list[str]:
    live, hind = summary["model_at_budget"], summary["model_at_budget_hindsight"]
    rules = summary.get("baseline_at_budget")
    out = [
        f"alarm budget {summary['budget']:g} false alarms / 1,000 GPU-days, met live on this "
        f"fleet's own scores (final threshold {live['threshold_final']:.4f}):",
        f"  live       recall w/ prec {_pct(live['recall_with_precursors'])}, "
        f"FA/1k GPU-d {_num(live['false_alarms_per_1000_gpu_days'], 6, 2).strip()}",
        f"  hindsight  recall w/ prec {_pct(hind['recall_with_precursors'])}, "
        f"FA/1k GPU-d {_num(hind['false_alarms_per_1000_gpu_days'], 6, 2).strip()}",
    ]
    if rules is None:
        out.append("  rules      no rule setting stays within that false-alarm rate")
    else:
        out.append(
            f"  rules      recall w/ prec {_pct(rules['recall_with_precursors'])}, "
            f"FA/1k GPU-d {_num(rules['false_alarms_per_1000_gpu_days'], 6, 2).strip()}"
        )
    floor = summary.get("model_floor_at_budget")
    if floor is not None:
        out.append(
            f"  model, rules as a floor: recall w/ prec "
            f"{_pct(floor['recall_with_precursors'])}, "
            f"FA/1k GPU-d {_num(floor['false_alarms_per_1000_gpu_days'], 6, 2).strip()}"
        )
        demoted = [d["rule"] for d in floor.get("floor_budget", {}).get("demoted", [])]
        if demoted:
            out.append(f"    not a floor at the end (over the budget): {', '.join(demoted)}")
        out.append(f"    {'kind':12} {'failures':>8} {'floor':>6} {'rules@FA':>8} {'rules':>6}")
        for kind, d in summary["floor_vs_rules_by_kind"].items():
            at = "-" if d["rules_at_rate"] is None else str(d["rules_at_rate"])
            out.append(
                f"    {kind:12} {d['failures']:8d} {d['model_floor']:6d} {at:>8} {d['rules']:6d}"
            )
    union = summary.get("union")
    if union is not None:
        out.append(
            f"  model OR rule {'/'.join(union['rules'])}: recall w/ prec "
            f"{_pct(union['recall_with_precursors'])}, "
            f"FA/1k GPU-d {_num(union['false_alarms_per_1000_gpu_days'], 6, 2).strip()}"
        )
    return out


def plot_curves(report: Report, path: str | Path) -> Path:
    """Recall (failures with precursors) against false alarms per 1,000 GPU-days, both
    scorers, with the operating points marked; written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    mc = report.model_curve.sort_values("false_alarms_per_1000_gpu_days")
    ax.step(
        mc["false_alarms_per_1000_gpu_days"],
        mc["recall_with_precursors"],
        where="post",
        label="model",
    )
    bc = report.baseline_curve.sort_values("false_alarms_per_1000_gpu_days")
    ax.plot(
        bc["false_alarms_per_1000_gpu_days"],
        bc["recall_with_precursors"],
        "s--",
        label="rule baseline",
    )
    for name, marker in (("model", "o"), ("baseline", "D")):
        d = report.summary[name]
        ax.plot(
            [d["false_alarms_per_1000_gpu_days"]],
            [d["recall_with_precursors"] or 0.0],
            marker,
            color="black",
            markersize=6,
        )
    ax.axvline(2.0, color="grey", linewidth=0.8, linestyle=":")
    # symlog so that 0 and 100 fit on one axis; the axis starts at 0 (no negative ticks) and
    # labels are plain numbers (0, 1, 2, 5, 10, 100, ...).
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax.set_xscale("symlog", linthresh=1.0, linscale=0.5)
    fa = np.r_[mc["false_alarms_per_1000_gpu_days"], bc["false_alarms_per_1000_gpu_days"], 2.0]
    right = float(np.nanmax(fa)) * 1.3 if np.isfinite(fa).any() else 10.0
    ax.set_xlim(0.0, max(right, 5.0))
    ticks = [t for t in (0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000) if t <= right]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(FixedLocator([]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xlabel("false alarms per 1,000 GPU-days")
    ax.set_ylabel("recall (failures with precursors)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Recall vs false alarms (lead >= L, <= H)")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
