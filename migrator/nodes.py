"""A job across several nodes: one launcher per node, one coordinator, one key-value store.

``forewarn launch`` runs once per node, as ``torchrun`` does. The launcher of node rank 0 is
the *coordinator*: it hosts the job's key-value store (a c10d ``TCPStore``) on the rendezvous
endpoint (``--rdzv-endpoint host:port``), runs the :class:`migrator.agent.Agent` (commands,
recovery, reports, the endpoint, the registration with the service) and sees every slot of
the job. Every other launcher is a :class:`NodeAgent`: a client of that key-value store that
starts its own node's ranks and spares, reports their pids and exits, beats a heartbeat, and
kills a slot when the coordinator asks. Nothing else travels between launchers; the ranks
themselves rendezvous through the same key-value store (process-group generations,
transfers), so a spare on any node can take over any rank.

Store keys of the launchers (beside those of :mod:`migrator.protocol`)::

    nodes/next               counter handing out node ranks to launchers without --node-rank
    node/{n}/hello           JSON {name, nproc, spares} of the launcher of node n
    node/{n}/beat            counter, bumped every ``BEAT_S`` by the launcher of node n
    node/{n}/pids            JSON {slot: pid} of node n's processes
    node/{n}/exits           JSON {slot: exit code} of node n's processes that ended
    node/{n}/bye             launcher n saw the end of the job and is leaving
    kill/{s}                 the coordinator wants slot s killed (its launcher does it)
    job/config               JSON: the job as the coordinator runs it (slots, world size ...)
    job/end                  the job's exit code; every launcher leaves when it appears
    job/stop                 a launcher was stopped (Ctrl-C, SIGTERM) in a job with a
                             checkpoint directory: the coordinator stops the job at a step
                             boundary, with its checkpoint, as if it had been stopped itself

A node whose launcher stops beating for ``node_timeout_s`` (its power, its network, or a
SIGKILL of its process group) is lost: every process it ran counts as killed, and the
coordinator recovers those ranks on spares of the surviving nodes. The coordinator's own node
hosts the key-value store: losing it ends the job (as losing torchrun's c10d store host does).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migrator import protocol as P
from migrator.preload import DEFAULT_PRELOAD, ForkedProc, ForkServer, fork_server, preloadable

__all__ = [
    "NodeAgent",
    "NodeMonitor",
    "Proc",
    "RemoteProc",
    "SlotSpec",
    "layout",
    "slot_env",
    "spawn",
]

log = logging.getLogger(__name__)

BEAT_S = 0.2
"""How often a node's launcher beats and forwards its processes' exits (seconds)."""


@dataclass(frozen=True)
class SlotSpec:
    """Where one process of the job runs: its job-wide slot, node, node-local index, rank."""

    index: int
    node_rank: int
    local: int
    rank: int | None  # None: a spare


def layout(shapes: list[tuple[int, int]]) -> list[SlotSpec]:
    """The job's slots from each node's (active ranks, spares), in node-rank order.

    Active ranks are numbered node by node (node 0 holds ranks 0..n0-1, as torchrun numbers
    them); spares come after every active slot. Slot indices are job-wide and stable.
    """
    specs: list[SlotSpec] = []
    rank = 0
    for node, (nproc, _) in enumerate(shapes):
        for local in range(nproc):
            specs.append(SlotSpec(len(specs), node, local, rank))
            rank += 1
    for node, (nproc, spares) in enumerate(shapes):
        for j in range(spares):
            specs.append(SlotSpec(len(specs), node, nproc + j, None))
    return specs


def slot_env(
    spec: SlotSpec, config: dict[str, Any], *, local_world: int, node_rank: int
) -> dict[str, str]:
    """The variables a process of the job gets (``FOREWARN_*`` and torchrun's own names)."""
    return {
        "FOREWARN_KV": config["kv"],
        "FOREWARN_SLOT": str(spec.index),
        "FOREWARN_WORLD_SIZE": str(config["world_size"]),
        "FOREWARN_INITIAL_RANK": "" if spec.rank is None else str(spec.rank),
        "FOREWARN_JOB_ID": config["job_id"],
        "FOREWARN_BACKEND": config["backend"],
        "FOREWARN_TIMEOUT_S": str(config["timeout_s"]),
        "FOREWARN_AGENT_URL": config.get("agent_url") or "",
        "FOREWARN_FAULTS": config.get("faults") or "",
        "FOREWARN_LOCAL_SLOT": str(spec.local),
        "FOREWARN_NODE_RANK": str(node_rank),
        "FOREWARN_JOIN_TIMEOUT_S": str(config.get("join_timeout_s", 300.0)),
        "FOREWARN_CHECKPOINT_DIR": config.get("checkpoint_dir") or "",
        "FOREWARN_RESUME_FROM": config.get("resume_from") or "",
        "FOREWARN_TIMING_WINDOW": str(config.get("timing_window") or ""),
        # torchrun's names, for code that reads them (a spare's RANK is set when it takes one)
        "LOCAL_RANK": str(spec.local),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node_rank),
        "WORLD_SIZE": str(config["world_size"]),
    }


