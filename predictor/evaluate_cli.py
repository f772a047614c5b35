"""``forewarn evaluate --data DIR --model PATH [--json]``: the model against the rule baseline.

Per failure event (not per row): recall of failures alarmed at least L and at most H before
they happen, lead time (median, 10th percentile), false alarms per 1,000 GPU-days, PR-AUC and
a table per failure kind, for the model and the baseline in the same replay; a
recall-versus-false-alarm PNG for both. With ``--json`` stdout holds one object
``{"model": {...}, "baseline": {...}, "threshold": ...}`` (plus the comparison at the
baseline's false-alarm rate and what was evaluated).

Prequential (``--adapt-days D``): the first D days of the fleet are given to the model as the
fleet's own history — a model is trained on top of it (:func:`predictor.lifecycle.adapt`, as
the service's retraining does) — and the rest is scored live with the budget by both, the
unadapted and the adapted model, beside the rules; ``--json`` then prints
``{"adapt_days", "unadapted": {...}, "adapted": {...} | null, "adapt_error": ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from forewarn.errors import ForewarnError
from predictor import evaluate, registry
from predictor.dataset import load_dataset, steps
from predictor.report import evaluate_dataset, format_table, plot_curves

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", required=True, metavar="DIR", help="dataset directory or fsspec URL"
    )
    parser.add_argument(
        "--model",
        default="models",
        metavar="PATH",
        help="model card (.json), booster file, or a directory (newest model; default models/, "
        "else the shipped model)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--threshold", type=float, default=None, help="override the card's")
    parser.add_argument(
        "--budget",
        type=float,
        default=2.0,
        help="false alarms per 1,000 GPU-days met live on the fleet's own scores "
        "(predictor.budget; 0: skip; default %(default)s)",
    )
    parser.add_argument("--step-s", type=float, default=None, help="replay step (card's)")
    parser.add_argument("--horizon-s", type=float, default=1800.0, help="H, seconds")
    parser.add_argument("--lead-min-s", type=float, default=120.0, help="L, seconds")
    parser.add_argument("--merge-s", type=float, default=600.0, help="alarm merge gap")
    parser.add_argument(
        "--plot",
        default="recall-vs-false-alarms.png",
        metavar="PNG",
        help="where to write the curve (default: ./recall-vs-false-alarms.png; '' for none)",
    )
    parser.add_argument(
        "--adapt-days",
        type=float,
        default=0.0,
        metavar="D",
        help="prequential: train on top of the model with the first D days of the fleet, "
        "then judge the unadapted and the adapted model on the rest (default 0: off)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (never one when stderr is not a terminal)",
    )


def _tick(bar: tqdm) -> None:
    bar.update(1)


def run(args: argparse.Namespace) -> int:
    if args.adapt_days:
        return _prequential(args)
    try:
        # The default directory with no model of the operator's: the shipped one.
        if args.model == "models" and not registry.list_models("models"):
            model = registry.load_default("models")
        else:
            model = registry.load(args.model)
        ds = load_dataset(args.data)
        step_s = args.step_s or float(model.card.get("training", {}).get("step_s", 60.0))
        params = evaluate.Params(args.lead_min_s, args.horizon_s, args.merge_s)
        with tqdm(
            total=steps(ds, step_s),
            unit="step",
            file=sys.stderr,
            disable=args.no_progress or args.json or not sys.stderr.isatty(),
        ) as bar:
            report = evaluate_dataset(
                ds,
                model,
                threshold=args.threshold,
                budget=args.budget or None,
                step_s=step_s,
                params=params,
                progress=lambda n: _tick(bar),
            )
    except ForewarnError as exc:
        print(f"forewarn evaluate: {exc.message}", file=sys.stderr)
        return 2
    png = plot_curves(report, args.plot) if args.plot else None
    if png is not None:
        report.summary["plot"] = str(png)
    if args.json:
        print(json.dumps(evaluate.json_safe(report.summary), allow_nan=False))
    else:
        print(format_table(report.summary))
        if png is not None:
            print(f"\ncurve: {png}")
    return 0


def _prequential(args: argparse.Namespace) -> int:
    from forewarn.errors import InvalidInput
    from predictor.dataset import split_at
    from predictor.lifecycle import adapt

    # the default directory with no model of the operator's: the shipped one
    none_here = args.model == "models" and not registry.list_models("models")
    base_path = registry.SHIPPED_DIR if none_here else Path(args.model)
    try:
        model = registry.load(base_path)
        ds = load_dataset(args.data)
        history, rest = split_at(ds, ds.start_ms + int(args.adapt_days * 86_400_000))
        step_s = args.step_s or float(model.card.get("training", {}).get("step_s", 60.0))
        params = evaluate.Params(args.lead_min_s, args.horizon_s, args.merge_s)
        kw = {"threshold": args.threshold, "budget": args.budget or None, "step_s": step_s}
        unadapted = evaluate_dataset(rest, model, params=params, **kw).summary
        adapted: dict[str, object] | None = None
        error = None
        try:
            new = adapt(base_path, [history])
            adapted = evaluate_dataset(rest, new, params=params, **kw).summary
        except InvalidInput as exc:  # e.g. no failure with precursors in the first days
            error = exc.message
    except ForewarnError as exc:
        print(f"forewarn evaluate: {exc.message}", file=sys.stderr)
        return 2
    out = {
        "adapt_days": args.adapt_days,
        "unadapted": unadapted,
        "adapted": adapted,
        "adapt_error": error,
    }
    if args.json:
        print(json.dumps(evaluate.json_safe(out), allow_nan=False))
    else:
        print(f"the first {args.adapt_days:g} days given as the fleet's own history; the rest:")
        print("\n== unadapted ==\n" + format_table(unadapted))
        if adapted is not None:
            print("\n== adapted ==\n" + format_table(adapted))
        else:
            print(f"\nnot adapted: {error}")
    return 0
