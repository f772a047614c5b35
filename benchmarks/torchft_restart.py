"""Unplanned recovery against torchft's process restart, the same state and ranks, one run.

    .venv/bin/python benchmarks/torchft_restart.py [--sizes 10MB,100MB,1GB] [--repeat 3]
        [--layouts replicated,hsdp,hsdp_tp,fsdp2,peer_copy]

The goal this measures (issue 28): an unplanned loss recovered by Forewarn, on every layout,
faster than torchft recovers it by restarting the lost process. Every line trains the
benchmark's MLP (``benchmarks/migration.py``'s ``model_for``: 1024-wide layers, Adam, about
the state size given) on 4 ranks over gloo on this machine and SIGKILLs the rank holding index
1 mid-run; the lines take turns within each round, so that all see the same load:

- **Forewarn**, per layout (``migration.py --parts e``'s jobs: replicated DDP, HSDP 2 x 2,
  HSDP + TP 2 x 1 x 2, FSDP2, FSDP2 with peer copies every 2 steps; 4 ranks + 1 warm spare):
  seconds from the kill to the failed step completed on the survivors, the step redone
  included, with the spare in the lost rank's place (the full world), or the refusal (FSDP2
  without a replica or peer copies stops for a checkpoint restart);
- **torchft** 0.2.0, the layout it recovers without a checkpoint: 4 replica groups of one rank
  each (a lighthouse in this process; ``torchft.ddp.PureDistributedDataParallel``, the
  all-reduce per gradient, because its ``DistributedDataParallel`` fails an assertion in its
  communication hook when an all-reduce breaks, 0.2.0 with this torch; its ``Manager`` with
  the timeouts of torchft's own example, gloo 5 s and 30 s; at least 3 replica groups; a
  healthy replica serves the state over HTTP). The killed process is started again at once
  (what torchelastic or a Kubernetes restart policy does, without their own delay), its
  group's store kept as torchrun's agent keeps it. Two figures, from the kill to (1) the first
  step the three survivors commit without it (the job goes on smaller: a quarter fewer
  samples a step) and (2) the first step committed with the restarted replica in it, healed
  from a survivor (the full world again).

``--json FILE`` writes the figures with the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from migration import LAYOUT_NAMES, SIZES, json_lines, layout_cases, model_for  # noqa: E402

REPLICAS = 4
KILLED = 1
KILL_AT = 5  # the killed replica's committed step at which it is killed
GIVE_UP_S = 180.0  # one torchft case's limit
# torchft's own example (train_ddp.py) on CPU: gloo's timeout 5 s, the manager's 30 s; the job
# goes on with 3 of the 4 replica groups
PG_TIMEOUT_S, MANAGER_TIMEOUT_S = 5.0, 30.0  # --torchft-pg-timeout-s overrides the first
MIN_REPLICAS = REPLICAS - 1


# -- a torchft replica group (one rank), run as a process of its own --------------------------


def replica(args: argparse.Namespace) -> None:
    """Train until the stop file exists; one JSON line a committed step."""
    from torchft import Manager, ProcessGroupGloo
    from torchft import Optimizer as FtOptimizer
    from torchft.ddp import PureDistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = model_for(args.state_bytes)
    adam = torch.optim.Adam(model.parameters(), lr=1e-4)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": adam.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        adam.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)),
        min_replica_size=MIN_REPLICAS,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{args.replica}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=args.store_port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=MANAGER_TIMEOUT_S),
    )
    # torchft's DistributedDataParallel fails an assertion in its communication hook when an
    # all-reduce breaks (0.2.0 with this torch), so its per-gradient wrapper, which reports
    # the error to the manager and lets the step be discarded as torchft intends
    net = PureDistributedDataParallel(manager, model)
    opt = FtOptimizer(manager, adam)
    x = torch.randn(2, 1024)
    stop = Path(args.stop)
    print(json.dumps({"replica": args.replica, "started": time.time()}), flush=True)
    go = stop.with_name("go")
    while not go.exists():  # every replica up before the first quorum
        time.sleep(0.01)
    while not stop.exists():
        opt.zero_grad(set_to_none=True)  # starts the step's quorum
        loss = net(x).square().mean()
        loss.backward()  # the gradients' all-reduce across the replica groups
        if manager.should_commit():
            adam.step()
            row = {
                "replica": args.replica,
                "step": manager.current_step(),
                "participants": manager.num_participants(),
                "done": time.time(),
            }
            print(json.dumps(row), flush=True)
    manager.shutdown(wait=False)


# -- the torchft case ---------------------------------------------------------------------------


def torchft_case(tmp: Path, size: int, pg_timeout_s: float = PG_TIMEOUT_S) -> dict:
    """4 replica groups; replica 1 SIGKILLed at its step KILL_AT and started again at once."""
    from torchft.coordination import LighthouseServer

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stop = tmp / "stop"
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=MIN_REPLICAS)
    # each replica group's store, hosted here as torchrun's agent hosts it: it outlives the
    # process restarted
    stores = [
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for _ in range(REPLICAS)
    ]
    ports = [s.port for s in stores]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}

    def start(i: int, log: Path) -> subprocess.Popen:
        cmd = [
            sys.executable,
            __file__,
            "--replica",
            str(i),
            "--state-bytes",
            str(size),
            "--lighthouse",
            lighthouse.address(),
            "--store-port",
            str(ports[i]),
            "--stop",
            str(stop),
            "--torchft-pg-timeout-s",
            str(pg_timeout_s),
        ]
        with log.open("w") as f:
            return subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    logs = [tmp / f"replica{i}.log" for i in range(REPLICAS)]
    procs = [start(i, logs[i]) for i in range(REPLICAS)]
    restarted_log = tmp / f"replica{KILLED}-restarted.log"
    out: dict = {"size": size}
    t_kill: float | None = None
    deadline = time.monotonic() + GIVE_UP_S
    try:
        while time.monotonic() < deadline:
            time.sleep(0.01)
            gone = [i for i, p in enumerate(procs) if p.poll() is not None]
            if gone:
                out["failed"] = f"replica {gone[0]} exited with {procs[gone[0]].returncode}"
                return out
            if not (tmp / "go").exists():
                if all(any("started" in r for r in json_lines(log)) for log in logs):
                    (tmp / "go").touch()
                continue
            if t_kill is None:
                rows = json_lines(logs[KILLED])
                if any(
                    r.get("step", -1) >= KILL_AT and r["participants"] == REPLICAS for r in rows
                ):
                    t_kill = time.time()
                    procs[KILLED].send_signal(signal.SIGKILL)
                    procs[KILLED].wait()
                    procs[KILLED] = start(KILLED, restarted_log)
                continue
            back = [r for r in json_lines(restarted_log) if r.get("participants") == REPLICAS]
            if back:
                break
        if t_kill is None or not back:
            out["failed"] = "no kill" if t_kill is None else "the restarted replica never joined"
            return out
        survivors = [i for i in range(REPLICAS) if i != KILLED]
        after = [
            [r for r in json_lines(logs[i]) if "step" in r and r["done"] > t_kill]
            for i in survivors
        ]
        shrunk = [[r for r in rows if r["participants"] < REPLICAS] for rows in after]
        if all(shrunk):  # the first step every survivor committed without the lost replica
            step = max(rows[0]["step"] for rows in shrunk)
            done = [r["done"] for rows in shrunk for r in rows if r["step"] == step]
            out["survivors_s"] = max(done) - t_kill if len(done) == len(survivors) else None
        started = next((r["started"] for r in json_lines(restarted_log) if "started" in r), None)
        out["restart_to_code_s"] = started - t_kill if started else None
        out["full_world_s"] = back[0]["done"] - t_kill
        out["healed_to_step"] = back[0]["step"]  # the survivors' step, not 1: state received
        out["steps_committed_meanwhile"] = min(len(rows) for rows in after)
        return out
    finally:
        stop.touch()
        time.sleep(0.5)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        lighthouse.shutdown()
        del stores
        if "failed" not in out:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            out["logs"] = str(tmp)


# -- main ---------------------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10MB,100MB", help="among 10MB,100MB,1GB")
    ap.add_argument(
        "--layouts",
        default=",".join(LAYOUT_NAMES),
        help="Forewarn's layouts to kill a rank of (default: all of them)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (default 3)")
    ap.add_argument("--json", type=Path, help="write the figures measured to this file")
    ap.add_argument("--replica", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--state-bytes", type=int, default=10**7, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stop", default="", help=argparse.SUPPRESS)
    ap.add_argument(
        "--torchft-pg-timeout-s",
        dest="pg_timeout_s",
        type=float,
        default=PG_TIMEOUT_S,
        help="torchft's gloo timeout (default 5, its example's; a step of the 1GB state on "
        "this machine can take longer)",
    )
    args = ap.parse_args()
    if args.replica >= 0:
        replica(args)
        return
    try:
        import torchft  # noqa: F401
    except ImportError:
        sys.exit("torchft is not installed: .venv/bin/pip install 'torchft==0.2.0' (make bench)")
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = sorted(set(layouts) - set(LAYOUT_NAMES))
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; among {','.join(LAYOUT_NAMES)}")

    load_before = os.getloadavg()
    print(
        f"unplanned loss of 1 of 4 ranks (gloo, this machine), {args.repeat} run(s) a case, "
        "min-max, the lines in turn; torchft 0.2.0: gloo timeout "
        f"{args.pg_timeout_s:g} s, manager {MANAGER_TIMEOUT_S:.0f} s, at least {MIN_REPLICAS} "
        f"replica groups, the killed one restarted at once; load average {load_before[0]:.2f}"
    )
    print(
        "    Forewarn: kill to the failed step completed, the spare in the lost rank's place; "
        "torchft: kill to the survivors' first step without it, and to the first step with "
        "the restarted replica healed (the full world)"
    )
    tmp = Path(tempfile.mkdtemp(prefix="forewarn-torchft-"))
    figures: dict = {"load_average_before": load_before, "sizes": []}
    for label, size in [x for x in SIZES if x[0] in args.sizes.split(",")]:
        ours: dict[str, list[float]] = {x: [] for x in layouts}
        refused: dict[str, str] = {}
        ft: list[dict] = []
        for i in range(args.repeat):  # every line once a round, so that all see the same load
            for layout in layouts:
                row = layout_cases(tmp / f"{layout}-{label}-{i}", size, layout, move=False)
                if row.get("kill_to_done_s") is not None:
                    ours[layout].append(row["kill_to_done_s"])
                elif "kill_refused" in row:
                    refused[layout] = row["kill_refused"]
            ft.append(torchft_case(tmp / f"torchft-{label}-{i}", size, args.pg_timeout_s))
        surv = [r["survivors_s"] for r in ft if r.get("survivors_s") is not None]
        full = [r["full_world_s"] for r in ft if r.get("full_world_s") is not None]
        code = [r["restart_to_code_s"] for r in ft if r.get("restart_to_code_s") is not None]
        print(f"    {label}:")
        for layout in layouts:
            got = ours[layout]
            ratio = (
                f"{statistics.median(got) / statistics.median(full):.3f} of torchft's full world"
                if got and full
                else ""
            )
            said = f"{_spread(got):>24} s" if got else f"refused: {refused.get(layout, 'failed')}"
            print(f"      Forewarn {layout:<10} {said}   {ratio}", flush=True)
        print(
            f"      torchft survivors {_spread(surv):>23} s   (3 of 4 ranks: a quarter fewer "
            f"samples a step until the restart)\n"
            f"      torchft full world {_spread(full):>22} s   (of which process start to "
            f"code {_spread(code)} s)",
            flush=True,
        )
        for r in ft:
            if "failed" in r:
                print(f"      torchft run failed: {r['failed']} (logs: {r.get('logs')})")
        figures["sizes"].append(
            {"state": label, "forewarn_kill_to_done_s": ours, "refused": refused, "torchft": ft}
        )
    figures["load_average_after"] = os.getloadavg()
    print(f"    load average at the end {figures['load_average_after'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if not any("failed" in r for size in figures["sizes"] for r in size["torchft"]):
        shutil.rmtree(tmp, ignore_errors=True)  # else the failed runs' logs are kept there


if __name__ == "__main__":
    main()
