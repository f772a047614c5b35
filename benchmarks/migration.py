"""Migration benchmark: pause and seconds lost per failure, one host and across nodes.

    .venv/bin/python benchmarks/migration.py [--quick] [--repeat N] [--sizes 10M,100M,1G]

In one run, on this machine (gloo, CPU, loopback):

(a) point-to-point bandwidth of a two-rank gloo group (the baseline of the pause), measured
    again before each size's cases;
(b) for states of about 10 MB, 100 MB and 1 GB (``--quick``: 10 and 100 MB), each case
    ``--repeat`` times (min-max printed, with the transfer's own rate), a job of 2 ranks +
    spares:
    - preventive move, one host and across two launchers (``forewarn launch --nnodes 2``,
      the spare on the other node): the pause as the ranks measure it, against
      bytes/bandwidth; goal: pause <= 2 x bytes/bandwidth + 1 s. No step is lost, so the
      pause is the seconds lost;
    - unplanned, one host (SIGKILL of a rank), across nodes (SIGKILL of the rank on node 1,
      the spare on node 0) and whole node (SIGKILL of the second launcher's process group,
      its rank with it): seconds from the kill to the failed step completed on the
      survivor, the step redone included;
    - checkpoint-restart of the same job: checkpoint every K steps, kill, restart all,
      load, recompute: seconds lost for a failure K/2 steps after a checkpoint;
(c) the per-step cost of ``job.steps()`` + ``with step:`` against the same plain loop, and
    of the step-boundary check alone, per round (min-max of 5 rounds), step timing included
    (it is always on: the clock around the step and its first collective, the timing's
    encoding and its ride on the mirror's store write); once with ``job.all_reduce`` per
    gradient, once with ``job.ddp`` against plain DDP with gradients as bucket views; and
    ``ElasticDDP`` alone against DDP, no job around either, on three shapes (1, 2, 16 buckets);
(d) (``--parts d``) the per-step cost of in-memory peer copies against k: a 4-rank job
    with copies every k steps against the same job without, seconds per step over the whole
    loop, per round, and the host memory the copies take per process; with
    ``--disk-every M``, each k again with the copies also written to disk every M steps
    (``disk_copy_every``, a sharded checkpoint in a temporary directory).

(e) (``--parts e``) per layout (replicated DDP, HSDP 2 x 2, HSDP + TP 2 x 1 x 2, FSDP2,
    FSDP2 with peer copies every 2 steps), 4 ranks + 1 spare, ``--layout-size`` of state
    (default 10MB; HSDP + TP rounds the MLP up to an even number of layers): the
    preventive pause, the stall from the source's last completed step to the new rank's
    first (that step's compute included) beside bytes / loopback bandwidth, and a SIGKILL's
    kill-to-done (or the refusal), against checkpoint-restart of the same state.

(f) (``--parts f``) the preventive stall with and without the next generation's group formed
    ahead, 4 ranks (replicated DDP) + 1 spare, at each of ``--sizes`` (10MB,100MB; 1GB as an
    option), ``--repeat`` runs each: the report's pause (from the source's last completed
    step to the new rank joined), beside bytes / loopback bandwidth and the goal
    1.2 x bytes/bandwidth + 0.2 s, and how long the group formed ahead took to form.

``--json FILE`` writes the figures measured, with the load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from migrator.agent import Agent, AgentConfig  # noqa: E402
from migrator.faults import FaultPlan  # noqa: E402
from migrator.groups import pair_group  # noqa: E402

BYTES_PER_PARAM = 12  # fp32 parameter + two Adam moments


def model_for(state_bytes: int, *, pairs: bool = False) -> torch.nn.Module:
    """An MLP of 1024-wide layers holding about ``state_bytes`` with Adam; ``pairs``: an even
    number of layers (tensor parallelism's column-then-row pairs)."""
    width = 1024
    layers = max(1, round(state_bytes / BYTES_PER_PARAM / (width * width)))
    if pairs:
        layers += layers % 2
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def tensor_parallel(model: torch.nn.Module, tp_mesh: Any) -> None:
    """The Megatron pairing on the benchmark's MLP (:func:`model_for` with ``pairs``): even
    layers column-wise, odd ones row-wise, whose all-reduce ties the tensor-parallel ranks
    together every forward, as in a transformer block."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {
        str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
        for i in range(len(model))  # type: ignore[arg-type]
    }
    parallelize_module(model, tp_mesh, plan, src_data_rank=None)


# -- worker (run by the agent) --------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from migrator import Job

    torch.set_num_threads(1)
    job = Job.from_env()
    job.member.form_ahead = not args.form_at_switch
    torch.manual_seed(0)
    model = model_for(args.state_bytes, pairs=args.layout == "hsdp_tp")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    start = 0
    if args.resume and Path(args.resume).exists():
        t = time.perf_counter()
        saved = torch.load(args.resume, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"] + 1
        print(json.dumps({"loaded_s": time.perf_counter() - t, "from": start}), flush=True)
    layout = args.layout
    if layout in ("fsdp2", "hsdp", "peer_copy", "hsdp_tp"):  # sharded before the optimizer
        tp: dict[str, Any] = {"tp": 2, "tp_plan": tensor_parallel} if layout == "hsdp_tp" else {}
        replicate = 2 if layout in ("hsdp", "hsdp_tp") else 1
        job.fsdp(model, layers=list(model.children()), replicate=replicate, **tp)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    every = args.peer_copy or (2 if layout == "peer_copy" else 0)
    if every:
        disk = args.disk_copy or None
        job.register(
            model=model,
            optimizer=opt,
            rank_unique=True,
            peer_copy_every=every,
            disk_copy_every=disk,
        )
    else:
        job.register(model=model, optimizer=opt)
    job._next = start
    net = job.ddp(model) if layout == "replicated" else model
    x = torch.randn(2, 1024)
    times = []
    t_loop = time.perf_counter()
    for step in job.steps(args.steps):
        t = time.perf_counter()
        with step:
            loss = net(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t)
        if step.ok:
            row = {"rank": job.rank, "step": step.index, "done": time.time()}
            print(json.dumps(row), flush=True)
        if args.ckpt_every and step.ok and job.rank == 0 and step.index % args.ckpt_every == 0:
            t = time.perf_counter()
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step.index},
                args.ckpt,
            )
            print(json.dumps({"ckpt_s": time.perf_counter() - t}), flush=True)
    loop_s = (time.perf_counter() - t_loop) / max(1, len(times))
    if job.rank == 0:
        row = {"step_s": sorted(times)[len(times) // 2], "loop_s": loop_s}
        peers = job.handover.peers
        if peers is not None:
            row.update(copy_s=peers.copy_s, copy_memory=peers.memory_bytes())
        print(json.dumps(row), flush=True)


def launch(
    tmp: Path,
    state_bytes: int,
    *,
    steps: int,
    plan: FaultPlan | None,
    spares: int,
    extra: Sequence[str] = (),
    nproc: int = 2,
    checkpoint_dir: Path | None = None,
    resume_from: Path | None = None,
) -> tuple[Agent, int, float, list[dict]]:
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--state-bytes",
        str(state_bytes),
        "--steps",
        str(steps),
        *extra,
    ]
    agent = Agent(
        AgentConfig(
            command=cmd,
            nproc=nproc,
            spares=spares,
            faults=plan,
            timeout_s=60,
            log_dir=tmp,
            pause_timeout_s=0.5,
            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            checkpoint_dir=checkpoint_dir,
            resume_from=resume_from,
        )
    )
    t = time.perf_counter()
    code = agent.run()
    wall = time.perf_counter() - t
    return agent, code, wall, _lines(tmp)


# -- (a) bandwidth ----------------------------------------------------------------------------


def bandwidth(nbytes: int = 256 * 2**20, reps: int = 3) -> float:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )

    def client() -> dist.TCPStore:
        return dist.TCPStore(
            "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60)
        )

    dst = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.ones(nbytes, dtype=torch.uint8)

    def recv() -> None:
        g = pair_group(client(), "bw", sender=False, backend="gloo", timeout_s=60)
        for i in range(reps + 1):
            g.recv([dst], 0, i).wait()

    t = threading.Thread(target=recv)
    t.start()
    g = pair_group(client(), "bw", sender=True, backend="gloo", timeout_s=60)
    g.send([src], 1, 0).wait()  # warm-up
    t0 = time.perf_counter()
    for i in range(reps):
        g.send([src], 1, i + 1).wait()
    t.join()
    return nbytes * reps / (time.perf_counter() - t0)


# -- (c) wrapper overhead ---------------------------------------------------------------------


_STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
print(store.port, flush=True)
sys.stdin.read()
"""


_HOSTS: list[subprocess.Popen[bytes]] = []


def job_store(*, own_process: bool) -> dist.TCPStore:
    """The job's key-value store for an in-process A/B: a client of a store hosted by a
    process of its own, as in a launched job (the agent hosts it; a rank's every write goes
    over a socket to another process), or, with ``own_process=False``, the store's server in
    this very process (its thread then takes the interpreter lock to answer each write, which
    the rank pays for and a launched job's rank does not). The process ends when this one
    exits (its stdin closes); it is kept until then, as the job's threads still use it."""
    if not own_process:
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        return store
    host = subprocess.Popen(
        [sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert host.stdout is not None
    port = int(host.stdout.readline())
    _HOSTS.append(host)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    return client


def medians_in_turn(
    first: Callable[[], float], second: Callable[[], float], steps: int
) -> tuple[float, float]:
    """Median seconds of ``first`` and ``second`` (each call times itself and returns it),
    called step by step in turn, which goes first alternating: the two medians share the
    machine's noise."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps):
        for turn in (0, 1) if i % 2 == 0 else (1, 0):
            times[turn].append((first, second)[turn]())
    return statistics.median(times[0]), statistics.median(times[1])


def overhead(
    steps: int = 100, rounds: int = 5, *, ddp: bool = False, store_apart: bool = True
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per round: plain and wrapped seconds per step (medians, step by step interleaved),
    the boundary check alone (1000 calls) and the same with step timing (each call after a
    timed step's clock work: it writes the step's timing with the mirror).

    ``ddp``: the plain loop runs DDP with gradients as bucket views on a copy of the model,
    the wrapped one ``job.ddp`` (the same, and its timing) on the model; else both
    ``job.all_reduce`` each gradient. ``store_apart``: the job's store in a process of its
    own, as in a launched job (:func:`job_store`; it outlives the job's threads, and ends
    with this process)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from migrator import Job

    store = job_store(own_process=store_apart)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024)
    )
    opt = torch.optim.Adam(model.parameters())
    job = Job(kv=store, slot=0, world_size=1, initial_rank=0, timeout_s=30)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.Adam(twin.parameters())
    job.register(model=model, optimizer=opt)
    job.start()
    x = torch.randn(64, 1024)
    if ddp:
        plain_net = DDP(twin, process_group=job.group, gradient_as_bucket_view=True)
        net = job.ddp(model)

        def body() -> None:
            loss = net(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        def plain_body() -> None:
            loss = plain_net(x).square().mean()
            twin_opt.zero_grad(set_to_none=True)
            loss.backward()
            twin_opt.step()

    else:

        def body() -> None:
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None
                job.all_reduce(p.grad)
            opt.step()

        plain_body = body

    for _ in range(20):
        body()
        plain_body()

    def plain_step() -> float:
        t = time.perf_counter()
        plain_body()
        return time.perf_counter() - t

    plain, wrapped, boundary, timed = [], [], [], []
    for _ in range(rounds):
        loop = job.steps(steps)

        def wrapped_step(loop: Iterator[Any] = loop) -> float:  # the boundary included
            t = time.perf_counter()
            with next(loop):
                body()
            return time.perf_counter() - t

        wrapped_median, plain_median = medians_in_turn(wrapped_step, plain_step, steps)
        for _ in loop:  # the loop's end (never a step: all ran)
            pass
        plain.append(plain_median)
        wrapped.append(wrapped_median)
        job._next = 0
        t = time.perf_counter()
        for k in range(1000):
            job._boundary(k)
        boundary.append((time.perf_counter() - t) / 1000)
        job._next = 0
        t = time.perf_counter()
        clock = job.clock
        for k in range(1000):
            clock.begin()
            clock.arrive()
            clock.completed()
            clock.end(k)
            job._boundary(k)
        timed.append((time.perf_counter() - t) / 1000)
    return plain, wrapped, boundary, timed


D_MODEL, LAYERS, SEQ = 128, 4, 128
"""The GPT of --parts c's last line: a step of ~50 ms on one CPU thread pair."""


def gpt_overhead(steps: int = 30, rounds: int = 5) -> tuple[list[float], list[float]]:
    """Per round: median seconds per step of the demo's GPT (``LAYERS`` layers of
    ``D_MODEL``, sequences of ``SEQ``, batch 8, dropout 0.1, AdamW) under DDP with gradients
    as bucket views, and the same under the whole job wrapper with its data position
    registered (``job.steps()``, ``with step:``, ``job.ddp``), step by step in turn, each
    first in turn.

    Both loops draw dropout from torch's global generator: the plain turn's draws are put
    back after it (outside the timed step), so that the wrapped loop's state changes only
    by its own steps, as in a job that runs one loop."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from demo.gpt import GPT, corpus
    from migrator import Job, ShardedIndices

    store = job_store(own_process=True)
    text = corpus(200_000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    seq, batch = SEQ, 8
    torch.manual_seed(0)
    model = GPT(len(chars), D_MODEL, LAYERS, 4, seq, 0.1)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=3e-4)
    batches = ShardedIndices(len(data) - seq - 1, batch, rank=0, world_size=1, seed=1)
    twin_batches = ShardedIndices(len(data) - seq - 1, batch, rank=0, world_size=1, seed=1)
    job = Job(kv=store, slot=0, world_size=1, initial_rank=0, timeout_s=30)
    job.register(model=model, optimizer=opt, data=batches)
    job.start()
    net = job.ddp(model)
    plain_net = DDP(twin, process_group=job.group, gradient_as_bucket_view=True)

    def body(net: torch.nn.Module, opt: torch.optim.Optimizer, at: torch.Tensor) -> None:
        x = torch.stack([data[i : i + seq] for i in at.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + seq] for i in at.tolist()])
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    loop = job.steps(10**9)

    def wrapped_step() -> float:
        t = time.perf_counter()
        with next(loop):
            body(net, opt, batches.next())
        return time.perf_counter() - t

    def plain_step() -> float:
        saved = torch.get_rng_state()
        t = time.perf_counter()
        body(plain_net, twin_opt, twin_batches.next())
        elapsed = time.perf_counter() - t
        torch.set_rng_state(saved)
        return elapsed

    for _ in range(5):
        wrapped_step()
        plain_step()
    plain, wrapped = [], []
    for _ in range(rounds):
        wrapped_median, plain_median = medians_in_turn(wrapped_step, plain_step, steps)
        plain.append(plain_median)
        wrapped.append(wrapped_median)
    return plain, wrapped


def hook_cost(
    layers: int = 2,
    width: int = 1024,
    bucket_cap_mb: float = 25.0,
    steps: int = 100,
    rounds: int = 10,
) -> tuple[list[float], list[float], list[float]]:
    """Per round: median seconds per step of DDP without a comm hook (as DDP comes, and
    with ``gradient_as_bucket_view=True``) and of ``ElasticDDP`` (its built-in all-reduce
    hook and its timing, gradients as bucket views, its default; the clock begun and ended
    around each step as ``with step:`` does) on copies of the same MLP of ``layers`` layers
    of ``width``, step by step in turn, each first in turn.

    ElasticDDP's timing is three or four Python calls a step whatever the number of buckets
    (``bucket_cap_mb`` sets how many there are)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from migrator.ddp import ElasticDDP
    from migrator.groups import new_group

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    group = new_group(store, "hook", rank=0, size=1, backend="gloo", timeout_s=30)
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*blocks[:-1])
    twin, triplet = copy.deepcopy(model), copy.deepcopy(model)
    plain_net = DDP(twin, process_group=group, bucket_cap_mb=bucket_cap_mb)
    viewed = DDP(
        triplet, process_group=group, gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb
    )
    hooked = ElasticDDP(model, bucket_cap_mb=bucket_cap_mb)
    hooked.rebuild(group, None, initial=True)
    opts = {id(plain_net): torch.optim.Adam(twin.parameters())}
    opts[id(viewed)] = torch.optim.Adam(triplet.parameters())
    opts[id(hooked)] = torch.optim.Adam(model.parameters())
    x = torch.randn(64, width)
    clock = hooked.clock

    def step(net: torch.nn.Module, k: int) -> float:
        t = time.perf_counter()
        if net is hooked:
            clock.begin()
        opt = opts[id(net)]
        loss = net(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if net is hooked:
            clock.end(k)
        return time.perf_counter() - t

    nets = (plain_net, viewed, hooked)
    for k in range(20):
        for net in nets:
            step(net, k)
            if net is hooked:
                hooked.settle()  # as the job does at each boundary
    per_round: list[list[float]] = [[], [], []]
    for _ in range(rounds):
        times: list[list[float]] = [[], [], []]
        for i in range(steps):
            order = [(i + k) % 3 for k in range(3)]  # each net first in turn
            for k in order:
                times[k].append(step(nets[k], i))
        for k in range(3):
            per_round[k].append(statistics.median(times[k]))
    if len(clock.rows) != clock.window:
        raise RuntimeError(f"ElasticDDP timed {len(clock.rows)} steps, not every step")
    return per_round[0], per_round[1], per_round[2]


# -- (d) peer copies -------------------------------------------------------------------------


def copy_cost(
    tmp: Path, size: int, every: int | None, steps: int, disk_every: int = 0
) -> dict | None:
    """One 4-rank job of ``steps`` steps (peer copies every ``every`` steps, or none; to disk
    every ``disk_every`` steps too): rank 0's seconds per step over the whole loop,
    boundaries included."""
    extra = ["--peer-copy", str(every)] if every else []
    if disk_every:
        extra += ["--disk-copy", str(disk_every)]
    ckpt = tmp / "ckpt" if disk_every else None
    _, code, _, lines = launch(
        tmp, size, steps=steps, plan=None, spares=0, extra=extra, nproc=4, checkpoint_dir=ckpt
    )
    rows = [x for x in lines if "loop_s" in x]
    shutil.rmtree(tmp, ignore_errors=True)
    return rows[0] if code == 0 and rows else None


def peer_copies(
    tmp: Path, size: int, ks: Sequence[int], rounds: int, steps: int, disk_every: int = 0
) -> dict:
    """Per round, interleaved: the job without copies, then with each k (and, with
    ``disk_every``, each k with disk copies too). Returns, per k, the extra seconds per step
    in % of the round's plain step, min-max over rounds."""
    plain: list[float] = []
    per_k: dict[int, list[float]] = {k: [] for k in ks}
    with_disk: dict[int, list[float]] = {k: [] for k in ks}
    at_boundary: dict[int, list[float]] = {k: [] for k in ks}
    memory: dict[int, int] = {}
    for i in range(rounds):
        base = copy_cost(tmp / f"plain{i}", size, None, steps)
        if base is None:
            continue
        plain.append(base["loop_s"])
        for k in ks:
            got = copy_cost(tmp / f"k{k}-{i}", size, k, steps)
            if got is not None:
                per_k[k].append(100 * (got["loop_s"] - base["loop_s"]) / base["loop_s"])
                at_boundary[k].append(100 * got["copy_s"] / (k * base["loop_s"]))
                memory[k] = got.get("copy_memory", 0)
            if disk_every:
                got = copy_cost(tmp / f"k{k}-disk-{i}", size, k, steps, disk_every)
                if got is not None:
                    extra = 100 * (got["loop_s"] - base["loop_s"]) / base["loop_s"]
                    with_disk[k].append(extra)
    return {
        "plain_step_s": plain,
        "extra_percent": per_k,
        "disk_extra_percent": with_disk,
        "disk_every": disk_every,
        "boundary_percent": at_boundary,
        "memory_bytes": memory,
    }


# -- (e) per layout, 4 ranks ---------------------------------------------------------------

LAYOUT_NAMES = ("replicated", "hsdp", "hsdp_tp", "fsdp2", "peer_copy")


def layout_cases(tmp: Path, size: int, layout: str, *, move: bool = True) -> dict:
    """A 4-rank job of ``layout``: a preventive move of rank 1 (the pause the ranks measure,
    and the stall from the source's last completed step to the new rank's first, that
    step's compute included; not with ``move=False``) and a SIGKILL of rank 1 (kill to the
    failed step completed on a survivor, or why it was refused)."""
    out: dict = {"layout": layout}
    extra = ["--layout", layout]
    rep = None
    if move:
        plan = FaultPlan().migrate_at(1, AT, reason="preventive")
        agent, code, _, lines = launch(
            tmp / "move", size, steps=STEPS, plan=plan, spares=1, extra=extra, nproc=4
        )
        rep = agent.reports[0] if agent.reports and code == 0 else None
    if rep is not None and rep.step is not None:
        done = {x["step"]: x["done"] for x in lines if x.get("rank") == 1 and "done" in x}
        stall = (
            done[rep.step] - done[rep.step - 1] if {rep.step, rep.step - 1} <= set(done) else None
        )
        out.update(pause_s=rep.pause_s, stall_s=stall, bytes=rep.bytes_moved or 0)
    plan = FaultPlan().fail_at(1, AT)
    agent, code, _, lines = launch(
        tmp / "kill", size, steps=STEPS, plan=plan, spares=1, extra=extra, nproc=4
    )
    if code == 0 and agent.reports:
        out["kill_to_done_s"] = _kill_to_done(lines, AT)
    else:
        out["kill_refused"] = (agent.message or "failed").split(";")[0][:60]
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def disk_restart(tmp: Path, size: int) -> dict:
    """Checkpoint-restart of the peer-copy job itself (4 ranks, FSDP2, copies every 2 steps,
    to disk every 4): rank 1 and its buddy SIGKILLed together 2 steps after a disk copy, the
    job stops at that copy, and is launched again with ``--resume``: seconds from the kill to
    the stop, and from the new launch to the failed step done again (its start, every rank's
    load of its own file and the steps redone)."""
    k, every, fail = 2, 4, 6
    ckpt = tmp / "ckpt"
    extra = ["--layout", "peer_copy", "--peer-copy", str(k), "--disk-copy", str(every)]
    plan = FaultPlan().fail_at(1, fail).fail_at(2, fail)
    agent, code, _, lines = launch(
        tmp / "a", size, steps=fail + 1, plan=plan, spares=1, extra=extra, nproc=4,
        checkpoint_dir=ckpt,
    )  # fmt: skip
    stopped = time.time()
    kill = [x["t"] for x in lines if "fault" in x]
    if code == 0 or not kill or not (ckpt / "latest").exists():
        return {"failed": (agent.message or "the job did not stop")[:80]}
    t = time.time()
    _, code, _, lines = launch(
        tmp / "b", size, steps=fail + 1, plan=None, spares=0, extra=extra, nproc=4,
        checkpoint_dir=ckpt, resume_from=ckpt,
    )  # fmt: skip
    done = [x["done"] for x in lines if x.get("step") == fail and "done" in x]
    if code != 0 or not done:
        return {"failed": "the resumed job did not reach the failed step"}
    return {"stop_s": stopped - min(kill), "restart_s": max(done) - t}


# -- (f) the stall with and without the group formed ahead -----------------------------------


def stall_case(tmp: Path, size: int, *, ahead: bool) -> dict | None:
    """A 4-rank job (replicated DDP) whose rank 1 moves preventively: the report's pause
    (the source at S to the new rank joined), its transfer, and the group formation."""
    extra = ["--layout", "replicated"] + ([] if ahead else ["--form-at-switch"])
    plan = FaultPlan().migrate_at(1, AT, reason="preventive")
    agent, code, _, _ = launch(tmp, size, steps=STEPS, plan=plan, spares=1, extra=extra, nproc=4)
    rep = agent.reports[0] if agent.reports and code == 0 else None
    if rep is None or rep.pause_s is None:
        return None
    group = agent.groups.get(rep.migration_id) or {}
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "pause_s": rep.pause_s,
        "transfer_s": rep.transfer_s,
        "bytes": rep.bytes_moved or 0,
        "preformed": bool(group.get("preformed")),
        "form_s": group.get("form_s"),
        "waited_s": group.get("waited_s"),
    }


def stalls(tmp: Path, sizes: Sequence[tuple[str, int]], repeat: int) -> list[dict]:
    print(
        f"(f) preventive stall, 4 ranks (DDP) + 1 spare, {repeat} run(s) per case (min-max): "
        "the report's pause, from the source's last completed step to the new rank joined;\n"
        "    goal: stall <= 1.2 x bytes/bandwidth + 0.2 s; loopback bandwidth measured before "
        "each size"
    )
    print(
        f"    {'state':>6} {'bytes':>13} {'bytes/bw s':>10} {'goal s':>7} "
        f"{'g+1 formed ahead s':>19} {'at the switch s':>16} {'formation s':>12}"
    )
    rows = []
    for label, size in sizes:
        bw = bandwidth()
        got: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(repeat):
            for ahead in (True, False):  # interleaved: the same load for both
                row = stall_case(tmp / f"stall-{label}-{ahead}-{i}", size, ahead=ahead)
                if row is not None:
                    got[ahead].append(row)
        nbytes = max((r["bytes"] for r in got[True] + got[False]), default=0)
        goal = 1.2 * nbytes / bw + 0.2

        def spread(rows: list[dict], key: str) -> str:
            vals = [r[key] for r in rows if r.get(key) is not None]
            if not vals:
                return "failed"
            text = f"{min(vals):.3f}-{max(vals):.3f}"
            return text if len(vals) == repeat else text + f" ({repeat - len(vals)} failed)"

        met = got[True] and max(r["pause_s"] for r in got[True]) <= goal
        print(
            f"    {label:>6} {nbytes:>13,} {nbytes / bw:>10.3f} {goal:>7.3f} "
            f"{spread(got[True], 'pause_s'):>19} {spread(got[False], 'pause_s'):>16} "
            f"{spread(got[True], 'form_s'):>12}  {'met' if met else 'MISSED'}",
            flush=True,
        )
        rows.append(
            {
                "state": label,
                "bandwidth": bw,
                "bytes": nbytes,
                "goal_s": goal,
                "ahead": got[True],
                "at_switch": got[False],
            }
        )
    print()
    return rows


def stall_fit(rows: list[dict]) -> dict | None:
    """stall = per_transfer x bytes/bandwidth + fixed_s, least squares on every run with the
    group formed ahead (what ``goodput`` charges a preventive move)."""
    xs, ys = [], []
    for row in rows:
        for run in row["ahead"]:
            xs.append(row["bytes"] / row["bandwidth"])
            ys.append(run["pause_s"])
    if len(set(xs)) < 2:
        return None
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return {"per_transfer": slope, "fixed_s": my - slope * mx, "runs": n}


# -- (b) the cases ----------------------------------------------------------------------------

SIZES = [("10MB", 10**7), ("100MB", 10**8), ("1GB", 10**9)]
STEPS, AT = 7, 3  # steps per run; the step a move or a failure happens at


def json_lines(path: Path) -> list[dict]:
    """The JSON objects a log holds one a line (none if it is not there yet)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _lines(log_dir: Path) -> list[dict]:
    return [x for f in sorted(log_dir.glob("slot*.log")) for x in json_lines(f)]


def _kill_to_done(lines: list[dict], step: int) -> float | None:
    """Seconds from the fault to the failed step completed on a rank that survived."""
    kill = [x["t"] for x in lines if "fault" in x]
    done = [x["done"] for x in lines if x.get("step") == step and "done" in x]
    return max(done) - min(kill) if kill and done else None


Result = tuple[float | None, int, float | None]  # seconds, bytes moved, transfer seconds


def one_host_pause(tmp: Path, size: int) -> Result:
    agent, code, _, _ = launch(
        tmp, size, steps=STEPS, plan=FaultPlan().migrate_at(0, AT, reason="preventive"), spares=1
    )
    rep = agent.reports[0] if agent.reports and code == 0 else None
    if rep is None:
        return None, 0, None
    return rep.pause_s, rep.bytes_moved or 0, rep.transfer_s


def one_host_kill(tmp: Path, size: int) -> Result:
    agent, code, _, lines = launch(
        tmp, size, steps=STEPS, plan=FaultPlan().fail_at(1, AT), spares=1
    )
    rep = agent.reports[0] if agent.reports and code == 0 else None
    if rep is None:
        return None, 0, None
    return _kill_to_done(lines, AT), rep.bytes_moved or 0, rep.transfer_s


def launch_nodes(
    tmp: Path, size: int, nodes: list[tuple[int, int]], plan: FaultPlan
) -> tuple[int, list[dict], list[dict]]:
    """One ``forewarn launch`` per node, each its own process group, on loopback."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), FOREWARN_RUN_DIR=str(tmp))
    worker = [sys.executable, __file__, "--worker", "--state-bytes", str(size)]
    worker += ["--steps", str(STEPS)]
    procs = []
    for rank, (nproc, spares) in enumerate(nodes):
        cmd = [sys.executable, "-m", "forewarn", "launch", "--nnodes", str(len(nodes))]
        cmd += ["--node-rank", str(rank), "--node-name", f"node{rank}", "--timeout-s", "60"]
        cmd += ["--node-timeout-s", "3"]
        cmd += ["--nproc-per-node", str(nproc), "--spares-per-node", str(spares)]
        cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--log-dir", str(tmp)]
        if rank == 0:
            cmd += ["--report", str(tmp / "reports.jsonl"), "--faults", plan.to_json()]
        procs.append(
            subprocess.Popen(
                [*cmd, "--", *worker],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    try:
        code = procs[0].wait(timeout=900)
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    path = tmp / "reports.jsonl"
    reports = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return code, reports, _lines(tmp)


def nodes_pause(tmp: Path, size: int) -> Result:
    """Rank 0 on node 0 moves to the spare on node 1."""
    plan = FaultPlan().migrate_at(0, AT, reason="preventive")
    code, reports, _ = launch_nodes(tmp, size, [(1, 0), (1, 1)], plan)
    rep = reports[0] if reports and code == 0 else None
    if rep is None:
        return None, 0, None
    return rep["pause_s"], rep["bytes_moved"] or 0, rep["transfer_s"]


def nodes_rank_kill(tmp: Path, size: int) -> Result:
    """Rank 1 on node 1 killed alone; the spare on node 0 takes it over."""
    plan = FaultPlan().fail_at(1, AT)
    code, reports, lines = launch_nodes(tmp, size, [(1, 1), (1, 0)], plan)
    rep = reports[0] if reports and code == 0 else None
    if rep is None:
        return None, 0, None
    return _kill_to_done(lines, AT), rep["bytes_moved"] or 0, rep["transfer_s"]


def nodes_kill(tmp: Path, size: int) -> Result:
    """Node 1's launcher and everything it started killed at once; the spare on node 0
    takes rank 1 over."""
    plan = FaultPlan().kill_node_at(1, AT)
    code, reports, lines = launch_nodes(tmp, size, [(1, 1), (1, 0)], plan)
    rep = reports[0] if reports and code == 0 else None
    if rep is None:
        return None, 0, None
    return _kill_to_done(lines, AT), rep["bytes_moved"] or 0, rep["transfer_s"]


def checkpoint_restart(tmp: Path, size: int) -> Result:
    """Checkpoint every K steps, a rank killed K/2 steps after one, everything restarted
    from it: restart + load + the steps redone (the checkpoint's own cost not counted)."""
    k, fail = 4, 6
    ckpt = tmp / "ckpt.pt"
    launch(
        tmp / "a",
        size,
        steps=fail + 1,
        plan=FaultPlan().fail_at(1, fail),
        spares=0,
        extra=["--ckpt-every", str(k), "--ckpt", str(ckpt)],
    )
    _, code, wall, lines = launch(
        tmp / "b", size, steps=fail + 1, plan=None, spares=0, extra=["--resume", str(ckpt)]
    )
    step_s = next((x["step_s"] for x in lines if "step_s" in x), 0.0)
    start_from = next((x["from"] for x in lines if "from" in x), 0)
    if code != 0 or not start_from:
        return None, 0, None
    # Everything until the failed step is done again: the restart, the load, the redo.
    return wall - (fail + 1 - fail) * step_s, size, None


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the 1 GB case")
    ap.add_argument("--repeat", type=int, default=2, help="runs per case (default 2)")
    ap.add_argument("--sizes", default="10MB,100MB,1GB", help="among 10MB,100MB,1GB")
    ap.add_argument(
        "--parts",
        default="b,c",
        help="b (moves and failures), c (wrapper cost), d (peer copies' cost against k), "
        "e (per layout, 4 ranks), f (preventive stall with and without g+1 formed ahead, "
        "4 ranks, at --sizes)",
    )
    ap.add_argument("--json", type=Path, help="write the figures measured to this file")
    ap.add_argument("--copy-ks", default="1,5,20", help="d: the k values (default 1,5,20)")
    ap.add_argument("--copy-rounds", type=int, default=2, help="d: rounds (default 2)")
    ap.add_argument("--peer-copy", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--disk-copy", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--disk-every",
        type=int,
        default=0,
        help="d: also each k with the copies written to disk every M steps (default off)",
    )
    ap.add_argument("--layout", default="replicated", help=argparse.SUPPRESS)
    ap.add_argument("--layout-size", default="10MB", help="e: the state size (default 10MB)")
    ap.add_argument("--form-at-switch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--write-stall",
        type=Path,
        help="f: write the stall figures and their fit here (goodput/data/preventive_stall.json)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--state-bytes", type=int, default=10**7, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-every", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    ap.add_argument("--resume", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    tmp = Path(tempfile.mkdtemp(prefix="forewarn-bench-"))
    figures: dict = {"load_average": os.getloadavg()}
    sizes = [x for x in SIZES if x[0] in args.sizes.split(",")]
    if "b" not in args.parts.split(","):
        sizes = []
    if args.quick:
        sizes = [x for x in sizes if x[1] < 10**9]
    if sizes:
        print(
            f"(a)+(b) 2 ranks, {args.repeat} run(s) per case (min-max); loopback bandwidth "
            "(gloo, 3 x 256 MiB messages) measured before each size's cases;\n"
            "    goal: pause <= 2 * bytes / bandwidth + 1 s"
        )
        head = f"    {'state':>6} {'case':<36} {'bytes':>13} {'goal s':>7} {'seconds':>13}"
        print(head + f" {'transfer GB/s':>14}")
    bws: list[float] = []
    failed: list[Path] = []  # the logs of failed runs are kept
    for label, size in sizes:
        bw = bandwidth()
        bws.append(bw)
        goal = 2 * size / bw + 1
        print(f"    {label:>6} loopback bandwidth {bw / 1e9:.2f} GB/s")
        cases = {
            "preventive, one host: pause": one_host_pause,
            "preventive, across nodes: pause": nodes_pause,
            "unplanned, one host: kill->done": one_host_kill,
            "unplanned, across nodes: kill->done": nodes_rank_kill,
            "whole node lost: kill->done": nodes_kill,
            "checkpoint-restart: seconds lost": checkpoint_restart,
        }
        for k, (name, case) in enumerate(cases.items()):
            got: list[float] = []
            rates: list[float] = []
            nbytes = 0
            for i in range(args.repeat):
                run_dir = tmp / f"{label}-case{k}-run{i}"
                value, moved, transfer_s = case(run_dir, size)
                if value is not None:
                    got.append(value)
                    nbytes = moved
                    shutil.rmtree(run_dir, ignore_errors=True)
                else:
                    failed.append(run_dir)
                if transfer_s:
                    rates.append(moved / transfer_s / 1e9)
            spread = f"{min(got):.2f}-{max(got):.2f}" if got else "failed"
            if len(got) < args.repeat:
                spread += f" ({args.repeat - len(got)} failed)"
            rate = f"{min(rates):.2f}-{max(rates):.2f}" if rates else "-"
            figures.setdefault("cases", []).append(
                {"state": label, "case": name, "bytes": nbytes, "goal_s": goal, "seconds": got}
            )
            mark = ""
            if got and "pause" in name:
                mark = "  met" if max(got) <= goal else "  MISSED"
            print(
                f"    {label:>6} {name:<36} {nbytes:>13,} {goal:>7.2f} {spread:>13} "
                f"{rate:>14}{mark}",
                flush=True,
            )
    if bws:
        print(
            f"    loopback bandwidth over the run: {min(bws) / 1e9:.2f}-{max(bws) / 1e9:.2f} GB/s"
        )
    if failed:
        print("    logs of the failed runs: " + " ".join(str(d) for d in failed))
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    if "d" in args.parts.split(","):
        ks = [int(k) for k in args.copy_ks.split(",")]
        print(
            f"(d) in-memory peer copies: 4 ranks (DDP, ~10 MB of state each), 40 steps, "
            f"{args.copy_rounds} round(s); seconds per step over the whole loop against the "
            "same job without copies, in the same round (goal < 1 %)"
        )
        copies = peer_copies(tmp / "copies", 10**7, ks, args.copy_rounds, 40, args.disk_every)
        figures["peer_copies"] = copies
        plain = copies["plain_step_s"]
        if plain:
            print(f"    no copies: {min(plain) * 1e3:.1f}-{max(plain) * 1e3:.1f} ms/step")
        for k in ks:
            extra = copies["extra_percent"][k]
            spread = f"{min(extra):+.2f} to {max(extra):+.2f} %" if extra else "failed"
            mem = copies["memory_bytes"].get(k, 0) / 1e6
            own = copies["boundary_percent"][k]
            at = f"{min(own):.2f}-{max(own):.2f} %" if own else "-"
            print(
                f"    k = {k:>3}: {spread} per step over the loop; a round's time on the "
                f"training thread (the copy; the first also builds the pair groups) / k steps: "
                f"{at}; held per process {mem:.0f} MB"
            )
            disk = copies["disk_extra_percent"][k]
            if args.disk_every:
                spread = f"{min(disk):+.2f} to {max(disk):+.2f} %" if disk else "failed"
                print(f"    k = {k:>3}, to disk every {args.disk_every} steps too: {spread}")
        print(flush=True)
    if "f" in args.parts.split(","):
        chosen = [x for x in SIZES if x[0] in args.sizes.split(",")]
        figures["stalls"] = stalls(tmp / "stalls", chosen, args.repeat)
        fit = figures["stall_fit"] = stall_fit(figures["stalls"])
        if fit is not None:
            print(
                f"    fit over the runs formed ahead: stall = {fit['per_transfer']:.2f} x "
                f"bytes/bandwidth + {fit['fixed_s']:.3f} s\n",
                flush=True,
            )
        if args.write_stall is not None and fit is not None:
            doc = {
                "benchmark": "benchmarks/migration.py --parts f",
                "command": " ".join(sys.argv[1:]),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "ranks": 4,
                "transport": "gloo, loopback, one host",
                "cpu_cores": os.cpu_count(),
                "load_average_before": figures["load_average"],
                "load_average": os.getloadavg(),
                "rows": figures["stalls"],
                "fit": fit,
            }
            args.write_stall.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"the stall's fit written to {args.write_stall}")
    if "e" in args.parts.split(","):
        size = dict(SIZES)[args.layout_size]
        bw = bandwidth()
        print(
            f"(e) per layout, 4 ranks + 1 spare, {args.layout_size} of state per rank's model "
            f"(its shard of it when sharded); loopback bandwidth {bw / 1e9:.2f} GB/s\n"
            "    stall: the source's last completed step to the new rank's first, that "
            "step's compute included; goal (issue 29): stall <= 1.2 x bytes/bandwidth + 0.2 s"
        )
        print(
            f"    {'layout':<11} {'bytes':>11} {'bytes/bw s':>10} {'pause s':>8} "
            f"{'stall s':>8} {'unplanned: kill->done s':>24}"
        )
        rows = []

        def num(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        for layout in LAYOUT_NAMES:
            row = layout_cases(tmp / f"layout-{layout}", size, layout)
            rows.append(row)
            nbytes = row.get("bytes", 0)

            kill = (
                num(row.get("kill_to_done_s"))
                if "kill_to_done_s" in row
                else row.get("kill_refused", "-")
            )
            print(
                f"    {layout:<11} {nbytes:>11,} {nbytes / bw:>10.3f} {num(row.get('pause_s')):>8} "
                f"{num(row.get('stall_s')):>8} {kill:>24}",
                flush=True,
            )
        ckpt, _, _ = checkpoint_restart(tmp / "layout-ckpt", size)
        print(f"    checkpoint-restart (2 ranks, DDP), seconds lost: {num(ckpt)}", flush=True)
        own = disk_restart(tmp / "layout-disk", size)
        said = (
            f"{own['stop_s'] + own['restart_s']:.2f} (the stop {own['stop_s']:.2f}, the "
            f"restart to the failed step {own['restart_s']:.2f})"
            if "failed" not in own
            else f"failed: {own['failed']}"
        )
        print(
            "    checkpoint-restart of the peer-copy job from its own disk copies (4 ranks, "
            f"every 4 steps; rank 1 and its buddy lost 2 steps after one), seconds lost: {said}\n",
            flush=True,
        )
        figures["layouts"] = {
            "bandwidth": bw,
            "rows": rows,
            "checkpoint_restart_s": ckpt,
            "own_disk_restart": own,
        }
    if "c" not in args.parts.split(","):
        _write(args.json, figures)
        return
    print(
        "(c) per-step cost of the wrapper, step timing on (1-rank group, 3x1024 MLP, batch 64, "
        "Adam), 5 rounds; the job's store in a process of its own, as the agent hosts it (and "
        "once in this process, as earlier runs of this benchmark had it)"
    )
    figures["wrapper"] = {}
    for ddp, apart in ((False, True), (True, True), (True, False)):
        plain, wrapped, boundary, timed = overhead(ddp=ddp, store_apart=apart)
        extra = [100 * (w - p) / p for p, w in zip(plain, wrapped, strict=True)]
        share = [100 * b / p for p, b in zip(plain, timed, strict=True)]
        timing = [100 * (t - b) / p for p, b, t in zip(plain, boundary, timed, strict=True)]
        what = "job.ddp against DDP (bucket views)" if ddp else "job.all_reduce per gradient"
        what += "" if apart else ", the store's server in this process"
        print(
            f"    {what}: plain loop {min(plain) * 1e3:.3f}-{max(plain) * 1e3:.3f} ms/step, "
            f"wrapped {min(wrapped) * 1e3:.3f}-{max(wrapped) * 1e3:.3f} ms/step: "
            f"{min(extra):+.2f} to {max(extra):+.2f} % per round (medians; noisy on a shared "
            "machine)"
        )
        print(
            f"    boundary alone {min(boundary) * 1e6:.1f}-{max(boundary) * 1e6:.1f} us; with "
            f"the step's timing {min(timed) * 1e6:.1f}-{max(timed) * 1e6:.1f} us = "
            f"{min(share):.2f}-{max(share):.2f} % of the plain step in the same round (goal "
            f"< 1 %), of which the timing {min(timing):+.2f} to {max(timing):+.2f} %",
            flush=True,
        )
        key = ("ddp" if ddp else "all_reduce") + ("" if apart else "_store_in_process")
        figures["wrapper"][key] = {
            "plain_s": plain,
            "wrapped_s": wrapped,
            "boundary_s": boundary,
            "boundary_timed_s": timed,
        }
    plain, wrapped = gpt_overhead()
    extra = [100 * (w - p) / p for p, w in zip(plain, wrapped, strict=True)]
    diff = [(w - p) * 1e6 for p, w in zip(plain, wrapped, strict=True)]
    print(
        f"    the whole wrapper on the demo's GPT ({LAYERS} x {D_MODEL}, sequences of {SEQ}, "
        "batch 8, dropout, "
        f"data position registered) against DDP (bucket views), 5 rounds: "
        f"{statistics.median(plain) * 1e3:.1f} against {statistics.median(wrapped) * 1e3:.1f} "
        f"ms/step (medians): {min(extra):+.2f} to {max(extra):+.2f} % per round, median "
        f"{statistics.median(extra):+.2f} % ({statistics.median(diff):+.0f} us a step)",
        flush=True,
    )
    figures["wrapper"]["gpt"] = {"plain_s": plain, "wrapped_s": wrapped}
    shapes: dict[str, dict] = {
        # a step of ~0.5 ms, where a cost of a few microseconds shows above the noise
        "2 x 64 MLP, 1 bucket, 1000 steps a round": {"layers": 2, "width": 64, "steps": 1000},
        "2 x 1024 MLP, 2 buckets": {"layers": 2, "width": 1024},
        "16 x 512 MLP, 1 MB buckets (16)": {"layers": 16, "width": 512, "bucket_cap_mb": 1.0},
    }
    for shape, kwargs in shapes.items():
        plain, viewed, hooked = hook_cost(**kwargs)
        for name, base in (("DDP as it comes", plain), ("DDP, gradients as bucket views", viewed)):
            extra = [100 * (h - p) / p for p, h in zip(base, hooked, strict=True)]
            diff = [(h - p) * 1e6 for p, h in zip(base, hooked, strict=True)]
            print(
                f"    ElasticDDP against {name} ({shape}, no job, 10 rounds): "
                f"{statistics.median(base) * 1e3:.3f} against "
                f"{statistics.median(hooked) * 1e3:.3f} ms/step (medians): "
                f"{min(extra):+.2f} to {max(extra):+.2f} % per round, median "
                f"{statistics.median(extra):+.2f} % ({statistics.median(diff):+.0f} us a step)",
                flush=True,
            )
        figures["wrapper"].setdefault("ddp_hook", {})[shape] = {
            "plain_s": plain,
            "viewed_s": viewed,
            "hooked_s": hooked,
        }
    print()
    _write(args.json, figures)


def _write(path: Path | None, figures: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(figures, indent=1, default=str))
        print(f"figures written to {path}")


if __name__ == "__main__":
    main()
