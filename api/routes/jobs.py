"""Job routes: registration and heartbeats from job agents, the command long-poll, reads.

Scopes: a job agent (``forewarn launch --service --token``) holds a token with the ``operate``
scope — it registers, heartbeats, takes commands and reports transitions, which is acting on
the fleet, not reading it; reads need ``read``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from sqlalchemy import text

from api.deps import StoreDep, require
from api.routes._common import iso, now_ms, stamp
from control.stragglers import summarise_history
from forewarn.errors import InvalidInput, NotFound
from forewarn.wire import JobHeartbeat, JobRegistration, MigrationCommand, Placement
from store import control as db

__all__ = ["JobPublic", "router"]

router = APIRouter(tags=["jobs"])

_MAX_GENERATION = 2**31 - 1


class _Heartbeat(JobHeartbeat):
    """The heartbeat as this route takes it: a generation the store's column holds."""

    generation: int = Field(default=0, ge=0, le=_MAX_GENERATION)


"""A job's generation is stored as a 32-bit integer."""


class RankPublic(BaseModel):
    slot: int
    rank: int
    node: str
    gpu: int | None
    uuid: str | None
    pid: int | None
    role: str
    """active, spare or retired."""
    compute_s: float | None = None
    """An active rank's median seconds from step start to its arrival at the step's first
    collective (the job's last heartbeat with timings); null: not measured."""
    wait_s: float | None = None
    """Its median seconds from arrival to that collective's end (it waited for its peers)."""
    step_s: float | None = None
    """Its median step time (the same on every rank under data parallelism)."""
    peers_median_s: float | None = None
    """The median compute_s of the job's other ranks in the same heartbeat."""
    straggler: bool = False
    """Its compute stayed above its peers' by the policy's margin for the policy's window."""
    straggler_reason: str | None = None
    """What its GPU's telemetry shows (clock-event reasons, temperature, PCIe link, link
    errors rising), or ``unknown``."""
    straggler_since: str | None = None


class TimingsPublic(BaseModel):
    """The job's step timing as its last heartbeat carried it."""

    window: int
    """Steps each median is taken over."""
    step: int
    """The newest step measured."""
    total_steps: int | None
    measured_at: str | None
    """When the heartbeat that carried it arrived."""


class JobPublic(BaseModel):
    job_id: str
    world_size: int
    spares: int
    agent_url: str | None
    status: str
    generation: int
    message: str | None
    registered_at: str | None
    heartbeat_at: str | None
    ranks: list[RankPublic]
    timings: TimingsPublic | None = None
    """null: no heartbeat carried step timings yet."""
    stragglers: list[int] = []
    """The ranks that are stragglers now."""


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


class CommandsPublic(BaseModel):
    data: list[MigrationCommand]
    count: int


def _public(stored: db.Job) -> dict[str, Any]:
    job: dict[str, Any] = dict(stored)
    timed = stored["timings"]
    computes = {t["rank"]: t["compute_s"] for t in timed}
    job["ranks"] = []
    for slot in stored["ranks"]:
        r: dict[str, Any] = dict(slot)
        job["ranks"].append(r)
        t = r.pop("timing", None)
        if t is None:
            continue
        peers = [v for k, v in computes.items() if k != r["rank"]]
        r.update(
            compute_s=t["compute_s"],
            wait_s=t["wait_s"],
            step_s=t["step_s"],
            peers_median_s=statistics.median(peers) if peers else None,
            straggler=bool(t["straggling"]),
            straggler_reason=t["reason"] if t["straggling"] else None,
            straggler_since=iso(t["straggling_ms"]) if t["straggling"] else None,
        )
    if timed:
        newest = max(timed, key=lambda t: t["received_ms"])
        job["timings"] = {
            "window": newest["window"],
            "step": newest["step"],
            "total_steps": newest["total_steps"],
            "measured_at": iso(newest["received_ms"]),
        }
    else:
        del job["timings"]
    job["stragglers"] = sorted(t["rank"] for t in timed if t["straggling"])
    return stamp(job, "registered_ms", "heartbeat_ms")


def _resolve(c: Any, p: Placement) -> tuple[str, int | None]:
    """A GPU UUID names the GPU whatever the launcher calls its node; else node + index."""
    if p.uuid:
        row = c.execute(text("SELECT node, gpu FROM gpus WHERE uuid = :u"), {"u": p.uuid}).first()
        if row is not None:
            return str(row[0]), int(row[1])
    return p.node, p.gpu


@router.post(
    "/v1/jobs",
    status_code=201,
    response_model=JobPublic,
    dependencies=[require("operate")],
    summary="Register a job and its placement (job agents; the full placement each time)",
)
async def register_job(store: StoreDep, body: JobRegistration) -> dict[str, Any]:
    slots = [p.slot if p.slot is not None else i for i, p in enumerate(body.placement)]
    if len(set(slots)) != len(slots):
        clash = sorted({s for s in slots if slots.count(s) > 1})
        raise InvalidInput(
            f"placement: slot {clash[0]} is given to more than one process "
            "(a slot defaults to the entry's position)"
        )

    def write() -> db.Job:
        ts = now_ms()
        with store.begin() as c:
            ranks = []
            for i, p in enumerate(body.placement):
                node, gpu = _resolve(c, p)
                ranks.append(
                    {
                        "slot": p.slot if p.slot is not None else i,
                        "rank": p.rank,
                        "node": node,
                        "gpu": gpu,
                        "uuid": p.uuid,
                        "pid": p.pid,
                        "role": p.role,
                    }
                )
            job = {
                "job_id": body.job_id,
                "world_size": body.world_size,
                "spares": body.spares,
                "agent_url": body.agent_url,
                "status": "running",
                "registered_ms": ts,
                "heartbeat_ms": ts,
            }
            db.upsert_job(c, job=job, ranks=ranks)
            return db.get_jobs(c, job_id=body.job_id)[0]

    return _public(await to_thread.run_sync(write))


