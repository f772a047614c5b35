"""Migration benchmark: pause against bytes/bandwidth, wrapper cost, checkpoint-restart.

    .venv/bin/python benchmarks/migration.py [--quick]

In one run, on this machine (gloo, CPU, loopback):

(a) point-to-point bandwidth of a two-rank gloo group (the baseline of the pause);
(b) the pause of a planned migration (training stopped at S -> step S+1 starts on every
    rank) for states of about 10 MB, 100 MB and 1 GB (``--quick`` skips 1 GB), printed with
    pause / (bytes / bandwidth); goal: pause <= 2 x bytes/bandwidth + 1 s;
(c) the per-step cost of ``job.steps()`` + ``with step:`` against the same plain loop;
(d) seconds lost per failure: checkpoint every K steps + kill + restart all + load +
    recompute, against an unplanned migration to a warm spare, on the same job.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from migrator.agent import Agent, AgentConfig  # noqa: E402
from migrator.faults import FaultPlan  # noqa: E402
from migrator.groups import pair_group  # noqa: E402

BYTES_PER_PARAM = 12  # fp32 parameter + two Adam moments


def model_for(state_bytes: int) -> torch.nn.Module:
    width = 1024
    layers = max(1, round(state_bytes / BYTES_PER_PARAM / (width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


# -- worker (run by the agent) --------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from migrator import Job

    torch.set_num_threads(1)
    job = Job.from_env()
    torch.manual_seed(0)
    model = model_for(args.state_bytes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    start = 0
    if args.resume and Path(args.resume).exists():
        t = time.perf_counter()
        saved = torch.load(args.resume, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"] + 1
        print(json.dumps({"loaded_s": time.perf_counter() - t, "from": start}), flush=True)
    job.register(model=model, optimizer=opt)
    job._next = start
    net = job.ddp(model)
    x = torch.randn(2, 1024)
    times = []
    for step in job.steps(args.steps):
        t = time.perf_counter()
        with step:
            loss = net(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t)
        if args.ckpt_every and step.ok and job.rank == 0 and step.index % args.ckpt_every == 0:
            t = time.perf_counter()
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step.index},
                args.ckpt,
            )
            print(json.dumps({"ckpt_s": time.perf_counter() - t}), flush=True)
    if job.rank == 0:
        print(json.dumps({"step_s": sorted(times)[len(times) // 2]}), flush=True)


def launch(
    tmp: Path,
    state_bytes: int,
    *,
    steps: int,
    plan: FaultPlan | None,
    spares: int,
    extra: list[str] = (),
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
            nproc=2,
            spares=spares,
            faults=plan,
            timeout_s=60,
            log_dir=tmp,
            pause_timeout_s=0.5,
            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        )
    )
    t = time.perf_counter()
    code = agent.run()
    wall = time.perf_counter() - t
    lines = []
    for f in sorted(tmp.glob("slot*.log")):
        for line in f.read_text().splitlines():
            if line.startswith("{"):
                lines.append(json.loads(line))
    return agent, code, wall, lines


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


def overhead(steps: int = 60) -> tuple[float, float, float]:
    from migrator import Job

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024)
    )
    opt = torch.optim.Adam(model.parameters())
    job = Job(store=store, slot=0, world_size=1, initial_rank=0, timeout_s=30)
    job.register(model=model, optimizer=opt)
    job.start()
    x = torch.randn(64, 1024)

    def body() -> None:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            job.all_reduce(p.grad)
        opt.step()

    for _ in range(20):
        body()
    plain, wrapped = [], []
    for _ in range(5):  # interleave to share the machine's noise
        t = time.perf_counter()
        for _ in range(steps):
            body()
        plain.append((time.perf_counter() - t) / steps)
        job._next = 0
        t = time.perf_counter()
        for step in job.steps(steps):
            with step:
                body()
        wrapped.append((time.perf_counter() - t) / steps)
    t = time.perf_counter()
    for k in range(1000):
        job._boundary(k)
    boundary = (time.perf_counter() - t) / 1000
    plain.sort()
    wrapped.sort()
    return plain[len(plain) // 2], wrapped[len(wrapped) // 2], boundary


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the 1 GB case")
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
    print("(a) loopback point-to-point bandwidth (gloo, 256 MiB messages)")
    bw = bandwidth()
    print(f"    {bw / 1e9:.2f} GB/s\n")

    sizes = [("10 MB", 10**7), ("100 MB", 10**8)] + ([] if args.quick else [("1 GB", 10**9)])
    print("(b) pause of a planned migration (2 active + 1 warm spare)")
    print(
        f"    {'state':>7} {'bytes':>12} {'bytes/bw s':>11} {'transfer s':>11} "
        f"{'pause s':>8} {'ratio':>6}  goal: pause <= 2*bytes/bw + 1 s"
    )
    for label, size in sizes:
        agent, code, _, _ = launch(
            tmp / f"b{size}", size, steps=6, plan=FaultPlan().migrate_at(0, 2), spares=1
        )
        rep = agent.reports[0] if agent.reports else None
        if code != 0 or rep is None or rep.pause_s is None:
            print(f"    {label:>7} failed: {agent.message}")
            continue
        ideal = (rep.bytes_moved or 0) / bw
        ok = "met" if rep.pause_s <= 2 * ideal + 1 else "MISSED"
        print(
            f"    {label:>7} {rep.bytes_moved:>12,} {ideal:>11.3f} {rep.transfer_s:>11.3f} "
            f"{rep.pause_s:>8.3f} {rep.pause_s / ideal:>6.2f}  {ok}"
        )
    print()

    print("(c) per-step cost of the wrapper (1-rank group, 3x1024 MLP, batch 64, Adam)")
    plain, wrapped, boundary = overhead()
    print(
        f"    plain loop {plain * 1e3:.3f} ms/step, wrapped {wrapped * 1e3:.3f} ms/step: "
        f"measured {100 * (wrapped - plain) / plain:+.2f} % (median of 5 rounds; noisy on a "
        "shared machine)"
    )
    print(
        f"    boundary alone {boundary * 1e6:.1f} us = {100 * boundary / plain:.2f} % of the "
        "plain step (goal < 1 %)\n"
    )

    print("(d) seconds lost per failure, 100 MB job, failure 6 steps after a checkpoint")
    size, k, fail = 10**8, 10, 16
    ckpt = tmp / "ckpt.pt"
    _, _, _, lines = launch(
        tmp / "d1",
        size,
        steps=fail + 1,
        plan=FaultPlan().fail_at(1, fail),
        spares=0,
        extra=["--ckpt-every", str(k), "--ckpt", str(ckpt)],
    )
    ckpt_s = max([x["ckpt_s"] for x in lines if "ckpt_s" in x] or [0.0])
    _, _, wall2, lines2 = launch(
        tmp / "d2", size, steps=fail + 1, plan=None, spares=0, extra=["--resume", str(ckpt)]
    )
    step_s = next((x["step_s"] for x in lines2 if "step_s" in x), 0.0)
    start_from = next((x["from"] for x in lines2 if "from" in x), 0)
    redo = fail - start_from
    restart_s = wall2 - (fail + 1 - start_from) * step_s
    lost_ckpt = restart_s + redo * step_s
    agent3, _, _, lines3 = launch(
        tmp / "d3", size, steps=fail + 3, plan=FaultPlan().fail_at(1, fail), spares=1
    )
    rep = agent3.reports[0] if agent3.reports else None
    step3 = next((x["step_s"] for x in lines3 if "step_s" in x), step_s)
    lost_mig = (rep.pause_s or 0) + step3 if rep else float("nan")
    print(
        f"    checkpoint-restart: restart+load {restart_s:.2f} s + {redo} steps redone "
        f"x {step_s:.3f} s = {lost_ckpt:.2f} s lost (+ {ckpt_s:.2f} s per checkpoint)"
    )
    print(
        f"    warm-spare migration: pause {rep.pause_s if rep else float('nan'):.2f} s "
        f"+ 1 step redone x {step3:.3f} s = {lost_mig:.2f} s lost"
    )
    if rep:
        print(f"    ratio checkpoint-restart / migration: {lost_ckpt / lost_mig:.1f}x")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
