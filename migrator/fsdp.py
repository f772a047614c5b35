"""FSDP2 (``fully_shard``) and HSDP that survive a change of process group.

``fully_shard`` binds a module to a ``DeviceMesh`` when it wraps it: the mesh names its
process groups, and FSDP keeps them for its all-gathers, reduce-scatters and (HSDP) the
all-reduce across replica groups. A migration moves the job to a new group (generation g+1)
with every rank at the same rank, so the shards stay where they are and only the groups
behind them change. :class:`ElasticFSDP` shards the module once, on a mesh whose dimensions
have fixed c10d names (:func:`group_names`), and at each new generation points those names
at the new generation's groups (:func:`rebind`).

- FSDP2 (``replicate=1``): a one-dimensional mesh over the job's ranks, named
  :data:`GROUP_NAME`, bound to the generation's group itself.
- HSDP (``replicate=R``): a two-dimensional mesh ``(R, world/R)``, replicate across groups,
  shard within a group, as ``fully_shard`` takes it (rank ``r * S + s`` holds shard ``s``
  of replica group ``r``). Each generation builds its two sub-groups, the rank's replica
  group (its shard index's ranks) and its shard group (its replica group's ranks), from the
  key-value store (:meth:`migrator.membership.Membership.join`), and both names are re-pointed.
- FSDP2 + tensor parallel (``tp=T``, TorchTitan's composition): a ``(world/T, T)`` mesh
  named ``("dp_shard", "tp")``; the script's plan is applied on the ``tp`` sub-mesh, then
  ``fully_shard`` on ``dp_shard``; both dimensions' groups are re-pointed the same way.
- HSDP + tensor parallel (``replicate=R, tp=T``, TorchTitan's three dimensions): a
  ``(R, world/(R*T), T)`` mesh named ``("dp_replicate", "dp_shard", "tp")``; the plan on
  ``tp``, then ``fully_shard`` on the ``("dp_replicate", "dp_shard")`` sub-mesh (HSDP);
  three sub-groups a generation, re-pointed the same way.

A rank's shards are its own within its replica group: a planned or preventive move carries
them to the spare (the source sends each parameter's and optimizer state's local tensor,
``DTensor.to_local()``). A rank lost without warning is rebuilt, under HSDP, from the rank
with the same shard index (and tensor-parallel index) in another replica group; under FSDP2
(with or without tensor parallelism) no other rank holds them and it is refused unless the
job keeps peer copies (docs/migration.md, "What each layout is guaranteed").

A spare does not know which rank it will take, and a rank's shard depends on it (uneven
chunks), so a spare's module is sharded when it is assigned its rank, before it receives the
state; the optimizer the script built on the unsharded parameters is pointed at the sharded
ones (:meth:`ElasticFSDP.shard`). Before a rank has its first real groups the mesh names
*placeholder* groups that know their rank and size but have no backend: ``fully_shard`` only
reads those when it wraps; its first collective runs after the real groups are bound.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from forewarn.errors import MigrationError

__all__ = ["GROUP_NAME", "HSDP_NAMES", "ElasticFSDP", "group_names", "rebind"]

GROUP_NAME: Any = "forewarn:fsdp"  # a c10d ``GroupName`` (a NewType of str)
"""The c10d name of the current generation's group, as the FSDP mesh knows it."""

_CHECKED_ON = "torch 2.13"


