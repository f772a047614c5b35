"""``forewarn demo`` (what ``make run`` starts): the service, a simulated fleet, a training job.

Everything runs on this machine, on the embedded SQLite default in the data directory:

- ``forewarn serve`` on ``--host``/``--port``;
- ``forewarn simulate`` streaming a fleet of ``--gpus`` simulated GPUs to it, as one
  collector per node would, with its failure-injection control API on ``--control-port``;
- ``forewarn launch`` running ``examples/train_gpt.py`` with two active ranks and one warm
  spare (``--no-job`` leaves it out).

The demo's tokens are printed at start. Ctrl-C stops every part, newest first.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["configure", "run"]

ROOT = Path(__file__).resolve().parents[1]
TOKENS = {
    "FOREWARN_INGEST_TOKEN": "demo-ingest-token-0001",
    "FOREWARN_READ_TOKEN": "demo-read-token-00001",
    "FOREWARN_ADMIN_TOKEN": "demo-admin-token-0001",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--gpus", type=int, default=64, help="simulated fleet size")
    parser.add_argument("--speed", type=float, default=30.0, help="failure dynamics speed-up")
    parser.add_argument("--control-port", type=int, default=8799)
    parser.add_argument("--data-dir", default=None, help="default: FOREWARN_DATA_DIR or ./var")
    parser.add_argument("--no-job", action="store_true", help="do not start the training job")
    parser.add_argument("--duration", type=float, help="stop after this many seconds")


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"forewarn demo: the service exited ({process.returncode})")
        try:
            if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"forewarn demo: the service was not ready within {timeout_s:.0f} s")


def _stop_on_sigterm(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # same orderly shutdown as Ctrl-C, children included


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    data_dir = Path(args.data_dir or os.environ.get("FOREWARN_DATA_DIR") or ROOT / "var")
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **TOKENS, "FOREWARN_DATA_DIR": str(data_dir)}
    url = f"http://{args.host}:{args.port}"
    forewarn = [sys.executable, "-m", "forewarn"]
    parts: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (data_dir / f"demo-{name}.log").open("ab")
        with log:
            process = subprocess.Popen(
                argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        parts.append((name, process))
        return process

    try:
        serve = start(
            "service", [*forewarn, "serve", "--host", args.host, "--port", str(args.port)]
        )
        _wait_ready(url, serve)
        start(
            "fleet",
            [
                *forewarn,
                "simulate",
                "--gpus",
                str(args.gpus),
                "--service",
                url,
                "--token",
                TOKENS["FOREWARN_INGEST_TOKEN"],
                "--speed",
                str(args.speed),
                "--control-port",
                str(args.control_port),
            ],
        )
        example = ROOT / "examples" / "train_gpt.py"
        job_note = "not started (--no-job)"
        if not args.no_job:
            if example.exists():
                start(
                    "job",
                    [
                        *forewarn,
                        "launch",
                        "--nproc",
                        "2",
                        "--spares",
                        "1",
                        "--job-id",
                        "demo-gpt",
                        "--service",
                        url,
                        "--",
                        sys.executable,
                        str(example),
                    ],
                )
                job_note = (
                    "demo-gpt: 2 ranks + 1 spare (examples/train_gpt.py); move a rank with\n"
                    "              forewarn migrate --job demo-gpt --rank 1 --wait"
                )
            else:
                job_note = "not started (examples/train_gpt.py is missing)"
        print(
            f"Forewarn demo is running (logs in {data_dir}/demo-*.log)\n"
            f"  service     {url}   API docs {url}/docs\n"
            f"  read token  {TOKENS['FOREWARN_READ_TOKEN']}\n"
            f"  fleet       {args.gpus} simulated GPUs; inject a failure with\n"
            f"              forewarn simulate inject --control http://127.0.0.1:"
            f"{args.control_port} --node sim-node-0000 --gpu 0 --kind memory\n"
            f"  job         {job_note}\n"
            "Ctrl-C stops it.",
            flush=True,
        )
        deadline = time.monotonic() + args.duration if args.duration else None
        while deadline is None or time.monotonic() < deadline:
            for name, process in parts:
                if process.poll() is not None and name != "job":
                    print(
                        f"forewarn demo: {name} exited ({process.returncode}); stopping",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        # One at a time, newest first: the fleet flushes to a service that is still up.
        for _, process in reversed(parts):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
