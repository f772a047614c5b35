"""``forewarn goodput``: how much training time a cluster keeps, three ways, on real failures.

    forewarn goodput                                  # 1,024 and 16,384 GPUs, both sources
    forewarn goodput --gpus 4096 --source trace --trace ../shared/data/stepfun-fault-trace
    forewarn goodput --json --no-png
    forewarn goodput --layout ddp hsdp sharded peer-copy   # each layout's strategies
    forewarn goodput --straggler-episodes-per-gpu-day 0.01 --straggler-slowdown 1.5  # what-if

Prints every assumption, the predictor's figures it uses, the table (ETTR, GPU-hours lost per
day, share of failures handled with nothing lost), the straggler term (what was published, and
with a rate and a slowdown given, its cost and Forewarn's gain) and the 64xH200 sanity check;
writes a PNG.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import urllib.request
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from forewarn.errors import InvalidInput
from goodput import trace as trace_mod
from goodput.compare import Row, Scenario, compare, model_mttf_h, write_png
from goodput.costs import group_formation, group_formation_s
from goodput.layouts import LAYOUTS
from goodput.model import Assumptions
from goodput.profile import DEFAULT_PROFILE, KINDS, PredictorProfile, find_card, from_card
from goodput.published import PUBLISHED_MIN, run_sanity_check
from goodput.stragglers import (
    STRAGGLERS_PATH,
    PublishedStragglers,
    Stragglers,
    from_history,
    measured_detect_s,
    published,
)

__all__ = ["configure", "run"]

_FLAGS = {  # Assumptions field -> (flag, unit conversion from the flag to seconds or as is)
    "step_s": ("--step-s", 1.0),
    "ckpt_save_s": ("--ckpt-save-s", 1.0),
    "restart_s": ("--restart-min", 60.0),
    "detect_s": ("--detect-s", 1.0),
    "rank_state_gb": ("--rank-state-gb", 1.0),
    "transfer_gb_s": ("--transfer-gb-s", 1.0),
    "wrapper_overhead": ("--wrapper-overhead", 1.0),
    "peer_copy_overhead": ("--peer-copy-overhead", 1.0),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        default=[1024, 16384],
        help="cluster sizes (GPUs in the job; default 1024 16384)",
    )
    parser.add_argument(
        "--source",
        nargs="+",
        choices=["fleet", "trace"],
        default=["fleet", "trace"],
        help="failures from the fleet model, the StepFun trace, or both",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="StepFun trace directory or derived table (default: the trace "
        "beside a source checkout, else the copy shipped in the package)",
    )
    parser.add_argument(
        "--days",
        type=float,
        default=349.0,
        help="window simulated, days (default 349, the trace's length)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=1, help="seeded runs per row (spread)")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model card (or directory) for the predictor's figures "
        "(default: the newest in ./models or beside the source)",
    )
    parser.add_argument(
        "--recall",
        action="append",
        default=[],
        metavar="KIND=R",
        help=f"override recall of one kind ({', '.join(KINDS)})",
    )
    parser.add_argument("--false-alarms-per-1000-gpu-days", type=float, default=None)
    d = Assumptions()
    for name, (flag, unit) in _FLAGS.items():
        parser.add_argument(
            flag,
            type=float,
            default=getattr(d, name) / unit,
            dest=name,
            help=f"(default {getattr(d, name) / unit:g})",
        )
    parser.add_argument(
        "--regroup-s",
        type=float,
        default=None,
        help="seconds to form a process-group generation (default: the measured rule at the "
        "job's size, goodput/data/group_formation.json)",
    )
    parser.add_argument(
        "--formation-at-switch",
        action="store_true",
        help="what-if: preventive moves form the next process group inside their stall (the "
        "migrator forms it while training goes on, so by default a move's stall is the "
        "transfer and the switch)",
    )
    parser.add_argument(
        "--layout",
        nargs="+",
        choices=sorted(LAYOUTS),
        default=[],
        help="compare per parallel layout: ddp (replicated), hsdp, sharded (no replica), "
        "peer-copy (sharded with in-memory copies); each with its strategies and Forewarn",
    )
    parser.add_argument(
        "--shard-ranks",
        type=int,
        default=d.shard_ranks,
        help=f"ranks a replica is sharded over in the sharded layouts (default {d.shard_ranks})",
    )
    parser.add_argument(
        "--peer-copy-every-steps",
        type=int,
        default=d.peer_copy_every_steps,
        help=f"peer-copy layout: steps between copies (default {d.peer_copy_every_steps})",
    )
    parser.add_argument(
        "--ckpt-interval-min",
        type=float,
        default=None,
        help="checkpoint-restart interval (default: Young/Daly optimum)",
    )
    pub = published()
    slow = parser.add_argument_group(
        "stragglers",
        "GPUs that run slower without failing (goodput/data/stragglers.json): no published "
        "rate per GPU nor slowdown of an episode was found, so the term is shown only when "
        "both are given (a what-if)",
    )
    slow.add_argument(
        "--straggler-episodes-per-gpu-day",
        type=float,
        default=pub.episodes_per_gpu_day,
        metavar="R",
        help="straggler episodes per GPU per day",
    )
    slow.add_argument(
        "--straggler-slowdown",
        type=float,
        default=pub.slowdown,
        metavar="S",
        help="how many times longer the straggler takes for its share of a step (>= 1)",
    )
    slow.add_argument(
        "--straggler-duration-min",
        type=float,
        default=None if pub.duration_mean_s is None else pub.duration_mean_s / 60.0,
        metavar="M",
        help="mean episode length, minutes (default %(default)s: the published figure)",
    )
    slow.add_argument(
        "--stragglers-from",
        metavar="SOURCE",
        help="take the rate, slowdown and episode length from a fleet's own history: the "
        "URL of a service's GET /v1/stragglers/history (a read token from FOREWARN_TOKEN), "
        "or a file of its JSON; the flags above, when given, override",
    )
    slow.add_argument(
        "--straggler-detect-s",
        type=float,
        default=round(measured_detect_s(), 1),
        metavar="S",
        help="Forewarn: seconds from an episode's start until the slow rank is moved "
        "(default %(default)s: measured, goodput/data/straggler_detection.json)",
    )
    parser.add_argument(
        "--sanity-seeds", type=int, default=20, help="runs of the 64xH200 sanity check (0: skip it)"
    )
    parser.add_argument("--png", type=Path, default=Path("var/goodput.png"))
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _assumptions(args: argparse.Namespace) -> Assumptions:
    values: dict[str, float | int | None] = {
        name: getattr(args, name) * unit for name, (_, unit) in _FLAGS.items()
    }
    values["regroup_s"] = args.regroup_s
    values["shard_ranks"] = args.shard_ranks
    values["peer_copy_every_steps"] = args.peer_copy_every_steps
    values["formation_at_switch"] = args.formation_at_switch
    if args.ckpt_interval_min is not None:
        values["ckpt_interval_s"] = args.ckpt_interval_min * 60.0
    return Assumptions(**values)  # type: ignore[arg-type]


def _profile(args: argparse.Namespace) -> PredictorProfile:
    card = args.model or find_card()
    profile = from_card(card) if card is not None else DEFAULT_PROFILE
    if args.recall:
        overrides = {}
        for item in args.recall:
            kind, _, value = item.partition("=")
            overrides[kind] = float(value)
        profile = profile.with_recall(overrides)
    if args.false_alarms_per_1000_gpu_days is not None:
        profile = replace(
            profile, false_alarms_per_1000_gpu_days=args.false_alarms_per_1000_gpu_days
        )
    return profile


def _stragglers(args: argparse.Namespace) -> Stragglers | None:
    """The straggler term of the flags; None without a rate and a slowdown.

    Raises:
        InvalidInput: only one of them given, or a value out of range.
    """
    rate, slowdown = args.straggler_episodes_per_gpu_day, args.straggler_slowdown
    if args.stragglers_from:
        try:
            fleet = from_history(
                _read_history(args.stragglers_from),
                source=args.stragglers_from,
                detect_s=args.straggler_detect_s,
                duration_fallback_s=(
                    None
                    if args.straggler_duration_min is None
                    else args.straggler_duration_min * 60.0
                ),
            )
            if rate is not None or slowdown is not None:  # what was given overrides
                fleet = replace(
                    fleet,
                    episodes_per_gpu_day=fleet.episodes_per_gpu_day if rate is None else rate,
                    slowdown=fleet.slowdown if slowdown is None else slowdown,
                    source=fleet.source + "; overridden by the flags given",
                )
            return fleet
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
    if rate is None and slowdown is None:
        return None
    if rate is None or slowdown is None or args.straggler_duration_min is None:
        raise InvalidInput(
            "the straggler term needs both --straggler-episodes-per-gpu-day and "
            "--straggler-slowdown (and a duration): neither is published "
            "(goodput/data/stragglers.json)"
        )
    try:
        return Stragglers(
            rate, slowdown, args.straggler_duration_min * 60.0, args.straggler_detect_s
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


def _read_history(source: str) -> dict[str, Any]:
    """The straggler history at ``source``: a service's URL (read token from
    ``FOREWARN_TOKEN``) or a file of its JSON.

    Raises:
        ValueError: it cannot be read, or is not the history's JSON.
    """
    try:
        if source.startswith(("http://", "https://")):
            request = urllib.request.Request(source, headers={"Accept": "application/json"})
            token = os.environ.get("FOREWARN_TOKEN")
            if token:
                request.add_header("Authorization", f"Bearer {token}")
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read(10_000_000)
        else:
            with Path(source).open("rb") as fh:
                body = fh.read(10_000_000)
        doc = json.loads(body)
    except (OSError, ValueError) as exc:  # urllib's errors are OSErrors
        raise ValueError(f"cannot read the straggler history at {source}: {exc}") from exc
    if not isinstance(doc, dict) or "episodes_per_gpu_day" not in doc:
        raise ValueError(f"{source} is not a straggler history (GET /v1/stragglers/history)")
    return doc


def _describe_stragglers(
    s: Stragglers | None, pub: PublishedStragglers, a: Assumptions, gpus: list[int]
) -> list[str]:
    """What was published, what the term uses, and an episode's arithmetic."""
    g = pub.figures.get("greyhound", {})
    lines = [
        f"  published ({STRAGGLERS_PATH.name}): Greyhound (USENIX ATC '25, arXiv 2410.12588), "
        f"a cluster of over 10,000 GPUs: episodes last {g.get('episode_duration', '?')}; "
        f"fail-slows delay large jobs {g.get('job_delay_x_mean', '?')}x on average (slow "
        f"computation and slow communication together)"
    ]
    if pub.duration_mean_s is not None:
        lines.append(f"  episode length {pub.duration_mean_s / 60:g} min: {pub.duration_source}")
    if s is None:
        lines.append(f"  not in the table: {pub.missing}")
        return lines
    lines.append(
        f"  {s.source or 'what-if'}: {s.episodes_per_gpu_day:g} episodes per GPU-day, slowdown "
        f"{s.slowdown:g}x, {s.duration_s / 60:g} min each (exponential), Forewarn moves the "
        f"slow rank {s.detect_s:g} s after the start ("
        + (
            "measured with the default policy: straggler_detection.json)"
            if s.detect_s == round(measured_detect_s(), 1)
            else "given)"
        )
    )
    for n in gpus:
        pause = a.migration_pause_s(n)
        lines.append(
            f"  => at {n:,} GPUs: {s.episodes_per_gpu_day * n:.1f} episodes a day; an "
            f"episode costs {s.duration_s * (1 - 1 / s.slowdown):.0f} s of training unmitigated "
            f"on average, with Forewarn {s.detect_s * (1 - 1 / s.slowdown):.0f} s + a move's "
            f"stall {pause:.2f} s (measured, preventive_stall.json); moving pays for an "
            f"episode longer than {s.break_even_s(pause):.0f} s"
        )
    return lines


