"""The demo's story, told by real processes: a GPU wears out under a rank, Forewarn moves the
rank before the GPU dies; later another rank's GPU dies without warning and the job rebuilds it
from a replica. The job ends exactly where a run without any of this ends.

:class:`Story` starts the parts (``forewarn serve``, ``forewarn simulate``, ``forewarn launch``
of :mod:`demo.gpt` with its ranks placed on fleet GPUs, and an unpaced reference run of the same
job), drives the scenario through the simulator's control API and the job's process ids, and
reads what happened from the service's REST API, as an operator's script would. It uses
nothing of the service's code: only its command line and its HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from demo.receiver import Receiver

__all__ = ["Config", "Story", "StoryFailed", "Summary", "free_port"]

T = TypeVar("T")

JOB_ID = "demo-gpt"
TOKENS = {
    "ingest": "demo-ingest-token-0001",
    "read": "demo-read-token-00001",
    "operate": "demo-operate-token-01",
    "admin": "demo-admin-token-0001",
}


class StoryFailed(RuntimeError):
    """A step of the story did not happen in time; the message says which and where to look."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Config:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8765
    control_port: int = 0
    """The simulator's failure-injection API; 0: any free port."""
    gpus: int = 256
    speed: float = 30.0
    steps: int = 600
    pace_s: float = 0.25
    wear_lead_s: float = 90.0
    """Wall seconds from the start of memory wear to the GPU's failure."""
    threshold: float | None = None
    """Policy threshold; None: the service's default (the model's)."""
    tick_s: float = 1.0
    step_timeout_s: float = 180.0


@dataclass
class Summary:
    preventive: dict[str, Any] = field(default_factory=dict)
    unplanned: dict[str, Any] = field(default_factory=dict)
    wear_started: float = 0.0
    gpu_failed_after_s: float | None = None
    lead_s: float | None = None
    final_loss: float | None = None
    reference_loss: float | None = None
    bitwise_equal: bool = False
    differences: list[str] = field(default_factory=list)
    webhooks: dict[str, int] = field(default_factory=dict)
    """Deliveries the demo's own receiver verified, by event type."""

    def as_json(self) -> dict[str, Any]:
        return {
            "preventive": self.preventive,
            "unplanned": self.unplanned,
            "lead_s": self.lead_s,
            "final_loss": self.final_loss,
            "reference_loss": self.reference_loss,
            "bitwise_equal": self.bitwise_equal,
            "differences": self.differences,
            "webhooks": self.webhooks,
        }

    def text(self) -> str:
        p, u = self.preventive, self.unplanned
        lead = (
            f"{self.lead_s:.0f} s before the GPU failed"
            if self.lead_s is not None
            else ("before the GPU failed")
        )
        lines = [
            "Forewarn demo: what happened",
            f"  preventive  rank {p.get('rank')} moved off {_gpu(p.get('source'))} to "
            f"{_gpu(p.get('target'))} at risk {_num(p.get('risk'))}, {lead}",
            f"              pause {_num(p.get('pause_s'))} s, {_mb(p.get('bytes_moved'))}, "
            f"steps lost {p.get('steps_lost', 0)}; reasons: {'; '.join(p.get('reasons') or [])}",
            f"  unplanned   rank {u.get('rank')} lost with {_gpu(u.get('source'))}; rebuilt on "
            f"{_gpu(u.get('target'))} from a replica in {_num(u.get('recovery_s'))} s, "
            f"steps lost {u.get('steps_lost', 0)}",
            f"  final loss  {_num(self.final_loss, 6)} (reference run without failures: "
            f"{_num(self.reference_loss, 6)})",
            "  bit for bit "
            + ("equal to the reference: parameters and optimizer state"
               if self.bitwise_equal else "DIFFERENT: " + "; ".join(self.differences[:5])),
            f"  webhooks    {sum(self.webhooks.values())} deliveries verified by the demo's "
            "receiver: " + (", ".join(f"{k} {n}" for k, n in sorted(self.webhooks.items()))
                            or "none"),
        ]  # fmt: skip
        return "\n".join(lines)


def _gpu(place: Any) -> str:
    return f"{place['node']}:{place['gpu']}" if isinstance(place, dict) else "?"


