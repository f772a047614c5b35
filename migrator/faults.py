"""Fault injection for migration tests and demos: kill, wedge, slow or migrate a rank at a step.

A :class:`FaultPlan` is a list of faults, each tied to a rank, a step and a point inside the
step. The launcher hands the plan to every process it starts (``FOREWARN_FAULTS``, JSON);
the job fires each fault at its point, once per job (the key-value store counts firings, so the
spare that replaces a killed rank does not kill itself again when it redoes the step).

Points inside a step:

- ``step_start``: entering ``with step:``;
- ``forward``: the first registered model's forward pre-hook (mid-step, before any
  collective of the step);
- ``backward``: the gradient hook of the first model's first parameter, which fires late in
  the backward pass while DDP's bucket all-reduces are in flight (mid-collective);
- ``before_optimizer``: the first optimizer's step pre-hook (after the gradient all-reduce);
- ``step_end``: leaving ``with step:`` after a body that finished: after the step's last
  collective, before the next boundary;
- ``transfer``: while this rank is sending its state to a spare, after the first tensor;
- ``receive``: in the spare taking over ``rank``, while it receives the state of ``step``
  (the handover step), after the first tensor: the spare dies mid-receive;
- ``forming``: in ``rank``, the source of a planned or preventive move, when it sees the
  command (``step``: the last boundary it passed), while the spare and the other ranks start
  forming the next generation ahead.

Kinds: ``kill`` (SIGKILL: the process vanishes), ``kill_node`` (SIGKILL of the process's
whole process group: its launcher and all it started), ``wedge`` (SIGSTOP: alive, silent; only a
timeout can tell), ``migrate`` (the rank asks its agent, over the agent's HTTP endpoint, to
migrate ``target`` — the same path ``forewarn migrate`` takes), ``slow`` (a throttled GPU:
see below).

``slow_at(rank, step, delay_s, where=...)`` makes a *process* slow, not a rank: the process
that holds ``rank`` at ``step`` sleeps ``delay_s`` at ``where`` from that step on, each time
the point fires (once a step for every point but ``forward``, which fires at each forward of
the first model), for as long as it holds any rank. When its rank moves to a spare, the spare
is not slow: the slowness stays with the process, as a throttled GPU stays with its node.
Under data parallelism the slow rank's peers then wait for it in the step's first collective
(:mod:`migrator.timing` measures both).

Example::

    plan = FaultPlan().migrate_at(0, 10, reason="preventive").fail_at(1, 25, where="backward")
    straggler = FaultPlan().slow_at(1, 2, 0.1, where="forward")  # rank 1's process, from step 2

``forewarn launch --faults "$(python -c 'print(plan.to_json())')" ...`` hands a plan to a job.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from migrator import protocol as P

__all__ = ["Fault", "FaultPlan"]

Point = Literal[
    "step_start",
    "forward",
    "backward",
    "before_optimizer",
    "step_end",
    "transfer",
    "receive",
    "forming",
]


@dataclass(frozen=True)
class Fault:
    kind: Literal["kill", "wedge", "migrate", "kill_node", "slow"]
    rank: int
    step: int
    where: Point = "forward"
    reason: str = "planned"
    target: int | None = None
    delay_s: float = 0.0


@dataclass
class FaultPlan:
    """Faults to inject into a job; build with the chaining helpers below."""

    faults: list[Fault] = field(default_factory=list)
    slowed: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    """This process's own slowness: seconds slept at each point (``slow`` faults it took)."""

    def fail_at(self, rank: int, step: int, *, where: Point = "forward") -> FaultPlan:
        """SIGKILL the process holding ``rank`` at ``step`` (at ``where`` in the step)."""
        self.faults.append(Fault("kill", rank, step, where))
        return self

    def kill_node_at(self, rank: int, step: int, *, where: Point = "forward") -> FaultPlan:
        """SIGKILL the whole process group of the process holding ``rank``: its node's
        launcher and every process it started (a launcher run in its own session, as the
        multi-node tests run them): a node lost at once."""
        self.faults.append(Fault("kill_node", rank, step, where))
        return self

    def wedge_at(self, rank: int, step: int, *, where: Point = "forward") -> FaultPlan:
        """SIGSTOP the process holding ``rank``: it stays alive and never answers."""
        self.faults.append(Fault("wedge", rank, step, where))
        return self

    def slow_at(
        self, rank: int, step: int, delay_s: float, *, where: Point = "forward"
    ) -> FaultPlan:
        """From ``step`` on, the process holding ``rank`` at ``step`` sleeps ``delay_s`` at
        ``where`` each time the point fires, while it holds any rank (a spare that takes its
        rank over is not slow)."""
        if delay_s <= 0:
            raise ValueError(f"slow_at: delay_s must be positive, not {delay_s}")
        self.faults.append(Fault("slow", rank, step, where, delay_s=delay_s))
        return self

    def migrate_at(
        self, rank: int, step: int, *, reason: str = "planned", target: int | None = None
    ) -> FaultPlan:
        """At the start of ``step``, ``rank`` asks the agent to migrate ``target`` (itself)."""
        self.faults.append(Fault("migrate", rank, step, "step_start", reason, target))
        return self

    def to_json(self) -> str:
        return json.dumps([asdict(f) for f in self.faults])

    @classmethod
    def from_json(cls, text: str | None) -> FaultPlan:
        return cls([Fault(**f) for f in json.loads(text)] if text else [])

    def due(self, where: Point, rank: int, step: int) -> list[tuple[int, Fault]]:
        return [
            (i, f)
            for i, f in enumerate(self.faults)
            if f.where == where and f.rank == rank and f.step == step
        ]

    def fire(self, where: Point, rank: int, step: int, *, kv: P.KVStore, job: Any) -> None:
        """Fire every fault due at this point, each at most once per job; then, if this
        process was made slow at this point, sleep."""
        for i, fault in self.due(where, rank, step):
            if kv.add(P.fault_key(i), 1) != 1:
                continue
            if fault.kind in ("kill", "kill_node"):
                # When it struck, for benchmarks that time a recovery (kill -> step done).
                print(json.dumps({"fault": fault.kind, "t": time.time()}), flush=True)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "kill_node":
                os.killpg(os.getpgrp(), signal.SIGKILL)
            elif fault.kind == "wedge":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "slow":
                self.slowed[where] = self.slowed.get(where, 0.0) + fault.delay_s
            else:
                job.request_migration(
                    fault.rank if fault.target is None else fault.target, fault.reason
                )
                # Seen at this very boundary (once g+1 is formed ahead, which the other ranks
                # do in their threads): the move happens at the next one, every run.
                commands = getattr(job, "commands", None)
                deadline = time.monotonic() + 120
                while commands is not None and time.monotonic() < deadline:
                    commands.poll()
                    if commands.flag is not None or commands.idle:
                        break
                    time.sleep(0.005)
        if delay := self.slowed.get(where):
            time.sleep(delay)