# Run the job's command with SIGINT ignored (an ignored signal stays ignored across exec, and
# Python then installs no KeyboardInterrupt handler): a Ctrl-C in the launcher's terminal
# reaches its whole process group, and the launcher, not each rank, decides what it means.
_IGNORE_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


Proc = subprocess.Popen[bytes] | ForkedProc
"""A process of the job this launcher started: a child of its own, or of its fork server."""


def spawn(
    command: list[str],
    env: dict[str, str],
    *,
    log_dir: Path | None,
    index: int,
    forks: ForkServer | None = None,
) -> Proc:
    """Start one process of the job; its output goes to ``log_dir/slot<index>.log`` if given.

    ``forks``: the job's fork server (:mod:`migrator.preload`), which forks the process with
    torch already imported when ``command`` runs a Python script; else, or if it cannot, a
    new process. Either way the process ignores SIGINT: a stopped launcher ends the job's
    processes with SIGTERM.
    """
    log_path = None if log_dir is None else log_dir / f"slot{index}.log"
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    if forks is not None and preloadable(command):
        forked = forks.spawn(command, env, log_path=log_path)
        if forked is not None:
            return forked
    out: Any = None
    if log_path is not None:
        out = open(log_path, "ab")  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _IGNORE_SIGINT, *command],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    finally:
        if out is not None:
            out.close()


# -- the coordinator's view of the other nodes ----------------------------------------------


class NodeMonitor:
    """What the coordinator knows of the other nodes: beats, exits and pids (key-value store).

    Args:
        kv: a client of the job's key-value store.
        node_timeout_s: a node that has not beaten for this long is lost.
        clock: monotonic seconds (a parameter for tests).
    """

    def __init__(
        self, kv: P.KVStore, *, node_timeout_s: float, clock: Any = time.monotonic
    ) -> None:
        self.kv = kv
        self.node_timeout_s = node_timeout_s
        self.clock = clock
        self.nodes: dict[int, dict[str, Any]] = {}
        self._refreshed = -1.0

    def watch(self, node: int) -> None:
        self.nodes[node] = {"beat": -1, "seen": self.clock(), "exits": {}, "pids": {}}
        self.nodes[node]["lost"] = False

    def refresh(self, *, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._refreshed < BEAT_S / 2:
            return
        self._refreshed = now
        for node, state in self.nodes.items():
            if state["lost"]:
                continue
            beat = int(self.kv.add(P.node_key(node, "beat"), 0))
            if beat != state["beat"]:
                state["beat"], state["seen"] = beat, now
            for key, field in (("exits", "exits"), ("pids", "pids")):
                if self.kv.check([P.node_key(node, key)]):
                    got = P.get_json(self.kv, P.node_key(node, key))
                    state[field] = {int(k): v for k, v in got.items()}
            if now - state["seen"] > self.node_timeout_s:
                state["lost"] = True
                log.warning(
                    "node %d: no heartbeat for %.1f s: lost, with every process on it",
                    node,
                    now - state["seen"],
                )

    def exit_code(self, node: int, slot: int) -> int | None:
        self.refresh()
        state = self.nodes[node]
        if slot in state["exits"]:
            return int(state["exits"][slot])
        return -signal.SIGKILL if state["lost"] else None

    def pid(self, node: int, slot: int) -> int | None:
        return self.nodes[node]["pids"].get(slot)


class RemoteProc:
    """A process on another node, seen through its launcher (duck-types ``Popen``)."""

    def __init__(self, monitor: NodeMonitor, node: int, slot: int) -> None:
        self.monitor = monitor
        self.node = node
        self.slot = slot
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:  # type: ignore[override]
        return self.monitor.pid(self.node, self.slot)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.monitor.exit_code(self.node, self.slot)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.monitor.kv.set(P.kill_key(self.slot), str(int(sig)))

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"slot {self.slot}", timeout or 0)
            time.sleep(BEAT_S / 2)
            self.monitor.refresh(force=True)
        assert self.returncode is not None
        return self.returncode


