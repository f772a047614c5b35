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

Each DDP it builds is DDP as it comes, without a comm hook (a hook a script registers on
``ElasticDDP.ddp`` is not carried to the next generation's DDP). DDP scales a gradient in one
of two ways: a gradient that is a view of its bucket already (kept from the step before and
zeroed in place, ``zero_grad(set_to_none=False)``) is divided by the world size in place; a
fresh one (set to None before the backward, ``zero_grad()``'s default) is multiplied by its
inverse as it is copied into the bucket. The two differ in the last bit for a world size that
is not a power of two, so a rebuild must leave the gradients as the undisturbed run would
have them: views of the new buckets, zeroed (:meth:`ElasticDDP.rebuild`). A script that sets
them to None then gets fresh ones either way. (A comm hook would scale every bucket the same
way whatever the script does, at the price of one more pass over the gradients a step when
they are fresh: DDP's built-in all-reduce hook cost +2-4 % of a small CPU step here.)

The step's first collective is timed without a Python call per bucket (:mod:`migrator.timing`):
a post-accumulate-grad hook on the parameter whose gradient completes DDP's first bucket notes
when it is ready (the bucket's all-reduce starts right after, in DDP's own hook on the same
gradient accumulator: this rank's arrival), and a callback at the end of the backward, queued
behind DDP's own (which waits for every bucket's all-reduce), notes that the backward's
collectives completed. That is three Python calls a step, whatever the number of buckets and
parameters. The times are the host's: on a GPU they are when the work was queued.

Gradients are views into DDP's buckets (``gradient_as_bucket_view=True`` unless the script
says otherwise): a gradient kept from step to step is reduced where it lies, and there is no
second copy of the gradients in memory. ``benchmarks/migration.py --parts c`` measures the
step against plain DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.hooks import RemovableHandle

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


class ElasticDDP(torch.nn.Module):
    """A DDP-wrapped module whose process group the job may replace between steps.

    Build it with ``job.ddp(module, **ddp_kwargs)``; call it like the module. ``module``
    stays the owner of the parameters (give ``module.parameters()`` to the optimizer).
    ``after_forward`` runs after each forward, before the backward's all-reduces (the job
    mirrors the rank's state there). ``clock`` times the step's first gradient bucket and the
    backward's collectives (see the module docstring).
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
        self._timer: RemovableHandle | None = None  # on the parameter completing bucket 0
        self._ready_at = 0.0  # when the first bucket was complete, this step
        self._queued_in = -1  # the clock's step whose backward end is queued

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
            self._time_first_bucket(self._plan[0] if self._plan else None)

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
            # buckets (a spare has none). DDP's constructor copies each gradient it finds
            # into its new bucket and makes it a view of it: a zero broadcast to the
            # gradient's shape costs one write of the bucket and no allocation, and leaves
            # the gradients as the undisturbed run has them (see the module docstring).
            for p in self.module.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
        with _adopt_bucket_plan(plan, cap):
            ddp = DDP(self.module, process_group=group, init_sync=initial, **self._kwargs)
        object.__setattr__(self, "_ddp", ddp)
        self._plan = None
        self._time_first_bucket(plan[0] if plan else None)

    # -- timing: the step's arrival at its first collective, and the collectives' end ---------

    def _time_first_bucket(self, bucket: list[int] | None) -> None:
        """Hook the parameter whose gradient completes DDP's first bucket: the last of
        ``bucket`` (their indices in the order their gradients were ready when DDP rebuilt
        its buckets); None: the last parameter, which DDP's first plan puts in its first
        bucket, until DDP settles its own. One hook: a bucket of small parameters (biases,
        norms) would otherwise cost a Python call each."""
        if self._timer is not None:
            self._timer.remove()
            self._timer = None
        params = [p for p in self.module.parameters() if p.requires_grad]
        if params:
            last = params[bucket[-1]] if bucket else params[-1]
            self._timer = last.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, _param: torch.Tensor) -> None:
        ddp: Any = self._ddp
        if ddp is None or not ddp.require_backward_grad_sync:  # no_sync(): no collective
            return
        if self._queued_in != self.clock.begun:  # a second backward in the step: untimed
            self._queued_in = self.clock.begun
            self._ready_at = self.clock.clock()
            Variable._execution_engine.queue_callback(self._behind_ddp)

    def _behind_ddp(self) -> None:
        # The engine runs its final callbacks in the order they were queued, and one queued
        # while they run after all of them: this one runs after DDP's own, which DDP queued
        # when its last bucket was ready and which waits for every bucket's all-reduce.
        Variable._execution_engine.queue_callback(self._collectives_done)

    def _collectives_done(self) -> None:
        if self.clock.arrive(at=self._ready_at):
            self.clock.completed()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.ddp(*args, **kwargs)
        if self._after_forward is not None and torch.is_grad_enabled():
            self._after_forward()
        return out
