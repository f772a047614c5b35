"""``forewarn demo`` (what ``make run`` starts): a fleet, a job on it, and Forewarn at work.

On this machine, on the embedded SQLite default in the data directory:

1. ``forewarn serve`` with the dashboard and the control loop (scoring every second);
2. ``forewarn simulate`` streaming ``--gpus`` simulated GPUs to it, as collectors would;
3. ``forewarn launch`` of a small GPT (:mod:`demo.gpt`): 2 ranks and 2 warm spares, placed on
   fleet GPUs ``sim-node-0000:0-1`` and ``sim-node-0001:0-1``; beside it, an unpaced reference
   run of the same job that nothing disturbs.

Then the story: the memory of the GPU under rank 1 starts wearing out; Forewarn scores the risk,
crosses its threshold and moves rank 1 to a spare before the GPU fails. Later the GPU under
rank 0 is lost without warning; its process dies and the job rebuilds the rank from a replica.
The summary shows the lead time, the pause, the steps lost and whether the job's final state
equals the reference run's, bit for bit. The service keeps serving until Ctrl-C (or SIGTERM,
or ``--duration`` seconds); every part is then stopped in order, newest first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["DEMO_THRESHOLD", "configure", "run"]

DEMO_THRESHOLD = 0.12
"""The demo's policy threshold. The demo's wear lasts 90 s of wall time (45-90 min of fleet
time), where the shipped model learnt precursors over hours: the worn GPU's risk reaches 0.27
about 14 s before it fails, the card's threshold exactly, with no margin. On the default
evaluation fleet, whose physics the demo's fleet shares, 0.12 costs about 1 false alarm per
1,000 GPU-days and catches all 22 failures with precursors (docs/predictor.md). A fleet of a
few hundred GPUs watched for minutes is too small for the alarm budget to fit a threshold of
its own."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--host", default="127.0.0.1", help="the service's address")
    parser.add_argument("--port", type=int, default=8765, help="the service's port")
    parser.add_argument("--gpus", type=int, default=256, help="simulated fleet size (8 a node)")
    parser.add_argument("--speed", type=float, default=30.0, help="fleet dynamics speed-up")
    parser.add_argument(
        "--control-port", type=int, default=0, help="simulator's injection API (0: any free)"
    )
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="default: FOREWARN_DATA_DIR or ./var"
    )
    parser.add_argument("--steps", type=int, default=600, help="training steps of the job")
    parser.add_argument(
        "--wear-lead-s",
        type=float,
        default=90.0,
        help="wall seconds from the start of the memory wear to the GPU's failure (the fleet "
        "lives this times --speed of it: raise both together to keep the same physics)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEMO_THRESHOLD,
        help="policy risk threshold (below the card's, which a 90-s wear episode reaches "
        "only just; docs/control.md)",
    )
    parser.add_argument(
        "--no-story", action="store_true", help="start the parts, inject nothing, just serve"
    )
    parser.add_argument("--duration", type=float, help="stop this many seconds after the story")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")


class _Stop(Exception):
    pass


def _stop(_signum: int, _frame: object) -> None:
    raise _Stop


def _gpu_note() -> str | None:
    """Where a real GPU is present, say how to collect from it instead of the simulator."""
    for module, source in (("pynvml", "nvml"), ("amdsmi", "amd")):
        try:
            __import__(module)
        except Exception:
            continue
        return (
            f"  this machine has the {module} library: collect from its real GPUs with\n"
            f"              forewarn collect --source {source} --service URL --token INGEST"
        )
    return None


def run(args: argparse.Namespace) -> int:
    from demo.story import TOKENS, Config, Story, StoryFailed

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    data_dir = (args.data_dir or Path(os.environ.get("FOREWARN_DATA_DIR") or "var")).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    for old in data_dir.glob("forewarn.db*"):  # each demo starts from an empty store
        old.unlink()
    config = Config(
        data_dir=data_dir,
        host=args.host,
        port=args.port,
        control_port=args.control_port,
        gpus=args.gpus,
        speed=args.speed,
        steps=args.steps,
        wear_lead_s=args.wear_lead_s,
        threshold=args.threshold,
    )
    story = Story(config, say=lambda line: print(line, flush=True))
    url = story.url
    code = 0
    try:
        story.start_parts()
        print(
            f"Forewarn demo (logs in {data_dir}/demo-*.log)\n"
            f"  dashboard   {url}/   API docs {url}/docs\n"
            f"  tokens      read {TOKENS['read']}   operate {TOKENS['operate']}   "
            f"admin {TOKENS['admin']}\n"
            f"  fleet       {args.gpus} simulated GPUs; injection API "
            f"http://127.0.0.1:{story.control_port}\n"
            f"  job         demo-gpt: 2 ranks + 2 spares on sim-node-0000/0001 "
            f"({args.steps} steps)",
            flush=True,
        )
        note = _gpu_note()
        if note:
            print(note, flush=True)
        if not args.no_story:
            story.preventive()
            story.unplanned()
            summary = story.finish()
            print(summary.text(), flush=True)
            if args.json:
                args.json.write_text(json.dumps(summary.as_json(), indent=1, default=str))
            if not summary.bitwise_equal:
                code = 1
        until = "until Ctrl-C" if args.duration is None else f"for {args.duration:g} s"
        print(f"Forewarn demo: serving {url}/ {until}", flush=True)
        deadline = time.monotonic() + args.duration if args.duration is not None else None
        while deadline is None or time.monotonic() < deadline:
            story.check_parts()
            time.sleep(0.5)
    except StoryFailed as exc:
        print(f"forewarn demo: {exc}", file=sys.stderr, flush=True)
        code = 1
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown
        story.close()
    return code