def _straggler_summary(rows: list[Row]) -> list[str]:
    """Per cluster and source: the straggler term without mitigation and with Forewarn."""
    lines = ["Stragglers (beside failures): GPU-hours lost a day, ETTR with them too:"]
    for gpus, source, layout in dict.fromkeys((r.gpus, r.source, r.layout) for r in rows):
        sel = [r for r in rows if (r.gpus, r.source, r.layout) == (gpus, source, layout)]
        fw = next(r for r in sel if r.strategy == "forewarn")
        others = [r for r in sel if r.strategy != "forewarn"]
        if not others or fw.ettr_with_stragglers is None:
            continue
        base = others[0]
        best = max(others, key=lambda r: r.ettr_with_stragglers or 0.0)
        gain = (fw.ettr_with_stragglers - (best.ettr_with_stragglers or 0.0)) * 100
        lines.append(
            f"  {gpus:>6} {source:<6} {layout:<9} {base.straggler_episodes_per_day:.1f} "
            f"episodes/day: unmitigated {base.straggler_gpu_hours_lost_per_day:,.0f}, Forewarn "
            f"{fw.straggler_gpu_hours_lost_per_day:,.0f} ({fw.straggler_moves_per_day:.1f} "
            f"moves/day); ETTR {best.strategy} {best.ettr_with_stragglers:.4f}, forewarn "
            f"{fw.ettr_with_stragglers:.4f} ({gain:+.2f} points)"
        )
    return lines


