"""The fleet simulator: GPUs that behave, and fail, the way real ones do.

A vectorised model of a whole fleet (``fleet.py``), its healthy workload (``workload.py``),
the physics of each failure mode and of benign noise (``precursors.py``), stragglers that run
slower without failing (``slowdowns.py``), calibrated to
published fleet figures (``calibration.py``) with every parameter in ``defaults.toml``
(``config.py``). It feeds the live source (``sim.source``) and writes labelled
datasets (``dataset.py``). ``docs/simulator.md`` tells the story; ``docs/datasets.md`` the
on-disk format.

For the predictor::

    from sim import generate_dataset, randomised
    info = generate_dataset("var/ds", gpus=1024, days=1, seed=7, params=randomised(7))

The simulator needs numpy (and pandas/pyarrow to write datasets), unlike the rest of the
node agent.
"""

from sim.config import FAILURE_KINDS, Params, default_params, load_params, randomised
from sim.dataset import DEFAULT_START_MS, DatasetInfo, generate_dataset
from sim.fleet import FleetModel, Tick
from sim.slowdowns import SLOWDOWN_KINDS

__all__ = [
    "DEFAULT_START_MS",
    "FAILURE_KINDS",
    "SLOWDOWN_KINDS",
    "DatasetInfo",
    "FleetModel",
    "Params",
    "Tick",
    "default_params",
    "generate_dataset",
    "load_params",
    "randomised",
]
