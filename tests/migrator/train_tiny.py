"""A tiny migratable training job for the migrator tests (run by the agent, not by pytest).

``--mode fsdp`` shards the model with FSDP2 through ``job.fsdp`` (each rank saves its own
shards; ``--replicate R``: HSDP, R replica groups). Uses every RNG a script may use
(dropout: torch; noise: NumPy; a random scale: Python), an Adam optimizer, a StepLR
scheduler and a sharded data position, so a handover that forgets any of them shows up as
a different loss. Writes one JSON line per finished step to ``OUT/log.slot<slot>.jsonl``
and the final state of each rank to ``OUT/final.rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from migrator import Job, ShardedIndices


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", choices=["ddp", "plain", "fsdp"], default="ddp")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--replicate", type=int, default=1, help="fsdp: replica groups (HSDP)")
    ap.add_argument("--peer-copy", type=int, metavar="K", help="copy to a buddy every K steps")
    ap.add_argument("--disk-copy", type=int, metavar="M", help="peer copies to disk every M steps")
    ap.add_argument("--unique", action="store_true", help="declare rank-unique state")
    ap.add_argument("--raise-at", metavar="RANK:STEP", help="RuntimeError there, every time")
    ap.add_argument("--raise-text", help="the --raise-at error's message")
    ap.add_argument("--oom-at", metavar="RANK:STEP", help="torch.OutOfMemoryError there")
    ap.add_argument("--cuda", action="store_true", help="train on the job's GPU (NCCL)")
    ap.add_argument("--crash-all-at", type=int, help="ValueError on every rank at this step")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, slept")
    ap.add_argument(
        "--keep-grads", action="store_true", help="zero the gradients in place, not to None"
    )
    ap.add_argument(
        "--draw-after",
        action="store_true",
        help="draw from every generator after the optimizer step (after the collectives)",
    )
    args = ap.parse_args()
    raise_at = tuple(int(v) for v in args.raise_at.split(":")) if args.raise_at else None
    oom_at = tuple(int(v) for v in args.oom_at.split(":")) if args.oom_at else None

    torch.manual_seed(0)
    torch.set_num_threads(1)
    job = Job.from_env()
    rank = job.rank if job.rank is not None else 0
    random.seed(1000 + rank)
    np.random.seed(2000 + rank)
    torch.manual_seed(3000 + rank)  # per-rank dropout stream; parameters are built below
    gen = torch.Generator().manual_seed(7)
    x_all = torch.randn(512, 8, generator=gen)
    y_all = torch.randn(512, 4, generator=gen)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, args.width),
            torch.nn.Dropout(0.1),
            torch.nn.Tanh(),
            torch.nn.Linear(args.width, 4),
        )
    device = job.device if args.cuda and job.device is not None else torch.device("cpu")
    model.to(device)
    x_all, y_all = x_all.to(device), y_all.to(device)
    if args.mode == "fsdp":  # FSDP2: the first layer its own unit, the rest the root's
        job.fsdp(model, layers=[model[0]], replicate=args.replicate)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    batches = ShardedIndices(512, 8, rank=rank, world_size=job.world_size, seed=5)
    job.register(
        model=model,
        optimizer=opt,
        scheduler=sched,
        data=batches,
        rank_unique=args.unique,
        peer_copy_every=args.peer_copy,
        disk_copy_every=args.disk_copy,
    )
    net = job.ddp(model) if args.mode == "ddp" else model
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"log.slot{job.slot}.jsonl", "a")  # noqa: SIM115

    for step in job.steps(args.steps):
        with step:
            idx = batches.next()
            noise = torch.from_numpy(np.random.normal(0, 0.01, size=(len(idx), 8))).float()
            noise = noise.to(device)
            x = x_all[idx] * (1 + 0.01 * random.random()) + noise
            loss = torch.nn.functional.mse_loss(net(x), y_all[idx])
            if raise_at == (job.rank, step.index):
                raise RuntimeError(args.raise_text or f"user bug on rank {job.rank}")
            if oom_at == (job.rank, step.index):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if args.crash_all_at == step.index:
                raise ValueError("a typo on every rank")
            opt.zero_grad(set_to_none=not args.keep_grads)
            loss.backward()
            if args.mode == "plain":
                for p in model.parameters():
                    job.all_reduce(p.grad)
                    p.grad.div_(job.world_size)
            opt.step()
            sched.step()
            if args.draw_after:  # changes the streams the next step draws from
                torch.rand(1), np.random.rand(), random.random()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step.ok:
            row = {
                "rank": job.rank,
                "step": step.index,
                "loss": loss.item().hex(),
                "samples": idx.tolist(),
                "pid": os.getpid(),
                "t": time.time(),  # when the step ended: steps per second, read by tests
            }
            log.write(json.dumps(row) + "\n")
            log.flush()
    final = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    torch.save(_local(final), args.out / f"final.rank{job.rank}.pt")


def _local(obj: object) -> object:
    """``obj`` with each DTensor (FSDP2's parameters and optimizer state) as this rank's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local(v) for v in obj]
    return obj.to_local() if isinstance(obj, DTensor) else obj


if __name__ == "__main__":
    main()