def _describe_assumptions(a: Assumptions, gpus: list[int]) -> list[str]:
    docs = {
        "step_s": "training step",
        "ckpt_interval_s": "checkpoint-restart interval",
        "ckpt_save_s": "checkpoint save (blocking)",
        "restart_s": "checkpoint-restart: detect, replace node, reload, re-initialise",
        "detect_s": "unplanned: survivors agree a rank is gone",
        "rank_state_gb": "state per migrated rank, GB",
        "transfer_gb_s": "transfer bandwidth, GB/s",
        "pause_per_transfer": "pause per ideal transfer second (measured, loopback)",
        "pause_fixed_s": "fixed pause (measured, loopback)",
        "regroup_s": "new process-group generation (None: measured rule, below)",
        "shard_ranks": "sharded layouts: ranks a replica is sharded over",
        "peer_copy_every_steps": "peer-copy layout: steps between a rank's copies",
        "peer_copy_overhead": "peer-copy layout: per-step cost of the copies (goal bound)",
        "formation_at_switch": "what-if: preventive moves form the group in their stall",
        "wrapper_overhead": "per-step cost of the Migratable wrapper (measured 0.02 %)",
        "migrating_ckpt_interval_s": "checkpoints a migrating job still keeps",
        "replica_step_overhead": "extra per-step cost of the peer-replica baseline",
    }
    lines = []
    for f in fields(a):
        value = getattr(a, f.name)
        if value is None:
            shown = {
                "ckpt_interval_s": "Young/Daly optimum sqrt(2 x save x MTTF)",
                "regroup_s": "measured",
            }.get(f.name, "none")
        else:
            shown = str(value) if isinstance(value, bool) else f"{value:g}"
        lines.append(f"  {f.name:<27} {shown:<12} {docs.get(f.name, '')}")
    if a.regroup_s is None:
        rule = group_formation()
        lines.append(
            f"  {'=> group formation':<27} {rule.a_s:.4f} + {rule.b_s_per_rank:.6f} x ranks s "
            f"(measured at {', '.join(map(str, rule.measured_ranks))} ranks, extrapolated "
            f"linearly; {rule.source})"
        )
    for g in gpus:
        lines.append(
            f"  {'=> at ' + f'{g:,}' + ' GPUs':<27} group {a.regroup_at(g):.2f} s, preventive "
            f"stall {a.migration_pause_s(g):.2f} s (nothing lost), replica recovery "
            f"{a.replica_recovery_s(g):.2f} s + the step in flight"
        )
    lines.append(
        "  failures stop the whole (synchronous) job; a warm spare is always free; "
        "a false alarm costs one preventive pause"
    )
    return lines


