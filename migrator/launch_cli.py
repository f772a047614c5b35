"""``forewarn launch``: run a training command as a migratable job with warm spares.

    forewarn launch --nproc 2 --spares 1 --job-id demo -- python examples/train_gpt.py

Starts ``--nproc`` active ranks and ``--spares`` warm spares of the command, hosts the
rendezvous store, serves the local command endpoint (``forewarn migrate`` finds it through
the job file), registers the job with ``--service`` when given, and supervises the job until
it ends. Exit code: the job's (0 completed, 1 failed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from forewarn.errors import ForewarnError
from migrator.endpoint import job_file, write_job_file
from migrator.faults import FaultPlan

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, help="active ranks (world size)")
    parser.add_argument("--spares", type=int, default=1, help="warm spares (default 1)")
    parser.add_argument("--job-id", default="job", help="the job's name (default: job)")
    parser.add_argument("--service", metavar="URL", help="register the job with the service")
    parser.add_argument(
        "--token",
        default=os.environ.get("FOREWARN_TOKEN"),
        help="bearer token for --service, with the 'operate' scope (default: $FOREWARN_TOKEN)",
    )
    parser.add_argument(
        "--placement",
        metavar="NODE:GPU,...",
        help="the fleet GPU each slot stands for, ranks first then spares (simulated fleets)",
    )
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        help="bound on collectives and transfers; a wedged rank is declared "
        "lost after about twice this (default 30)",
    )
    parser.add_argument(
        "--pause-timeout-s",
        type=float,
        default=600.0,
        help="how long a job with no spare left stays paused before failing",
    )
    parser.add_argument(
        "--refill-spares",
        action="store_true",
        help="start a new spare on a slot freed by a planned/preventive move",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of the store and endpoint")
    parser.add_argument("--store-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--http-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--log-dir", type=Path, help="one log file per process (default: inherit)")
    parser.add_argument("--report", type=Path, help="append each MigrationReport (JSON lines)")
    parser.add_argument("--faults", help=argparse.SUPPRESS)  # FaultPlan JSON, for drills
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at module level: ``forewarn launch --help`` stays fast.
    from migrator.agent import Agent, AgentConfig

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("forewarn launch: no training command (put it after --)", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    cfg = AgentConfig(
        command=command,
        nproc=args.nproc,
        spares=args.spares,
        job_id=args.job_id,
        backend=args.backend,
        timeout_s=args.timeout_s,
        pause_timeout_s=args.pause_timeout_s,
        refill_spares=args.refill_spares,
        host=args.host,
        store_port=args.store_port,
        http_port=args.http_port,
        service_url=args.service,
        faults=FaultPlan.from_json(args.faults) if args.faults else None,
        log_dir=args.log_dir,
        report_path=args.report,
    )
    link = None
    if args.service:
        from migrator.service_link import ServiceLink, parse_placement

        try:
            link = ServiceLink(
                args.service,
                token=args.token,
                job_id=args.job_id,
                placement=parse_placement(args.placement) if args.placement else None,
            )
            link.preflight()
        except ForewarnError as exc:
            print(f"forewarn launch: {exc.message}", file=sys.stderr)
            return 2
    agent = Agent(cfg, link=link)
    original = agent._register

    def register_and_publish() -> None:
        write_job_file(
            args.job_id,
            {"job_id": args.job_id, "agent_url": agent.agent_url, "store": agent.store_address},
        )
        original()

    agent._register = register_and_publish  # type: ignore[method-assign]
    try:
        code = agent.run()
    except ForewarnError as exc:  # the service refused the registration
        print(f"forewarn launch: {exc.message}", file=sys.stderr)
        code = 2
    finally:
        job_file(args.job_id).unlink(missing_ok=True)
    print(
        f"forewarn launch: job {args.job_id} {agent.status}"
        f"{': ' + agent.message if agent.message else ''}",
        file=sys.stderr,
    )
    return code
