"""Leave-one-family-out: train without some mechanism families, judge on fleets made with them.

A score on the training distribution says little about a fleet the model never saw. Here the
families of :mod:`sim.shapes` are split into folds; for each fold a model is trained on
mechanism-randomised fleets that never draw the fold's families, then evaluated on a fleet
made with exactly those families (every other physics at its default shape), beside the rule
baseline, with the alarm budget met live on that fleet's own scores
(:func:`predictor.report.evaluate_dataset`).

``python -m predictor.lofo OUT_DIR`` runs every fold and writes ``OUT_DIR/lofo.json`` and
``OUT_DIR/lofo.md`` (the table of ``docs/predictor.md``); sizes are options, small by default.
``--extra-data DIR`` (repeatable) adds datasets to every fold's training, e.g. the six
fleet-weeks (``python -m predictor.fleets DIR --only shipped``: default shapes and
randomised numbers, no mechanism family, so nothing of a fold leaks in). ``--model PATH``
trains nothing: it judges that model on each fold's held-out fleet, the same fleet and
evaluation as the fold models get (for a model trained without any mechanism family, such as
the previous default model, every fold is held out; the card says which were seen).
``--keep-scored`` keeps each fold's scored rows; ``--replay-budget`` then meets the alarm
budget again on them with this version's :mod:`predictor.budget`, in seconds, so a change to
the budget is judged on every kept fold without training or scoring again.

Prequential (``--adapt-days D``): the first D days of each fold's held-out fleet are given to
the fold's model as the fleet's own history — a model is trained on top of it with them
(:func:`predictor.lifecycle.adapt`, as ``forewarn evaluate --adapt-days`` and the lifecycle's
``retrain`` do) — and the unadapted and the adapted model are judged on the rest of the fleet,
each beside the rules, live with the budget: the fold's row is the unadapted model on the rest,
and a second row (``A, adapted on its first D days``) the adapted one. When the first days
hold no failure to learn from, the fold's result says why (``adapt_error``) and has no second
row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from forewarn.errors import InvalidInput, NotFound
from predictor import evaluate, registry
from predictor.budget import AlarmBudget
from predictor.dataset import load_dataset, read_manifest, split_at
from predictor.evaluate import json_safe
from predictor.features import ABSOLUTE_LEVELS
from predictor.fleets import Fleet, make
from predictor.lifecycle import adapt
from predictor.report import Report, evaluate_dataset, live_budget_metrics, raw_threshold
from predictor.train import TrainConfig, train

__all__ = [
    "FOLDS",
    "LofoConfig",
    "card_section",
    "format_table",
    "replay_budget",
    "run_fold",
    "train_config",
]

FOLDS: dict[str, tuple[str, ...]] = {
    "A": ("memory:bursts", "memory_remap:early", "thermal:step", "benign:ecc_bursts",
          "benign:hot_nodes"),
    "B": ("memory_remap:never", "nvlink:steps", "benign:remap_clears", "benign:node_slowdown"),
    "C": ("pcie:steps", "pcie_width:never", "thermal:time", "benign:link_retrains",
          "benign:app_xids"),
    "D": ("memory_remap:late", "pcie_width:early", "benign:counter_resets", "benign:gaps_stalls"),
}  # fmt: skip
"""Fold -> the families it holds out (at most one shape per physics, so that one fleet can be
made with all of them). Every non-default shape and every look-alike is in one fold."""


@dataclass(frozen=True)
class LofoConfig:
    train_fleets: int = 3
    train_gpus: int = 512
    train_days: float = 2.0
    train_mttf_h: float = 0.4
    eval_gpus: int = 1024
    eval_days: float = 2.0
    eval_mttf_h: float = 0.79
    rounds: int = 150
    budget: float = 2.0
    seed: int = 7000
    label_horizons: str = "1800"  # training targets in seconds, comma-separated
    relative_only: int = 0  # 1: the trees ignore absolute levels (features.ABSOLUTE_LEVELS)
    sudden_positives: int = 0  # 1: rows before failures without precursors train as positives
    adapt_days: float = 0.0  # > 0: prequential, the held-out fleet's first days adapt the model


def train_config(cfg: LofoConfig) -> TrainConfig:
    """The training settings of every fold's model."""
    return TrainConfig(
        rounds=cfg.rounds,
        seed=cfg.seed,
        label_horizons_s=tuple(float(h) for h in cfg.label_horizons.split(",")),
        ignore_features=ABSOLUTE_LEVELS if cfg.relative_only else (),
        sudden_positives=bool(cfg.sudden_positives),
    )


