"""What a rank's state is made of, how it is listed for transfer and put back in place.

The state of a data-parallel rank has two parts:

- the *replica state*, equal on every data-parallel rank: model parameters and buffers,
  optimizer state and hyper-parameters, LR schedulers, the grad scaler. A spare may take it
  from any healthy replica.
- the *rank state*, this rank's own: the RNG states (Python, NumPy, torch CPU, the rank's
  CUDA device), the data position, the step. It is small (a few KB), snapshotted at every
  step boundary and mirrored to the agent's key-value store, so that a dead rank's share can be
  rebuilt from a replica without the rank itself.

An FSDP2 module's parameters and optimizer state are DTensors (:mod:`migrator.fsdp`): each
is listed, sent and received as this rank's local shard (``DTensor.to_local()``, a view of
its storage), and the job's state is then rank-unique, not replicated.

Tensors travel in a fixed order described by a *manifest* (name, shape, dtype) sent ahead of
them, so the receiver checks that its model matches and allocates the optimizer state it
does not have yet before receiving each tensor in place. Everything that is not a tensor
travels in one pickled *meta* blob.
"""

from __future__ import annotations

import array
import ctypes
import pickle
import random
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from forewarn.errors import MigrationError

__all__ = [
    "LAYOUTS",
    "DataPosition",
    "Layout",
    "RankStateCapture",
    "Registry",
    "capture_rank_state",
    "peek_step",
    "refuse_bound_sharding",
    "restore_rank_state",
]


def refuse_bound_sharding(
    models: Sequence[torch.nn.Module], fsdp: Sequence[torch.nn.Module] = ()
) -> None:
    """Refuse modules whose sharding is bound to a process group the job cannot move:
    FSDP1 (``FullyShardedDataParallel``), FSDP2 (``fully_shard``) applied by the script
    itself rather than through ``job.fsdp``, and DTensor tensor parallelism. A migration
    moves the job to a new process group (generation g+1); only the modules in ``fsdp``
    (sharded by ``job.fsdp``) are rebound to it (docs/migration.md, "What each layout is
    guaranteed")."""
    from torch.distributed import fsdp as torch_fsdp
    from torch.distributed.tensor import DTensor

    ours = {id(u) for m in fsdp for u in m.modules()}
    ours_params = {id(p) for m in fsdp for p in m.parameters()}
    fsdp2 = getattr(torch_fsdp, "FSDPModule", None)  # torch >= 2.6
    for i, model in enumerate(models):
        what, hint = "", ""
        for name, module in model.named_modules():
            if isinstance(module, torch_fsdp.FullyShardedDataParallel):
                what = f"an FSDP1 FullyShardedDataParallel module ({name or 'the model'})"
                hint = "FSDP1 is not supported: shard with FSDP2 through job.fsdp(module)"
                break
            if fsdp2 is not None and isinstance(module, fsdp2) and id(module) not in ours:
                what = f"an FSDP2 module not sharded by job.fsdp ({name or 'the model'})"
                hint = "shard it with job.fsdp(module, **fully_shard_kwargs) instead"
                break
        else:
            for name, p in model.named_parameters():
                if isinstance(p, DTensor) and id(p) not in ours_params:
                    what = f"a DTensor parameter ({name})"
                    hint = (
                        "DTensor tensor parallelism is not supported outside job.fsdp: apply "
                        "it through job.fsdp(module, tp=T, tp_plan=apply_tp)"
                    )
                    break
        if not what:
            continue
        raise MigrationError(
            f"model {i} holds {what}: its sharding is bound to the process group it was "
            f"wrapped on, and a migration moves the job to a new group. {hint}. Supported: "
            "replicated modules (job.ddp), FSDP2 through job.fsdp, and plain tensors "
            "declared rank_unique=True",
            details={"model": i, "found": what},
        )


@dataclass(frozen=True)
class Layout:
    """What a job's registered state allows, stated at registration (``job.register``
    returns it and logs it; docs/migration.md, "What each layout is guaranteed")."""

    kind: str  # "replicated", "rank_unique", "fsdp2", "hsdp", "fsdp2_tp", "hsdp_tp", "peer_copy"
    planned: str  # planned and preventive moves
    unplanned: str  # a rank lost without warning

    def __str__(self) -> str:
        return (
            f"layout {self.kind}: planned/preventive: {self.planned}; unplanned: {self.unplanned}"
        )