# -- the launcher of any other node ---------------------------------------------------------


@dataclass
class NodeConfig:
    """One non-coordinator launcher. Timeouts in seconds."""

    command: list[str]
    kv_host: str
    kv_port: int
    nproc: int
    spares: int
    node_rank: int | None  # None: the key-value store hands one out
    node: str
    join_timeout_s: float = 300.0
    log_dir: Path | None = None
    env: dict[str, str] | None = None
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """What this node's fork server imports (:mod:`migrator.preload`); empty: no server."""


class NodeAgent:
    """Start and watch this node's processes for the coordinator; see the module docstring.

    :meth:`run` blocks until the job ends and returns its exit code (1 if the coordinator
    was lost).
    """

    def __init__(self, config: NodeConfig) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.cfg = config
        self.kv = P.as_kv_store(
            dist.TCPStore(
                config.kv_host,
                config.kv_port,
                is_master=False,
                timeout=timedelta(seconds=config.join_timeout_s),
            )
        )
        if config.node_rank is None:
            self.node_rank = int(self.kv.add(P.NODES_NEXT_KEY, 1))
        else:
            self.node_rank = config.node_rank
        if self.node_rank < 1:
            raise ValueError("node rank 0 is the coordinator's (it hosts the key-value store)")
        self.procs: dict[int, Proc] = {}
        self.exits: dict[int, int] = {}
        self.interrupted = False
        self.forks: ForkServer | None = None

    def run(self) -> int:
        hello = {"name": self.cfg.node, "nproc": self.cfg.nproc, "spares": self.cfg.spares}
        P.put_json(self.kv, P.node_key(self.node_rank, "hello"), hello)
        config = P.wait_json(
            self.kv, P.JOB_CONFIG_KEY, timeout_s=self.cfg.join_timeout_s, what="the coordinator"
        )
        mine = [SlotSpec(**s) for s in config["slots"] if s["node_rank"] == self.node_rank]
        try:
            self._start(mine, config)
            code = self._watch()
        except (
            RuntimeError,
            OSError,
        ) as exc:  # the key-value store (the coordinator's node) is gone
            log.error("node %d: lost the coordinator: %s", self.node_rank, exc)
            code = 1
        except KeyboardInterrupt:  # SIGINT or SIGTERM to this launcher
            self.interrupted, code = True, 130
            if config.get("checkpoint_dir"):
                self._stop_with_the_job(float(config["timeout_s"]))
        self._end()
        return code

    def _start(self, mine: list[SlotSpec], config: dict[str, Any]) -> None:
        """Start this node's processes, beating meanwhile: the first waits for the fork
        server's imports (seconds, more on a loaded node), which may be longer than the
        coordinator waits for a node that is silent. An interrupt meanwhile lands once every
        process is started (stopping them is then the launcher's usual way out)."""
        common = {**os.environ, **(self.cfg.env or {})}
        self.forks = fork_server(self.cfg.command, common, self.cfg.preload)
        failed: list[BaseException] = []

        def start_all() -> None:
            try:
                for spec in mine:
                    env = dict(common)
                    local_world, rank = len(mine), self.node_rank
                    env.update(slot_env(spec, config, local_world=local_world, node_rank=rank))
                    self.procs[spec.index] = spawn(
                        self.cfg.command,
                        env,
                        log_dir=self.cfg.log_dir,
                        index=spec.index,
                        forks=self.forks,
                    )
            except BaseException as exc:  # raised again in the launcher's thread
                failed.append(exc)

        starting = threading.Thread(target=start_all, name="forewarn-start", daemon=True)
        starting.start()
        try:
            while starting.is_alive():
                self.kv.add(P.node_key(self.node_rank, "beat"), 1)
                starting.join(BEAT_S)
        finally:
            starting.join()
            pids = {slot: proc.pid for slot, proc in self.procs.items()}
            P.put_json(self.kv, P.node_key(self.node_rank, "pids"), pids)
        if failed:
            raise failed[0]

    def _stop_with_the_job(self, timeout_s: float) -> None:
        """Stopped, in a job with a checkpoint directory: ask the coordinator to stop the
        job at a step boundary (``job/stop``) and keep this node's ranks running, and
        beating, until the job ends (bounded; a second interrupt stops at once), so that
        they write their part of the stop checkpoint."""
        try:
            self.kv.set(P.JOB_STOP_KEY, str(self.node_rank))
            self._watch(deadline=time.monotonic() + 4 * timeout_s + 60)
        except (RuntimeError, OSError, KeyboardInterrupt):
            pass

    def _watch(self, deadline: float | None = None) -> int:
        while deadline is None or time.monotonic() < deadline:
            self.kv.add(P.node_key(self.node_rank, "beat"), 1)
            changed = False
            for slot, proc in self.procs.items():
                code = None if slot in self.exits else proc.poll()
                if code is not None:
                    self.exits[slot] = code
                    changed = True
                elif slot not in self.exits and self.kv.check([P.kill_key(slot)]):
                    proc.send_signal(int(self.kv.get(P.kill_key(slot))))
            if changed:
                P.put_json(self.kv, P.node_key(self.node_rank, "exits"), self.exits)
            if self.kv.check([P.JOB_END_KEY]):
                return int(self.kv.get(P.JOB_END_KEY))
            time.sleep(BEAT_S)
        return 130

    def _end(self) -> None:
        if self.interrupted:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
        deadline = time.monotonic() + 10
        for slot, proc in self.procs.items():
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(timeout=30)
            self.exits.setdefault(slot, code)
        if self.forks is not None:
            self.forks.close()
        try:
            P.put_json(self.kv, P.node_key(self.node_rank, "exits"), self.exits)
            self.kv.set(P.node_key(self.node_rank, "bye"), "1")
        except (RuntimeError, OSError):
            pass


