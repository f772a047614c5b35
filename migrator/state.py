"""What a rank's state is made of, how it is listed for transfer and put back in place.

The state of a data-parallel rank has two parts:

- the *replica state*, equal on every data-parallel rank: model parameters and buffers,
  optimizer state and hyper-parameters, LR schedulers, the grad scaler. A spare may take it
  from any healthy replica.
- the *rank state*, this rank's own: the RNG states (Python, NumPy, torch CPU, the rank's
  CUDA device), the data position, the step. It is small (a few KB), snapshotted at every
  step boundary and mirrored to the agent's store, so that a dead rank's share can be
  rebuilt from a replica without the rank itself.

Tensors travel in a fixed order described by a *manifest* (name, shape, dtype) sent ahead of
them, so the receiver checks that its model matches and allocates the optimizer state it
does not have yet before receiving each tensor in place. Everything that is not a tensor
travels in one pickled *meta* blob.
"""

from __future__ import annotations

import array
import pickle
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from forewarn.errors import MigrationError

__all__ = [
    "DataPosition",
    "Registry",
    "capture_rank_state",
    "peek_step",
    "refuse_bound_sharding",
    "restore_rank_state",
]


def refuse_bound_sharding(models: Sequence[torch.nn.Module]) -> None:
    """Refuse modules whose sharding is bound to a process group at wrapping time: FSDP
    (``FullyShardedDataParallel``), FSDP2 (``fully_shard``) and DTensor tensor parallelism.
    A migration moves the job to a new process group (generation g+1), and such a module
    cannot be rebound to it (docs/migration.md, "What each layout is guaranteed")."""
    from torch.distributed import fsdp
    from torch.distributed.tensor import DTensor

    # FSDP2's class (torch >= 2.6); before it, fully_shard's parameters are DTensors all the same
    wrappers = tuple(
        c for c in (fsdp.FullyShardedDataParallel, getattr(fsdp, "FSDPModule", None)) if c
    )
    for i, model in enumerate(models):
        for name, module in model.named_modules():
            if isinstance(module, wrappers):
                what = f"an FSDP-wrapped module ({name or 'the model'})"
                break
        else:
            name = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), "")
            if not name:
                continue
            what = f"a DTensor parameter ({name})"
        raise MigrationError(
            f"model {i} holds {what}: its sharding is bound to the process group it was "
            "wrapped on, and a migration moves the job to a new group. Supported: replicated "
            "modules (job.ddp) and plain tensors declared rank_unique=True",
            details={"model": i, "found": what},
        )


class DataPosition(Protocol):
    """Anything that can say where it is in the data and go back there (e.g. a sampler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


Manifest = list[tuple[str, tuple[int, ...], str]]


@dataclass
class Registry:
    """The objects a training script registered with its job."""

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    scaler: Any = None
    data: DataPosition | None = None
    rank_unique: bool = False

    # -- tensors ---------------------------------------------------------------------------

    def _model_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for i, model in enumerate(self.models):
            for name, tensor in model.state_dict(keep_vars=False).items():
                out.append((f"model{i}.{name}", tensor))
        return out

    def _optimizer_slots(self) -> list[tuple[str, torch.optim.Optimizer, torch.Tensor, str]]:
        """(name, optimizer, parameter, state key) for every tensor of optimizer state."""
        out = []
        for i, opt in enumerate(self.optimizers):
            j = 0
            for group in opt.param_groups:
                for p in group["params"]:
                    for key in sorted(opt.state.get(p, {})):
                        if isinstance(opt.state[p][key], torch.Tensor):
                            out.append((f"opt{i}.p{j}.{key}", opt, p, key))
                    j += 1
        return out

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the replica state, in transfer order."""
        out = self._model_tensors()
        out += [(name, opt.state[p][key]) for name, opt, p, key in self._optimizer_slots()]
        return out

    def manifest(self) -> Manifest:
        return [(n, tuple(t.shape), str(t.dtype)) for n, t in self.tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    # -- meta ------------------------------------------------------------------------------

    def meta(self) -> dict[str, Any]:
        """The non-tensor replica state plus the manifest of the tensors that follow."""
        optimizers = []
        for opt in self.optimizers:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            scalars = {}
            j = 0
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in opt.state.get(p, {}).items():
                        if not isinstance(value, torch.Tensor):
                            scalars[(j, key)] = value
                    j += 1
            optimizers.append({"groups": groups, "scalars": scalars})
        return {
            "manifest": self.manifest(),
            "optimizers": optimizers,
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def prepare(self, manifest: Manifest) -> list[torch.Tensor]:
        """The tensors to receive into, in manifest order; allocates missing optimizer state.

        Raises:
            MigrationError: the sender's model or optimizer does not match this one.
        """
        params = [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]
        mine = dict(self._model_tensors())
        out = []
        for name, shape, dtype in manifest:
            if name.startswith("opt"):
                head, pj, key = name.split(".", 2)
                opt = self.optimizers[int(head[3:])]
                p = params[int(head[3:])][int(pj[1:])]
                state = opt.state.setdefault(p, {})
                t = state.get(key)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                    device = torch.device("cpu") if key == "step" else p.device
                    t = torch.empty(shape, dtype=getattr(torch, dtype[6:]), device=device)
                    state[key] = t
            else:
                t = mine.get(name)
                if t is None:
                    raise MigrationError(f"the sender has {name}, this model has not")
            if tuple(t.shape) != shape or str(t.dtype) != dtype:
                raise MigrationError(
                    f"{name}: sender has {shape} {dtype}, receiver {tuple(t.shape)} {t.dtype}"
                )
            out.append(t)
        if len(mine) != sum(1 for n, _, _ in manifest if n.startswith("model")):
            raise MigrationError("the sender's model has fewer tensors than this one")
        return out

    def apply_meta(self, meta: dict[str, Any]) -> None:
        """Load the non-tensor replica state received from a peer."""
        for opt, saved in zip(self.optimizers, meta["optimizers"], strict=True):
            for group, hyper in zip(opt.param_groups, saved["groups"], strict=True):
                group.update(hyper)
            flat = [p for g in opt.param_groups for p in g["params"]]
            for (j, key), value in saved["scalars"].items():
                opt.state.setdefault(flat[j], {})[key] = value
        for sched, state in zip(self.schedulers, meta["schedulers"], strict=True):
            sched.load_state_dict(state)
        if self.scaler is not None and meta["scaler"] is not None:
            self.scaler.load_state_dict(meta["scaler"])

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)


def capture_rank_state(step: int, data: DataPosition | None) -> bytes:
    """This rank's own state at a step boundary, pickled (a few KB)."""
    version, mt, gauss = random.getstate()
    # The dict form skips the legacy tuple's conversions (a third of the cost).
    np_state: Any = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "step": step,
        # Flat byte strings pickle as one copy; a 625-int tuple pickles int by int.
        "python": (version, array.array("Q", mt).tobytes(), gauss),
        "numpy": np_state,
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": None,
        "data": None if data is None else data.state_dict(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def restore_rank_state(blob: bytes, data: DataPosition | None) -> int:
    """Put back a state from :func:`capture_rank_state`; returns its step.

    The CUDA state goes to this process's current device: a spare on another GPU continues
    the source's random stream.
    """
    state = pickle.loads(blob)
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(array.array("Q", mt)), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))
    if data is not None and state["data"] is not None:
        data.load_state_dict(state["data"])
    return int(state["step"])


def peek_step(blob: bytes) -> int:
    """The step of a state from :func:`capture_rank_state`, without restoring it."""
    return int(pickle.loads(blob)["step"])


def tensors_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