def _table(rows: list[Row]) -> list[str]:
    slow = any(r.ettr_with_stragglers is not None for r in rows)
    head = (
        f"{'GPUs':>6} {'source':<6} {'MTTF h':>7} {'fail/d':>6} {'layout':<9} {'strategy':<19} "
        f"{'ETTR':>7} {'GPU-h lost/d':>12} {'no loss':>7} {'<=1 step':>8}"
    )
    if slow:
        head += f" {'slow GPU-h/d':>12} {'ETTR+slow':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = "" if r.ettr_min == r.ettr_max else f" ({r.ettr_min:.4f}-{r.ettr_max:.4f})"
        if slow and spread:
            spread = f" (ETTR {spread[2:]}"
        extra = ""
        if slow:
            extra = f" {r.straggler_gpu_hours_lost_per_day:>12,.0f} {r.ettr_with_stragglers:>9.4f}"
        lines.append(
            f"{r.gpus:>6} {r.source:<6} {r.mttf_h:>7.2f} {r.failures_per_day:>6.1f} "
            f"{r.layout:<9} {r.strategy:<19} {r.ettr:>7.4f} {r.gpu_hours_lost_per_day:>12,.0f} "
            f"{r.no_loss_share:>7.0%} {r.at_most_one_step_share:>8.0%}{extra}{spread}"
        )
    return lines


