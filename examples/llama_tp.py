"""A small llama-like model trained with FSDP2 (or HSDP) + tensor parallelism, as TorchTitan
composes them, under Forewarn's migrator.

    forewarn launch --nproc 4 --spares 1 -- python examples/llama_tp.py --tp 2 --out OUT
    forewarn launch --nproc 8 --spares 1 -- \
        python examples/llama_tp.py --tp 2 --replicate 2 --out OUT

The parallelisms are applied in one place, from the job's mesh, the way TorchTitan's
``parallelize_llama`` applies them: :func:`apply_tp` (a ``parallelize_module`` plan per
block: attention ``wq``/``wk``/``wv`` and feed-forward ``w1``/``w3`` column-wise, ``wo`` and
``w2`` row-wise) on the ``tp`` sub-mesh, then ``fully_shard`` per block and on the root on
the ``dp_shard`` sub-mesh (``job.fsdp(model, layers=model.layers, tp=T, tp_plan=apply_tp)``).
Ranks ``d * T .. d * T + T - 1`` form a tensor-parallel group and read the same batches
(data-parallel index ``d``). With ``--peer-copy K`` each rank's shards are also copied to a
buddy every K steps, so a rank lost without warning is rebuilt (the layout has no replica
dimension).

With ``--replicate R`` (HSDP + TP, TorchTitan's ``dp_replicate`` x ``dp_shard`` x ``tp``)
``fully_shard`` runs on the ``("dp_replicate", "dp_shard")`` sub-mesh: each replica group
holds the whole model, so a rank lost without warning is rebuilt from the rank in its place
in another replica group. The data-parallel index is still ``rank // T``.

Writes one JSON line per finished step to ``OUT/log.slot<slot>.jsonl`` and each rank's local
shards to ``OUT/final.rank<r>.pt`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from migrator import Job, ShardedIndices


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Multi-head causal self-attention; the head count is read from the projections'
    output (``view(..., -1, head_dim)``), so a tensor-parallel rank runs its own heads."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = (
            w(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4, hidden: int = 64
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """TorchTitan's per-block tensor-parallel plan, on the ``tp`` sub-mesh. Every rank built
    the same weights from the same seed, so each takes its own slice (``src_data_rank=None``)
    with no collective."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers:  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, plan, src_data_rank=None)


def _local(obj: object) -> object:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local(v) for v in obj]
    return obj.to_local() if isinstance(obj, DTensor) else obj


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--replicate", type=int, default=1, help="replica groups (HSDP)")
    ap.add_argument("--peer-copy", type=int, metavar="K", help="copy to a buddy every K steps")
    args = ap.parse_args()

    torch.set_num_threads(1)
    job = Job.from_env()
    torch.manual_seed(0)  # the same weights on every rank, spares included
    model = Llama()
    job.fsdp(
        model, layers=list(model.layers), replicate=args.replicate, tp=args.tp, tp_plan=apply_tp
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = job.rank if job.rank is not None else 0
    dp, dp_rank = job.world_size // args.tp, rank // args.tp
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, 64, (256, 17), generator=gen)
    batches = ShardedIndices(256, 4, rank=dp_rank, world_size=dp, seed=5)
    job.register(model=model, optimizer=opt, data=batches, peer_copy_every=args.peer_copy)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"log.slot{job.slot}.jsonl", "a")  # noqa: SIM115

    for step in job.steps(args.steps):
        with step:
            idx = batches.next()
            tokens = data[idx]
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step.ok:
            row = {
                "rank": job.rank,
                "step": step.index,
                "loss": loss.item().hex(),
                "pid": os.getpid(),
            }
            log.write(json.dumps(row) + "\n")
            log.flush()
    final = {"model": model.state_dict(), "opt": opt.state_dict()}
    torch.save(_local(final), args.out / f"final.rank{job.rank}.pt")


if __name__ == "__main__":
    main()
