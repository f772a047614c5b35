"""The in-job library: register what makes up the training state, mark the step boundaries.

A training script started by ``forewarn launch`` builds a :class:`Job` from its environment,
registers its model(s), optimizer(s), LR scheduler(s), grad scaler and data position, and runs
its loop through :meth:`Job.steps`::

    job = Job.from_env()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    job.register(model=model, optimizer=opt, scheduler=sched, data=batches)
    ddp = job.ddp(model)                  # or job.all_reduce(...) in a plain loop
    for step in job.steps(1000):
        with step:
            x, y = batches.next()
            loss = loss_fn(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if step.ok:
            log(step.index, loss.item())

Every process of the job runs the same script. Active ranks join process-group generation 0
and train. Spares build their model and optimizer, then wait inside ``job.steps()`` until the
agent gives them a rank; they receive its state in place and continue at the step where it
stopped. A source whose rank moved to a spare leaves the loop with ``SystemExit(0)``.

The job mirrors this rank's own state (RNG, data position) to the agent's key-value store
for every step boundary, so that a spare can rebuild the rank without it. Inside step k,
before its collectives (after each forward of :meth:`ddp`'s module, before each
:meth:`all_reduce`), the rank writes its state as boundary k+1 will find it: a rank that dies
after its last collective of step k leaves the survivors at k+1, and its spare needs the
rank's state at k+1, not at k. The two last boundaries' states are kept (a key per step
parity, :func:`migrator.protocol.mirror_key`): one that dies before its collectives leaves
the survivors at k. At boundary k+1 the rank captures its state again (a local read,
:class:`~migrator.state.RankStateCapture`) and writes it only if it changed since (random
numbers drawn after the collectives), then checks for a migration command (a local flag):
one key-value store round trip a step, which also carries this rank's step timing
(:mod:`migrator.timing`: the compute before the step's first collective and the wait in it,
over the last ``timing_window`` steps) for the agent's heartbeat. ``benchmarks/migration.py``
measures it against a plain loop.

If a collective fails inside ``with step:`` because a peer died or wedged, the step's context
manager reports to the agent, waits for its decision, puts back this rank's state as it was
at the boundary, and — once a spare has taken the dead rank's place — the loop runs the same
step again. Any other exception — the script's own, an out-of-memory error included —
propagates unchanged (:func:`is_peer_failure` tells the two apart), after the job has told
the agent what it was, so the agent can report it and stop a crash loop.

With a checkpoint directory (``checkpoint_dir``, ``FOREWARN_CHECKPOINT_DIR``) a job that
stops at a step boundary writes one consistent checkpoint there (:mod:`migrator.checkpoint`);
``resume_from`` starts the active ranks from one, and :meth:`Job.steps` continues at its step.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forewarn.errors import MigrationError
from migrator import checkpoint
from migrator import protocol as P
from migrator.channels import Channels, PairChannels
from migrator.checkpoint import StopCheckpointer
from migrator.commands import CommandWatcher
from migrator.ddp import ElasticDDP
from migrator.faults import FaultPlan
from migrator.fsdp import ElasticFSDP
from migrator.handover import Handover, PlanHooks
from migrator.layouts import MeshLayout, publish_layout
from migrator.membership import Membership
from migrator.peercopy import PeerCopies
from migrator.state import (
    LAYOUTS,
    DataPosition,
    Layout,
    RankStateCapture,
    Registry,
    capture_rank_state,
    refuse_bound_sharding,
    restore_rank_state,
)
from migrator.timing import DEFAULT_WINDOW, StepClock, timing_key

__all__ = ["CollectiveFailed", "Job", "Step", "is_peer_failure", "spare_may_help"]

log = logging.getLogger(__name__)

TIMING_EVERY = 10
"""Without the state mirror (``mirror=False``), steps between two writes of the timing."""


def _seq(one: Any, many: Sequence[Any] | None) -> list[Any]:
    out = [] if one is None else [one]
    return out + list(many or ())


class Step:
    """One attempt at one training step; use as ``with step:``.

    Attributes:
        index: the step number (0-based).
        ok: the body finished without error.
        redo: the body failed because a peer was lost; the job recovered and the loop will
            run this step again.
    """

    def __init__(self, job: Job, index: int) -> None:
        self.job = job
        self.index = index
        self.ok = False
        self.redo = False

    def __enter__(self) -> Step:
        self.job._stepped = False
        self.job.clock.begin()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.ok = True
            self.job.clock.end(self.index)
            if self.job.rank is not None:
                self.job.hooks.fire("step_end", self.job.rank, self.index)
            return False
        if self.job.group is not None and is_peer_failure(exc):
            self.redo = self.job._recover(exc, self.index)
            return self.redo
        # The script's own error (a bug, an out-of-memory): it propagates unchanged, and the
        # agent learns what it was, so a crash loop can be named instead of eating spares.
        self.job._report_error(exc, self.index)
        return False


# Where a failed collective surfaces in Python: torch.distributed itself (a collective's
# wait, the key-value store, FSDP's hooks), DDP's reducer, or the autograd engine, which runs DDP's
# bucket all-reduces inside ``loss.backward()``. gloo raises plain RuntimeErrors there;
# NCCL and the key-value store raise torch.distributed.DistError subclasses.
_COLLECTIVE_MODULES = ("torch.distributed", "torch.nn.parallel", "torch.autograd", "torch._tensor")


class CollectiveFailed(RuntimeError):
    """A collective the job ran on its process group failed (:meth:`Job.all_reduce`): a
    peer died, wedged or closed its connection."""


_DISPATCH_MODULES = ("torch._ops", "torch.utils._pytree", "torch.utils._python_dispatch")
"""Frames that only pass a call on (an op's dispatch, a tree map): where an error was raised
is the first frame outside them (DTensor's functional collectives wait through them)."""


def _raised_in(exc: BaseException) -> str:
    """The module of the innermost Python frame ``exc`` went through, dispatch frames
    skipped ("" if none)."""
    modules = []
    tb = exc.__traceback__
    while tb is not None:
        modules.append(str(tb.tb_frame.f_globals.get("__name__", "")))
        tb = tb.tb_next
    for module in reversed(modules):
        if not any(module == m or module.startswith(m + ".") for m in _DISPATCH_MODULES):
            return module
    return ""


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a failed collective (a lost or wedged peer), not the script's
    own error.

    Told by the exception's type and where it was raised, never by its words: a
    ``torch.distributed.DistError``, a :class:`CollectiveFailed` (:meth:`Job.all_reduce`), or
    a plain ``RuntimeError`` raised out of
    torch.distributed, DDP or the autograd engine (gloo's failures). A ``RuntimeError``
    the script raises itself ("... timed out" included), any subclass of it (an
    out-of-memory error, ``NotImplementedError``) and every other exception are the
    script's and propagate.
    """
    dist_error = getattr(dist, "DistError", None)
    if isinstance(exc, CollectiveFailed) or (
        dist_error is not None and isinstance(exc, dist_error)
    ):
        return True
    if type(exc) is not RuntimeError:
        return False
    module = _raised_in(exc)
    return any(module == m or module.startswith(m + ".") for m in _COLLECTIVE_MODULES)


def spare_may_help(exc: BaseException) -> bool:
    """Whether a spare redoing the step could succeed where this process raised ``exc``.

    A ``RuntimeError`` can be the device's (a CUDA or driver error): a spare on another GPU
    may not raise it, so the agent lets one try once (the same error again is a crash loop).
    An out-of-memory error, ``NotImplementedError``, ``RecursionError`` and every other
    exception (``ValueError``, ``KeyError``, ...) are the script's: the spare would redo the
    same step on the same data and raise them again.
    """
    deterministic = (torch.OutOfMemoryError, NotImplementedError, RecursionError)
    return isinstance(exc, RuntimeError) and not isinstance(exc, deterministic)


def kv_address(env: Mapping[str, str]) -> str:
    """The key-value store's ``host:port`` a process of the job was given: ``FOREWARN_KV``,
    or ``FOREWARN_STORE`` (its former name) when that is unset."""
    return env["FOREWARN_KV"] if "FOREWARN_KV" in env else env["FOREWARN_STORE"]


class Job:
    """One process of a migratable job (an active rank or a warm spare).

    Built from collaborators: a :class:`~migrator.membership.Membership` (rank, generation,
    process group, DDP wrappers, the command watcher) and a
    :class:`~migrator.handover.Handover` (the planned, preventive and unplanned procedures),
    which gets the key-value store client, the membership, the registry, the transfer channels
    and the fault hooks. Pass ``channels`` to use another transport than the two-rank process
    groups.

    Args:
        kv: a client of the agent's key-value store.
        slot: this process's slot, its identity for the agent (not its rank).
        world_size: number of active ranks (unchanged by migrations).
        initial_rank: the rank this process starts with; None for a spare.
        job_id: the job's name.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: bound on every collective, transfer and wait (a wedged peer is declared
            lost after it).
        faults: a fault-injection plan (tests and demos).
        agent_url: the agent's HTTP endpoint (for :meth:`request_migration`).
        device: this rank's CUDA device, for NCCL.
        mirror: mirror the rank state to the key-value store at each boundary (needed to rebuild a
            dead rank from a replica).
        join_timeout_s: how long the ranks wait for each other to start (the launchers of
            a multi-node job do not start at the same moment).
        channels: opens the transport of each state transfer (default:
            :class:`~migrator.channels.PairChannels` on ``kv``).
        checkpoint_dir: where the job writes its checkpoint when it stops at a step
            boundary (no spare left, a crash loop, the launcher stopped); None: none.
            See :mod:`migrator.checkpoint`.
        resume_from: a checkpoint file or directory to start from: an active rank loads
            the replica state and its own rank state, and :meth:`steps` continues at the
            checkpoint's step.
        timing_window: steps this rank keeps its step timing over (the agent's medians).
    """

    def __init__(
        self,
        *,
        kv: P.KVStore,
        slot: int,
        world_size: int,
        initial_rank: int | None,
        job_id: str = "job",
        backend: str = "gloo",
        timeout_s: float = 30.0,
        faults: FaultPlan | None = None,
        agent_url: str | None = None,
        device: torch.device | None = None,
        mirror: bool = True,
        join_timeout_s: float = 300.0,
        channels: Channels | None = None,
        checkpoint_dir: str | Path | None = None,
        resume_from: str | Path | None = None,
        timing_window: int = DEFAULT_WINDOW,
    ) -> None:
        self.kv = kv
        self.slot = slot
        self.world_size = world_size
        self.job_id = job_id
        self.backend = backend
        self.timeout_s = timeout_s
        self.faults = faults or FaultPlan()
        self.agent_url = agent_url
        self.device = device
        self.mirror = mirror
        self.join_timeout_s = join_timeout_s
        self.registry = Registry()
        self.clock = StepClock(timing_window)
        """This rank's step timing (:mod:`migrator.timing`)."""
        self.events: list[dict[str, Any]] = []
        self.member = Membership(
            kv,
            world_size=world_size,
            rank=initial_rank,
            backend=backend,
            timeout_s=timeout_s,
            device=device,
        )
        self.hooks = PlanHooks(self.faults, kv, self)
        self.resume_from = Path(resume_from) if resume_from else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        checkpointer = None
        if checkpoint_dir:
            checkpointer = StopCheckpointer(
                kv,
                Path(checkpoint_dir),
                registry=self.registry,
                member=self.member,
                timeout_s=timeout_s + 30,
                job_id=job_id,
            )
        self.handover = Handover(
            kv=kv,
            member=self.member,
            registry=self.registry,
            channels=channels
            or PairChannels(
                kv, backend=backend, timeout_s=timeout_s, graveyard=self.member.graveyard
            ),
            faults=self.hooks,
            slot=slot,
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            note=self.note,
            checkpointer=checkpointer,
        )
        self._next = 0
        self._current = 0
        self._snapshot: bytes | None = None
        self._capture = RankStateCapture()
        # What this process wrote to each mirror key in generation _mirrored_gen.
        self._mirrored: dict[str, bytes] = {}
        self._mirrored_gen = -1
        self._stepped = False
        self._started = False
        self._published = False  # the manifest, for the spares (see _publish_manifest)
        self._boundary_t = 0.0
        self.mesh_layout: MeshLayout | None = None
        """How the job's ranks hold its state (set by :meth:`register`)."""

    # The membership's view, as the script reads it.

    @property
    def rank(self) -> int | None:
        """This process's rank now (None while it is a spare)."""
        return self.member.rank

    @property
    def gen(self) -> int:
        """The current process-group generation."""
        return self.member.gen

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The current generation's process group (None while a spare)."""
        return self.member.group

    @property
    def commands(self) -> CommandWatcher:
        return self.member.commands

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Job:
        """Build the job from the variables ``forewarn launch`` sets (``FOREWARN_*``)."""
        env = os.environ if environ is None else environ
        host, port = kv_address(env).rsplit(":", 1)
        timeout_s = float(env.get("FOREWARN_TIMEOUT_S", "30"))
        kv = P.as_kv_store(
            dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s + 30)
            )
        )
        initial = env.get("FOREWARN_INITIAL_RANK", "")
        kwargs: dict[str, Any] = {
            "kv": kv,
            "slot": int(env["FOREWARN_SLOT"]),
            "world_size": int(env["FOREWARN_WORLD_SIZE"]),
            "initial_rank": int(initial) if initial else None,
            "job_id": env.get("FOREWARN_JOB_ID", "job"),
            "backend": env.get("FOREWARN_BACKEND", "gloo"),
            "timeout_s": timeout_s,
            "faults": FaultPlan.from_json(env.get("FOREWARN_FAULTS")),
            "agent_url": env.get("FOREWARN_AGENT_URL") or None,
            "join_timeout_s": float(env.get("FOREWARN_JOIN_TIMEOUT_S", "300")),
            "checkpoint_dir": env.get("FOREWARN_CHECKPOINT_DIR") or None,
            "resume_from": env.get("FOREWARN_RESUME_FROM") or None,
            "timing_window": int(env.get("FOREWARN_TIMING_WINDOW") or DEFAULT_WINDOW),
        }
        if kwargs["backend"] == "nccl":
            local = int(env.get("LOCAL_RANK", env.get("FOREWARN_LOCAL_SLOT", "0")))
            kwargs["device"] = torch.device("cuda", local)
            torch.cuda.set_device(kwargs["device"])
        kwargs.update(overrides)
        return cls(**kwargs)

    # -- registration -----------------------------------------------------------------------

    def register(
        self,
        *,
        model: torch.nn.Module | None = None,
        models: Sequence[torch.nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        schedulers: Sequence[Any] | None = None,
        scaler: Any = None,
        data: DataPosition | None = None,
        rank_unique: bool = False,
        peer_copy_every: int | str | None = None,
        disk_copy_every: int | None = None,
    ) -> Layout:
        """Say what the training state is. Call once, before :meth:`steps`.

        Args:
            model, models: modules whose ``state_dict`` is the model state (unwrapped,
                not the DDP wrapper).
            optimizer, optimizers: their optimizers.
            scheduler, schedulers: LR schedulers (anything with ``state_dict``).
            scaler: a ``torch.amp.GradScaler``.
            data: the data position: ``state_dict()``/``load_state_dict()`` covering all
                that is rank-specific (shard, offset, epoch, shuffle seed).
            rank_unique: the model or optimizer state differs between ranks (a hand-sharded
                optimizer, tensor-parallel shards kept as plain tensors). Planned and
                preventive migrations still work (the rank itself sends it); rebuilding a
                dead rank from a replica is refused. Implied by a module of :meth:`fsdp`.
            peer_copy_every: ``k``: every ``k`` steps each rank's whole state is copied, in
                the background, into the memory of its buddy process (the next rank in
                the job's ring: on another node when there are several), so
                that a rank lost without warning is rebuilt from that copy and every rank
                goes back to its step (:mod:`migrator.peercopy`). For state no replica
                holds (rank-unique, FSDP2); costs four times the rank's state in host memory.
                ``"auto"``: ``k`` derived after the first 5 steps so that the copy into
                memory costs under 1 % of a step (rank 0's copy time and median step).
            disk_copy_every: ``m``, with peer copies and a checkpoint directory: the copy
                round whose k steps hold a multiple of ``m`` also writes every rank's copy to
                the directory, in the background (:mod:`migrator.shards`), so that a rank lost
                together with its buddy stops the job at that consistent checkpoint
                (``forewarn launch --resume DIR`` goes on from it, bitwise).

        Returns:
            The guarantees the layout allows (also logged and noted as ``registered``):
            replicated, rank-unique, FSDP2 or HSDP (docs/migration.md, "What each layout is
            guaranteed").

        Raises:
            MigrationError: a module sharded by FSDP1, by FSDP2 other than through
                :meth:`fsdp`, or by DTensor tensor parallelism (bound to the group it was
                wrapped on; see :func:`migrator.state.refuse_bound_sharding`).
        """
        sharded = [f.module for f in self.member.fsdps]
        refuse_bound_sharding(_seq(model, models), sharded)
        # Filled in place: the handover holds this same registry.
        reg = self.registry
        reg.models = _seq(model, models)
        reg.optimizers = _seq(optimizer, optimizers)
        reg.schedulers = _seq(scheduler, schedulers)
        reg.scaler, reg.data = scaler, data
        reg.rank_unique = rank_unique or bool(sharded)
        for opt in self.registry.optimizers:
            opt.register_step_post_hook(self._on_optimizer_step)
        if peer_copy_every is not None:
            reg.peer_copies = True
            self.handover.peers = PeerCopies(
                self.kv,
                reg,
                self.handover.channels,
                every=peer_copy_every,
                world=self.world_size,
                timeout_s=self.timeout_s,
                where=lambda: (self.gen, self.rank),
                graveyard=self.member.graveyard,
                disk=self.checkpoint_dir,
                disk_every=disk_copy_every,
            )
        elif disk_copy_every is not None:
            raise ValueError("disk_copy_every writes the peer copies: set peer_copy_every too")
        self.mesh_layout = self._mesh_layout(rank_unique)
        reg.holders = self.mesh_layout.holders
        layout = LAYOUTS[self.mesh_layout.kind]
        log.info("%s", layout)
        self.note(
            "registered", layout=layout.kind, planned=layout.planned, unplanned=layout.unplanned
        )
        return layout

    def _mesh_layout(self, rank_unique: bool) -> MeshLayout:
        """The job's layout, read from how its state is held (its mesh)."""
        replicate = max((f.replicate for f in self.member.fsdps), default=0)
        if self.handover.peers is not None and replicate <= 1:
            return MeshLayout.of("peer_copy", self.world_size)
        if any(f.kind == "fsdp2_tp" for f in self.member.fsdps):
            return MeshLayout.of("fsdp2_tp", self.world_size)
        if any(f.kind == "hsdp_tp" for f in self.member.fsdps):
            return MeshLayout.of("hsdp_tp", self.world_size, replicate=replicate)
        if replicate > 1:
            return MeshLayout.of("hsdp", self.world_size, replicate=replicate)
        if replicate == 1:
            return MeshLayout.of("fsdp2", self.world_size)
        return MeshLayout.of("rank_unique" if rank_unique else "replicated", self.world_size)

    def _on_optimizer_step(self, *_: Any) -> None:
        self._stepped = True

    def ddp(self, module: torch.nn.Module, **ddp_kwargs: Any) -> ElasticDDP:
        """Wrap ``module`` in DDP on the job's current process group, whatever it becomes."""
        wrapped = ElasticDDP(
            module, after_forward=self._mirror_ahead, clock=self.clock, **ddp_kwargs
        )
        self.member.ddps.append(wrapped)
        if self.group is not None:
            wrapped.rebuild(self.group, None, initial=True)
        return wrapped

    def fsdp(
        self,
        module: torch.nn.Module,
        *,
        layers: Sequence[torch.nn.Module] = (),
        replicate: int = 1,
        tp: int = 1,
        tp_plan: Callable[[torch.nn.Module, Any], Any] | None = None,
        **kwargs: Any,
    ) -> torch.nn.Module:
        """Shard ``module`` with FSDP2's ``fully_shard`` on the job's group, whatever it
        becomes; returns ``module`` (sharded in place). Call before building the optimizer
        and before :meth:`register`.

        ``layers`` are sharded first, each its own unit (e.g. the transformer blocks);
        ``kwargs`` go to every ``fully_shard`` call (not ``mesh``: the job's). On a spare the
        module is sharded when the spare is given its rank (a rank's shards depend on it),
        and the registered optimizers are then pointed at the sharded parameters.

        ``replicate=R`` (HSDP) shards on a two-dimensional mesh ``(R, world_size / R)``:
        rank ``r * S + s`` holds shard ``s`` in replica group ``r``; gradients are
        reduce-scattered within a replica group and all-reduced across them.

        ``tp=T, tp_plan=apply_tp`` composes tensor parallelism as TorchTitan does: a
        ``(world_size / T, T)`` mesh named ``("dp_shard", "tp")`` (rank ``d * T + t``),
        ``apply_tp(module, mesh["tp"])`` first (a ``parallelize_module`` plan with
        ``src_data_rank=None``), then ``fully_shard`` on ``mesh["dp_shard"]``. Both
        dimensions' groups are re-pointed at each generation; planned and preventive moves
        carry the rank's TP and FSDP shards; a rank lost without warning is rebuilt only
        with peer copies (no replica dimension).

        Both (``replicate=R, tp=T``, TorchTitan's HSDP + TP) shard on a three-dimensional
        mesh ``(R, world_size / (R * T), T)`` named ``("dp_replicate", "dp_shard", "tp")``:
        the plan on ``mesh["tp"]``, then ``fully_shard`` on ``mesh["dp_replicate",
        "dp_shard"]``. A rank lost without warning is rebuilt from the rank with the same
        shard and tensor-parallel index in another replica group.

        The shards are this rank's own within its replica group: planned and preventive
        moves carry them, bit for bit. A rank lost without warning is rebuilt under HSDP
        from the rank with its shard index in another replica group; without a replica
        group (``replicate=1``) it cannot be (``state_not_replicated``).

        Raises:
            MigrationError: the module already holds DTensor parameters (tensor
                parallelism; not supported) or this torch lacks what rebinding needs.
            ValueError: ``replicate`` does not divide the job's ranks.
        """
        from torch.distributed.tensor import DTensor

        if self.registry.models:
            raise RuntimeError("call job.fsdp(module) before job.register(...)")
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise MigrationError(
                "job.fsdp: the module already holds DTensor parameters (tensor parallelism "
                "or fully_shard applied before): not supported; pass a tensor-parallel plan "
                "as job.fsdp(module, tp=T, tp_plan=apply_tp)"
            )
        if tp < 1 or self.world_size % tp:
            raise ValueError(f"job.fsdp(tp={tp}): {self.world_size} ranks do not split so")
        if replicate < 1 or self.world_size % (replicate * tp):
            raise ValueError(
                f"job.fsdp(replicate={replicate}, tp={tp}): the {self.world_size} ranks do "
                "not split into that many replica groups of tensor-parallel groups"
            )
        device_type = self.device.type if self.device is not None else "cpu"
        sharded = ElasticFSDP(
            module,
            layers=layers,
            device_type=device_type,
            replicate=replicate,
            tp=tp,
            tp_plan=tp_plan,
            **kwargs,
        )
        if self.rank is not None:  # the job's groups are bound when it joins generation 0
            groups = [self.group] if self.group is not None and sharded.kind == "fsdp2" else None
            sharded.shard(self.rank, self.world_size, groups, self.registry.optimizers)
        self.member.fsdps.append(sharded)
        return module

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce ``tensor`` in place on the current generation (bounded by the timeout)."""
        if self.group is None:
            raise RuntimeError("all_reduce before the job joined a process group")
        self._mirror_ahead()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        first = self.clock.arrive()
        try:
            self.group.allreduce([tensor], opts).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # converted here, where it is known to be the group's
            raise CollectiveFailed(f"all_reduce on generation {self.gen}: {exc}") from exc
        if first:
            self.clock.completed()
        return tensor

    # -- the loop ---------------------------------------------------------------------------

    @property
    def step_index(self) -> int:
        """The next step to run (equal on every rank at a boundary)."""
        return self._next

    @property
    def is_spare(self) -> bool:
        return self.group is None

    def start(self) -> None:
        """Join generation 0, or as a spare wait for a rank. :meth:`steps` calls it."""
        if self._started:
            return
        self._started = True
        self._install_fault_hooks()
        if self.registry.rank_unique:
            self.kv.set(P.unique_key(self.slot), "1")
        if self.rank is not None and self.mesh_layout is not None:
            publish_layout(self.kv, self.mesh_layout)
        if self.rank is None:
            self._next = self.handover.serve_as_spare()
            return
        plans = None
        if self.resume_from is not None:
            # A spare gets its state from a rank, never from the checkpoint.
            payload = checkpoint.load(self.resume_from, rank=self.rank)
            if payload.get("world_size", self.world_size) != self.world_size:
                raise checkpoint.CheckpointError(
                    f"{self.resume_from} holds a job of {payload['world_size']} ranks; this "
                    f"one has {self.world_size}: launch it with --nproc {payload['world_size']}"
                )
            self._next = checkpoint.restore(payload, self.registry, self.rank)
            # "layouts": the key's name in checkpoints written before it was renamed.
            saved = payload.get("bucket_plans", payload.get("layouts"))
            plans = saved if self.member.ddps else None
            self.note("resumed", rank=self.rank, step=self._next, path=str(self.resume_from))
        self._arrive()
        self.member.join(0, self.rank, plans, initial=True)

    def _arrive(self) -> None:
        """Wait until every rank of generation 0 started (bounded by ``join_timeout_s``).

        Processes of a multi-node job start when their node's launcher does; the group's own
        rendezvous is bounded by ``timeout_s`` (the failure bound), which must not be spent
        waiting for a slow node to import torch.
        """
        self.kv.add(P.ARRIVED_KEY, 1)
        deadline = time.monotonic() + self.join_timeout_s
        while int(self.kv.add(P.ARRIVED_KEY, 0)) < self.world_size:
            if time.monotonic() >= deadline:
                raise P.HandoverTimeout(
                    f"waited {self.join_timeout_s:.0f} s for the {self.world_size} ranks to start"
                )
            time.sleep(0.02)

    def steps(self, total: int) -> Iterator[Step]:
        """Yield one :class:`Step` per step from the current one up to ``total``.

        A step lost to a dead peer is yielded again. On the source of a migration the loop
        ends with ``SystemExit(0)`` at the handover boundary.
        """
        self.start()
        self.clock.total = total
        while self._next < total:
            k = self._next
            self._boundary(k)
            step = Step(self, k)
            self._current = k
            yield step
            if step.ok:
                self._next = k + 1
            elif step.redo and self.handover.rewind is not None:
                self._next, self.handover.rewind = self.handover.rewind, None
        if self.handover.peers is not None:
            self.handover.peers.wait()  # the last round's copies, sent and received
        if self.rank is not None and (timing := self.clock.take(self.slot)) is not None:
            self.kv.set(timing_key(self.rank), timing)  # the last step's, once
        self.commands.close()
        if self.rank is not None:
            self.kv.set(P.done_key(self.rank), str(self.slot))

    def _boundary(self, k: int) -> None:
        assert self.rank is not None
        self.commands.passed = k  # before the flag is read (see migrator.commands)
        self._boundary_t = time.perf_counter()
        snapshot = self._snapshot = self._capture.capture(k, self.registry.data)
        if self.mirror:
            # Written inside the last step already, unless random numbers were drawn after its
            # collectives or none ran (see _mirror_ahead).
            self._mirror(k, snapshot)
        elif k % TIMING_EVERY == 0 and (timing := self.clock.take(self.slot)) is not None:
            self.kv.set(timing_key(self.rank), timing)
        if self.handover.peers is not None:
            self.handover.peers.at_boundary(k, snapshot)
        self.hooks.fire("step_start", self.rank, k)
        self.member.settle()
        if not self._published and self.rank == 0:
            self._publish_manifest()
        handover = self.handover
        cmd = self.commands.pending(self.gen) if handover.stop is None else None
        # A command was flagged (a local read: the watcher thread polls the key-value store): wait
        # here for the step S every rank hands over at (migrator.commands).
        if cmd is not None and not handover.await_stop(cmd, k, snapshot=snapshot):
            return
        if handover.stop is not None:
            if k > handover.stop:
                raise RuntimeError(f"rank {self.rank} passed the handover step {handover.stop}")
            if k == handover.stop:
                handover.hand_over(k, snapshot=snapshot, t0=self._boundary_t)

    def _publish_manifest(self) -> None:
        """Publish the replica state's manifest once the optimizers have their state, for
        the spares to allocate it ahead (:meth:`Registry.preallocate`). Once per process:
        state that appears later is allocated by the spare when it arrives."""
        optimizers = self.registry.optimizers
        if self.member.fsdps or not optimizers:
            self._published = True
        elif any(opt.state for opt in optimizers):
            manifest = self.registry.manifest()
            self.kv.set(P.MANIFEST_KEY, pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))
            self._published = True

    def _mirror_ahead(self) -> None:
        """Mirror this rank's state as boundary ``k+1`` will find it, from inside step ``k``.

        Called before the step's collectives; the key-value store is written only when the state
        changed since the last call (a plain loop all-reduces many tensors in a row).
        """
        if not self.mirror or self.rank is None:
            return
        k = self._current + 1
        self._mirror(k, self._capture.capture(k, self.registry.data))

    def _mirror(self, k: int, blob: bytes) -> None:
        """Write ``blob``, the state at boundary ``k``, to its mirror key unless it is there
        already; the last steps' timing rides along when it has news."""
        assert self.rank is not None
        if self._mirrored_gen != self.gen:  # written again once in each generation
            self._mirrored, self._mirrored_gen = {}, self.gen
        key = P.mirror_key(self.rank, k)
        if self._mirrored.get(key) == blob:
            return
        timing = self.clock.take(self.slot)
        if timing is None:
            self.kv.set(key, blob)
        else:
            self.kv.multi_set([key, timing_key(self.rank)], [blob, timing])
        self._mirrored[key] = blob

    def bucket_plans(self) -> list[Any]:
        """Each DDP wrapper's bucket plan."""
        return self.member.bucket_plans()

    def _recover(self, exc: BaseException, step: int) -> bool:
        """A collective failed in ``step``; True: the step is to be run again."""
        return self.handover.recover(exc, step, stepped=self._stepped, snapshot=self._snapshot)

    def _install_fault_hooks(self) -> None:
        points = {f.where for f in self.faults.faults}
        reg = self.registry

        def fire(where: Any) -> None:
            if self.rank is not None:
                self.hooks.fire(where, self.rank, self._current)

        if "forward" in points and reg.models:
            reg.models[0].register_forward_pre_hook(lambda *_: fire("forward"))
        if "backward" in points and reg.models:
            first = next(p for p in reg.models[0].parameters() if p.requires_grad)

            def on_grad(grad: torch.Tensor) -> torch.Tensor:
                fire("backward")
                return grad

            first.register_hook(on_grad)
        if "before_optimizer" in points and reg.optimizers:
            reg.optimizers[0].register_step_pre_hook(lambda *_: fire("before_optimizer"))

    def request_migration(self, rank: int, reason: str = "planned") -> str:
        """Ask the agent to migrate ``rank`` at the next boundary; returns the migration id.

        Leaves the random streams as they were: importing and using httpx draws from the
        global generators, which would make this run differ from one without the request.
        """
        if not self.agent_url:
            raise RuntimeError("no agent URL (FOREWARN_AGENT_URL) to send the request to")
        saved = capture_rank_state(0, None)
        try:
            import httpx

            body = {"job_id": self.job_id, "rank": rank, "reason": reason}
            url = f"{self.agent_url}/v1/migrations"
            resp = httpx.post(url, json=body, timeout=self.timeout_s)
            resp.raise_for_status()
            return str(resp.json()["migration_id"])
        finally:
            restore_rank_state(saved, None)

    def _report_error(self, exc: BaseException, step: int) -> None:
        """Tell the agent what the script raised (before the process exits with it)."""
        if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            return
        info: P.ScriptError = {
            "rank": self.rank,
            "step": step,
            "type": type(exc).__name__,
            "retryable": spare_may_help(exc),
            "message": str(exc)[:2000],
            "traceback": "".join(traceback.format_exception(exc))[-8000:],
        }
        try:
            P.put_json(self.kv, P.error_key(self.slot), info)
        except (RuntimeError, OSError) as err:  # the agent is gone: nobody to tell
            log.warning("could not report the error to the agent: %s", err)

    def note(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "t": time.time(), **fields})
        log.info("%s %s", event, fields)
