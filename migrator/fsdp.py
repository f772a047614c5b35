"""FSDP2 (``fully_shard``) that survives a change of process group.

``fully_shard`` binds a module to a ``DeviceMesh`` when it wraps it: the mesh names its
process group, and FSDP keeps that group for its all-gathers and reduce-scatters. A
migration moves the job to a new group (generation g+1) with every rank at the same rank, so
the shards stay where they are and only the group behind them changes. :class:`ElasticFSDP`
shards the module once, on a mesh whose one dimension is named :data:`GROUP_NAME`, and at each
new generation points that name at the new group (:func:`rebind`).

A rank's shards are its own (no other rank holds them): a planned or preventive move carries
them to the spare (the source sends each parameter's and optimizer state's local tensor,
``DTensor.to_local()``), while a rank lost without warning cannot be rebuilt (the job
registers rank-unique state; docs/migration.md, "What each layout is guaranteed").

A spare does not know which rank it will take, and a rank's shard depends on it (uneven
chunks), so a spare's module is sharded when it is assigned its rank, before it receives the
state; the optimizer the script built on the unsharded parameters is pointed at the sharded
ones (:meth:`ElasticFSDP.shard`). Before a rank has its first real group the mesh names a
*placeholder* group that knows its rank and size but has no backend: ``fully_shard`` only
reads those when it wraps; its first collective runs after the real group is bound.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from forewarn.errors import MigrationError

__all__ = ["GROUP_NAME", "ElasticFSDP", "rebind"]

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


def rebind(group: dist.ProcessGroup, modules: Sequence[torch.nn.Module]) -> None:
    """Make ``group`` the one every FSDP unit of ``modules`` (and their DTensors) use.

    The private torch internals the migrator's FSDP support uses are all in this function
    and :func:`_mesh` (checked on torch 2.13; :func:`_internals_missing` looks for them):

    - the c10d registry of group names (``_register_process_group``,
      ``ProcessGroup._set_group_name``): a ``DeviceMesh`` resolves its group by name at each
      use, so re-registering :data:`GROUP_NAME` moves the mesh, and every DTensor on it, to
      ``group``;
    - FSDP's per-unit mesh info (``FSDPState._fsdp_param_groups[*].mesh_info``, the same on
      each ``FSDPParam``), which caches the group object when the module is wrapped:
      re-running its ``__post_init__`` reads it again from the mesh;
    - in :func:`_mesh`, ``DeviceMesh(_init_backend=False, _rank=)`` and its
      ``_dim_group_names``.

    Raises:
        MigrationError: this torch lacks one of them (another version than the one checked).
    """
    from torch.distributed import distributed_c10d as c10d

    _require_internals()
    group._set_group_name(GROUP_NAME)
    with contextlib.suppress(RuntimeError, KeyError, ValueError):  # not registered yet
        c10d._unregister_process_group(GROUP_NAME)
    c10d._register_process_group(GROUP_NAME, group)
    infos: dict[int, Any] = {}
    for module in modules:
        for unit in module.modules():
            state_of = getattr(unit, "_get_fsdp_state", None)
            if state_of is None:
                continue
            groups = getattr(state_of(), "_fsdp_param_groups", None)
            if groups is None:
                raise MigrationError(
                    "cannot rebind FSDP: FSDPState._fsdp_param_groups is absent in torch "
                    f"{torch.__version__} (checked on {_CHECKED_ON})"
                )
            param_group: Any
            for param_group in groups:
                for owner in (param_group, *param_group.fsdp_params):
                    for info in (owner.mesh_info, owner.post_forward_mesh_info):
                        if info is not None:
                            infos[id(info)] = info
    for info in infos.values():
        if info.mesh.get_group(getattr(info, "shard_mesh_dim", 0)) is not group:
            raise MigrationError("an FSDP unit is on a mesh that is not the job's own")
        info.__post_init__()  # re-reads the group (and its rank and size) from the mesh


def _mesh(rank: int, size: int, device_type: str) -> Any:
    """A one-dimensional mesh over the job's ``size`` ranks, its group named
    :data:`GROUP_NAME`. Built directly (``DeviceMesh.from_group`` asks the default group
    for this process's rank, and a job has no default group)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device_type, torch.arange(size), _init_backend=False, _rank=rank)
    mesh._dim_group_names = [GROUP_NAME]
    return mesh


class ElasticFSDP:
    """A module sharded with ``fully_shard`` on the job's process group, whatever it becomes.

    Build it with ``job.fsdp(module, layers=..., **fully_shard_kwargs)``, which returns the
    module itself (sharded in place, as ``fully_shard`` does; on a spare, once it has a rank).

    Args:
        module: the model; sharded last, as the root unit.
        layers: submodules sharded first, each its own unit (e.g. the transformer blocks).
        device_type: the mesh's device type (``"cpu"``; ``"cuda"`` with NCCL).
        fully_shard_kwargs: passed to every ``fully_shard`` call (not ``mesh``: the job's).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        layers: Iterable[torch.nn.Module] = (),
        device_type: str = "cpu",
        **fully_shard_kwargs: Any,
    ) -> None:
        if "mesh" in fully_shard_kwargs:
            raise ValueError("job.fsdp shards on the job's own mesh: do not pass mesh=")
        _require_internals()  # here, not first when a spare is given its rank
        reshard = fully_shard_kwargs.get("reshard_after_forward")
        if isinstance(reshard, int) and not isinstance(reshard, bool):
            raise ValueError("reshard_after_forward=<int> builds its own groups: not supported")
        self.module = module
        self.layers = list(layers)
        self.device_type = device_type
        self.kwargs = fully_shard_kwargs
        self.rank: int | None = None
        """The rank the module is sharded as; None until it is sharded."""
        self._placeholder: dist.ProcessGroup | None = None

    def shard(
        self,
        rank: int,
        size: int,
        group: dist.ProcessGroup | None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Shard the module as rank ``rank`` of ``size`` on ``group`` (None: a placeholder
        until the job's group is built), and point ``optimizers`` at the sharded parameters
        (they were built on the unsharded ones)."""
        from torch.distributed.fsdp import fully_shard

        if self.rank is not None:
            if rank != self.rank:  # a spare's shards fit the rank it was first given
                raise MigrationError(
                    f"this spare's FSDP module is sharded as rank {self.rank}; it cannot "
                    f"take rank {rank}",
                    details={"sharded_as": self.rank, "asked": rank},
                )
            return
        before = {id(p): name for name, p in self.module.named_parameters()}
        if group is None:  # c10d's registry holds groups weakly: keep it referenced
            group = self._placeholder = dist.ProcessGroup(dist.HashStore(), rank, size)
        rebind(group, [])
        mesh = _mesh(rank, size, self.device_type)
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

    def bind(self, group: dist.ProcessGroup) -> None:
        """Point the module's mesh at ``group`` (the new generation's)."""
        if self.rank is not None:
            rebind(group, [self.module])
            self._placeholder = None
