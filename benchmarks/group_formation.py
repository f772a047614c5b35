"""Group formation benchmark: how long forming one process-group generation takes, by ranks.

    .venv/bin/python benchmarks/group_formation.py [--ranks 2,4,8,16] [--repeat 5] [--runs 3]
    .venv/bin/python benchmarks/group_formation.py --runs 3 \
        --write goodput/data/group_formation.json

Every generation of a migratable job is a fresh process group (``migrator.groups.new_group``
under ``g{g}/pg``), formed by every rank after a membership change: the cost a preventive
move, a planned move and a recovery each pay once, whatever state moves. Here ``n`` real
processes (gloo, CPU, loopback, one store hosted by this process, as the job agent hosts it)
form ``--repeat`` generations each, one after another, as a job would:

- formation: from the moment the store says "go" to the group formed and its first
  all-reduce (one float) done, the slowest rank's time;
- baseline, in the same processes and the same round: a store barrier of the ``n`` ranks
  (each adds to a counter and waits for the last), the floor any rendezvous through the
  store pays. The ratio formation / baseline is printed beside the seconds.

Each of ``--runs`` runs starts fresh processes; the medians pool every run's generations,
and each run's own fit is kept for the spread. The scaling rule goodput uses is fitted on
the pooled medians: ``formation_s = a + b x ranks`` (least squares), stated with its
largest residual; ``--write`` keeps the figures, the fits, the machine's load average before
and after and the command in a JSON file (``goodput/data/``).

On a machine with fewer cores than ranks the processes share the cores, and the figure grows
with that contention as well as with the group: the output says how many cores there were.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from migrator.groups import new_group  # noqa: E402

TIMEOUT_S = 120.0


def worker(store_port: int, rank: int, size: int, repeat: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S)
    )
    groups = []  # kept referenced: dropping a gloo group mid-run costs its teardown
    for gen in range(repeat + 1):  # generation 0 warms up (imports, first connections)
        store.wait([f"go/{gen}"])
        t0 = time.perf_counter()
        store.add(f"barrier/{gen}", 1)
        while int(store.add(f"barrier/{gen}", 0)) < size:
            time.sleep(0.0005)
        barrier = time.perf_counter() - t0
        store.wait([f"go2/{gen}"])
        t0 = time.perf_counter()
        group = new_group(store, f"g{gen}/pg", rank=rank, size=size, timeout_s=TIMEOUT_S)
        one = torch.ones(1)
        group.allreduce([one]).wait()
        formed = time.perf_counter() - t0
        assert one.item() == size
        groups.append(group)
        store.set(f"t/{gen}/{rank}", json.dumps({"formation": formed, "barrier": barrier}))


def measure(size: int, repeat: int) -> dict[str, list[float]]:
    """``repeat`` generations of ``size`` ranks: per generation the slowest rank's times."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(store.port), str(r), str(size), str(repeat)],
            env=env,
        )
        for r in range(size)
    ]
    out: dict[str, list[float]] = {"formation_s": [], "barrier_s": []}
    try:
        for gen in range(repeat + 1):
            store.set(f"go/{gen}", "1")
            keys = [f"t/{gen}/{r}" for r in range(size)]
            # The barrier half is done once every rank counted itself in.
            while int(store.add(f"barrier/{gen}", 0)) < size:
                time.sleep(0.001)
            time.sleep(0.05)  # let the last rank leave its barrier before the next phase
            store.set(f"go2/{gen}", "1")
            store.wait(keys, timedelta(seconds=TIMEOUT_S))
            times = [json.loads(store.get(k)) for k in keys]
            if gen == 0:
                continue
            out["formation_s"].append(max(t["formation"] for t in times))
            out["barrier_s"].append(max(t["barrier"] for t in times))
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def fit(ranks: list[int], seconds: list[float]) -> dict[str, float]:
    """Least squares ``seconds = a + b x ranks``; its largest residual, relative."""
    n = len(ranks)
    mx, my = sum(ranks) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in ranks)
    b = sum((x - mx) * (y - my) for x, y in zip(ranks, seconds, strict=True)) / sxx
    a = my - b * mx
    worst = max(abs(a + b * x - y) / y for x, y in zip(ranks, seconds, strict=True))
    return {"a_s": a, "b_s_per_rank": b, "max_relative_residual": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4,8,16", help="group sizes (default 2,4,8,16)")
    ap.add_argument("--repeat", type=int, default=5, help="generations per size (default 5)")
    ap.add_argument("--runs", type=int, default=1, help="runs, fresh processes each (default 1)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--write", type=Path, help="also keep the JSON document in this file")
    ap.add_argument("--worker", nargs=4, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    sizes = [int(v) for v in args.ranks.split(",")]
    load_before = list(os.getloadavg())
    results: dict[int, dict] = {s: {"formation_s": [], "barrier_s": []} for s in sizes}
    run_fits = []
    for _ in range(args.runs):
        run_medians = []
        for size in sizes:
            got = measure(size, args.repeat)
            results[size]["formation_s"] += got["formation_s"]
            results[size]["barrier_s"] += got["barrier_s"]
            run_medians.append(statistics.median(got["formation_s"]))
        run_fits.append(fit(sizes, run_medians))
    for size in sizes:
        r = results[size]
        r["formation_median_s"] = statistics.median(r["formation_s"])
        r["barrier_median_s"] = statistics.median(r["barrier_s"])
    medians = [results[s]["formation_median_s"] for s in sizes]
    doc = {
        "benchmark": "benchmarks/group_formation.py",
        "command": " ".join(["benchmarks/group_formation.py", *sys.argv[1:]]),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": "gloo",
        "transport": "loopback, one host",
        "cpu_cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "load_average_before": load_before,
        "torch": torch.__version__,
        "repeat": args.repeat,
        "runs": args.runs,
        "run_fits": run_fits,
        "by_ranks": {str(s): results[s] for s in sizes},
        "fit": {
            **fit(sizes, medians),
            "rule": "formation_s = a_s + b_s_per_rank x ranks (least squares on the medians)",
        },
    }
    if args.write:
        args.write.write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    print(
        f"group formation (gloo, loopback, {os.cpu_count()} cores, load "
        f"{' '.join(f'{v:.2f}' for v in doc['load_average'])}), {args.repeat} generations:"
    )
    print(
        f"{'ranks':>6} {'formation s (median, min-max)':>32} {'store barrier s':>16} {'ratio':>7}"
    )
    for s in sizes:
        r = results[s]
        f = r["formation_s"]
        print(
            f"{s:>6} {r['formation_median_s']:>10.4f} ({min(f):.4f}-{max(f):.4f})"
            f"{'':>5} {r['barrier_median_s']:>16.4f} "
            f"{r['formation_median_s'] / max(r['barrier_median_s'], 1e-9):>7.1f}"
        )
    ft = doc["fit"]
    print(
        f"fit: formation_s = {ft['a_s']:.4f} + {ft['b_s_per_rank']:.5f} x ranks "
        f"(largest residual {ft['max_relative_residual']:.0%}); per run b: "
        + ", ".join(f"{f['b_s_per_rank']:.5f}" for f in run_fits)
    )


if __name__ == "__main__":
    main()
