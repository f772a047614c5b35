"""The control protocol between the job agent and its ranks: key names and bounded waits.

Everything the agent and the processes of a job say to each other goes through the job's
key-value store: a c10d TCPStore the agent hosts, so that no message lives in a process
that may die. This module names every key in one place and gives the one primitive every
participant uses to wait: a poll with a deadline. Nothing here blocks without a timeout.

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
    slot{s}/ready            the spare of slot ``s`` is up and waits for an assignment
    err/{s}                  the exception the script of slot ``s`` raised (JSON: rank, step,
                             type, message, traceback), written before the process exits
    rs/{r}/{k % 2}           mirror of rank r's own state (RNG, data position) at step
                             boundary k, for rebuilding it from a replica; two keys by the
                             step's parity, so the last two boundaries' states are kept. The
                             state at k+1 is written inside step k, before its collectives
                             (a rank that dies after its last collective of step k leaves
                             the survivors at boundary k+1); boundary k+1 writes it again
                             only if it changed since (random numbers drawn after the
                             collectives)
    manifest                 the replica state's manifest (pickled), published by rank 0
                             once its optimizer state exists: a waiting spare allocates that
                             state ahead of its assignment (see Registry.preallocate)
    t/{r}                    rank r's step timing over its last steps and the slot that
                             measured it (migrator.timing), written with rs/{r}/...
    ckpt/{id}/rs/{r}         rank r's state at the boundary of a stop checkpoint ``id``
    ckpt/{id}/done           the checkpoint's path, once written (its writer)
    ckpt/{id}/failed         why no checkpoint was written (its writer)
    m/{id}/...               progress and timings of migration ``id``
    x/{id}/...               point-to-point transfer groups of migration ``id``
    fault/{i}                fault-injection bookkeeping (each fault fires once per job)
    done/{r}                 rank r finished its last step
    g0/arrived               how many ranks reached their first step (counter)
    g{g}/m/{id}/pg/...       generation g formed ahead for migration ``id`` (PrefixStore)
    pc/...                   peer copies: k (pc/every), held and since steps, pair groups
    job/config, job/layout   the slots' configuration (agent), the job's mesh layout (ranks)
    job/stop, job/end        a node's launcher was stopped; the job's exit code (agent)
    nodes/next, node/{n}/... node ranks handed out; node n's hello, beat, pids, exits, bye
    kill/{s}                 the signal the node hosting slot ``s`` is to send it

Every key is built here (:class:`MigrationKeys`, :class:`CheckpointKeys` and the ``*_key``
functions), and the values the agent and the ranks compare (a migration's outcome, the
job's status, the agent's recovery decision) are the enums below, whose values are the
strings on the wire. The JSON values the agent and the ranks exchange about a move (its
command, a spare's assignment, a survivor's report, a script's error, the agent's decision,
a stop checkpoint's plan) are the ``TypedDict``s below: plain dicts on the wire, typed where
they are built and read. :class:`KVStore` is what the migrator asks of the store itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, NotRequired, Protocol, TypedDict, cast

from forewarn.errors import MigrationError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "ARRIVED_KEY",
    "EVERY_KEY",
    "JOB_CONFIG_KEY",
    "JOB_END_KEY",
    "JOB_STOP_KEY",
    "LAYOUT_KEY",
    "MANIFEST_KEY",
    "NODES_NEXT_KEY",
    "RING_KEY",
    "Assignment",
    "CheckpointKeys",
    "CheckpointPlan",
    "Command",
    "Decision",
    "HandoverTimeout",
    "JobStatus",
    "KVStore",
    "MigrationKeys",
    "Outcome",
    "RecoveryDecision",
    "ScriptError",
    "SurvivorReport",
    "alive_count_key",
    "alive_key",
    "as_kv_store",
    "assign_key",
    "cmd_key",
    "disk_copy_key",
    "disk_sealed_key",
    "done_key",
    "error_key",
    "fault_key",
    "first_present",
    "formation_prefix",
    "get_json",
    "held_key",
    "kill_key",
    "mirror_key",
    "node_key",
    "peer_copy_prefix",
    "pg_prefix",
    "put_json",
    "ready_key",
    "recovery_key",
    "roster_key",
    "since_key",
    "stop_key",
    "suspect_key",
    "timing_key",
    "unique_key",
    "wait_json",
]

POLL_S = 0.005


class HandoverTimeout(MigrationError):
    """A participant did not do its part of a handover within the bound."""

    code = "handover_timeout"
    retryable = True


class KVStore(Protocol):
    """The job's key-value store, as the migrator uses it: the methods it calls, no more.

    At run time this is a c10d ``TCPStore`` (the agent's server, or a client of it), or a
    ``PrefixStore`` or ``HashStore`` in tests; :func:`as_kv_store` is where one enters. Each
    call on a TCPStore is one round trip to its server. Only :meth:`get` and
    :meth:`multi_get` wait, for a missing key, and then only up to the timeout the client
    was built with (``timeout_s + 30`` for the agent's and the ranks'): they are called
    once the key is known to exist or behind a bounded :func:`first_present`, so that
    timeout is a backstop, not a wait the protocol relies on. When the server is gone, any
    call raises ``torch.distributed.DistNetworkError`` (a ``RuntimeError``).

    The keys are strings (a ``PrefixStore`` puts ``{prefix}/`` in front); the values are
    bytes, written as bytes or as str (stored UTF-8 encoded).
    """

    def set(self, key: str, value: str | bytes, /) -> None:
        """Write ``value`` at ``key``, replacing any value there. Does not wait."""
        ...

    def get(self, key: str, /) -> bytes:
        """The value at ``key``.

        Blocks while ``key`` is missing, up to the client's timeout.

        Raises:
            torch.distributed.DistStoreError: (a ``RuntimeError``) ``key`` did not appear
                within the client's timeout.
        """
        ...

    def add(self, key: str, amount: int, /) -> int:
        """Add ``amount`` to the counter at ``key`` (created at 0) and return its new value;
        atomic across clients. ``add(key, 0)`` reads a counter without waiting for it.

        Raises:
            torch.distributed.DistNetworkError: ``key`` holds a value written by :meth:`set`
                that is not a decimal integer (the server drops this client's connection:
                every later call on the client raises too).
        """
        ...

    def check(self, keys: list[str], /) -> bool:
        """Whether every one of ``keys`` exists. Does not wait."""
        ...

    def delete_key(self, key: str, /) -> bool:
        """Remove ``key``; True if it existed. Does not wait."""
        ...

    def multi_get(self, keys: list[str], /) -> list[bytes]:
        """The values at ``keys``, in order, in one round trip.

        Blocks while any of ``keys`` is missing, up to the client's timeout.

        Raises:
            torch.distributed.DistStoreError: a key did not appear within the client's
                timeout.
        """
        ...

    def multi_set(self, keys: list[str], values: Sequence[str | bytes], /) -> None:
        """Write ``values[i]`` at ``keys[i]`` for every i, in one round trip. Does not wait."""
        ...


def as_kv_store(store: dist.Store) -> KVStore:
    """The c10d ``store`` as the migrator's :class:`KVStore`: where a real store enters.

    Every c10d store has these methods at run time, but torch's stub
    (``torch/_C/_distributed_c10d.pyi``) types ``Store.set``'s value as ``str`` (the binding
    takes bytes too: the mirrors and the manifest are pickles) and declares no
    ``multi_set`` (the binding has it), so mypy cannot see a ``Store`` as a ``KVStore``.
    This cast says so once, where each store is built, instead of at every call.
    """
    return cast(KVStore, store)


class Outcome(StrEnum):
    """How a migration ended (``MigrationReport.outcome``)."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobStatus(StrEnum):
    """Where the job stands (``JobTable.status``, and ``GET /v1/job``'s ``status``)."""

    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    FAILED = "failed"
    COMPLETED = "completed"
    STOPPED = "stopped"


