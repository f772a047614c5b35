"""The comparison itself: every cluster size x failure source x strategy, over seeded runs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from goodput.layouts import LAYOUTS, simulate_layout
from goodput.model import STRATEGIES, Assumptions, simulate, young_daly_interval_s
from goodput.profile import PredictorProfile
from goodput.schedule import Failure, fleet_schedule, job_mttf_h, trace_schedule
from goodput.stragglers import StragglerCost, Stragglers, cost
from goodput.stragglers import schedule as straggler_schedule
from goodput.trace import TraceFault

__all__ = ["Row", "Scenario", "compare"]

DAY_S = 86400.0


@dataclass(frozen=True)
class Scenario:
    """What to compare: cluster sizes, failure sources, window, seeds."""

    gpus: tuple[int, ...] = (1024, 16384)
    sources: tuple[str, ...] = ("fleet", "trace")
    days: float = 349.0
    seed: int = 0
    runs: int = 1
    layouts: tuple[str, ...] = ()
    """Parallel layouts (:data:`goodput.layouts.LAYOUTS`); empty: the three strategies of
    replicated data parallelism, as before layouts were modelled."""
    stragglers: Stragglers | None = None
    """The straggler term (:mod:`goodput.stragglers`); None: failures only."""


@dataclass
class Row:
    """One (cluster, source, strategy): means over the runs, with the spread of ETTR."""

    gpus: int
    source: str
    strategy: str
    failures_per_day: float
    mttf_h: float
    ckpt_interval_s: float
    ettr: float
    ettr_min: float
    ettr_max: float
    gpu_hours_lost_per_day: float
    no_loss_share: float
    at_most_one_step_share: float
    false_alarms_per_day: float
    lost_hours_per_day: dict[str, float] = field(default_factory=dict)
    layout: str = "ddp"
    straggler_episodes_per_day: float = 0.0
    straggler_moves_per_day: float = 0.0
    straggler_gpu_hours_lost_per_day: float = 0.0
    """GPU-hours a day the straggler episodes cost (slow steps, and Forewarn's moves)."""
    ettr_with_stragglers: float | None = None
    """ETTR with the straggler term too (None: no straggler term)."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _schedule(
    source: str,
    gpus: int,
    horizon_s: float,
    rng: np.random.Generator,
    faults: list[TraceFault] | None,
) -> list[Failure]:
    if source == "fleet":
        return fleet_schedule(gpus, horizon_s, rng)
    if source == "trace":
        if faults is None:
            raise ValueError("the trace source needs the trace's faults")
        return trace_schedule(faults, gpus, horizon_s, rng)
    raise ValueError(f"unknown failure source {source!r} (fleet or trace)")


def compare(
    scenario: Scenario,
    assumptions: Assumptions,
    profile: PredictorProfile,
    faults: list[TraceFault] | None = None,
) -> list[Row]:
    """Simulate every strategy on the same schedules; one row per cluster/source/strategy."""
    horizon_s = scenario.days * DAY_S
    rows = []
    for gpus in scenario.gpus:
        for source in scenario.sources:
            cases = _cases(scenario)
            outs: dict[tuple[str, str], list] = {c: [] for c in cases}
            slow: dict[tuple[str, str], list[tuple[StragglerCost, float]]] = {c: [] for c in cases}
            counts, intervals = [], []
            for run in range(scenario.runs):
                rng = np.random.default_rng([scenario.seed, gpus, run, source == "trace"])
                failures = _schedule(source, gpus, horizon_s, rng, faults)
                counts.append(len(failures))
                # The checkpoint interval is tuned to the failure rate the job really sees.
                mttf_s = horizon_s / max(1, len(failures))
                interval = assumptions.ckpt_interval_s or young_daly_interval_s(
                    assumptions.ckpt_save_s, mttf_s
                )
                intervals.append(interval)
                episodes = []
                if scenario.stragglers is not None:
                    srng = np.random.default_rng([scenario.seed, gpus, run, 11])
                    episodes = straggler_schedule(gpus, horizon_s, scenario.stragglers, srng)
                for layout, strategy in cases:
                    rng = np.random.default_rng([scenario.seed, gpus, run, 7])
                    if scenario.layouts:
                        out = simulate_layout(
                            LAYOUTS[layout],
                            strategy,
                            failures,
                            assumptions,
                            gpus=gpus,
                            rng=rng,
                            profile=profile,
                            horizon_s=horizon_s,
                            mttf_s=mttf_s,
                        )
                    else:
                        out = simulate(
                            strategy,
                            failures,
                            assumptions,
                            gpus=gpus,
                            rng=rng,
                            profile=profile,
                            horizon_s=horizon_s,
                            mttf_s=mttf_s,
                        )
                    outs[(layout, strategy)].append(out)
                    if scenario.stragglers is not None:
                        c = cost(
                            episodes,
                            scenario.stragglers,
                            mitigate=strategy == "forewarn",
                            pause_s=assumptions.migration_pause_s(gpus),
                            horizon_s=horizon_s,
                        )
                        slow[(layout, strategy)].append((c, out.ettr - c.lost_s / out.wall_s))
            n = float(np.mean(counts))
            for (layout, strategy), runs in outs.items():
                ettrs = [o.ettr for o in runs]
                lost: dict[str, float] = {}
                for o in runs:
                    for k, v in o.lost_s.items():
                        lost[k] = lost.get(k, 0.0) + v / 3600.0 / scenario.days / len(runs)
                rows.append(
                    Row(
                        gpus=gpus,
                        source=source,
                        strategy=strategy,
                        failures_per_day=n / scenario.days,
                        mttf_h=horizon_s / max(n, 1e-9) / 3600.0 if n else math.inf,
                        ckpt_interval_s=float(np.mean(intervals)),
                        ettr=float(np.mean(ettrs)),
                        ettr_min=min(ettrs),
                        ettr_max=max(ettrs),
                        gpu_hours_lost_per_day=float(
                            np.mean([o.gpu_hours_lost_per_day(gpus) for o in runs])
                        ),
                        no_loss_share=float(np.mean([o.no_loss_share for o in runs])),
                        at_most_one_step_share=float(
                            np.mean([o.at_most_one_step_share for o in runs])
                        ),
                        false_alarms_per_day=float(np.mean([o.false_alarms for o in runs]))
                        / scenario.days,
                        lost_hours_per_day=lost,
                        layout=layout,
                        **_straggler_fields(slow[(layout, strategy)], gpus, scenario.days),
                    )
                )
    return rows


def _straggler_fields(
    runs: list[tuple[StragglerCost, float]], gpus: int, days: float
) -> dict[str, float]:
    """The straggler columns of a row: means over the runs (none: no straggler term)."""
    if not runs:
        return {}
    return {
        "straggler_episodes_per_day": float(np.mean([c.episodes for c, _ in runs])) / days,
        "straggler_moves_per_day": float(np.mean([c.moves for c, _ in runs])) / days,
        "straggler_gpu_hours_lost_per_day": float(np.mean([c.lost_s for c, _ in runs]))
        * gpus
        / 3600.0
        / days,
        "ettr_with_stragglers": float(np.mean([e for _, e in runs])),
    }


def _cases(scenario: Scenario) -> list[tuple[str, str]]:
    """(layout, strategy) pairs to simulate, in the order rows are printed."""
    if not scenario.layouts:
        return [("ddp", s) for s in STRATEGIES]
    unknown = [name for name in scenario.layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown} (one of {sorted(LAYOUTS)})")
    return [(name, s) for name in scenario.layouts for s in LAYOUTS[name].strategies]


def model_mttf_h(gpus: int) -> float:
    """The fleet model's job MTTF, for the printed assumptions."""
    return job_mttf_h(gpus)


def write_png(rows: list[Row], path: str | Path) -> Path:
    """ETTR and GPU-hours lost per day, side by side for every cluster and source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.gpus, r.source) for r in rows})
    colours = {"checkpoint-restart": "#c0504d", "peer-replica": "#4f81bd", "forewarn": "#2e8b57"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(STRATEGIES)
    for j, strategy in enumerate(STRATEGIES):
        sel = [
            next(r for r in rows if (r.gpus, r.source) == g and r.strategy == strategy)
            for g in groups
        ]
        xs = [i + (j - 1) * width for i in range(len(groups))]
        axes[0].bar(xs, [r.ettr for r in sel], width, label=strategy, color=colours[strategy])
        axes[1].bar(
            xs,
            [r.gpu_hours_lost_per_day for r in sel],
            width,
            label=strategy,
            color=colours[strategy],
        )
    labels = [f"{g:,} GPUs\n{s}" for g, s in groups]
    for ax in axes:
        ax.set_xticks(range(len(groups)), labels)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("effective training time ratio (ETTR)")
    axes[0].set_ylim(min(0.9, min(r.ettr for r in rows) - 0.05), 1.0)
    axes[1].set_ylabel("GPU-hours lost per day")
    axes[1].set_yscale("log")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(STRATEGIES), frameon=False)
    fig.suptitle("Training time kept through failures (forewarn goodput)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
