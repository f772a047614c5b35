"""Live migration of training ranks to warm spares (the in-job library and the job agent).

In the training script::

    from migrator import Job
    job = Job.from_env()
    job.register(model=model, optimizer=opt, scheduler=sched, data=batches)
    for step in job.steps(total):
        with step:
            ...

Started by ``forewarn launch --nproc N --spares K -- python train.py``; migrations are
asked for with ``forewarn migrate --job ID --rank R``. See ``docs/migration.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from migrator.data import ShardedIndices
    from migrator.ddp import ElasticDDP
    from migrator.faults import Fault, FaultPlan
    from migrator.fsdp import ElasticFSDP
    from migrator.job import Job, Step

__all__ = ["ElasticDDP", "ElasticFSDP", "Fault", "FaultPlan", "Job", "ShardedIndices", "Step"]

# Imported on first use: ``forewarn migrate``, ``forewarn launch --help`` and the service's
# wire/client parts must not pay for (or need) torch.
_LAZY = {
    "ShardedIndices": "migrator.data",
    "ElasticDDP": "migrator.ddp",
    "ElasticFSDP": "migrator.fsdp",
    "Fault": "migrator.faults",
    "FaultPlan": "migrator.faults",
    "Job": "migrator.job",
    "Step": "migrator.job",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'migrator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