class Decision(StrEnum):
    """The agent's decision after a suspected failure (``status`` of ``g{g}/recovery``)."""

    NONE = "none"
    """no rank was lost: the survivors go on in generation g"""
    PAUSED = "paused"
    """no spare yet: the survivors wait for a later decision"""
    PLAN = "plan"
    """spares take the lost ranks in generation g+1"""
    FAILED = "failed"
    """the job cannot go on"""


class CheckpointPlan(TypedDict):
    """A stop checkpoint the ranks are to write (:mod:`migrator.checkpoint`): in a stop
    command's ``checkpoint`` and in a failed :class:`RecoveryDecision`'s."""

    id: str
    """The checkpoint's id (:class:`CheckpointKeys`)."""
    step: NotRequired[int]
    """The boundary the survivors stand at (a failed recovery's plan)."""
    writer: int
    """The rank that writes the file (the lowest live one)."""
    live: list[int]
    """The ranks that hand their own state over at the boundary."""
    lost: list[int]
    """The ranks whose state comes from their mirror."""
    reason: str
    """Why the job stopped (``stopped``, or the failure's code)."""


class Command(TypedDict):
    """A planned, preventive or stop command (JSON at ``g{g}/cmd``, written by the agent)."""

    migration_id: str
    rank: int
    """The rank that moves (-1: a stop, every rank)."""
    replica: int | None
    """The healthy rank that sends the moving rank's state if its source cannot."""
    reason: NotRequired[str]
    """``planned`` or ``preventive`` (a move's)."""
    spare: NotRequired[int]
    """The slot of the spare that takes the rank (a move's)."""
    kind: NotRequired[Literal["stop"]]
    """A stop: every rank hands its state to the stop checkpoint and leaves."""
    checkpoint: NotRequired[CheckpointPlan]
    """The stop's checkpoint."""
    gen: NotRequired[int]
    """The generation the rank read the command in: set by the rank's watcher
    (:mod:`migrator.commands`), never on the wire."""


