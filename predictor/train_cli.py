"""``forewarn train --data DIR [--data DIR ...] --out models/``: train, calibrate, write.

Prints where the model and its card went and the held-out (validation) figures. With
``--base MODEL`` it retrains on top of an existing model (:mod:`predictor.retrain`): the base
card's settings and hyper-parameters, the new data plus the base's datasets still present.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tqdm import tqdm

from forewarn.errors import ForewarnError
from predictor import evaluate, registry
from predictor.dataset import read_manifest
from predictor.features import ABSOLUTE_LEVELS
from predictor.retrain import Base, load_base
from predictor.train import TrainConfig, train

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        action="append",
        required=True,
        metavar="DIR",
        help="dataset directory or fsspec URL, e.g. s3://bucket/history (docs/datasets.md); "
        "repeat to train on several fleets",
    )
    parser.add_argument("--out", default="models", help="model directory (default: models/)")
    parser.add_argument("--step-s", type=float, default=60.0, help="replay step in seconds")
    parser.add_argument("--horizon-s", type=float, default=1800.0, help="label horizon H")
    parser.add_argument("--lead-min-s", type=float, default=120.0, help="minimum lead L")
    parser.add_argument(
        "--max-false-alarms",
        type=float,
        default=2.0,
        help="false alarms per 1,000 GPU-days the threshold may cost on validation",
    )
    parser.add_argument(
        "--threshold-not-early",
        action="store_true",
        help="count, against --max-false-alarms, only false alarms on GPUs that did not fail "
        "within a day (what an alarm budget counts); training fleets fail ten times as often "
        "as a real one, so many of their false alarms are early ones",
    )
    parser.add_argument(
        "--label-horizon-s",
        type=float,
        action="append",
        metavar="S",
        help="training target 'failure within S' (repeat: one booster each, the best on "
        "validation is kept; default: the horizon H)",
    )
    parser.add_argument("--rounds", type=int, default=TrainConfig.rounds, help="boosting rounds")
    parser.add_argument(
        "--val-from",
        type=float,
        default=TrainConfig.val_from,
        help="validation starts at this fraction of each dataset's time (default %(default)s)",
    )
    parser.add_argument(
        "--val-node-frac",
        type=float,
        default=TrainConfig.val_node_frac,
        help="share of nodes held out for validation (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--relative-only",
        action="store_true",
        help="the trees may not split on absolute temperature, power, clock and utilisation "
        "levels, only on their forms relative to the node, the fleet and the GPU's own day",
    )
    parser.add_argument(
        "--base",
        metavar="MODEL",
        help="retrain on top of this model: a card, or a directory and its newest model "
        "(the shipped one when it holds none, e.g. models/). Training settings and "
        "hyper-parameters come from its card (options above win when set to other than "
        "their defaults); the data is "
        "--data plus the datasets its card lists that are still here, and those that are not "
        "are named. See docs/predictor.md",
    )
    parser.set_defaults(cli_defaults={dest: parser.get_default(dest) for dest in _FROM_BASE})
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (none when stderr is not a terminal)",
    )


# option -> TrainConfig field: with --base the card's value, unless the option was changed
_FROM_BASE = {
    "step_s": "step_s",
    "horizon_s": "horizon_s",
    "lead_min_s": "lead_min_s",
    "max_false_alarms": "max_false_alarms",
    "threshold_not_early": "threshold_not_early",
    "rounds": "rounds",
    "seed": "seed",
    "val_from": "val_from",
    "val_node_frac": "val_node_frac",
}


def _from_base(args: argparse.Namespace) -> tuple[TrainConfig, Base]:
    base = load_base(args.base)
    overrides: dict[str, Any] = {
        field: getattr(args, dest)
        for dest, field in _FROM_BASE.items()
        if getattr(args, dest) != args.cli_defaults[dest]
    }
    if args.label_horizon_s:
        overrides["label_horizons_s"] = tuple(args.label_horizon_s)
    if args.relative_only:
        overrides["ignore_features"] = ABSOLUTE_LEVELS
    print(f"base: {base.card_path} (its settings and hyper-parameters)", file=sys.stderr)
    for path, why in base.missing.items():
        print(f"base data {path}: {why}; left out", file=sys.stderr)
    if base.missing and not base.found:
        how = (base.card.get("training") or {}).get("command")
        print(
            "none of the base's data is here: training on --data alone with the base's "
            "settings" + (f" (the base's data came from: {how})" if how else ""),
            file=sys.stderr,
        )
    if base.added_features:
        print(
            f"features: this version's; the base lacked {len(base.added_features)} "
            f"({', '.join(base.added_features)})",
            file=sys.stderr,
        )
    return base.config(overrides), base


def run(args: argparse.Namespace) -> int:
    cfg = TrainConfig(
        step_s=args.step_s,
        horizon_s=args.horizon_s,
        lead_min_s=args.lead_min_s,
        max_false_alarms=args.max_false_alarms,
        threshold_not_early=args.threshold_not_early,
        rounds=args.rounds,
        seed=args.seed,
        val_from=args.val_from,
        val_node_frac=args.val_node_frac,
        label_horizons_s=tuple(args.label_horizon_s or (args.horizon_s,)),
        ignore_features=ABSOLUTE_LEVELS if args.relative_only else (),
    )
    base: Base | None = None
    try:
        if args.base:
            cfg, base = _from_base(args)
        datasets = [*(base.found if base else []), *args.data]
        total = 2 * sum(_steps(d, cfg.step_s) for d in datasets)
        with tqdm(
            total=total,
            unit="step",
            disable=args.no_progress or not sys.stderr.isatty(),
            file=sys.stderr,
        ) as bar:
            done = {"collect": 0, "validate": 0}

            def progress(phase: str, n: int) -> None:
                bar.set_description(phase)
                bar.update(1)
                done[phase] = n

            model = train(
                datasets,
                cfg,
                progress=progress,
                booster_params=base.booster_params() if base else None,
            )
        if base is not None:
            model.card["base"] = base.describe(base.found)
        card_path = registry.save(model, args.out)
    except ForewarnError as exc:
        print(f"forewarn train: {exc.message}", file=sys.stderr)
        return 2
    val = model.card["metrics"]["validation"]
    print(f"model: {card_path}")
    print(f"threshold: {model.threshold:.4f}")
    brief = evaluate.json_safe({k: _brief(v) for k, v in val.items()})
    print("validation:", json.dumps(brief, allow_nan=False))
    return 0


def _brief(d: dict) -> dict:
    keys = ("recall", "recall_with_precursors", "false_alarms_per_1000_gpu_days", "pr_auc")
    return {k: d.get(k) for k in keys}


def _steps(path: str, step_s: float) -> int:
    m = read_manifest(path)
    return max(int(-(-(m["end_ms"] - m["start_ms"]) // (step_s * 1000))), 1)