def _internals_missing() -> str:
    """Which private torch piece :func:`rebind` and :func:`_mesh` rely on is absent ("" if none)."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    needs = {
        "distributed_c10d._register_process_group": hasattr(c10d, "_register_process_group"),
        "distributed_c10d._unregister_process_group": hasattr(c10d, "_unregister_process_group"),
        "ProcessGroup._set_group_name": hasattr(dist.ProcessGroup, "_set_group_name"),
        "DeviceMesh(_init_backend=, _rank=)": {"_init_backend", "_rank"}
        <= set(inspect.signature(DeviceMesh.__init__).parameters),
        "FSDPModule._get_fsdp_state": hasattr(FSDPModule, "_get_fsdp_state"),
        "distributed_c10d._update_default_pg": hasattr(c10d, "_update_default_pg"),
        "distributed_c10d._world.pg_map": hasattr(getattr(c10d, "_world", None), "pg_map"),
    }
    return ", ".join(name for name, ok in needs.items() if not ok)


def _require_internals() -> None:
    missing = _internals_missing()
    if missing:
        raise MigrationError(
            f"cannot rebind FSDP to a new process group: this torch ({torch.__version__}) "
            f"lacks {missing} (the migrator's FSDP support was checked on {_CHECKED_ON})",
            details={"missing": missing, "torch": torch.__version__},
        )


HSDP_NAMES: tuple[Any, Any] = ("forewarn:hsdp:replicate", "forewarn:hsdp:shard")
"""The c10d names of an HSDP mesh's replicate and shard dimensions' groups."""
TP_NAMES: tuple[Any, Any] = ("forewarn:fsdp_tp:dp_shard", "forewarn:fsdp_tp:tp")
"""The c10d names of an FSDP2 + tensor-parallel mesh's dp_shard and tp dimensions' groups."""
HSDP_TP_NAMES: tuple[Any, Any, Any] = (
    "forewarn:hsdp_tp:dp_replicate",
    "forewarn:hsdp_tp:dp_shard",
    "forewarn:hsdp_tp:tp",
)
"""The c10d names of an HSDP + tensor-parallel mesh's three dimensions' groups."""
DIMS = {
    "fsdp2": ("shard",),
    "hsdp": ("replicate", "shard"),
    "fsdp2_tp": ("dp_shard", "tp"),
    "hsdp_tp": ("dp_replicate", "dp_shard", "tp"),
}
"""Each layout's mesh dimension names, outer first (a rank's coordinates are its index in
the mesh's shape, row-major: on a ``(R, S)`` mesh ``(o, i)`` is rank ``o * S + i``)."""


def group_names(kind: str) -> tuple[Any, ...]:
    """The c10d names of the mesh dimensions' groups of a layout ``kind`` (:data:`DIMS`)."""
    return {
        "fsdp2": (GROUP_NAME,),
        "hsdp": HSDP_NAMES,
        "fsdp2_tp": TP_NAMES,
        "hsdp_tp": HSDP_TP_NAMES,
    }[kind]


def coords(rank: int, shape: Sequence[int]) -> list[int]:
    """``rank``'s index along each dimension of a mesh of ``shape`` (row-major)."""
    out = []
    for n in reversed(shape):
        rank, c = divmod(rank, n)
        out.append(c)
    return out[::-1]


def dim_ranks(rank: int, shape: Sequence[int]) -> list[list[int]]:
    """The job ranks of each of ``rank``'s mesh-dimension groups, outer first: along each
    dimension of a mesh of ``shape``, the ranks whose other coordinates are ``rank``'s
    (one dimension: every rank)."""
    at = coords(rank, shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return [[rank + (j - at[d]) * strides[d] for j in range(n)] for d, n in enumerate(shape)]


_REGISTERED: dict[Any, dist.ProcessGroup] = {}  # name -> the group c10d's maps hold for it


def _register(name: Any, group: dist.ProcessGroup, ranks: list[int]) -> None:
    """Name ``group`` in c10d's registry and in its world maps (its backend, the job ranks
    it spans: what ``dist.get_backend(group)`` and the c10d logger of a failed collective
    read), in place of the group the name had."""
    from torch.distributed import distributed_c10d as c10d

    group._set_group_name(name)
    with contextlib.suppress(RuntimeError, KeyError, ValueError):  # not registered yet
        c10d._unregister_process_group(name)
    c10d._register_process_group(name, group)
    old = _REGISTERED.pop(name, None)
    if old is not None:
        c10d._world.pg_map.pop(old, None)
        c10d._world.pg_group_ranks.pop(old, None)
    _REGISTERED[name] = group
    with contextlib.suppress(RuntimeError):  # a placeholder has no backend
        c10d._world.pg_map[group] = (group._get_backend_name(), dist.HashStore())
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}