_REFUSED = (
    "refused (state_not_replicated): no other rank holds this rank's {what}; "
    "restart from a checkpoint"
)
LAYOUTS = {
    "replicated": Layout(
        "replicated",
        "bitwise equal, 0 steps lost",
        "bitwise equal, 1 step lost, rebuilt from any healthy replica",
    ),
    "rank_unique": Layout(
        "rank_unique",
        "bitwise equal, 0 steps lost: the rank sends its own tensors",
        _REFUSED.format(what="state"),
    ),
    "fsdp2": Layout(
        "fsdp2",
        "bitwise equal, 0 steps lost: the rank sends its own shards",
        _REFUSED.format(what="shards (no replica group)"),
    ),
    "fsdp2_tp": Layout(
        "fsdp2_tp",
        "bitwise equal, 0 steps lost: the rank sends its own tensor-parallel and FSDP shards",
        _REFUSED.format(what="shards (no replica dimension; peer copies rebuild it)"),
    ),
    "peer_copy": Layout(
        "peer_copy",
        "bitwise equal, 0 steps lost: the rank sends its own state",
        "bitwise equal, at most k steps replayed (2k if the last copy had not landed): the "
        "lost rank's copy comes from its buddy's memory and every rank goes back to that "
        "copy's step; a rank and its buddy lost together stop the job at the last disk copy "
        "(disk_copy_every), which --resume continues bitwise",
    ),
    "hsdp": Layout(
        "hsdp",
        "bitwise equal, 0 steps lost: the rank sends its own shards",
        "bitwise equal, 1 step lost, rebuilt from the rank with the same shard index in "
        "another replica group (refused only if every rank of that shard index is lost)",
    ),
    "hsdp_tp": Layout(
        "hsdp_tp",
        "bitwise equal, 0 steps lost: the rank sends its own tensor-parallel and FSDP shards",
        "bitwise equal, 1 step lost, rebuilt from the rank with the same shard and "
        "tensor-parallel index in another replica group (refused only if every such rank "
        "is lost)",
    ),
}


