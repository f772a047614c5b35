"""The simulated fleets the default model is trained and judged on, reproducibly.

``python -m predictor.fleets OUT_DIR`` writes every fleet of :data:`TRAINING` and
:data:`EVALUATION` under ``OUT_DIR`` (``--only shipped``: those of :data:`SHIPPED`; each one a
dataset directory, ``docs/datasets.md``), skipping those already there. The same seeds give
the same bytes.

Mechanism-randomised fleets (``setting="mechanism"``) draw, besides every ``[ranges]`` number,
the *shape* of each failure physics and a random set of benign look-alikes
(:mod:`sim.shapes`), never one of ``exclude`` (leave-one-family-out, :mod:`predictor.lofo`);
``setting="families"`` makes a fleet with the default numbers and exactly ``families``.

Training fleets only: the failure rate is raised tenfold (``hazard.fleet_mttf_h`` 7.9 h ->
0.79 h at 1,024 GPUs) so that a fleet-week holds a few hundred failures instead of ~20; the
physics of each failure and of the benign noise is unchanged. Randomised fleets draw every
``[ranges]`` parameter of ``sim/defaults.toml`` from their seed; their sampling
period is coarsened to at least 30 s (the model replays in 60 s steps, and a 1 s fleet-week
would not fit in memory). Evaluation fleets keep the calibrated failure rate and seeds never
used in training.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forewarn.errors import InvalidInput
from predictor.dataset import read_manifest
from sim import generate_dataset, load_params, randomised
from sim.config import Params
from sim.shapes import draw, with_families

__all__ = ["EVALUATION", "SHIPPED", "TRAINING", "Fleet", "make"]

TRAINING_MTTF_H = 0.79
MIN_RANDOMISED_INTERVAL_S = 30.0


@dataclass(frozen=True)
class Fleet:
    """One simulated fleet: ``setting`` "default", "randomised" (numbers drawn from
    ``seed``), "mechanism" (numbers and shapes drawn, never ``exclude``) or "families"
    (default numbers, exactly ``families``)."""

    name: str
    setting: str
    seed: int
    gpus: int = 1024
    days: float = 7.0
    mttf_h: float | None = None  # None: the calibrated rate
    families: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    interval_s: float | None = None  # None: the setting's own

    def params(self) -> tuple[Params, float]:
        """Simulator parameters and sampling period."""
        if self.setting in ("default", "families"):
            over = {} if self.mttf_h is None else {"hazard.fleet_mttf_h": self.mttf_h}
            p = with_families(load_params(overrides=over), self.families)
            return p, self.interval_s or 60.0
        p = randomised(self.seed)
        if self.setting == "mechanism":
            rng = np.random.default_rng([self.seed, 0xFA])
            p = with_families(p, self.families or draw(rng, exclude=self.exclude))
        if self.mttf_h is not None:
            p["hazard"]["fleet_mttf_h"] = self.mttf_h
        interval = max(float(p["sampling"]["interval_s"]), MIN_RANDOMISED_INTERVAL_S)
        return p, self.interval_s or interval


TRAINING: tuple[Fleet, ...] = (
    Fleet("tr-default-s1001", "default", 1001, days=3.0, mttf_h=TRAINING_MTTF_H),
    *(
        Fleet(f"tr-mech-s{s}", "mechanism", s, days=3.0, mttf_h=TRAINING_MTTF_H, interval_s=60.0)
        for s in range(3001, 3008)
    ),
)
"""Half of the default model's fleets: one at the default shapes, seven mechanism-randomised
(every family of :mod:`sim.shapes` can be drawn), 1,024 GPUs for 3 days each; the other half is
:data:`SHIPPED` (its card's ``training.command``)."""
SHIPPED: tuple[Fleet, ...] = (
    Fleet("tr-default-s1001", "default", 1001, mttf_h=TRAINING_MTTF_H),
    Fleet("tr-default-s1002", "default", 1002, mttf_h=TRAINING_MTTF_H),
    *(Fleet(f"tr-rand-s{s}", "randomised", s, mttf_h=TRAINING_MTTF_H) for s in range(2001, 2005)),
)
"""Six fleet-weeks: two at the default shapes and four with randomised numbers, 1,024 GPUs for
7 days each. The previous default model was trained on these alone; the default model
(``predictor/shipped``) on these and :data:`TRAINING` (its card's ``training.command``).
Written under the same names as :data:`TRAINING`'s default fleet, so keep the two groups in
separate directories (var/ds2 and var/ds3 in the card's command)."""
EVALUATION: tuple[Fleet, ...] = (
    Fleet("eval-default-s4242", "default", 4242, gpus=2048),
    Fleet("eval-rand-s777", "randomised", 777),
)


def make(fleet: Fleet, out_dir: str | Path) -> Path:
    """Write one fleet under ``out_dir`` (kept if its manifest is already there and records
    the same seed, size and span; another fleet under that name is an error)."""
    path = Path(out_dir) / fleet.name
    if (path / "manifest.json").exists():
        m = read_manifest(path)
        days = (m["end_ms"] - m["start_ms"]) / 86_400_000
        if (m["seed"], m["gpus"]) != (fleet.seed, fleet.gpus) or not (
            fleet.days - 1 / 24 <= days <= fleet.days
        ):
            raise ValueError(
                f"{path} holds another fleet (seed {m['seed']}, {m['gpus']} GPUs, "
                f"{days:.2f} days) than {fleet.name} (seed {fleet.seed}, {fleet.gpus} GPUs, "
                f"{fleet.days:g} days); write this group into another directory"
            )
    else:
        params, interval_s = fleet.params()
        generate_dataset(
            path,
            gpus=fleet.gpus,
            days=fleet.days,
            interval_s=interval_s,
            seed=fleet.seed,
            params=params,
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m predictor.fleets", description=__doc__)
    parser.add_argument("out", help="directory for the dataset directories")
    parser.add_argument(
        "--only",
        choices=("training", "evaluation", "shipped"),
        default=None,
        help="one group; without it, training and evaluation (shipped: the six fleet-weeks "
        "the shipped model also trains on, in a directory of their own)",
    )
    args = parser.parse_args(argv)
    fleets = {"training": TRAINING, "evaluation": EVALUATION, "shipped": SHIPPED}
    try:
        for group in [args.only] if args.only else ["training", "evaluation"]:
            for f in fleets[group]:
                print(make(f, args.out), flush=True)
    except (ValueError, InvalidInput) as e:  # another fleet there, or not a dataset
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