def rebind(
    groups: Sequence[dist.ProcessGroup],
    modules: Sequence[torch.nn.Module],
    ranks: Sequence[list[int]] | None = None,
    names: Sequence[Any] | None = None,
) -> None:
    """Make ``groups`` (one per mesh dimension, named ``names``, :func:`group_names`;
    default: FSDP2's one, HSDP's two, or HSDP + TP's three) the ones every FSDP unit of
    ``modules`` (and every DTensor on the mesh, tensor-parallel ones included) use.

    The private torch internals the migrator's FSDP support uses are all in this function
    and :func:`_mesh` (checked on torch 2.13; :func:`_internals_missing` looks for them):

    - the c10d registry of group names (``_register_process_group``,
      ``ProcessGroup._set_group_name``): a ``DeviceMesh`` resolves its groups by name at
      each use, so re-registering the names moves the mesh, and every DTensor on it, to
      ``groups``;
    - FSDP's per-unit mesh info (``FSDPState._fsdp_param_groups[*].mesh_info``, the same on
      each ``FSDPParam``), which caches the group objects when the module is wrapped:
      re-running its ``__post_init__`` reads them again from the mesh;
    - c10d's world maps (``_world.pg_map``, ``_world.pg_group_ranks``) that
      ``dist.get_backend`` reads (the c10d logger asks it when a collective fails), and
      :func:`name_world`'s default group;
    - in :func:`_mesh`, ``DeviceMesh(_init_backend=False, _rank=)`` and its
      ``_dim_group_names``.

    Raises:
        MigrationError: this torch lacks one of them (another version than the one checked).
    """
    _require_internals()
    if names is None:
        names = group_names({1: "fsdp2", 2: "hsdp", 3: "hsdp_tp"}[len(groups)])
    if ranks is None:
        ranks = [list(range(g.size())) for g in groups]
    for name, group, spans in zip(names, groups, ranks, strict=True):
        _register(name, group, spans)
    infos: dict[int, Any] = {}
    for module in modules:
        for unit in module.modules():
            state_of = getattr(unit, "_get_fsdp_state", None)
            if state_of is None:
                continue
            param_groups = getattr(state_of(), "_fsdp_param_groups", None)
            if param_groups is None:
                raise MigrationError(
                    "cannot rebind FSDP: FSDPState._fsdp_param_groups is absent in torch "
                    f"{torch.__version__} (checked on {_CHECKED_ON})"
                )
            param_group: Any
            for param_group in param_groups:
                for owner in (param_group, *param_group.fsdp_params):
                    for info in (owner.mesh_info, owner.post_forward_mesh_info):
                        if info is not None:
                            infos[id(info)] = info
    for info in infos.values():
        dims = [getattr(info, "replicate_mesh_dim", None), getattr(info, "shard_mesh_dim", 0)]
        for dim in dims:
            if dim is not None and info.mesh.get_group(dim) not in groups:
                raise MigrationError("an FSDP unit is on a mesh that is not the job's own")
        info.__post_init__()  # re-reads the groups (and their ranks and sizes) from the mesh