def _is_dtensor(t: Any) -> bool:
    # No DTensor exists before its module is imported: a job without one never imports it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (a view of its storage)."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


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
    peer_copies: bool = False  # copied to a buddy every k steps (migrator.peercopy)
    holders: Callable[[int], list[int]] | None = None
    """The ranks that hold the same state as a rank (:meth:`MeshLayout.holders`); None
    before registration."""
    # Optimizer state allocated ahead of a transfer (see preallocate), by manifest name.
    ahead: dict[str, torch.Tensor] = field(default_factory=dict)

    # -- tensors ---------------------------------------------------------------------------

    def _model_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for i, model in enumerate(self.models):
            for name, tensor in model.state_dict(keep_vars=False).items():
                out.append((f"model{i}.{name}", _local(tensor)))
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
        """Every tensor of the replica state (a DTensor's local shard), in transfer order."""
        out = self._model_tensors()
        out += [(name, _local(opt.state[p][key])) for name, opt, p, key in self._optimizer_slots()]
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

    def _params(self) -> list[list[torch.Tensor]]:
        """Each optimizer's parameters in the order manifest names number them."""
        return [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]

    def _slot(
        self, name: str, params: list[list[torch.Tensor]]
    ) -> tuple[torch.optim.Optimizer, torch.Tensor, str]:
        """The optimizer, parameter and state key a manifest name ``opt{i}.p{j}.{key}``
        stands for (``params``: :meth:`_params`).

        Raises:
            MigrationError: this process has no such optimizer or parameter.
        """
        head, pj, key = name.split(".", 2)
        i, j = int(head[3:]), int(pj[1:])
        if i >= len(self.optimizers):
            raise MigrationError(f"the sender has {name}, this process has no optimizer {i}")
        if j >= len(params[i]):
            n = len(params[i])
            raise MigrationError(f"the sender has {name}, optimizer {i} has {n} params")
        return self.optimizers[i], params[i][j], key

    @staticmethod
    def _new_state(p: torch.Tensor, key: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        kind = getattr(torch, dtype[6:])
        if key != "step" and _is_dtensor(p):
            return torch.empty_like(p, dtype=kind)  # sharded like its parameter
        device = torch.device("cpu") if key == "step" else p.device
        return torch.empty(shape, dtype=kind, device=device)

    def preallocate(self, manifest: Manifest) -> int:
        """Allocate and write once the optimizer state ``manifest`` lists that this process
        lacks, kept aside until :meth:`prepare` uses it; returns the bytes allocated.

        A spare calls this while it waits for its assignment: its memory pages are then
        faulted in before the handover instead of while the state arrives, which made the
        spare's receive of a 1 GB state CPU-bound here (0.9-1.5 GB/s against 2.4-2.6 GB/s
        into memory already touched). A manifest that no longer matches at the handover
        costs nothing but the allocation: :meth:`prepare` allocates what does not match.

        Raises:
            MigrationError: the manifest names an optimizer or parameter this process lacks.
        """
        nbytes = 0
        params = self._params()
        for name, shape, dtype in manifest:
            if not name.startswith("opt"):
                continue
            opt, p, key = self._slot(name, params)
            have = opt.state.get(p, {}).get(key)
            if isinstance(have, torch.Tensor) or _is_dtensor(p):
                continue
            t = self._new_state(p, key, shape, dtype)
            t.zero_()
            self.ahead[name] = t
            nbytes += t.numel() * t.element_size()
        return nbytes

    def prepare(self, manifest: Manifest) -> list[torch.Tensor]:
        """The tensors to receive into, in manifest order; allocates missing optimizer state
        (or takes it from what :meth:`preallocate` set aside).

        Raises:
            MigrationError: the sender's model or optimizer does not match this one.
        """
        mine = dict(self._model_tensors())
        params = self._params()
        ahead, self.ahead = self.ahead, {}
        out = []
        for name, shape, dtype in manifest:
            if name.startswith("opt"):
                opt, p, key = self._slot(name, params)
                state = opt.state.setdefault(p, {})
                t = state.get(key)
                if not isinstance(t, torch.Tensor) or tuple(_local(t).shape) != shape:
                    t = ahead.get(name)
                    if t is None or tuple(t.shape) != shape or str(t.dtype) != dtype:
                        t = self._new_state(p, key, shape, dtype)
                    state[key] = t
                t = _local(t)
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


_HEAD = struct.Struct("<Bq")
"""A rank state's head: the format (1) and the step, ahead of the pickled parts. A blob that
starts with pickle's protocol byte (0x80) is the format before it, a pickled dict with the
step inside: checkpoints written by earlier versions hold those."""

_FORMAT = 1

_MT_BYTES = 624 * 4 + 4
"""NumPy's ``mt19937_state``: ``uint32_t key[624]; int pos``."""


class RankStateCapture:
    """Captures this rank's own state (:func:`capture_rank_state`) at a cost of a few
    microseconds when little changed since the last capture, which between two step
    boundaries is the rule: the job captures twice a step.

    Each part is read cheaply and compared with the last capture's; only a part that changed
    is encoded again. NumPy's ``get_state`` (34 us: it copies the key word by word) is
    called only when the Mersenne Twister's raw state (its key and position, read in place
    through the bit generator's ``ctypes.state_address``) differs from the last capture's,
    or when that capture held a cached Gaussian: using a cached Gaussian draws no number,
    so only ``get_state`` shows it. One case is not seen: a script that puts back with
    ``np.random.set_state`` a state equal to the current one but for a Gaussian cached in
    it; the capture then misses that cached value.
    """

    def __init__(self) -> None:
        self._random = _PyRandomView()
        self._py: Any = None  # Python's random state at the last capture (read or getstate)
        self._py_part = b""
        self._mt = _MTView()
        self._np_raw = b""  # the Mersenne Twister's raw state at the last get_state
        self._np_gauss = True  # the last get_state held a cached Gaussian (or none was made)
        self._np_part = b""
        self._body: tuple[Any, ...] | None = None
        self._pickled = b""

    def capture(self, step: int, data: DataPosition | None) -> bytes:
        """This rank's state at boundary ``step``, as :func:`restore_rank_state` takes it."""
        read = self._random.read()
        py = read if read is not None else random.getstate()
        if py != self._py:
            self._py = py
            version, mt, gauss = random.getstate() if read is not None else py
            # Flat byte strings pickle as one copy; a 625-int tuple pickles int by int.
            self._py_part = pickle.dumps(
                (version, array.array("Q", mt).tobytes(), gauss), pickle.HIGHEST_PROTOCOL
            )
        raw = self._mt.read()
        if raw is None or raw != self._np_raw or self._np_gauss:
            # The dict form skips the legacy tuple's conversions (a third of the cost).
            state: Any = np.random.get_state(legacy=False)
            self._np_raw = raw or b""
            self._np_gauss = raw is None or bool(state.get("has_gauss"))
            self._np_part = pickle.dumps(state, pickle.HIGHEST_PROTOCOL)
        cuda = None
        # Initialized implies available; is_available() asks the driver each call (15 us).
        if torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state().numpy().tobytes()
        body = (
            self._py_part,
            self._np_part,
            torch.get_rng_state().numpy().tobytes(),
            cuda,
            None if data is None else data.state_dict(),
        )
        if body != self._body:
            self._body, self._pickled = body, pickle.dumps(body, pickle.HIGHEST_PROTOCOL)
        return _HEAD.pack(_FORMAT, step) + self._pickled


def _bytes_at(address: int) -> np.ndarray:
    """The ``_MT_BYTES`` bytes at ``address``, viewed in place (no copy): the caller keeps
    the object that owns them referenced as long as the view is read."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * _MT_BYTES).from_address(address))


class _PyRandomView:
    """Python's global ``random`` generator's raw state (its index and 624 words) and its
    cached Gaussian, read in place: ``random.getstate()`` builds 625 ints for it. The view
    assumes CPython's ``RandomObject`` layout (``PyObject_HEAD; int index; uint32_t
    state[624]``) and is checked once against ``getstate()``; where that check fails
    (another interpreter or layout) :meth:`read` gives None and the caller uses
    ``getstate()``."""

    def __init__(self) -> None:
        self._view: np.ndarray | None = None
        inst = getattr(random, "_inst", None)
        if type(inst) is not random.Random or sys.implementation.name != "cpython":
            return
        view = _bytes_at(id(inst) + object.__basicsize__)
        index = int.from_bytes(view[:4].tobytes(), sys.byteorder, signed=True)
        words = view[4:].view(np.uint32)
        _, state, _ = inst.getstate()
        if index == state[-1] and tuple(words.tolist()) == state[:-1]:
            self._inst, self._view = inst, view

    def read(self) -> tuple[bytes, Any] | None:
        if self._view is None:
            return None
        return self._view.tobytes(), self._inst.gauss_next  # type: ignore[attr-defined]


class _MTView:
    """NumPy's global Mersenne Twister's raw state (2,500 bytes), read in place through a
    view made once per bit generator (its ``ctypes.state_address``); None where the global
    generator is not one (``np.random.set_bit_generator``)."""

    def __init__(self) -> None:
        self._bit_generator: Any = None  # kept referenced: the view points into it
        self._view: np.ndarray | None = None

    def read(self) -> bytes | None:
        bit_generator = np.random.mtrand._rand._bit_generator
        if bit_generator is not self._bit_generator:
            self._bit_generator, self._view = bit_generator, None
            if type(bit_generator) is np.random.MT19937:
                self._view = _bytes_at(bit_generator.ctypes.state_address)
        return None if self._view is None else self._view.tobytes()


def capture_rank_state(step: int, data: DataPosition | None) -> bytes:
    """This rank's own state at a step boundary (a few KB): the RNGs' and the data position.
    A job captures through its own :class:`RankStateCapture`, which re-uses what did not
    change."""
    return RankStateCapture().capture(step, data)


def restore_rank_state(blob: bytes, data: DataPosition | None) -> int:
    """Put back a state from :func:`capture_rank_state`; returns its step.

    The CUDA state goes to this process's current device: a spare on another GPU continues
    the source's random stream.
    """
    step, state = _decode(blob)
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(array.array("Q", mt)), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))
    if data is not None and state["data"] is not None:
        data.load_state_dict(state["data"])
    return step


def peek_step(blob: bytes) -> int:
    """The step of a state from :func:`capture_rank_state`, without restoring it."""
    if blob[:1] == b"\x80":  # the format before the head (see _HEAD)
        return int(pickle.loads(blob)["step"])
    return _HEAD.unpack_from(blob)[1]


def _decode(blob: bytes) -> tuple[int, dict[str, Any]]:
    if blob[:1] == b"\x80":
        state = pickle.loads(blob)
        return int(state["step"]), state
    version, step = _HEAD.unpack_from(blob)
    if version != _FORMAT:
        raise MigrationError(f"a rank state of format {version}: this version reads {_FORMAT}")
    py, numpy_state, cpu, cuda, data = pickle.loads(blob[_HEAD.size :])
    return step, {
        "python": pickle.loads(py),
        "numpy": pickle.loads(numpy_state),
        "torch": cpu,
        "cuda": cuda,
        "data": data,
    }


def tensors_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
