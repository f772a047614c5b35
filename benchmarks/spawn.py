"""Process start benchmark: a job's processes forked with torch imported, against new ones.

    .venv/bin/python benchmarks/spawn.py [--procs 4] [--repeat 3]

Each round starts ``--procs`` processes of a small script the way the launcher starts a job's
ranks and spares (``migrator.nodes.spawn``) and waits until every one has done what each
process of a job does before its first step: imported torch, torch.distributed and the job
wrapper and built an optimizer (which imports ``torch._dynamo``). Then one more process
alone: a replacement or a new spare in a running job, whose fork server is already warm.

- baseline: every process a new interpreter (``--preload none``);
- forked: one fork server per round (:mod:`migrator.preload`, its start and imports counted
  in the round), every process forked from it.

Printed per way: wall seconds from the first spawn to the last process ready (median and
range of ``--repeat`` rounds), CPU seconds of the round (the processes and the server:
``RUSAGE_CHILDREN`` once all are reaped), and the lone process's wall seconds; then
forked / baseline ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from migrator.nodes import spawn  # noqa: E402
from migrator.preload import DEFAULT_PRELOAD, ForkServer  # noqa: E402

SCRIPT = """\
import sys
from pathlib import Path
import torch
import torch.distributed
from migrator import Job
torch.optim.Adam([torch.zeros(1, requires_grad=True)])
Path(sys.argv[1]).touch()
"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _wait_ready(marks: list[Path], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(m.exists() for m in marks):
        if time.monotonic() > deadline:
            raise TimeoutError("a process did not get ready")
        time.sleep(0.005)


def one_round(tmp: Path, procs: int, preload: bool) -> tuple[float, float, float]:
    """(wall to all ready, CPU of the round, wall of one more process alone)."""
    script = tmp / "ready.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    forks = ForkServer(env, DEFAULT_PRELOAD) if preload else None
    marks = [tmp / f"ready{i}" for i in range(procs + 1)]
    started = [
        spawn([sys.executable, str(script), str(m)], env, log_dir=tmp, index=i, forks=forks)
        for i, m in enumerate(marks[:procs])
    ]
    _wait_ready(marks[:procs])
    all_ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    started.append(
        spawn(
            [sys.executable, str(script), str(marks[-1])],
            env,
            log_dir=tmp,
            index=procs,
            forks=forks,
        )
    )
    _wait_ready(marks[-1:])
    alone = time.perf_counter() - t1
    for proc in started:
        assert proc.wait(timeout=60) == 0, (tmp / "slot0.log").read_text()
    if forks is not None:
        forks.close()
    return all_ready, _children_cpu() - cpu0, alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before")
    results: dict[str, list[tuple[float, float, float]]] = {"baseline": [], "forked": []}
    for _ in range(args.repeat):  # interleaved, so both ways see the same machine
        for way in results:
            with tempfile.TemporaryDirectory() as tmp:
                results[way].append(one_round(Path(tmp), args.procs, way == "forked"))
    med: dict[str, list[float]] = {}
    for way, rows in results.items():
        cols = list(zip(*rows, strict=True))
        med[way] = [statistics.median(c) for c in cols]
        said = ", ".join(
            f"{name} {statistics.median(c):.2f} s ({min(c):.2f}-{max(c):.2f})"
            for name, c in zip(
                (f"{args.procs} processes ready", "CPU", "one more alone"), cols, strict=True
            )
        )
        print(f"{way:>8}: {said}")
    ratios = [f / b for f, b in zip(med["forked"], med["baseline"], strict=True)]
    print(
        f"forked / baseline: ready {ratios[0]:.2f}, CPU {ratios[1]:.2f}, "
        f"one more alone {ratios[2]:.3f}"
    )
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