class Assignment(TypedDict):
    """What a spare is to become (JSON at ``slot{s}/assign``, written by the agent)."""

    mode: Literal["peer", "replica", "exit"]
    """``peer``: take the rank from its source (a planned or preventive move);
    ``replica``: rebuild it from a healthy rank (a recovery); ``exit``: leave."""
    gen: NotRequired[int]
    """The generation the spare joins."""
    rank: NotRequired[int]
    migration_id: NotRequired[str]
    attempt: NotRequired[int]
    """The how-many-th spare tried for the rank (:meth:`MigrationKeys.attempt`; 0 if absent)."""


class SurvivorReport(TypedDict):
    """A survivor's report after a failed collective (JSON at ``g{g}/alive/{r}``)."""

    step: int
    """The step whose collective failed (the rank stands at its boundary)."""
    stepped: bool
    """Whether the rank's optimizer stepped in that step (then it cannot be redone)."""
    slot: int
    error: str


class ScriptError(TypedDict):
    """What a rank's script raised (JSON at ``err/{s}``), written before its process exits."""

    rank: int | None
    """The rank the process held (None: a spare)."""
    step: int
    type: str
    """The exception's class name."""
    retryable: bool
    """Whether a spare could get past it (``migrator.job.spare_may_help``): False for an
    error the spare would raise again on the same step (out of memory, a ``ValueError``)."""
    message: str
    traceback: str


class RecoveryDecision(TypedDict):
    """The agent's decision after a suspected failure (JSON at ``g{g}/recovery``)."""

    status: str
    """A :class:`Decision` (read back, the plain string, which compares equal to it)."""
    message: NotRequired[str]
    """Why the job is paused or failed."""
    code: NotRequired[str]
    """The failure's error code (``FAILED``): the survivors raise that error."""
    checkpoint: NotRequired[CheckpointPlan]
    """The stop checkpoint the survivors write before they raise (``FAILED``)."""
    gen: NotRequired[int]
    """The generation the survivors and the spares form (``PLAN``), and what follows."""
    replacements: NotRequired[list[int]]
    """The lost ranks a spare takes."""
    replica: NotRequired[int | None]
    """The healthy rank that sends a lost rank's state when ``senders`` names none."""
    senders: NotRequired[dict[str, int | None]]
    """Per lost rank (a str: a JSON key), the healthy rank that sends its state."""
    rewind: NotRequired[int | None]
    """The boundary every rank goes back to (peer copies); None: the failed step's."""
    migration_id: NotRequired[str]
    from_move: NotRequired[bool]
    """The recovery took over a move whose source was lost (``PLAN``): the move's spare may
    still wait on that source, up to the timeout, before it falls back to the replica."""


