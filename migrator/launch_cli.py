"""``forewarn launch``: run a training command as a migratable job with warm spares.

    forewarn launch --nproc 2 --spares 1 --job-id demo -- python examples/train_gpt.py

Starts ``--nproc`` active ranks and ``--spares`` warm spares of the command, hosts the
job's key-value store (a c10d TCPStore), serves the local command endpoint (``forewarn
migrate`` finds it through the job file), registers the job with ``--service`` when given,
and supervises the job until it ends. Exit code: the job's (0 completed, 1 failed).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

from forewarn.errors import ForewarnError
from migrator.endpoint import job_file, write_job_file
from migrator.faults import FaultPlan
from migrator.nodes import node_rank_from_env, run_node
from migrator.preload import DEFAULT_PRELOAD

__all__ = ["configure", "run"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of steps")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds in (0, 3600]")
    return value


def _modules(text: str) -> tuple[str, ...]:
    if text.strip().lower() == "none":
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or not all(n.replace(".", "_").isidentifier() for n in names):
        raise argparse.ArgumentTypeError(f"not a list of module names: {text!r}")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc",
        type=int,
        default=int(env("PET_NPROC_PER_NODE", "0")) or None,
        help="active ranks on this node (the world size on one node)",
    )
    parser.add_argument(
        "--spares-per-node",
        "--spares",
        dest="spares",
        type=int,
        default=1,
        help="warm spares on this node (default 1); spares on any node serve any rank",
    )
    parser.add_argument(
        "--job-id",
        "--rdzv-id",
        dest="job_id",
        default=env("PET_RDZV_ID", "job"),
        help="the job's name, the same on every node (default: job)",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=int(env("PET_NNODES", "1")),
        help="launchers of the job, one per node (default 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=node_rank_from_env(os.environ),
        help="this launcher's node rank; 0 coordinates and hosts the key-value store "
        "(default: $PET_NODE_RANK, $SLURM_NODEID, $JOB_COMPLETION_INDEX, else automatic)",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default=env("PET_RDZV_ENDPOINT"),
        metavar="HOST[:PORT]",
        help="the key-value store of a multi-node job, hosted by node rank 0 (port default 29400)",
    )
    parser.add_argument("--node-name", help="this node's name in placements (default: hostname)")
    parser.add_argument(
        "--node-timeout-s",
        type=float,
        help="a node whose launcher is silent this long is lost, with every process on it "
        "(default: the smaller of --timeout-s and 10)",
    )
    parser.add_argument(
        "--join-timeout-s",
        type=float,
        default=300.0,
        help="how long launchers wait for each other at the start (default 300)",
    )
    parser.add_argument(
        "--timing-window",
        type=_positive_int,
        default=20,
        metavar="STEPS",
        help="steps each rank's step-timing medians are taken over, as the heartbeat sends "
        "them (default 20)",
    )
    parser.add_argument("--service", metavar="URL", help="register the job with the service")
    parser.add_argument(
        "--token",
        default=os.environ.get("FOREWARN_TOKEN"),
        help="bearer token for --service, with the 'operate' scope (default: $FOREWARN_TOKEN)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=_positive_seconds,
        default=5.0,
        metavar="SECONDS",
        help="interval of the heartbeats to --service, which carry the ranks' step timing "
        "(default 5)",
    )
    parser.add_argument(
        "--webhook-listen",
        metavar="HOST:PORT",
        help="also receive migration commands as signed webhooks here (needs --service and "
        "an admin token to subscribe; the long-poll stays the fallback)",
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
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=env("FOREWARN_CHECKPOINT_DIR") or None,
        metavar="DIR",
        help="when the job stops at a step boundary (no spare left, a crash loop, Ctrl-C or "
        "SIGTERM), write one consistent checkpoint there (default: $FOREWARN_CHECKPOINT_DIR; "
        "a path every node can reach)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="start from the checkpoint in DIR (its latest) or from a checkpoint file",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address of the key-value store and endpoint"
    )
    parser.add_argument(
        "--kv-port", type=int, default=0, help="port of the key-value store (0: any free port)"
    )
    parser.add_argument("--store-port", dest="kv_port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--log-dir", type=Path, help="one log file per process (default: inherit)")
    parser.add_argument("--report", type=Path, help="append each MigrationReport (JSON lines)")
    parser.add_argument(
        "--preload",
        type=_modules,
        default=DEFAULT_PRELOAD,
        metavar="MODULES",
        help="comma-separated modules a fork server imports once per node before it forks "
        "each process of a Python training command, so a spare or a replacement starts with "
        f"them imported; 'none': every process starts on its own (default: "
        f"{','.join(DEFAULT_PRELOAD)})",
    )
    parser.add_argument("--faults", help=argparse.SUPPRESS)  # FaultPlan JSON, for drills
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("forewarn launch: no training command (put it after --)", file=sys.stderr)
        return 2
    if args.nproc is None:
        print("forewarn launch: --nproc-per-node is required", file=sys.stderr)
        return 2
    if args.resume is not None and not (
        args.resume.is_file() or (args.resume / "latest").is_file()
    ):
        print(f"forewarn launch: no checkpoint in {args.resume}", file=sys.stderr)
        return 2
    # SIGTERM (a scheduler's stop) ends the job as Ctrl-C does: the launcher terminates the
    # job's processes, which ignore SIGINT (migrator.nodes.spawn), and exits with 130.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # A launcher that seems stuck: ``kill -USR1 <pid>`` prints every thread's stack to its
    # stderr and changes nothing else.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.rdzv_endpoint:  # several launchers: node rank 0 hosts the key-value store there
        host, _, port = args.rdzv_endpoint.partition(":")
        args.host, args.kv_port = host, int(port or 29400)
    if args.nnodes > 1:
        code = run_node(args, command)
        if code is not None:  # another node's launcher: it ran its share of the job
            return code
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
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
                heartbeat_s=args.heartbeat_s,
            )
            link.preflight()
        except ForewarnError as exc:
            print(f"forewarn launch: {exc.message}", file=sys.stderr)
            return 2
        if args.webhook_listen:
            from migrator.webhook_listener import attach_listener

            attach_listener(
                link,
                args.webhook_listen,
                service_url=args.service,
                token=args.token,
                job_id=args.job_id,
            )
    # torch comes with the agent: imported only now, so ``--help`` and a refused token or a
    # bad option answer at once instead of after torch's import.
    from migrator.agent import Agent, AgentConfig

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
        kv_port=args.kv_port,
        http_port=args.http_port,
        service_url=args.service,
        faults=FaultPlan.from_json(args.faults) if args.faults else None,
        log_dir=args.log_dir,
        report_path=args.report,
        nnodes=args.nnodes,
        join_timeout_s=args.join_timeout_s,
        node_timeout_s=args.node_timeout_s,
        checkpoint_dir=args.checkpoint_dir.resolve() if args.checkpoint_dir else None,
        resume_from=args.resume.resolve() if args.resume else None,
        timing_window=args.timing_window,
        preload=args.preload,
    )
    if args.node_name:
        cfg.node = args.node_name
    agent = Agent(cfg, link=link)
    original = agent._register

    def register_and_publish() -> None:
        write_job_file(
            args.job_id,
            {"job_id": args.job_id, "agent_url": agent.agent_url, "kv": agent.kv_address},
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
