"""Sharded checkpoints: each rank's own state in a file of its own, for state no replica holds.

A job with peer copies (:mod:`migrator.peercopy`) keeps each rank's state in its buddy's
memory; a rank lost together with its buddy has no copy left anywhere in memory. With
``job.register(..., peer_copy_every=k, disk_copy_every=m)`` and a checkpoint directory
(``forewarn launch --checkpoint-dir DIR``), the copy round whose k steps hold a multiple of
``m`` also writes every rank's copy, from a background thread, to::

    DIR/step-<c>/rank-<r>.pt      one per rank: its tensors (a DTensor's local shard), the
                                  optimizer hyper-parameters, schedulers, scaler, its RNG
                                  states and data position, all at boundary c
    DIR/step-<c>/manifest.json    written once every rank's file is in place
    DIR/latest                    names the newest sealed step-<c> (only ever moves forward)

Each file is written under a temporary name, fsynced and renamed into place; a rank says so in
the job's key-value store (:func:`migrator.protocol.disk_copy_key`), and the rank that finds
every rank's key present first (one ``add`` on :func:`migrator.protocol.disk_sealed_key`)
writes the manifest and moves ``latest``. So ``latest`` always names a step every rank wrote:
a consistent checkpoint of the whole job, which ``forewarn launch --resume DIR`` loads
(:func:`migrator.checkpoint.load`, each rank its own file). The directory must be one every
node sees (a shared file system) for a job of several nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT",
    "is_sharded",
    "latest_step",
    "load_shard",
    "replace_atomically",
    "seal",
    "shard_dir",
    "write_shard",
]

FORMAT = 2
"""The sharded checkpoint's format (the one-file checkpoint of a replicated job is 1)."""


def shard_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def _rank_file(folder: Path, rank: int) -> Path:
    """Rank ``rank``'s file in a step's folder (:func:`shard_dir`)."""
    return folder / f"rank-{rank:05d}.pt"


def _sealed_folder(path: Path) -> Path | None:
    """The sealed step folder at ``path``: ``path`` itself, or the one the ``latest`` in it
    names; None when neither holds a manifest."""
    if (path / "manifest.json").exists():
        return path
    try:
        folder = path / (path / "latest").read_text().strip()
    except OSError:
        return None
    return folder if (folder / "manifest.json").exists() else None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a file system without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(final: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write ``final`` through ``write(file)`` under a temporary name, fsync it, rename it into
    place and fsync its directory: a reader sees the old file or the whole new one."""
    tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_shard(
    directory: Path,
    *,
    step: int,
    rank: int,
    world_size: int,
    meta: dict[str, Any],
    tensors: list[torch.Tensor],
    rank_state: bytes,
) -> Path:
    """Write rank ``rank``'s state at boundary ``step`` atomically; returns its path.

    ``meta``: the registry's non-tensor state and manifest (:meth:`Registry.meta`);
    ``tensors``: its tensors in the manifest's order, in host memory.
    """
    import torch  # here: the agent reads latest_step, and never imports torch

    final = _rank_file(shard_dir(directory, step), rank)
    final.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "meta": {k: v for k, v in meta.items() if k != "rank_state"},
        "tensors": tensors,
        "rank_state": rank_state,
    }
    replace_atomically(final, lambda fh: torch.save(payload, fh))
    return final


def latest_step(directory: Path) -> int | None:
    """The step of the checkpoint ``DIR/latest`` names (a sealed sharded one, or a one-file
    checkpoint of :mod:`migrator.checkpoint`), else None."""
    try:
        name = (directory / "latest").read_text().strip()
    except OSError:
        return None
    target = directory / name
    sealed = (target / "manifest.json").exists() or (name.endswith(".pt") and target.is_file())
    if not name.startswith("step-") or not sealed:
        return None
    try:
        return int(name[5:].split(".")[0])
    except ValueError:
        return None


def seal(directory: Path, *, step: int, world_size: int, info: dict[str, Any]) -> bool:
    """Write the manifest of the sharded checkpoint of ``step`` (every rank's file is in
    place: the caller checked) and point ``latest`` at it unless it names a later one.
    Returns whether ``latest`` moved."""
    folder = shard_dir(directory, step)
    missing = [r for r in range(world_size) if not _rank_file(folder, r).exists()]
    if missing:
        raise FileNotFoundError(f"ranks {missing} have no file in {folder}")
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "info": {**info, "written_at": time.time()},
    }
    replace_atomically(folder / "manifest.json", lambda fh: fh.write(json.dumps(manifest).encode()))
    current = latest_step(directory)
    if current is not None and current >= step:
        return False
    replace_atomically(directory / "latest", lambda fh: fh.write(f"{folder.name}\n".encode()))
    prune(directory, keep=KEEP_SEALED)
    return True


KEEP_SEALED = 2
"""Sealed sharded checkpoints a job's directory keeps: ``latest`` and the one before it."""


def prune(directory: Path, *, keep: int) -> list[Path]:
    """Remove the step folders older than the ``keep`` newest sealed ones, sealed or not (a
    round a killed rank never finished, with its temporary files); returns those removed.

    Safe while the job writes: sealing a step needs every rank's file of it, and each rank
    writes its rounds in order, so no rank still writes a round older than a sealed one.
    One-file checkpoints (``step-<c>.pt``) and anything else in the directory are left alone.
    """
    if keep < 1:
        raise ValueError(f"keep {keep} must be at least 1")
    folders: dict[int, Path] = {}
    for entry in directory.glob("step-*"):
        name = entry.name[5:]
        if entry.is_dir() and len(name) == 8 and name.isdigit():
            folders[int(name)] = entry
    sealed = sorted(s for s, f in folders.items() if (f / "manifest.json").exists())
    if len(sealed) <= keep:
        return []
    oldest_kept = sealed[-keep]
    removed = [f for s, f in sorted(folders.items()) if s < oldest_kept]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def is_sharded(path: Path) -> bool:
    """Whether ``path`` (a directory holding ``latest``, or a ``step-<c>`` folder) is a sharded
    checkpoint."""
    return _sealed_folder(path) is not None


def load_shard(path: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s file of the sharded checkpoint at ``path`` (its folder, or the directory
    whose ``latest`` names it).

    Raises:
        FileNotFoundError: no sealed checkpoint there, or no file of that rank.
        ValueError: the checkpoint is of another world size than the rank asks.
    """
    import torch

    folder = _sealed_folder(path)
    if folder is None:
        raise FileNotFoundError(f"no sealed sharded checkpoint at {path}")

    manifest = json.loads((folder / "manifest.json").read_text())
    if not 0 <= rank < manifest["world_size"]:
        raise ValueError(f"the checkpoint has {manifest['world_size']} ranks; this is rank {rank}")
    payload: dict[str, Any] = torch.load(
        _rank_file(folder, rank), map_location="cpu", weights_only=False
    )
    if payload.get("format") != FORMAT or payload["step"] != manifest["step"]:
        raise ValueError(f"{folder}: rank {rank}'s file is not of step {manifest['step']}")
    return payload