def _layout_summary(rows: list[Row]) -> list[str]:
    """Per cluster, source and layout: Forewarn against the best other strategy."""
    lines = ["Where prediction pays (Forewarn's ETTR minus the best other strategy's):"]
    keys = list(dict.fromkeys((r.gpus, r.source, r.layout) for r in rows))
    for gpus, source, layout in keys:
        sel = [r for r in rows if (r.gpus, r.source, r.layout) == (gpus, source, layout)]
        fw = next(r for r in sel if r.strategy == "forewarn")
        best = max((r for r in sel if r.strategy != "forewarn"), key=lambda r: r.ettr)
        gain = fw.ettr - best.ettr
        lines.append(
            f"  {gpus:>6} {source:<6} {layout:<9} {gain * 100:+.2f} points against "
            f"{best.strategy} ({gain * gpus * 24:+,.0f} GPU-h/day); YOCO ratio "
            f"{fw.no_loss_share:.0%}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        stragglers = _stragglers(args)
    except InvalidInput as exc:
        print(f"forewarn goodput: {exc.message}", file=sys.stderr)
        return 2
    found = published()
    assumptions = _assumptions(args)
    profile = _profile(args)
    trace_path = args.trace or trace_mod.find_trace_dir()
    faults, trace_source = trace_mod.load(trace_path) if "trace" in args.source else ([], "")
    scenario = Scenario(
        tuple(args.gpus),
        tuple(args.source),
        args.days,
        args.seed,
        args.runs,
        tuple(args.layout),
        stragglers,
    )
    rows = compare(scenario, assumptions, profile, faults)
    sanity = run_sanity_check(args.sanity_seeds, args.seed) if args.sanity_seeds > 0 else None
    png, png_note = None, ""
    if args.no_png:
        pass
    elif args.layout:
        png_note = "PNG skipped: it shows the three strategies without --layout"
    elif importlib.util.find_spec("matplotlib") is None:
        png_note = "PNG skipped: matplotlib is not installed (pip install 'forewarn[server]')"
    else:
        png = write_png(rows, args.png)

    if args.json:
        doc = {
            "scenario": asdict(scenario),
            "assumptions": asdict(assumptions),
            "migration_pause_s": {str(g): assumptions.migration_pause_s(g) for g in args.gpus},
            "replica_recovery_s": {str(g): assumptions.replica_recovery_s(g) for g in args.gpus},
            "group_formation": None
            if assumptions.regroup_s is not None
            else {
                **asdict(group_formation()),
                "at": {str(g): group_formation_s(g) for g in args.gpus},
            },
            "fleet_model_mttf_h": {str(g): model_mttf_h(g) for g in args.gpus},
            "trace": trace_source,
            "predictor": {**asdict(profile), "notes": list(profile.notes)},
            "rows": [r.as_dict() for r in rows],
            "stragglers": {
                "term": None if stragglers is None else asdict(stragglers),
                "published": {**asdict(found), "path": str(STRAGGLERS_PATH)},
            },
            "sanity_64xh200": None
            if sanity is None
            else {
                "published_min": PUBLISHED_MIN,
                "model_min": {
                    k: {"mean": v[0], "min": v[1], "max": v[2]} for k, v in sanity.minutes.items()
                },
                "failures_mean": sanity.failures_mean,
                "seeds": sanity.seeds,
                "assumptions": asdict(sanity.assumptions),
            },
            "png": None if png is None else str(png),
            "png_note": png_note or None,
        }
        json.dump(doc, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0

    out = print
    out(
        f"forewarn goodput: {scenario.days:g} days, seed {scenario.seed}, "
        f"{scenario.runs} run(s) per row"
    )
    out("\nAssumptions (seconds unless stated):")
    for line in _describe_assumptions(assumptions, args.gpus):
        out(line)
    out("\nFailure sources:")
    if "fleet" in args.source:
        mttfs = ", ".join(f"{g:,} GPUs {model_mttf_h(g):.2f} h" for g in args.gpus)
        out(
            f"  fleet: Meta FAIR's published job MTTF (HPCA 2025: 7.9 h at 1,024 GPUs, 1.8 h "
            f"at 16,384, 14 min at 131,072; a power law between them; kinds in the StepFun "
            f"mix): {mttfs}"
        )
    if "trace" in args.source:
        out(
            f"  trace: {trace_source}: job-stopping hardware faults replayed on the job's "
            f"share of the 400 servers (copies shifted in time beyond 400 nodes)"
        )
    out(f"\nPredictor ({profile.source}):")
    for kind in KINDS:
        lead = profile.lead_median_s.get(kind)
        lead_s = "-" if lead is None else f"{lead / 60:.0f} min"
        out(f"  {kind:<11} recall {profile.recall.get(kind, 0.0):.2f}  median lead {lead_s}")
    out(f"  false alarms {profile.false_alarms_per_1000_gpu_days:.2f} per 1,000 GPU-days")
    for note in profile.notes:
        out(f"  ({note})")
    out("")
    for line in _table(rows):
        out(line)
    out(
        "  ETTR: training kept / wall time. 'no loss': failures moved away before they "
        "happened (nothing recomputed: the YOCO ratio); '<=1 step': at most the step in "
        "flight redone."
    )
    if args.layout:
        out("")
        for line in _layout_summary(rows):
            out(line)
    out("\nStragglers (GPUs that run slower without failing):")
    for line in _describe_stragglers(stragglers, found, assumptions, args.gpus):
        out(line)
    if stragglers is not None:
        for line in _straggler_summary(rows):
            out(line)
    if sanity is not None:
        out(
            f"\nSanity check, 64xH200 (published schedule: 3,000 steps, checkpoint every 100 "
            f"steps, a failure every 2,700-4,500 s; {sanity.seeds} seeds):"
        )
        ratios = sanity.ratios()
        for name, pub in PUBLISHED_MIN.items():
            mean, lo, hi = sanity.minutes[name]
            out(
                f"  {name:<19} published {pub:>5.0f} min   model {mean:>5.0f} min "
                f"({lo:.0f}-{hi:.0f}), x{ratios[name]:.2f} of live migration "
                f"(published x{pub / PUBLISHED_MIN['live migration']:.2f}), "
                f"{sanity.failures_mean[name]:.1f} failures"
            )
        sa = sanity.assumptions
        out(
            f"  assumed (not published): step {sa.step_s:g} s, save {sa.ckpt_save_s:g} s, "
            f"restart {sa.restart_s / 60:g} min, replica recovery "
            f"{sa.replica_recovery_s(64):.0f} s; peer-replica = TorchFT's per-step overhead "
            f"taken from the published ratio (+{PUBLISHED_MIN['peer-replica'] / 405 - 1:.0%})"
        )
    if png is not None:
        out(f"\nPNG: {png}")
    elif png_note:
        out(f"\n{png_note}")
    return 0
