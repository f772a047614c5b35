"""The control protocol between the job agent and its ranks: store keys and bounded waits.

Everything the agent and the processes of a job say to each other goes through the
rendezvous store the agent hosts (a ``torch.distributed.TCPStore``), so that no message lives
in a process that may die. This module names every key in one place and gives the one
primitive every participant uses to wait: a poll with a deadline. Nothing here blocks without
a timeout.

Key map (``g`` is a process-group generation, ``r`` a rank, ``s`` a process slot)::

    gen                      current generation (agent)
    g{g}/roster              JSON {rank: slot} of generation g (agent)
    g{g}/pg/...              gloo/NCCL rendezvous of generation g (PrefixStore)
    g{g}/cmd                 planned/preventive migration for generation g (agent)
    g{g}/stop/{id}           the step S all ranks hand over at for migration ``id`` (agent,
                             once every rank acknowledged the command: m/{id}/ack/{r})
    g{g}/suspect             the agent suspects a failure in generation g
    g{g}/alive/{r}           a survivor's report after a failed collective (rank)
    g{g}/alive_n             how many survivors reported (counter)
    g{g}/recovery            the agent's decision after a failure
    slot{s}/assign           what a spare is to become (agent)
    slot{s}/unique           the process registered rank-unique state
    err/{s}                  the exception the script of slot ``s`` raised (JSON: rank, step,
                             type, message, traceback), written before the process exits
    rs/{r}                   mirror of rank r's own state (RNG, data position) at its last
                             step boundary, for rebuilding it from a replica
    manifest                 the replica state's manifest (pickled), published by rank 0
                             once its optimizer state exists: a waiting spare allocates that
                             state ahead of its assignment (see Registry.preallocate)
    rs/{r}/ahead             the same state as the next boundary will find it, written
                             before the step's collectives (a rank that dies after its last
                             collective of step k leaves the survivors at boundary k+1)
    t/{r}                    rank r's step timing over its last steps and the slot that
                             measured it (migrator.timing), written with rs/{r}
    ckpt/{id}/rs/{r}         rank r's state at the boundary of a stop checkpoint ``id``
    ckpt/{id}/done           the checkpoint's path, once written (its writer)
    ckpt/{id}/failed         why no checkpoint was written (its writer)
    m/{id}/...               progress and timings of migration ``id``
    x/{id}/...               point-to-point transfer groups of migration ``id``
    fault/{i}                fault-injection bookkeeping (each fault fires once per job)
    done/{r}                 rank r finished its last step
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from forewarn.errors import MigrationError

__all__ = [
    "MANIFEST_KEY",
    "HandoverTimeout",
    "alive_count_key",
    "alive_key",
    "assign_key",
    "attempt_key",
    "checkpoint_key",
    "cmd_key",
    "error_key",
    "first_present",
    "get_json",
    "mirror_ahead_key",
    "mirror_key",
    "put_json",
    "recovery_key",
    "replica_prefix",
    "roster_key",
    "stop_key",
    "suspect_key",
    "wait_json",
]

POLL_S = 0.005


class HandoverTimeout(MigrationError):
    """A participant did not do its part of a handover within the bound."""

    code = "handover_timeout"
    retryable = True


def roster_key(gen: int) -> str:
    return f"g{gen}/roster"


def cmd_key(gen: int) -> str:
    return f"g{gen}/cmd"


def stop_key(gen: int, migration_id: str) -> str:
    return f"g{gen}/stop/{migration_id}"


def suspect_key(gen: int) -> str:
    """Set by the agent when it suspects a failure in generation ``gen``."""
    return f"g{gen}/suspect"


def error_key(slot: int) -> str:
    return f"err/{slot}"


def replica_prefix(migration_id: str, rank: int, attempt: int = 0) -> str:
    """The transfer group of a replica sending rank ``rank``'s state (``attempt``: the
    how-many-th spare tried; a spare that dies mid-receive is replaced by another)."""
    return f"x/{migration_id}/replica/{rank}" + (f"/{attempt}" if attempt else "")


def attempt_key(migration_id: str, rank: int, attempt: int) -> str:
    return f"m/{migration_id}/attempt/{rank}/{attempt}"


def checkpoint_key(checkpoint_id: str) -> str:
    """Prefix of the keys of one stop checkpoint (see :mod:`migrator.checkpoint`)."""
    return f"ckpt/{checkpoint_id}"


def alive_key(gen: int, rank: int) -> str:
    return f"g{gen}/alive/{rank}"


def alive_count_key(gen: int) -> str:
    return f"g{gen}/alive_n"


def recovery_key(gen: int) -> str:
    return f"g{gen}/recovery"


def assign_key(slot: int) -> str:
    return f"slot{slot}/assign"


MANIFEST_KEY = "manifest"


def mirror_key(rank: int) -> str:
    return f"rs/{rank}"


def mirror_ahead_key(rank: int) -> str:
    return f"rs/{rank}/ahead"


def put_json(store: Any, key: str, value: Any) -> None:
    store.set(key, json.dumps(value, separators=(",", ":")))


def get_json(store: Any, key: str) -> Any:
    return json.loads(store.get(key))


def first_present(
    store: Any,
    keys: Sequence[str],
    *,
    timeout_s: float,
    what: str,
    abort: Callable[[], str | None] | None = None,
) -> str:
    """Wait until one of ``keys`` exists and return it (the first in ``keys`` order).

    Args:
        keys: store keys to watch.
        timeout_s: seconds to wait at most.
        what: what is awaited, for the error message.
        abort: called between polls; a non-None return ends the wait with that reason.

    Raises:
        HandoverTimeout: none of the keys appeared within ``timeout_s``, or ``abort`` fired.
    """
    deadline = time.monotonic() + timeout_s
    poll = POLL_S
    while True:
        for key in keys:
            if store.check([key]):
                return key
        if abort is not None and (reason := abort()) is not None:
            raise HandoverTimeout(f"gave up waiting for {what}: {reason}")
        if time.monotonic() >= deadline:
            raise HandoverTimeout(
                f"waited {timeout_s:.1f} s for {what}", details={"keys": list(keys)}
            )
        time.sleep(poll)
        poll = min(poll * 1.5, 0.05)


def wait_json(store: Any, key: str, *, timeout_s: float, what: str) -> Any:
    """Wait for ``key`` (bounded, see :func:`first_present`) and decode its JSON value."""
    first_present(store, [key], timeout_s=timeout_s, what=what)
    return get_json(store, key)