@dataclass(frozen=True)
class MigrationKeys:
    """The keys of migration ``migration_id``: its progress (``m/{id}/...``) and its
    transfer groups (``x/{id}/...``)."""

    migration_id: str

    @property
    def base(self) -> str:
        return f"m/{self.migration_id}"

    @property
    def aborted(self) -> str:
        """Set (to why) by the agent when it aborts a planned move; the source trains on."""
        return f"{self.base}/aborted"

    @property
    def failed(self) -> str:
        """The move failed (JSON: code, message), written by the new rank."""
        return f"{self.base}/failed"

    @property
    def source_at(self) -> str:
        """When the source stood at S (wall clock), for the stall the job sees."""
        return f"{self.base}/source_at"

    @property
    def peer_prefix(self) -> str:
        """The transfer group of the source sending its state to the spare."""
        return f"x/{self.migration_id}/peer"

    def ack(self, rank: int) -> str:
        """The last boundary rank ``rank`` passed when it read the command."""
        return f"{self.base}/ack/{rank}"

    def received(self, rank: int) -> str:
        return f"{self.base}/received/{rank}"

    def fallback(self, rank: int) -> str:
        """The spare gave up on the source of rank ``rank`` (it takes a replica's state)."""
        return f"{self.base}/fallback/{rank}"

    def pause(self, rank: int) -> str:
        return f"{self.base}/pause/{rank}"

    def report(self, rank: int) -> str:
        return f"{self.base}/report/{rank}"

    def group(self, rank: int) -> str:
        """Rank ``rank``'s record of how generation g+1 was formed ahead."""
        return f"{self.base}/group/{rank}"

    def formed(self, rank: int) -> str:
        return f"{self.base}/formed/{rank}"

    def attempts(self, rank: int) -> str:
        """Counter of the spares tried for rank ``rank``."""
        return f"{self.base}/attempts/{rank}"

    def attempt(self, rank: int, attempt: int) -> str:
        return f"{self.base}/attempt/{rank}/{attempt}"

    def replica_prefix(self, rank: int, attempt: int = 0) -> str:
        """The transfer group of a replica sending rank ``rank``'s state (``attempt``: the
        how-many-th spare tried; a spare that dies mid-receive is replaced by another)."""
        return f"x/{self.migration_id}/replica/{rank}" + (f"/{attempt}" if attempt else "")


@dataclass(frozen=True)
class CheckpointKeys:
    """The keys of stop checkpoint ``checkpoint_id`` (see :mod:`migrator.checkpoint`)."""

    checkpoint_id: str

    @property
    def base(self) -> str:
        return f"ckpt/{self.checkpoint_id}"

    def rank_state(self, rank: int) -> str:
        return f"{self.base}/rs/{rank}"

    @property
    def done(self) -> str:
        """The checkpoint's path and step (JSON), once written."""
        return f"{self.base}/done"

    @property
    def failed(self) -> str:
        """Why no checkpoint was written."""
        return f"{self.base}/failed"


ARRIVED_KEY = "g0/arrived"
"""Counter of the ranks that reached their first step."""
JOB_STOP_KEY = "job/stop"
"""A node's launcher was stopped: the job stops (the node's rank)."""
JOB_END_KEY = "job/end"
"""The job's exit code, for the nodes' launchers."""
NODES_NEXT_KEY = "nodes/next"
"""Counter handing out node ranks."""
LAYOUT_KEY = "job/layout"
"""The job's :class:`~migrator.layouts.MeshLayout` (JSON), written by every active rank."""
EVERY_KEY = "pc/every"
"""The peer copies' k rank 0 derived."""
RING_KEY = "pc/ring"
"""The peer copies' ring (JSON list of ranks, each one's buddy the next), written by the
coordinator at the start (:func:`migrator.peerplan.ring_of`)."""
JOB_CONFIG_KEY = "job/config"
"""The coordinator's slot configuration, for the nodes' launchers (JSON)."""


