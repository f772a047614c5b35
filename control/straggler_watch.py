"""The control loop's side of stragglers: judge the timings the heartbeats stored, name each
straggler's GPU from its samples, and weigh a move's gain against its cost.

:mod:`control.stragglers` holds the pure rules; this module reads and writes the store on
the loop's connection (inside its tick's transaction), so a straggler's state, its
``rank.straggling`` event and the decision about it commit together. An episode's end (its
compute back among its peers', or its rank moved to another GPU) is announced as
``rank.recovered``, with the episode's span: the fleet's own straggler history, which
``GET /v1/stragglers/history`` sums up and ``forewarn goodput --stragglers-from`` uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from control import stragglers as strag
from control.policy import Policy, StragglerCase
from store import control as db
from store import reads
from store.outbox import emit_event

__all__ = ["Straggler", "case_of", "judge_stored", "name_gpu", "state_values"]

REASON_SAMPLES_S = 300.0
"""A straggler's GPU is named from its samples of the last 5 minutes: the newest for its clock
reasons, temperature and link width, all of them for counters rising and a PCIe generation
that dropped."""
_REASON_FIELDS = (
    "throttle_reasons",
    "temp_gpu_c",
    "pcie_link_width",
    "pcie_link_width_max",
    "pcie_link_gen",
    "nvlink_crc_flit",
    "nvlink_crc_data",
    "nvlink_replay",
    "nvlink_recovery",
    "pcie_replay",
)


@dataclass(frozen=True)
class Straggler:
    """A rank judged a straggler this tick, with what its decision weighs."""

    compute_s: float
    peers_median_s: float
    reason: str
    step: int
    total_steps: int | None


def judge_stored(
    c: Connection,
    policy: Policy,
    *,
    now_ms: int,
    active: list[db.RankPlacement],
    recent: list[db.Migration],
    fresh_s: float,
    forget: Callable[[tuple[str, int]], None],
) -> tuple[dict[tuple[str, int], Straggler], int]:
    """Judge the ranks of every running job from their stored timings; write each changed
    straggler state and announce each new straggler.

    A rank's timings count while they are fresh (its job heartbeated within the agent
    timeout) and, after the rank moved (a completed migration), once their window lies
    past the handover step: medians that still hold the old GPU's steps would judge it.

    Args:
        active: the active ranks of the running jobs (``job_ranks`` rows).
        recent: recent migrations (their handover steps and outcomes).
        fresh_s: timings that arrived longer ago are not judged (the agent timeout).
        forget: called with (job, rank) of a straggler that cleared or moved.

    Returns:
        (the stragglers by (job, rank), how many ranks were judged).
    """
    rows = db.timing_rows(c)
    if not rows:
        return {}, 0
    where: dict[tuple[str, int], tuple[str | None, int | None]] = {
        (r["job_id"], r["rank"]): (r["node"], r["gpu"]) for r in active
    }
    moved: dict[tuple[str, int], int] = {}
    for m in recent:
        if m["state"] == "completed" and m["step"] is not None:
            k = (m["job_id"], m["rank"])
            moved[k] = max(moved.get(k, -1), int(m["step"]))
    by_job: dict[str, list[db.RankTiming]] = {}
    for t in rows:
        k = (t["job_id"], t["rank"])
        gone = k not in where or where[k][1] is None  # not an active rank of a running job
        if gone or now_ms - t["received_ms"] > fresh_s * 1000:
            if t["straggling"]:  # its episode ends with what it knew: no open span grows
                ended_by = "job_ended" if gone else "stale"
                _recovered(c, t, where.get(k, (None, None)), now_ms=now_ms, ended_by=ended_by)
                db.set_straggler_state(c, job_id=k[0], rank=k[1], values=state_values())
                forget(k)
            continue
        if k in moved and t["step"] - t["window"] < moved[k]:
            if t["above_since_ms"] is not None or t["straggling"]:  # judged afresh
                if t["straggling"]:
                    _recovered(c, t, where[k], now_ms=now_ms, ended_by="moved")
                db.set_straggler_state(c, job_id=k[0], rank=k[1], values=state_values())
                forget(k)
            continue
        by_job.setdefault(t["job_id"], []).append(t)
    slow: dict[tuple[str, int], Straggler] = {}
    judged = 0
    for job_id, timed in by_job.items():
        stored = {t["rank"]: t for t in timed}
        states = {
            rank: strag.RankState(
                t["above_since_ms"], bool(t["straggling"]), t["straggling_ms"], t["reason"]
            )
            for rank, t in stored.items()
        }
        found = strag.judge(
            policy, {r: t["compute_s"] for r, t in stored.items()}, states, now_ms=now_ms
        )
        judged += len(found)
        for j in found:
            k = (job_id, j.rank)
            t = stored[j.rank]
            node, gpu = where[k]
            assert node is not None and gpu is not None  # a rank without a GPU is gone (above)
            state = j.state
            if state.straggling:
                state.reason = name_gpu(c, policy, node, int(gpu), now_ms)
                slow[k] = Straggler(
                    j.compute_s, j.peers_median_s, state.reason, t["step"], t["total_steps"]
                )
            if j.became:
                emit_event(
                    c,
                    "rank.straggling",
                    {
                        "job_id": job_id,
                        "rank": j.rank,
                        "node": node,
                        "gpu": int(gpu),
                        "compute_s": j.compute_s,
                        "peers_median_s": j.peers_median_s,
                        "wait_s": t["wait_s"],
                        "step": t["step"],
                        "reason": state.reason,
                        "above_since_ms": state.above_since_ms,
                    },
                    job_id=job_id,
                    node=node,
                )
            if j.cleared:
                _recovered(c, t, (node, gpu), now_ms=now_ms, ended_by="cleared", judged=j)
                forget(k)
            values = state_values(state)
            if values != {n: v for n, v in t.items() if n in db.STRAGGLER_COLUMNS}:
                db.set_straggler_state(c, job_id=job_id, rank=j.rank, values=values)
    return slow, judged


def _recovered(
    c: Connection,
    stored: db.RankTiming,
    where: tuple[str | None, int | None],
    *,
    now_ms: int,
    ended_by: str,
    judged: strag.Judgement | None = None,
) -> None:
    """Announce the end of a straggler episode (``rank.recovered``): from when its compute
    first stayed above its peers' to now, how it ended (``cleared``: back among its peers;
    ``moved``: its rank now runs on another GPU; ``job_ended``: the rank is no longer an
    active rank of a running job; ``stale``: its job stopped sending timings), and why it
    was slow."""
    since = stored["above_since_ms"] if stored["above_since_ms"] is not None else now_ms
    node, gpu = where  # (None, None) once the job left the placement
    emit_event(
        c,
        "rank.recovered",
        {
            "job_id": stored["job_id"],
            "rank": stored["rank"],
            "node": node,
            "gpu": None if gpu is None else int(gpu),
            "above_since_ms": since,
            "straggling_ms": stored["straggling_ms"],
            "ended_ms": now_ms,
            "duration_s": max(0, now_ms - since) / 1000,
            "ended_by": ended_by,
            "reason": stored["reason"],
            "compute_s": judged.compute_s if judged is not None else stored["compute_s"],
            "peers_median_s": judged.peers_median_s if judged is not None else None,
        },
        job_id=stored["job_id"],
        node=node,
    )


def name_gpu(c: Connection, policy: Policy, node: str, gpu: int, now_ms: int) -> str:
    """Why the GPU is slow, from its recent samples (:func:`stragglers.name_reason`)."""
    since = now_ms - int(REASON_SAMPLES_S * 1000)
    frame = reads.gpu_window(
        c, node=node, gpu=gpu, since_ms=since, fields=list(_REASON_FIELDS), limit=10_000
    )
    rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
    return strag.name_reason(rows, hot_c=policy.straggler_hot_c)  # type: ignore[arg-type]


def case_of(
    policy: Policy,
    slow: Straggler,
    *,
    job_pauses_s: list[float],
    fleet_pauses_s: list[float],
) -> StragglerCase:
    """What the decision about ``slow`` weighs: the seconds a move saves, what it costs."""
    gain = strag.projected_gain(
        compute_s=slow.compute_s,
        peers_median_s=slow.peers_median_s,
        step=slow.step,
        total_steps=slow.total_steps,
        horizon_steps=policy.straggler_horizon_steps,
    )
    cost_s, cost_from = strag.move_cost(
        job_pauses_s=job_pauses_s,
        fleet_pauses_s=fleet_pauses_s,
        default_s=policy.straggler_move_cost_s,
    )
    return StragglerCase(
        gain_s=gain.seconds,
        remaining_steps=gain.remaining_steps,
        remaining_from=gain.remaining_from,
        cost_s=cost_s,
        cost_from=cost_from,
    )


def state_values(state: strag.RankState | None = None) -> dict[str, Any]:
    state = state or strag.RankState()
    return {
        "above_since_ms": state.above_since_ms,
        "straggling": state.straggling,
        "straggling_ms": state.straggling_ms,
        "reason": state.reason,
    }