def run_fold(
    name: str,
    out: Path,
    cfg: LofoConfig,
    *,
    extra_data: Sequence[Path] = (),
    model_path: Path | None = None,
    keep_scored: bool = False,
) -> dict[str, Any]:
    """Train without fold ``name``'s families (on the fold's mechanism fleets and
    ``extra_data``) and evaluate on a fleet made with them; with ``model_path``, train nothing
    and evaluate that model instead. ``keep_scored`` writes the evaluation's scored rows to
    ``OUT/fold-NAME-scored/`` for :func:`replay_budget`."""
    held = FOLDS[name]
    test = Fleet(
        f"lofo-{name}-eval",
        "families",
        _seed_base(cfg, name) + 50,
        gpus=cfg.eval_gpus,
        days=cfg.eval_days,
        mttf_h=cfg.eval_mttf_h,
        families=held,
    )
    card_path = model_path or _fold_model(name, out, cfg, extra_data)
    model = registry.load(card_path)
    fleet = load_dataset(make(test, out / "data"))
    prequential: dict[str, Any] = {}
    if cfg.adapt_days > 0:
        history, fleet = split_at(fleet, fleet.start_ms + int(cfg.adapt_days * 86_400_000))
        prequential = {"adapt_days": cfg.adapt_days, "adapted": None, "adapt_error": None}
        try:
            adapted = adapt(card_path, [history])
        except InvalidInput as exc:  # e.g. no failure with precursors in the first days
            prequential["adapt_error"] = exc.message
        else:
            rep = evaluate_dataset(fleet, adapted, budget=cfg.budget)
            prequential["adapted"] = rep.summary
            prequential["adapted_model"] = adapted.card.get("created_at")
    report = evaluate_dataset(fleet, model, budget=cfg.budget)
    if keep_scored:
        _keep(report, out / f"fold-{name}-scored", raw_threshold(model))
    seen = sorted({f for d in model.card.get("data", []) for f in d.get("families", [])})
    return {
        "fold": name,
        "held_out": list(held),
        "model": str(model.card["booster_file"]).removesuffix(registry.BOOSTER_SUFFIX),
        "extra_data": [str(p) for p in extra_data],
        "training_families": seen,
        "held_out_seen_in_training": sorted(set(seen) & set(held)),
        "summary": report.summary,
        **prequential,
    }


def _seed_base(cfg: LofoConfig, name: str) -> int:
    """Fold ``name``'s first seed: its training fleets take the next ones, its evaluation
    fleet this plus 50."""
    return cfg.seed + 100 * (ord(name) - ord("A"))


def _fold_model(name: str, out: Path, cfg: LofoConfig, extra_data: Sequence[Path]) -> Path:
    """The card of fold ``name``'s model: the one already under ``OUT/models/NAME``, else one
    trained on the fold's mechanism fleets and ``extra_data`` (refused if any of it was made
    with the fold's families) and saved there."""
    held = FOLDS[name]
    for p in extra_data:
        leak = set(read_manifest(Path(p)).get("families", [])) & set(held)
        if leak:
            raise ValueError(
                f"{p} was made with fold {name}'s held-out families ({', '.join(sorted(leak))}); "
                "extra training data must not hold them"
            )
    model_dir = out / "models" / name
    cards = registry.list_models(model_dir) if model_dir.exists() else []
    if cards:
        return cards[-1][1]
    fleets = [
        Fleet(
            f"lofo-{name}-train-{i}",
            "mechanism",
            _seed_base(cfg, name) + i,
            gpus=cfg.train_gpus,
            days=cfg.train_days,
            mttf_h=cfg.train_mttf_h,
            exclude=held,
            interval_s=60.0,
        )
        for i in range(cfg.train_fleets)
    ]
    paths = [make(f, out / "data") for f in fleets] + [Path(p) for p in extra_data]
    return registry.save(train(paths, train_config(cfg)), model_dir)


