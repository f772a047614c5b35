"""DistributedDataParallel that survives a change of process group.

:class:`ElasticDDP` is the module a training script calls; it holds a real
``torch.nn.parallel.DistributedDataParallel`` and rebuilds it on every rank whenever the job
moves to a new process-group generation. Rebuilding on *every* rank (survivors and the spare
alike) keeps DDP's internal state — bucket readiness, the one-time bucket rebuild and its
broadcast from rank 0 — in step across ranks. The bucket plan is carried over: survivors
reuse their current plan and a spare receives it with the state, so each gradient element
is reduced with the same neighbours, in the same order, as before the swap (with three or
more ranks gloo's ring sums depend on that order, so bitwise equality does too).

The rebuilt DDP skips its initial broadcast (``init_sync=False``): the parameters are
already equal on every rank, bit for bit, by construction of the handover.

Each DDP it builds gets a communication hook that times the step's first gradient bucket
(:mod:`migrator.timing`: this rank's arrival and the bucket's completion) and otherwise does
what DDP does without a hook, bit for bit: scale the bucket by ``1 / world_size`` (a
multiplication, as DDP's reducer does; the stock ``allreduce_hook`` divides, which differs in
the last bit for a world size that is not a power of two), then all-reduce it with a sum. A
script therefore cannot register a comm hook of its own on ``ElasticDDP.ddp``.

Gradients are views into DDP's buckets (``gradient_as_bucket_view=True`` unless the script
says otherwise): with a comm hook, DDP no longer folds the scaling into its copy of each
gradient into the bucket, so the hook's scaling would be one more pass over the gradients;
with the gradients in the buckets there is no copy at all, and the hook's scaling is the one
pass DDP itself makes in that mode (its own divides; this hook multiplies, as above). It
also saves the memory of a second copy of the gradients. ``benchmarks/migration.py --parts
c`` measures the step against plain DDP both ways.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from migrator.timing import StepClock

__all__ = ["ElasticDDP"]


@contextlib.contextmanager
def _adopt_bucket_plan(plan: list[list[int]] | None, cap_bytes: int) -> Iterator[None]:
    """Make DDP's constructor adopt ``plan`` instead of computing its first bucket plan."""
    if plan is None:
        yield
        return
    original = dist._compute_bucket_assignment_by_size

    def fixed(*_: Any, **__: Any) -> tuple[list[list[int]], list[int]]:
        # DDP reverses the plan it is given (gradients arrive last layer first).
        return list(reversed(plan)), [cap_bytes] * len(plan)

    dist._compute_bucket_assignment_by_size = fixed  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original  # type: ignore[attr-defined]


def _reduced(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    """The all-reduced bucket (a Python comm hook's future must hold a tensor)."""
    return fut.value()[0]


class ElasticDDP(torch.nn.Module):
    """A DDP-wrapped module whose process group the job may replace between steps.

    Build it with ``job.ddp(module, **ddp_kwargs)``; call it like the module. ``module``
    stays the owner of the parameters (give ``module.parameters()`` to the optimizer).
    ``after_forward`` runs after each forward, before the backward's all-reduces (the job
    mirrors the rank's state there). ``clock`` times the step's first gradient bucket.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        after_forward: Callable[[], None] | None = None,
        clock: StepClock | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.module = module
        self._after_forward = after_forward
        self.clock = clock or StepClock()
        ddp_kwargs.pop("process_group", None)
        ddp_kwargs.pop("init_sync", None)
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)  # see the module docstring
        self._kwargs = ddp_kwargs
        object.__setattr__(self, "_ddp", None)  # not a submodule: no duplicate state_dict
        self._plan: list[list[int]] | None = None  # kept once DDP settled it

    @property
    def ddp(self) -> DDP:
        if self._ddp is None:
            raise RuntimeError("ElasticDDP is used before its job joined a process group")
        return cast(DDP, self._ddp)

    def bucket_plan(self) -> list[list[int]] | None:
        """The current bucket plan as lists of parameter indices (DDP's own order)."""
        if self._ddp is None:
            return None
        self.settle()
        return self._plan if self._plan is not None else self._read_plan()

    def settle(self) -> None:
        """Read and keep the bucket plan once DDP has settled it; the job calls this at
        each step boundary, so that a handover does not read it while the ranks wait.

        Reading it is not free: the reducer's only view of its buckets is a zeroed copy of
        every gradient bucket (a third of the state's bytes under Adam, 0.3-0.5 s at 1 GB
        here). Cheap once kept: one attribute read.
        """
        if self._ddp is not None and self._plan is None and self._settled():
            self._plan = self._read_plan()

    def _settled(self) -> bool:
        """Whether DDP will not change its bucket plan again: it rebuilt its buckets in
        gradient-ready order after the first backward, or it never does
        (``find_unused_parameters`` without ``static_graph``)."""
        ddp: Any = self._ddp
        if getattr(ddp, "_has_rebuilt_buckets", False):
            return True
        return bool(ddp.find_unused_parameters and not ddp.static_graph)

    def _read_plan(self) -> list[list[int]]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        index = {id(p): i for i, p in enumerate(params)}
        ddp: Any = self._ddp
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        return [[index[id(p)] for p in b.parameters()] for b in buckets]

    def rebuild(
        self, group: dist.ProcessGroup, plan: list[list[int]] | None, *, initial: bool = False
    ) -> None:
        """Wrap the module anew on ``group`` with bucket plan ``plan`` (None: DDP's).

        ``initial``: the job's first group; DDP then broadcasts rank 0's parameters and
        buffers as it always does.
        """
        cap = int(self._kwargs.get("bucket_cap_mb", 25) * 1024 * 1024)
        if not initial and self._kwargs.get("gradient_as_bucket_view"):
            # At a step boundary the gradients are spent. As views they hold the old
            # buckets, which the new DDP would copy into buckets of its own.
            for p in self.module.parameters():
                p.grad = None
        with _adopt_bucket_plan(plan, cap):
            ddp = DDP(self.module, process_group=group, init_sync=initial, **self._kwargs)
        ddp.register_comm_hook(group, self._timed_allreduce)
        object.__setattr__(self, "_ddp", ddp)
        self._plan = None

    # No annotations: DDP compares them with its own classes, and postponed annotations are
    # strings. ``group``: the generation's process group; ``bucket``: a dist.GradBucket.
    def _timed_allreduce(self, group, bucket):  # type: ignore[no-untyped-def]
        """DDP's own all-reduce of ``bucket`` (see the module docstring), its first of the
        step timed: the future handed back completes after the clock noted the end."""
        first = self.clock.arrive()
        buf = bucket.buffer()
        buf.mul_(1.0 / group.size())  # the reducer's own scaling: grad * (1.0 / world_size)
        fut = group.allreduce([buf]).get_future()
        return fut.then(self.clock.completed_value if first else _reduced)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.ddp(*args, **kwargs)
        if self._after_forward is not None and torch.is_grad_enabled():
            self._after_forward()
        return out
