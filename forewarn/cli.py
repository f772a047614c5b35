"""The ``forewarn`` command line: one console script, one subcommand per task.

Each subcommand lives in the room that owns it and is imported only when it is run, so that
``forewarn collect`` on a GPU node never imports the server (or torch), and ``forewarn
launch`` inside a job never imports the database layer. A subcommand module exposes::

    configure(parser: argparse.ArgumentParser) -> None   # add its arguments
    run(args: argparse.Namespace) -> int                 # do the work, return an exit code

``python -m forewarn <command>`` is the same as ``forewarn <command>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple

from forewarn import __version__

__all__ = ["COMMANDS", "main"]


class Command(NamedTuple):
    module: str
    summary: str


COMMANDS: dict[str, Command] = {
    "serve": Command("api.cli", "run the service (API, dashboard, control loop)"),
    "control": Command("api.control_cli", "run the control loop alone (serve starts one)"),
    "token": Command("api.token_cli", "create, list and revoke the service's API tokens"),
    "collect": Command("collector.cli", "run the node agent: read GPUs, push to the service"),
    "simulate": Command("sim.cli", "simulate a GPU fleet: live or to a dataset"),
    "train": Command("predictor.train_cli", "train the failure-risk model on a dataset"),
    "evaluate": Command("predictor.evaluate_cli", "evaluate a model against the rule baseline"),
    "import": Command("predictor.import_cli", "a dataset from a fleet's Prometheus history"),
    "launch": Command("migrator.launch_cli", "start a migratable training job with spares"),
    "migrate": Command("migrator.migrate_cli", "ask a running job to move a rank to a spare"),
    "demo": Command("demo.cli", "service, simulated fleet and a job that survives failures"),
    "goodput": Command("goodput.cli", "training time kept through failures, three ways"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<10} {cmd.summary}" for name, cmd in COMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="forewarn",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Forewarn keeps training jobs running through GPU failures.",
        epilog="commands:\n" + "\n".join(lines) + "\n\n'forewarn COMMAND --help' for more.",
    )
    parser.add_argument("--version", action="version", version=f"forewarn {__version__}")
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv[:1] or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    try:
        module = importlib.import_module(COMMANDS[name].module)
    except ModuleNotFoundError as exc:
        print(f"forewarn {name}: not available in this installation ({exc})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"forewarn {name}", description=COMMANDS[name].summary)
    module.configure(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