def _mesh(rank: int, shape: Sequence[int], device_type: str, kind: str = "fsdp2") -> Any:
    """The job's mesh of ``shape``: one dimension over its ranks (its group named
    :data:`GROUP_NAME`), or two or three, named by ``kind`` (:data:`DIMS`,
    :func:`group_names`). Built directly (``DeviceMesh.from_group`` asks the default group
    for this process's rank, and a job has no default group)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(math.prod(shape)).view(*shape)
    mesh = DeviceMesh(
        device_type, ranks, mesh_dim_names=DIMS[kind], _init_backend=False, _rank=rank
    )
    mesh._dim_group_names = list(group_names(kind))
    return mesh


_WORLD: list[dist.ProcessGroup] = []  # the placeholder default group, kept referenced


def name_world(rank: int, size: int) -> None:
    """Give this process a placeholder default group (rank ``rank`` of ``size``, no backend)
    when it has none, as the job never calls ``init_process_group``.

    A ``DeviceMesh`` sliced from a mesh of two or more dimensions (HSDP's shard mesh, a
    tensor-parallel plan's sub-mesh) asks ``dist.get_rank()`` for this process's place in
    it, and only that: no collective runs on the default group. A process's rank does not
    change once given (a spare refuses another rank), so it is named once
    (``distributed_c10d._update_default_pg`` and ``_world``'s maps, checked on torch 2.13).
    """
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != size:
            raise MigrationError(
                f"this process's default group is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, the job's rank {rank} of {size}"
            )
        return
    kv = dist.HashStore()
    world = dist.ProcessGroup(kv, rank, size)
    _WORLD.append(world)
    c10d._world.pg_map[world] = ("undefined", kv)
    c10d._world.pg_group_ranks[world] = {i: i for i in range(size)}
    c10d._update_default_pg(world)


def placeholders(rank: int, shape: Sequence[int]) -> list[dist.ProcessGroup]:
    """Groups with the rank and size of each mesh dimension (:func:`dim_ranks`) and no
    backend, for sharding before the job's groups exist (``fully_shard`` and
    ``parallelize_module`` read only those when they wrap)."""
    return [
        dist.ProcessGroup(dist.HashStore(), spans.index(rank), len(spans))
        for spans in dim_ranks(rank, shape)
    ]


class ElasticFSDP:
    """A module sharded with ``fully_shard`` on the job's process groups, whatever they become.

    Build it with ``job.fsdp(module, layers=..., replicate=R, **fully_shard_kwargs)`` or
    ``job.fsdp(module, layers=..., tp=T, tp_plan=apply_tp)``, which returns the module
    itself (sharded in place, as ``fully_shard`` does; on a spare, once it has a rank).

    Args:
        module: the model; sharded last, as the root unit.
        layers: submodules sharded first, each its own unit (e.g. the transformer blocks).
        device_type: the mesh's device type (``"cpu"``; ``"cuda"`` with NCCL).
        replicate: replica groups (HSDP); 1: plain FSDP2 over every rank.
        tp: tensor-parallel degree; > 1: a ``(world / tp, tp)`` mesh named
            ``("dp_shard", "tp")``, ``tp_plan(module, mesh["tp"])`` applied first, then
            ``fully_shard`` on ``mesh["dp_shard"]`` (TorchTitan's ``apply_tp`` then
            ``apply_fsdp``).
        tp_plan: applies tensor parallelism to ``module`` on the tp sub-mesh (a
            ``parallelize_module`` plan with ``src_data_rank=None``: every rank takes its
            own slice of the weights it built, with no collective before the job's groups
            exist).
        fully_shard_kwargs: passed to every ``fully_shard`` call (not ``mesh``: the job's).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        layers: Iterable[torch.nn.Module] = (),
        device_type: str = "cpu",
        replicate: int = 1,
        tp: int = 1,
        tp_plan: Callable[[torch.nn.Module, Any], Any] | None = None,
        **fully_shard_kwargs: Any,
    ) -> None:
        if "mesh" in fully_shard_kwargs:
            raise ValueError("job.fsdp shards on the job's own mesh: do not pass mesh=")
        if replicate < 1 or tp < 1:
            raise ValueError(f"replicate and tp must be >= 1, not {replicate} and {tp}")
        if (tp > 1) != (tp_plan is not None):
            raise ValueError("tensor parallelism needs both tp > 1 and tp_plan")
        _require_internals()  # here, not first when a spare is given its rank
        reshard = fully_shard_kwargs.get("reshard_after_forward")
        if isinstance(reshard, int) and not isinstance(reshard, bool):
            raise ValueError("reshard_after_forward=<int> builds its own groups: not supported")
        self.module = module
        self.layers = list(layers)
        self.device_type = device_type
        self.replicate = replicate
        self.tp = tp
        self.tp_plan = tp_plan
        self.kind = {(False, False): "fsdp2", (True, False): "hsdp", (False, True): "fsdp2_tp"}.get(
            (replicate > 1, tp > 1), "hsdp_tp"
        )
        self.kwargs = fully_shard_kwargs
        self.rank: int | None = None
        """The rank the module is sharded as; None until it is sharded."""
        self._groups: list[dist.ProcessGroup] = []  # c10d's registry holds groups weakly
        self._size = 0

    def shape(self, size: int) -> tuple[int, ...]:
        """The mesh's shape over ``size`` ranks, outer dimension first (:data:`DIMS`)."""
        return {
            "fsdp2": (size,),
            "hsdp": (self.replicate, size // self.replicate),
            "fsdp2_tp": (size // self.tp, self.tp),
            "hsdp_tp": (self.replicate, size // (self.replicate * self.tp), self.tp),
        }[self.kind]

    def shard(
        self,
        rank: int,
        size: int,
        groups: Sequence[dist.ProcessGroup] | None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Shard the module as rank ``rank`` of ``size`` on ``groups`` (one per mesh
        dimension, :meth:`mesh_groups`; None: placeholders until the job's groups are
        built), and point ``optimizers`` at the sharded parameters (they were built on the
        unsharded ones).

        Raises:
            MigrationError: already sharded as another rank.
            ValueError: ``size`` does not split into the mesh's shape.
        """
        from torch.distributed.fsdp import fully_shard

        if self.rank is not None:
            if rank != self.rank:  # a spare's shards fit the rank it was first given
                raise MigrationError(
                    f"this spare's FSDP module is sharded as rank {self.rank}; it cannot "
                    f"take rank {rank}",
                    details={"sharded_as": self.rank, "asked": rank},
                )
            return
        if size % (self.replicate * self.tp):
            raise ValueError(
                f"{size} ranks do not split into {self.replicate} replica groups x "
                f"{self.tp} tensor-parallel ranks"
            )
        shape = self.shape(size)
        before = {id(p): name for name, p in self.module.named_parameters()}
        if self.kind != "fsdp2":
            name_world(rank, size)
        if groups is None:
            groups = placeholders(rank, shape)
        self._groups, self._size = list(groups), size
        names = group_names(self.kind)
        rebind(self._groups, [], dim_ranks(rank, shape), names)
        mesh = _mesh(rank, shape, self.device_type, self.kind)
        if self.tp_plan is not None:  # TorchTitan's order: tensor parallel, then FSDP
            self.tp_plan(self.module, mesh["tp"])
            mesh = mesh["dp_shard"] if self.replicate == 1 else mesh["dp_replicate", "dp_shard"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh, **self.kwargs)
        fully_shard(self.module, mesh=mesh, **self.kwargs)
        self.rank = rank
        after = dict(self.module.named_parameters())
        for opt in optimizers:
            for param_group in opt.param_groups:
                params = param_group["params"]
                for i, p in enumerate(params):
                    name = before.get(id(p))
                    if name is None:
                        continue
                    params[i] = after[name]
                    if p in opt.state:
                        opt.state[after[name]] = opt.state.pop(p)

    def mesh_groups(
        self, group: dist.ProcessGroup, new_group: Callable[[str, int, int], dist.ProcessGroup]
    ) -> list[dist.ProcessGroup]:
        """The groups of this module's mesh dimensions for a generation whose group of every
        rank is ``group``: ``group`` itself (FSDP2), or this rank's group along each of the
        two or three dimensions built with ``new_group(tag, rank_in_it, size)`` (``tag``
        names the sub-group, the same on each of its members: the dimension's name and the
        rank's coordinates along the others)."""
        shape = self.shape(group.size())
        if len(shape) == 1:
            return [group]
        at = coords(group.rank(), shape)
        out = []
        for d, name in enumerate(DIMS[self.kind]):
            others = "_".join(str(c) for e, c in enumerate(at) if e != d)
            out.append(new_group(f"{name}{others}", at[d], shape[d]))
        return out

    def reset(self) -> None:
        """Forget the step a failed collective cut short (``FSDPModule.reset_iter_state``:
        in-flight all-gathers and reductions dropped, every unit resharded), so that the
        step runs again from its start like on a spare that never ran it."""
        state_of = getattr(self.module, "_get_fsdp_state", None)
        if self.rank is None or state_of is None or state_of()._is_root is None:
            return  # never ran a forward: nothing to forget
        root = state_of()
        # The all-gathers in flight ran on the broken group: their work would raise (or
        # wait for a timeout) if waited on; they are dropped unwaited.
        # The gradients the cut step left on the unsharded parameters are dropped too:
        # reset_iter_state keeps them, and the step run again would add to them.
        root._comm_ctx.all_gather_state = None
        for state in root._state_ctx.all_states:
            for param_group in state._fsdp_param_groups:
                param_group._all_gather_result = None
                for param in param_group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None
        self.module.reset_iter_state()  # type: ignore[operator]

    def bind(self, groups: Sequence[dist.ProcessGroup]) -> None:
        """Point the module's mesh at ``groups`` (the new generation's, :meth:`mesh_groups`)."""
        if self.rank is not None:
            self._groups = list(groups)
            spans = dim_ranks(self.rank, self.shape(self._size))
            rebind(self._groups, [self.module], spans, group_names(self.kind))