def wait_for_nodes(kv: P.KVStore, nnodes: int, *, timeout_s: float) -> list[dict[str, Any]]:
    """The coordinator waits until every other node's launcher said hello (bounded)."""
    keys = [P.node_key(n, "hello") for n in range(1, nnodes)]
    deadline = time.monotonic() + timeout_s
    hellos = []
    for key in keys:
        left = max(0.1, deadline - time.monotonic())
        hellos.append(P.wait_json(kv, key, timeout_s=left, what=f"the launcher of {key[:-6]}"))
    return hellos


def say_goodbye(kv: P.KVStore, nodes: list[int], code: int, *, timeout_s: float = 15.0) -> None:
    """The coordinator ends the job on ``nodes`` and waits (bounded) for them to leave."""
    kv.set(P.JOB_END_KEY, str(code))
    deadline = time.monotonic() + timeout_s
    for n in nodes:
        while not kv.check([P.node_key(n, "bye")]) and time.monotonic() < deadline:
            time.sleep(0.05)


# -- the command line -------------------------------------------------------------------------


def node_rank_from_env(environ: Any) -> int | None:
    """The node rank the scheduler gives: torchrun's, Slurm's, or a Kubernetes indexed Job's."""
    for name in ("PET_NODE_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX"):
        value = environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def _can_host(host: str, port: int) -> bool:
    """Whether this machine can bind the key-value store's address (automatic node rank:
    first wins)."""
    import socket

    try:
        with socket.create_server((host, port)):
            return True
    except OSError:
        return False


def run_node(args: Any, command: list[str]) -> int | None:
    """``forewarn launch`` with ``--nnodes`` > 1: None if this launcher is the coordinator
    (node rank 0; the caller runs the agent), else run this node's share and return its
    exit code."""
    node_rank = args.node_rank
    if node_rank is None:
        node_rank = 0 if _can_host(args.host, args.kv_port) else None
    if node_rank == 0:
        return None
    import socket

    name = args.node_name or socket.gethostname().split(".")[0] or "localhost"
    agent = NodeAgent(
        NodeConfig(
            command=command,
            kv_host=args.host,
            kv_port=args.kv_port,
            nproc=args.nproc,
            spares=args.spares,
            node_rank=node_rank,
            node=name,
            join_timeout_s=args.join_timeout_s,
            log_dir=args.log_dir,
            preload=args.preload,
        )
    )
    code = agent.run()
    print(
        f"forewarn launch: node {agent.node_rank} ({name}) of job {args.job_id} "
        f"{'ended' if code == 0 else 'stopped' if agent.interrupted else 'failed'}",
        file=sys.stderr,
    )
    return code