def _keep(report: Report, path: Path, fallback: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    report.scored.rows.to_parquet(path / "rows.parquet")
    report.scored.failures.to_parquet(path / "failures.parquet")
    (path / "meta.json").write_text(
        json.dumps({"fallback": fallback, "step_s": report.summary["step_s"]})
    )


def replay_budget(path: Path, budget: float) -> dict[str, Any]:
    """The model met live by today's :class:`~predictor.budget.AlarmBudget` on a fold's kept
    scored rows (``--keep-scored``): how a change to the budget code moves the realised false
    alarms and recall, without training or scoring again."""
    meta = json.loads((path / "meta.json").read_text())
    rows = pd.read_parquet(path / "rows.parquet")
    failures = pd.read_parquet(path / "failures.parquet")
    table = evaluate.ScoreTable(rows, failures, step_s=meta["step_s"])
    return live_budget_metrics(table, failures, AlarmBudget(budget, fallback=meta["fallback"]))


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _fa(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """The leave-one-family-out table (Markdown); with ``--adapt-days``, a second row per
    fold for the adapted model, judged on the same days as the unadapted one."""
    lines = [
        "| fold: held-out families | failures (w/ precursors) | model, live budget: recall "
        ">= 2 min / FA per 1k GPU-d (those on GPUs that did not fail within a day) | same "
        "budget in hindsight | rules at the same FA rate | "
        "rules at their own setting: recall / FA | kinds where the model (at the rules' FA "
        "rate) catches fewer than the rules | model OR rule (live): recall / FA | kinds where "
        "model OR rule catches fewer than the best rule setting within its FA rate | "
        "model, rules as a floor (live): recall / FA | kinds where it catches fewer than the "
        "rules (own setting or the same FA rate) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        label = f"{r['fold']}: {', '.join(r['held_out'])}"
        if r.get("adapt_days"):
            label += f" (unadapted, on the days after the first {r['adapt_days']:g})"
        lines.append(_row(label, r["summary"]))
        if r.get("adapted") is not None:
            lines.append(_row(f"{r['fold']}, adapted on its first {r['adapt_days']:g} days",
                              r["adapted"]))  # fmt: skip
    return "\n".join(lines)


def _row(label: str, s: dict[str, Any]) -> str:
    """One line of the table: ``s``, an evaluation summary, under ``label``."""
    live, hind, rules = s["model_at_budget"], s["model_at_budget_hindsight"], s["baseline"]
    at = s.get("baseline_at_budget")
    by_kind = s.get("model_at_baseline_false_alarm_rate_by_kind") or {}
    fewer = [
        f"{k} {by_kind.get(k, {}).get('caught', 0)} < {d['caught']}"
        for k, d in rules["by_kind"].items()
        if by_kind.get(k, {}).get("caught", 0) < d["caught"]
    ]
    return (
        f"| {label} "
        f"| {live['failures']} ({live['failures_with_precursors']}) "
        f"| {_pct(live['recall_with_precursors'])} / "
        f"{_fa(live['false_alarms_per_1000_gpu_days'])} "
        f"({_fa(live.get('false_alarms_not_early_per_1000_gpu_days'))}) "
        f"| {_pct(hind['recall_with_precursors'])} / "
        f"{_fa(hind['false_alarms_per_1000_gpu_days'])} "
        f"| {_pct(at['recall_with_precursors']) if at else '0 % (none that low)'} "
        f"| {_pct(rules['recall_with_precursors'])} / "
        f"{_fa(rules['false_alarms_per_1000_gpu_days'])} "
        f"| {', '.join(fewer) or 'none'} "
        f"| {_union_cells(s)} | {_floor_cells(s)} |"
    )


def _fewer(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    return [
        f"{k} {mine.get(k, {}).get('caught', 0)} < {d['caught']}"
        for k, d in theirs.items()
        if mine.get(k, {}).get("caught", 0) < d["caught"]
    ]


def _union_cells(s: dict[str, Any]) -> str:
    union = s.get("union")
    if union is None:
        return "- | -"
    rules = s.get("baseline_at_union_rate")
    fewer = "none" if rules is None else ", ".join(_fewer(union["by_kind"], rules["by_kind"]))
    if rules is not None:
        fewer = f"{fewer or 'none'} (vs {rules['setting']})"
    return (
        f"{'/'.join(union['rules'])}: {_pct(union['recall_with_precursors'])} / "
        f"{_fa(union['false_alarms_per_1000_gpu_days'])} | {fewer}"
    )


def _floor_cells(s: dict[str, Any]) -> str:
    floor = s.get("model_floor_at_budget")
    if floor is None:
        return "- | -"
    below = [
        f"{k} {d['model_floor']} < {max(d['rules'], d['rules_at_rate'] or 0)}"
        for k, d in s.get("floor_vs_rules_by_kind", {}).items()
        if k in s.get("floor_kinds_below_rules", [])
    ]
    return (
        f"{_pct(floor['recall_with_precursors'])} / "
        f"{_fa(floor['false_alarms_per_1000_gpu_days'])} | {', '.join(below) or 'none'}"
    )


_BRIEF = (
    "failures",
    "failures_with_precursors",
    "caught_with_precursors",
    "recall_with_precursors",
    "false_alarms_per_1000_gpu_days",
    "false_alarms_not_early_per_1000_gpu_days",
    "caught_at_least_ahead",
    "false_alarms_by_cause",
    "false_alarms_early",
)


def card_section(results: list[dict[str, Any]], cfg: LofoConfig) -> dict[str, Any]:
    """The leave-one-family-out results as the model card keeps them."""

    def brief(m: dict[str, Any] | None) -> dict[str, Any] | None:
        if m is None:
            return None
        out = {k: m.get(k) for k in _BRIEF}
        out["by_kind"] = {k: d["caught"] for k, d in m.get("by_kind", {}).items()}
        return out

    folds = []
    for r in results:
        s = r["summary"]
        folds.append(
            {
                "fold": r["fold"],
                "held_out": r["held_out"],
                "model_at_budget": brief(s["model_at_budget"]),
                "model_at_budget_hindsight": brief(s["model_at_budget_hindsight"]),
                "baseline": brief(s["baseline"]),
                "baseline_at_budget": brief(s.get("baseline_at_budget")),
                "union": brief(s.get("union")),
                "union_rules": (s.get("union") or {}).get("rules"),
                "baseline_at_union_rate": brief(s.get("baseline_at_union_rate")),
                "model_floor_at_budget": brief(s.get("model_floor_at_budget")),
                "baseline_at_floor_rate": brief(s.get("baseline_at_floor_rate")),
                "floor_vs_rules_by_kind": s.get("floor_vs_rules_by_kind"),
                "model_at_baseline_false_alarm_rate_by_kind": {
                    k: d["caught"]
                    for k, d in (s.get("model_at_baseline_false_alarm_rate_by_kind") or {}).items()
                },
            }
        )
        if r.get("adapt_days"):
            a = r.get("adapted") or {}
            folds[-1]["prequential"] = {
                "adapt_days": r["adapt_days"],
                "adapt_error": r.get("adapt_error"),
                "adapted_model_at_budget": brief(a.get("model_at_budget")),
                "adapted_model_floor_at_budget": brief(a.get("model_floor_at_budget")),
                "baseline": brief(a.get("baseline")),
            }
    return {
        "config": {k: getattr(cfg, k) for k in LofoConfig.__dataclass_fields__},
        "table_markdown": format_table(results),
        "folds": json_safe(folds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m predictor.lofo", description=__doc__)
    parser.add_argument("out", help="working directory (datasets, models, results)")
    parser.add_argument("--folds", default=",".join(FOLDS), help="e.g. A,C")
    parser.add_argument(
        "--card", default=None, help="a model card (.json) to write the results into"
    )
    parser.add_argument(
        "--collect",
        action="append",
        default=[],
        metavar="DIR",
        help="only gather fold-*.json results already written under DIR (repeatable)",
    )
    parser.add_argument(
        "--extra-data",
        action="append",
        default=[],
        metavar="DIR",
        help="a dataset added to every fold's training (repeatable), e.g. the six fleet-weeks "
        "from `python -m predictor.fleets DIR --only shipped`",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="train nothing: evaluate this model (a card, or a directory and its newest model) "
        "on each fold's held-out fleet",
    )
    parser.add_argument(
        "--keep-scored",
        action="store_true",
        help="keep each fold's scored rows (OUT/fold-NAME-scored/) for --replay-budget",
    )
    parser.add_argument(
        "--replay-budget",
        action="store_true",
        help="train and score nothing: meet the budget live again, with this version's budget "
        "code, on the scored rows kept under OUT, and print each fold's figures",
    )
    for field, default in LofoConfig.__dataclass_fields__.items():
        parser.add_argument(
            f"--{field.replace('_', '-')}", type=type(default.default), default=default.default
        )
    args = parser.parse_args(argv)
    cfg = LofoConfig(**{k: getattr(args, k) for k in LofoConfig.__dataclass_fields__})
    out = Path(args.out)
    if args.replay_budget:
        return _print_replays(out, cfg.budget)
    if args.model and args.extra_data:
        print("error: --model trains nothing, so --extra-data has no use", file=sys.stderr)
        return 2
    if not 0 <= cfg.adapt_days < cfg.eval_days:
        print("error: --adapt-days must be at least 0 and below --eval-days", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    folds = [] if args.collect else [f.strip() for f in args.folds.split(",")]
    unknown = [f for f in folds if f not in FOLDS]
    if unknown:
        print(f"error: no fold {', '.join(unknown)} (folds: {', '.join(FOLDS)})", file=sys.stderr)
        return 2
    results = []
    if args.collect:
        for d in args.collect:
            results += [json.loads(p.read_text()) for p in sorted(Path(d).glob("fold-*.json"))]
        results.sort(key=lambda r: r["fold"])
    for name in folds:
        try:
            res = run_fold(
                name,
                out,
                cfg,
                extra_data=[Path(p) for p in args.extra_data],
                model_path=None if args.model is None else Path(args.model),
                keep_scored=args.keep_scored,
            )
        except (ValueError, InvalidInput, NotFound) as e:  # a leak, not a dataset, no model
            print(f"error: {e}", file=sys.stderr)
            return 2
        results.append(res)
        (out / f"fold-{res['fold']}.json").write_text(json.dumps(json_safe(res), indent=1))
        print(format_table([res]).splitlines()[-1], flush=True)
    (out / "lofo.json").write_text(json.dumps(json_safe(results), indent=1))
    (out / "lofo.md").write_text(format_table(results) + "\n")
    print(format_table(results))
    if args.card:
        card_path = Path(args.card)
        card = json.loads(card_path.read_text())
        card["leave_one_family_out"] = card_section(results, cfg)
        card_path.write_text(json.dumps(json_safe(card), indent=1, allow_nan=False) + "\n")
    return 0


def _print_replays(out: Path, budget: float) -> int:
    kept = sorted(out.glob("fold-*-scored"))
    if not kept:
        print(f"error: no kept scored rows under {out} (run with --keep-scored)", file=sys.stderr)
        return 2
    print(
        "| fold | live: caught / with precursors | FA per 1k GPU-d | of GPUs that did not fail "
        "within a day | early | final threshold |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for path in kept:
        m = replay_budget(path, budget)
        print(
            f"| {path.name.removeprefix('fold-').removesuffix('-scored')} "
            f"| {m['caught_with_precursors']} / {m['failures_with_precursors']} "
            f"| {_fa(m['false_alarms_per_1000_gpu_days'])} "
            f"| {_fa(m['false_alarms_not_early_per_1000_gpu_days'])} "
            f"| {m['false_alarms_early']} of {m['false_alarms']} "
            f"| {m['threshold_final']:.4f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