def peer_copy_prefix(gen: int, rank: int, step: int) -> str:
    """The pair group carrying rank ``rank``'s copy of step ``step`` to its buddy."""
    return f"pc/g{gen}/{rank}/{step}"


def pg_prefix(gen: int) -> str:
    """The prefix of generation ``gen``'s gloo/NCCL rendezvous."""
    return f"g{gen}/pg"


def formation_prefix(gen: int, migration_id: str) -> str:
    """The prefix of generation ``gen``'s group formed ahead for ``migration_id``."""
    return f"g{gen}/m/{migration_id}/pg"


def ready_key(slot: int) -> str:
    """The process of slot ``slot`` (a spare) is ready to receive."""
    return f"slot{slot}/ready"


def unique_key(slot: int) -> str:
    """The process of slot ``slot`` registered rank-unique state."""
    return f"slot{slot}/unique"


def done_key(rank: int) -> str:
    """Rank ``rank`` finished its last step."""
    return f"done/{rank}"


def fault_key(index: int) -> str:
    """Counter of fault ``index``'s firings (it fires once per job)."""
    return f"fault/{index}"


def node_key(node: int, what: str) -> str:
    """Node ``node``'s ``beat`` (counter), ``exits``, ``pids`` (JSON) or ``bye``."""
    return f"node/{node}/{what}"


def kill_key(slot: int) -> str:
    """The signal the node hosting slot ``slot`` is to send its process."""
    return f"kill/{slot}"


def held_key(rank: int) -> str:
    """The step of rank ``rank``'s last whole peer copy (written by the buddy)."""
    return f"pc/held/{rank}"


def disk_copy_key(step: int, rank: int) -> str:
    """Rank ``rank``'s file of the sharded checkpoint of step ``step`` is in place
    (:mod:`migrator.shards`)."""
    return f"pc/disk/{step}/{rank}"


def disk_sealed_key(step: int) -> str:
    """Counter: the first rank to find every file of step ``step`` in place seals it."""
    return f"pc/disk/{step}/sealed"


def since_key(rank: int) -> str:
    """The first step whose copy rank ``rank``'s current process holds (a spare that took
    the rank at step S holds no copy of an earlier step)."""
    return f"pc/since/{rank}"


def timing_key(rank: int) -> str:
    """Rank ``rank``'s recent step timings (:func:`migrator.timing.encode`)."""
    return f"t/{rank}"


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


def alive_key(gen: int, rank: int) -> str:
    return f"g{gen}/alive/{rank}"


def alive_count_key(gen: int) -> str:
    return f"g{gen}/alive_n"


def recovery_key(gen: int) -> str:
    return f"g{gen}/recovery"


def assign_key(slot: int) -> str:
    return f"slot{slot}/assign"


MANIFEST_KEY = "manifest"


def mirror_key(rank: int, step: int) -> str:
    """Where rank ``rank``'s state at boundary ``step`` is mirrored (one of two keys)."""
    return f"rs/{rank}/{step % 2}"


def put_json(kv: KVStore, key: str, value: Any) -> None:
    kv.set(key, json.dumps(value, separators=(",", ":")))


def get_json(kv: KVStore, key: str) -> Any:
    return json.loads(kv.get(key))


def first_present(
    kv: KVStore,
    keys: Sequence[str],
    *,
    timeout_s: float,
    what: str,
    abort: Callable[[], str | None] | None = None,
) -> str:
    """Wait until one of ``keys`` exists and return it (the first in ``keys`` order).

    Args:
        keys: keys to watch.
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
            if kv.check([key]):
                return key
        if abort is not None and (reason := abort()) is not None:
            raise HandoverTimeout(f"gave up waiting for {what}: {reason}")
        if time.monotonic() >= deadline:
            raise HandoverTimeout(
                f"waited {timeout_s:.1f} s for {what}", details={"keys": list(keys)}
            )
        time.sleep(poll)
        poll = min(poll * 1.5, 0.05)


def wait_json(kv: KVStore, key: str, *, timeout_s: float, what: str) -> Any:
    """Wait for ``key`` (bounded, see :func:`first_present`) and decode its JSON value."""
    first_present(kv, [key], timeout_s=timeout_s, what=what)
    return get_json(kv, key)
