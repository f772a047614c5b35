"""The state transfer of a migration between two GPUs (NCCL send/recv): seconds against bytes.

    python benchmarks/migration_nccl.py [--sizes 10MB,100MB,1GB,4GB] [--repeat 3]

For a GPU machine with at least two GPUs (NVLink or PCIe between them): the sender and the
receiver are two processes, each on its own GPU, joined by the same two-rank group the
migrator uses for a handover (``migrator.groups.pair_group``, NCCL), and the state moves with
``migrator.transport.PGTransport`` (meta blob, then every tensor received in place). Printed:
bytes, seconds (min-max over the repeats), GB/s, and the same bytes with a single
``send``/``recv`` of one buffer (the link's own rate, the baseline of the pause).

Nothing here runs without CUDA; the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from migrator.groups import new_group  # noqa: E402
from migrator.transport import PGTransport  # noqa: E402

SIZES = {"10MB": 10**7, "100MB": 10**8, "1GB": 10**9, "4GB": 4 * 10**9}
CHUNK = 4 * 2**20  # bytes per tensor, like a 1024x1024 fp32 weight


def _tensors(nbytes: int, device: torch.device) -> list[torch.Tensor]:
    n = max(1, nbytes // CHUNK)
    return [torch.ones(CHUNK // 4, device=device) for _ in range(n)]


def _worker(rank: int, port: int, sizes: list[str], repeat: int, out: mp.Queue) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=120))
    group = new_group(
        store, "bench", rank=rank, size=2, backend="nccl", timeout_s=120, device=device
    )
    transport = PGTransport(group)
    for label in sizes:
        tensors = _tensors(SIZES[label], device)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        flat = torch.ones(nbytes // 4, device=device)
        for i in range(repeat + 1):  # the first round warms the communicator up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 0:
                transport.send({"step": i}, tensors, timeout_s=120)
            else:
                transport.recv(lambda meta, ts=tensors: ts, timeout_s=120)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            if rank == 0:
                group.send([flat], 1, 0).wait()
            else:
                group.recv([flat], 0, 0).wait()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if rank == 1 and i > 0:
                out.put((label, nbytes, t1 - t0, t2 - t1))
        del tensors, flat
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10MB,100MB,1GB,4GB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("needs two CUDA GPUs (a rank's and its spare's); nothing measured")
        return
    sizes = [s for s in args.sizes.split(",") if s in SIZES]
    os.environ.setdefault("NCCL_ALGO", "Ring")
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, port, sizes, args.repeat, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows: dict[str, list[tuple[int, float, float]]] = {}
    while not out.empty():
        label, nbytes, migrate_s, flat_s = out.get()
        rows.setdefault(label, []).append((nbytes, migrate_s, flat_s))
    print(f"{'state':>6} {'bytes':>14} {'transfer s':>15} {'GB/s':>7} {'one buffer s':>15}")
    for label in sizes:
        got = rows.get(label, [])
        if not got:
            print(f"{label:>6} failed")
            continue
        nbytes = got[0][0]
        mig = sorted(r[1] for r in got)
        flat = sorted(r[2] for r in got)
        print(
            f"{label:>6} {nbytes:>14,} {mig[0]:>7.3f}-{mig[-1]:<7.3f} "
            f"{nbytes / mig[len(mig) // 2] / 1e9:>7.1f} {flat[0]:>7.3f}-{flat[-1]:<7.3f}"
        )


if __name__ == "__main__":
    main()
