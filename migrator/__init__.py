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

from migrator.data import ShardedIndices
from migrator.ddp import ElasticDDP
from migrator.faults import Fault, FaultPlan
from migrator.job import Job, Step

__all__ = ["ElasticDDP", "Fault", "FaultPlan", "Job", "ShardedIndices", "Step"]