@router.post(
    "/v1/jobs/{job_id}/heartbeat",
    response_model=JobPublic,
    dependencies=[require("operate")],
    summary="A job agent's sign of life (with its ranks' step timings, when measured)",
)
async def heartbeat(store: StoreDep, job_id: str, body: _Heartbeat) -> dict[str, Any]:
    if body.generation > _MAX_GENERATION:  # the wire allows more than the store's column holds
        raise InvalidInput(f"generation: at most {_MAX_GENERATION}")

    def write() -> db.Job:
        ts = now_ms()
        values = {
            "heartbeat_ms": ts,
            "status": body.status,
            "generation": body.generation,
            "message": body.message,
        }
        with store.begin() as c:
            if not db.heartbeat_job(c, job_id=job_id, values=values):
                raise NotFound(f"no job {job_id!r} (register it first)")
            if body.timings is not None:
                db.store_timings(
                    c, job_id=job_id, timings=body.timings.model_dump(), received_ms=ts
                )
            return db.get_jobs(c, job_id=job_id)[0]

    return _public(await to_thread.run_sync(write))


class StragglerHistoryPublic(BaseModel):
    """The fleet's own straggler history (:func:`control.stragglers.summarise_history`)."""

    episodes: int
    """Straggler episodes announced (``rank.straggling``)."""
    ended: int
    """Of them, those that ended (``rank.recovered``)."""
    rank_days: float
    """Rank time the control loop judged, in days."""
    since: str | None
    """When it started judging (null: never)."""
    episodes_per_gpu_day: float | None
    slowdown: float | None
    """Median of compute over the peers' median when an episode was announced."""
    duration_mean_s: float | None
    """Mean span of an episode (first above its peers' to its end; those still lasting
    count their time so far); null before one ended."""
    detect_median_s: float | None
    """Median seconds from first above to announced."""
    ended_by: dict[str, int]
    """cleared (back among its peers) or moved (the rank went to another GPU)."""
    reasons: dict[str, int]
    """The reasons named, by episode."""


@router.get(
    "/v1/stragglers/history",
    response_model=StragglerHistoryPublic,
    dependencies=[require("read")],
    summary="The fleet's own straggler history: episodes, rank time watched, rate, slowdown",
)
async def straggler_history(store: StoreDep) -> dict[str, Any]:
    def read() -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        with store.engine.connect() as c:
            return db.straggler_episodes(c), db.read_watched(c)

    episodes, watched = await to_thread.run_sync(read)
    history = summarise_history(episodes, watched, now_ms=now_ms())
    out = dataclasses.asdict(history)
    out["since"] = iso(out.pop("since_ms"))
    return out


@router.get(
    "/v1/jobs", response_model=JobsPublic, dependencies=[require("read")], summary="Every job"
)
async def list_jobs(store: StoreDep) -> dict[str, Any]:
    def read() -> list[db.Job]:
        with store.engine.connect() as c:
            return db.get_jobs(c)

    rows = [_public(j) for j in await to_thread.run_sync(read)]
    return {"data": rows, "count": len(rows)}


@router.get(
    "/v1/jobs/{job_id}",
    response_model=JobPublic,
    dependencies=[require("read")],
    summary="One job: ranks with node, GPU and role, generation, status",
)
async def get_job(store: StoreDep, job_id: str) -> dict[str, Any]:
    def read() -> list[db.Job]:
        with store.engine.connect() as c:
            return db.get_jobs(c, job_id=job_id)

    found = await to_thread.run_sync(read)
    if not found:
        raise NotFound(f"no job {job_id!r}")
    return _public(found[0])


def command_of(m: db.Migration) -> MigrationCommand:
    target = None
    if m["target_slot"] is not None and m["target_node"] is not None:  # written together
        target = Placement(
            rank=m["rank"],
            node=m["target_node"],
            gpu=m["target_gpu"],
            role="spare",
            slot=m["target_slot"],
        )
    trigger = m["trigger"]
    return MigrationCommand(
        migration_id=m["id"],
        job_id=m["job_id"],
        rank=m["rank"],
        # A manual move and a straggler's are planned: the rank's GPU is slow, not failing.
        reason="planned" if trigger in ("manual", "straggler") else trigger,  # type: ignore[arg-type]
        requested_at=m["requested_ms"] / 1000,  # type: ignore[arg-type]
        detail=m["detail"],
        trigger=trigger,
        target=target,
    )


POLL_INTERVAL_S = 0.2


@router.get(
    "/v1/jobs/{job_id}/commands",
    response_model=CommandsPublic,
    dependencies=[require("operate")],
    summary="Long-poll: the job's requested migrations (answers as soon as there is one)",
)
async def commands(
    store: StoreDep,
    job_id: str,
    wait_s: Annotated[float, Query(ge=0, le=30)] = 10.0,
) -> dict[str, Any]:
    def read() -> list[db.Migration]:
        with store.engine.connect() as c:
            return db.list_migrations(c, job_id=job_id, states=["requested"])

    deadline = time.monotonic() + wait_s
    while True:
        pending = await to_thread.run_sync(read)
        if pending or time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_INTERVAL_S)
    data = [command_of(m) for m in sorted(pending, key=lambda m: m["requested_ms"])]
    return {"data": data, "count": len(data)}
