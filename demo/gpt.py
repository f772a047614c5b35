"""A tiny GPT trained data-parallel under ``forewarn launch``: the migratable-job example.

    forewarn launch --nproc 2 --spares 1 --job-id gpt -- python examples/train_gpt.py
    forewarn migrate --job gpt --rank 1 --reason preventive      # from another shell

(``examples/train_gpt.py`` runs this module; it lives in the ``demo`` package so that an
installed wheel has it too: ``python -m demo.gpt``.)

A character-level decoder-only transformer on a text corpus generated here from a fixed seed
(no download). Every rank reads its own shard; dropout, AdamW, a warm-up + cosine LR schedule
and (on CUDA) a grad scaler make up the state that a migration moves. Per-step losses go to
stdout from rank 0 and, with ``--log``, to a JSON-lines file per process; with ``--out``
each rank saves its final model and optimizer state to ``OUT/final.rank<r>.pt``, which is how
``forewarn demo`` proves a migrated run equal, bit for bit, to one that never moved.

``--pace-s`` sleeps after every step until the file ``--fast-file`` exists: a demo job lives
long enough to be watched, and the pause touches no state (a paced run ends where an unpaced
one does).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from migrator import Job, ShardedIndices

WORDS = [
    "the", "a", "one", "every", "some", "spare", "rank", "node", "step", "loss", "model",
    "grad", "warm", "cold", "fast", "slow", "gpu", "moves", "keeps", "trains", "fails",
    "waits", "learns", "sends", "runs", "checks", "saves", "bright", "quiet", "early",
]  # fmt: skip


def corpus(n_chars: int, seed: int = 0) -> str:
    """Sentence-shaped text from a small vocabulary, the same on every rank."""
    rnd = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 10))) + ". "
        parts.append(sentence.capitalize())
        size += len(sentence)
    return "".join(parts)[:n_chars]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads, dropout) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--plain", action="store_true", help="all-reduce gradients by hand, no DDP")
    ap.add_argument("--log", type=Path, help="directory for per-process JSON-lines losses")
    ap.add_argument("--out", type=Path, help="directory for each rank's final state")
    ap.add_argument("--pace-s", type=float, default=0.0, help="sleep after every step")
    ap.add_argument("--fast-file", type=Path, help="stop pacing once this file exists")
    args = ap.parse_args(argv)

    job = Job.from_env()
    device = job.device or torch.device("cpu")
    text = corpus(200_000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    starts = len(data) - args.seq - 1

    torch.manual_seed(0)  # identical initial weights on every rank
    model = GPT(len(chars), args.d_model, args.layers, args.heads, args.seq, 0.1).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
    rank = job.rank if job.rank is not None else 0
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream
    batches = ShardedIndices(starts, args.batch, rank=rank, world_size=job.world_size, seed=1)
    job.register(model=model, optimizer=opt, scheduler=sched, scaler=scaler, data=batches)
    net = model if args.plain else job.ddp(model)

    log = None
    if args.log is not None:
        args.log.mkdir(parents=True, exist_ok=True)
        log = open(args.log / f"gpt.slot{job.slot}.jsonl", "a")  # noqa: SIM115
    for step in job.steps(args.steps):
        with step:
            # Paced inside the step, after its boundary: a rank killed while it waits here
            # is rebuilt from the snapshot its boundary just took.
            if args.pace_s > 0 and not (args.fast_file and args.fast_file.exists()):
                time.sleep(args.pace_s)
            at = batches.next()
            x = torch.stack([data[i : i + args.seq] for i in at.tolist()]).to(device)
            y = torch.stack([data[i + 1 : i + 1 + args.seq] for i in at.tolist()]).to(device)
            with torch.autocast(device.type, enabled=device.type == "cuda"):
                loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.plain:
                for p in model.parameters():
                    assert p.grad is not None
                    job.all_reduce(p.grad).div_(job.world_size)
            scaler.step(opt)
            scaler.update()
            sched.step()
        if step.ok:
            if job.rank == 0 and (step.index % 20 == 0 or step.index == args.steps - 1):
                print(f"step {step.index:5d}  loss {loss.item():.4f}", flush=True)
            if log is not None:
                row = {
                    "rank": job.rank,
                    "step": step.index,
                    "loss": float(loss.item()).hex(),
                    "t": time.time(),  # when the step ended
                }
                log.write(json.dumps(row) + "\n")
                log.flush()
    if args.out is not None and job.rank is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        final = {"model": model.state_dict(), "optimizer": opt.state_dict(), "loss": loss.item()}
        torch.save(final, args.out / f"final.rank{job.rank}.pt")


if __name__ == "__main__":
    main()
