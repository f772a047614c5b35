"""``forewarn migrate``: ask a running job's agent to move a rank to a warm spare.

    forewarn migrate --job demo --rank 1 --reason preventive --wait
    forewarn migrate --job demo --status

The agent is found through its job file (see :mod:`migrator.endpoint`) or ``--agent URL``.
With ``--wait`` the command returns when the migration ends and prints its
``MigrationReport``. Exit codes: 0 done/accepted, 1 refused or failed, 2 no such job.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

from forewarn.errors import Conflict, NotFound
from migrator.endpoint import read_job_file

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="the job id given to forewarn launch")
    parser.add_argument("--rank", type=int, help="the rank to move")
    parser.add_argument("--reason", choices=["planned", "preventive"], default="planned")
    parser.add_argument("--agent", metavar="URL", help="the agent's endpoint (default: job file)")
    parser.add_argument("--wait", action="store_true", help="wait for the migration to end")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound for --wait")
    parser.add_argument("--status", action="store_true", help="print the job and its reports")


def run(args: argparse.Namespace) -> int:
    try:
        url = args.agent or read_job_file(args.job)["agent_url"]
    except NotFound as exc:
        print(f"forewarn migrate: {exc.message}", file=sys.stderr)
        return 2
    except Conflict as exc:
        print(f"forewarn migrate: {exc.message}", file=sys.stderr)
        return 1
    with httpx.Client(base_url=url, timeout=10.0) as client:
        if args.status:
            job = client.get("/v1/job").json()
            job["migrations"] = client.get("/v1/migrations").json()["data"]
            print(json.dumps(job, indent=2))
            return 0
        if args.rank is None:
            print("forewarn migrate: --rank is required (or --status)", file=sys.stderr)
            return 2
        body = {"job_id": args.job, "rank": args.rank, "reason": args.reason}
        resp = client.post("/v1/migrations", json=body)
        if resp.status_code != 202:
            err = resp.json().get("error", {})
            print(
                f"forewarn migrate: refused ({err.get('code')}): {err.get('message')}",
                file=sys.stderr,
            )
            return 1
        mid = resp.json()["migration_id"]
        print(f"migration {mid} accepted: rank {args.rank} moves at the next step boundary")
        if not args.wait:
            return 0
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            got = client.get(f"/v1/migrations/{mid}")
            if got.status_code == 200:
                report = got.json()
                print(json.dumps(report, indent=2))
                return 0 if report["outcome"] == "completed" else 1
            time.sleep(0.2)
        print(
            f"forewarn migrate: migration {mid} still running after {args.timeout_s} s",
            file=sys.stderr,
        )
        return 1