def _num(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "?"


def _mb(value: Any) -> str:
    return f"{value / 1e6:.1f} MB" if isinstance(value, int | float) else "? MB"


class Story:
    """The demo's processes and the scenario. ``close()`` stops every part, newest first."""

    def __init__(self, config: Config, *, say: Callable[[str], None] = print) -> None:
        self.config = config
        self.say = say
        self.url = f"http://{config.host}:{config.port}"
        self.control_port = config.control_port or free_port()
        self.parts: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.job_dir = config.data_dir / "demo-job"
        self.reference_dir = config.data_dir / "demo-reference"
        self.fast_file = self.job_dir / "fast"
        self.read = {"Authorization": f"Bearer {TOKENS['read']}"}
        self.summary = Summary()
        self.receiver: Receiver | None = None

    # -- processes ----------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        policy: dict[str, Any] = {"hysteresis": 2, "cooldown_s": 30, "stale_after_s": 30}
        if self.config.threshold is not None:
            policy["threshold"] = self.config.threshold
        env = dict(os.environ)
        return {
            **env,
            "FOREWARN_DATA_DIR": str(self.config.data_dir),
            "FOREWARN_INGEST_TOKEN": TOKENS["ingest"],
            "FOREWARN_READ_TOKEN": TOKENS["read"],
            "FOREWARN_TOKENS": json.dumps({TOKENS["operate"]: ["operate", "read"]}),
            "FOREWARN_ADMIN_TOKEN": TOKENS["admin"],
            "FOREWARN_CONTROL_TICK_S": str(self.config.tick_s),
            "FOREWARN_POLICY": json.dumps(policy),
            "FOREWARN_WEBHOOK_ALLOW": "127.0.0.1",  # the demo's own receiver
            "FOREWARN_WEBHOOK_RETRY_BASE_S": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, name: str, argv: list[str], *, nice: bool = False) -> subprocess.Popen[bytes]:
        """Start one part in its own session: Ctrl-C reaches the demo, which stops it in order."""
        log = (self.config.data_dir / f"demo-{name}.log").open("ab")
        with log:
            process = subprocess.Popen(
                [*(["nice", "-n", "10"] if nice else []), sys.executable, *argv],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.parts.append((name, process))
        return process

    def forewarn(self, name: str, *args: str, nice: bool = False) -> subprocess.Popen[bytes]:
        # -P: the working directory is not put first on sys.path, so a directory there named
        # like a package (a clone called forewarn/, a run dir) cannot shadow the installed one.
        return self.start(name, ["-P", "-m", "forewarn", *args], nice=nice)

    def check_parts(self) -> None:
        for name, process in self.parts:
            if name in ("service", "fleet") and process.poll() is not None:
                raise StoryFailed(
                    f"the {name} exited ({process.returncode}); see "
                    f"{self.config.data_dir}/demo-{name}.log"
                )

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.fast_file.parent.mkdir(parents=True, exist_ok=True)
        self.fast_file.touch()
        for _, process in reversed(self.parts):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    # -- the service's API ---------------------------------------------------------------------

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(self.url + path, headers=self.read, params=params, timeout=10)
        response.raise_for_status()
        return response.json()

    def wait(self, what: str, check: Callable[[], T | None], timeout_s: float) -> T:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_parts()
            try:
                got = check()
            except httpx.HTTPError:
                got = None
            if got:
                return got
            time.sleep(0.5)
        raise StoryFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def inject(self, node: str, gpu: int, kind: str, lead_s: float) -> None:
        body = {"node": node, "gpu": gpu, "kind": kind, "lead_s": lead_s}
        response = httpx.post(f"http://127.0.0.1:{self.control_port}/inject", json=body, timeout=10)
        if response.status_code >= 400:
            raise StoryFailed(f"the simulator refused the injection: {response.text}")

    def ranks(self) -> dict[int, dict[str, Any]]:
        """Active ranks of the demo job by rank."""
        job = self.get(f"/v1/jobs/{JOB_ID}")
        return {r["rank"]: r for r in job["ranks"] if r["role"] == "active"}

    def migrations(self, trigger: str) -> list[dict[str, Any]]:
        data = self.get("/v1/migrations", job=JOB_ID)["data"]
        return [m for m in data if m["trigger"] == trigger]

    def with_report(self, migration: dict[str, Any]) -> dict[str, Any]:
        """The migration as the service has it, plus what the job agent measured (steps lost,
        the stall its ranks saw) from the launcher's report file."""
        path = self.job_dir / "reports.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            report = json.loads(line)
            if report.get("migration_id") == migration["id"]:
                measured = {k: v for k, v in report.items() if k not in migration}
                return {**migration, **measured, "steps_lost": report.get("steps_lost", 0)}
        return migration

    # -- the scenario ------------------------------------------------------------------------

    def start_parts(self) -> None:
        c = self.config
        for d in (self.job_dir, self.reference_dir):  # what an earlier demo left: logs/ too
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        serve = self.forewarn("service", "serve", "--host", c.host, "--port", str(c.port))
        self.wait_ready(serve)
        self.subscribe()
        self.forewarn(
            "fleet", "simulate", "--gpus", str(c.gpus), "--service", self.url,
            "--token", TOKENS["ingest"], "--speed", str(c.speed),
            "--control-port", str(self.control_port),
        )  # fmt: skip
        job = [
            "--", sys.executable, "-P", "-m", "demo.gpt", "--steps", str(c.steps),
            "--log", str(self.job_dir), "--out", str(self.job_dir),
        ]  # fmt: skip
        self.forewarn(
            "job", "launch", "--nproc", "2", "--spares", "2", "--job-id", JOB_ID,
            "--service", self.url, "--token", TOKENS["operate"],
            "--placement", "sim-node-0000:0,sim-node-0000:1,sim-node-0001:0,sim-node-0001:1",
            "--log-dir", str(self.job_dir / "logs"),
            "--report", str(self.job_dir / "reports.jsonl"),
            *job, "--pace-s", str(c.pace_s), "--fast-file", str(self.fast_file),
        )  # fmt: skip
        self.forewarn(
            "reference", "launch", "--nproc", "2", "--spares", "0", "--job-id", "demo-reference",
            *[a if a != str(self.job_dir) else str(self.reference_dir) for a in job],
            nice=True,
        )  # fmt: skip

    def subscribe(self) -> None:
        """Start the demo's own webhook receiver and subscribe it to every event."""
        self.receiver = Receiver(self.config.data_dir / "demo-webhooks.log")
        self.receiver.start()
        response = httpx.post(
            self.url + "/v1/webhooks",
            headers={"Authorization": f"Bearer {TOKENS['admin']}"},
            json={"url": self.receiver.url, "description": "the demo's own receiver"},
            timeout=10,
        )
        if response.status_code != 201:
            raise StoryFailed(f"the service refused the demo's webhook: {response.text}")
        self.receiver.secret = response.json()["secret"]

    def wait_ready(self, serve: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if serve.poll() is not None:
                raise StoryFailed(
                    f"the service exited ({serve.returncode}); see "
                    f"{self.config.data_dir}/demo-service.log"
                )
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise StoryFailed(f"the service was not ready within {timeout_s:.0f} s")

    def preventive(self) -> None:
        """Wear out the memory of the GPU under rank 1; wait for Forewarn to move the rank."""
        c = self.config
        self.wait("the job to register its ranks", lambda: len(self.ranks()) == 2, 120)
        self.wait("training to start", lambda: any(self.job_dir.glob("gpt.slot*.jsonl")), 120)
        rank1 = self.ranks()[1]
        node, gpu = rank1["node"], int(rank1["gpu"])
        self.say(f"[demo] wearing out the memory of {node}:{gpu} (under rank 1); it will fail "
                 f"in {c.wear_lead_s:.0f} s")  # fmt: skip
        self.summary.wear_started = time.time()
        self.inject(node, gpu, "memory", c.wear_lead_s)
        done = self.wait(
            "the preventive migration",
            lambda: [m for m in self.migrations("preventive")
                     if m["state"] in ("completed", "failed", "cancelled")],
            c.step_timeout_s,
        )  # fmt: skip
        m = self.wait("the job's report", lambda: _reported(self.with_report(done[0])), 30)
        if m["state"] != "completed":
            raise StoryFailed(f"the preventive migration ended {m['state']}: {m.get('error')}")
        self.summary.preventive = m
        requested = _epoch(m.get("requested_at"))
        failed_at = self.summary.wear_started + c.wear_lead_s
        if requested is not None:
            self.summary.lead_s = failed_at - requested
        self.say(f"[demo] rank 1 moved to {_gpu(m.get('target'))} (pause "
                 f"{_num(m.get('pause_s'))} s); the worn GPU now serves no rank")  # fmt: skip

    def unplanned(self) -> None:
        """Rank 0's GPU dies without warning: its process dies with it."""
        moved_at = int(self.summary.preventive.get("step") or 0)
        self.wait(
            "training to go on after the move",
            lambda: max((step for _, step in _losses(self.job_dir)), default=0) >= moved_at + 20,
            self.config.step_timeout_s,
        )
        rank0 = self.ranks()[0]
        node, gpu, pid = rank0["node"], int(rank0["gpu"]), rank0.get("pid")
        if not pid:
            raise StoryFailed("the job did not report the process id of rank 0")
        self.say(f"[demo] {node}:{gpu} (under rank 0) is lost without warning")
        lost_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
        self.inject(node, gpu, "gpu_lost", 0.0)
        done = self.wait(
            "the recovery of rank 0",
            lambda: [m for m in self.migrations("unplanned")
                     if m["rank"] == 0 and m["state"] in ("completed", "failed")],
            self.config.step_timeout_s,
        )  # fmt: skip
        m = self.wait("the job's report", lambda: _reported(self.with_report(done[0])), 30)
        if m["state"] != "completed":
            raise StoryFailed(f"the recovery of rank 0 ended {m['state']}: {m.get('error')}")
        finished = _epoch(m.get("finished_at")) or time.time()
        self.summary.unplanned = {**m, "recovery_s": max(0.0, finished - lost_at)}
        self.say(f"[demo] rank 0 rebuilt on {_gpu(m.get('target'))} from a replica")

    def finish(self, job_timeout_s: float = 600.0) -> Summary:
        """Let the job run to its end at full speed; compare it with the reference run."""
        self.fast_file.touch()
        job = dict(self.parts)["job"]
        reference = dict(self.parts)["reference"]
        for name, process in (("job", job), ("reference run", reference)):
            try:
                code = process.wait(timeout=job_timeout_s)
            except subprocess.TimeoutExpired as exc:
                raise StoryFailed(f"the {name} did not finish in {job_timeout_s:.0f} s") from exc
            if code != 0:
                raise StoryFailed(f"the {name} failed ({code}); see {self.config.data_dir}")
        self.summary.differences = compare(self.job_dir, self.reference_dir)
        self.summary.bitwise_equal = not self.summary.differences
        self.summary.final_loss = _final_loss(self.job_dir)
        self.summary.reference_loss = _final_loss(self.reference_dir)
        if self.receiver is not None:  # the completions are delivered within a retry or two
            self.wait(
                "the webhook deliveries of both migrations",
                lambda: self.receiver.counts().get("migration.completed", 0) >= 2,  # type: ignore[union-attr]
                60,
            )
            self.summary.webhooks = self.receiver.counts()
        return self.summary


def compare(run: Path, reference: Path, ranks: int = 2) -> list[str]:
    """Every tensor of every rank's final model and optimizer state, and every step's loss."""
    import torch  # the demo's own comparison; the service never imports torch

    out: list[str] = []
    for rank in range(ranks):
        a = torch.load(run / f"final.rank{rank}.pt", weights_only=True)
        b = torch.load(reference / f"final.rank{rank}.pt", weights_only=True)
        for name, tensor in b["model"].items():
            if not torch.equal(tensor, a["model"][name]):
                out.append(f"rank {rank} parameter {name}")
        for pid, state in b["optimizer"]["state"].items():
            for key, value in state.items():
                if not torch.equal(value, a["optimizer"]["state"][pid][key]):
                    out.append(f"rank {rank} optimizer {pid}.{key}")
    if _losses(run) != _losses(reference):
        out.append("per-step losses")
    return out


def _losses(directory: Path) -> dict[tuple[int, int], str]:
    rows: dict[tuple[int, int], str] = {}
    for path in directory.glob("gpt.slot*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[(row["rank"], row["step"])] = row["loss"]  # a redone step: the last one counts
    return rows


def _final_loss(directory: Path) -> float | None:
    losses = _losses(directory)
    if not losses:
        return None
    last = max(step for _, step in losses)
    values = [float.fromhex(v) for (_, step), v in losses.items() if step == last]
    return sum(values) / len(values)


def _reported(migration: dict[str, Any]) -> dict[str, Any] | None:
    return migration if "steps_lost" in migration else None


def _epoch(iso: str | None) -> float | None:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None
