"""``forewarn launch`` and ``forewarn migrate`` as an operator runs them: a job that loses a
rank with no spare left pauses, says so, refuses commands, and fails after its pause bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from migrator.endpoint import read_job_file
from migrator.faults import FaultPlan

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("train_tiny.py")


def _forewarn(*args: str, env: dict[str, str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "forewarn", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )  # type: ignore[call-overload]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_no_spare_left_pauses_refuses_and_fails(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        FOREWARN_RUN_DIR=str(tmp_path / "run"),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    plan = FaultPlan().fail_at(1, 3).to_json()
    launch = _forewarn(
        "launch",
        "--nproc",
        "2",
        "--spares",
        "0",
        "--job-id",
        "t1",
        "--timeout-s",
        "5",
        "--pause-timeout-s",
        "6",
        "--faults",
        plan,
        "--log-dir",
        str(tmp_path / "logs"),
        "--",
        sys.executable,
        str(SCRIPT),
        "--out",
        str(tmp_path / "out"),
        "--steps",
        "20",
        env=env,
    )
    try:
        os.environ["FOREWARN_RUN_DIR"] = env["FOREWARN_RUN_DIR"]
        deadline = time.monotonic() + 240  # three processes import torch on a busy machine
        status = None
        while time.monotonic() < deadline and status != "paused":
            time.sleep(0.2)
            try:
                url = read_job_file("t1")["agent_url"]
                status = httpx.get(f"{url}/v1/job", timeout=5).json()["status"]
            except Exception:  # the job file or endpoint is not there yet
                continue
        assert status == "paused"
        refused = subprocess.run(
            [sys.executable, "-m", "forewarn", "migrate", "--job", "t1", "--rank", "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 1 and "paused" in refused.stderr
        _, err = launch.communicate(timeout=60)
    finally:
        os.environ.pop("FOREWARN_RUN_DIR", None)
        if launch.poll() is None:
            launch.kill()
            launch.communicate(timeout=30)
    assert launch.returncode == 1
    assert "paused at step 3" in err and "no spare" in err
    missing = subprocess.run(
        [sys.executable, "-m", "forewarn", "migrate", "--job", "t1", "--rank", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2  # the job file went away with the job


def _stuck(launch: subprocess.Popen[str]) -> str:
    """What a launcher that did not end in time was doing: its process group, every thread's
    stack (SIGUSR1) and its output so far; the group is killed."""
    group = subprocess.run(
        ["ps", "-o", "pid,ppid,stat,etime,args", "-g", str(launch.pid)],
        capture_output=True,
        text=True,
    ).stdout
    if launch.poll() is None:
        launch.send_signal(signal.SIGUSR1)
        time.sleep(2)
    os.killpg(launch.pid, signal.SIGKILL)
    _, stderr = launch.communicate(timeout=30)
    return f"exit {launch.returncode}; the group:\n{group}\nstderr:\n{stderr}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_launcher_ends_its_ranks_quietly(how: str, tmp_path: Path) -> None:
    """Ctrl-C in the launcher's terminal (SIGINT to its whole process group) or SIGTERM to the
    launcher alone: the ranks and the spare end, none prints a KeyboardInterrupt traceback,
    and the launcher says it stopped and exits with 130. (A SIGUSR1 before it prints every
    thread's stack and changes nothing.)"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["FOREWARN_RUN_DIR"] = str(tmp_path / "run")
    out, logs = tmp_path / "out", tmp_path / "logs"
    launch = _forewarn(
        "launch", "--nproc", "2", "--spares", "1", "--job-id", "stop", "--log-dir", str(logs),
        "--", sys.executable, str(SCRIPT), "--out", str(out), "--steps", "100000",
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(out.glob("log.slot*.jsonl")):
            time.sleep(0.2)
        group = [int(p) for p in subprocess.run(
            ["pgrep", "-g", str(launch.pid)], capture_output=True, text=True
        ).stdout.split() if int(p) != launch.pid]  # fmt: skip
        servers = [
            p for p in group if b"migrator.preload" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        pids = [p for p in group if p not in servers]
        assert len(pids) == 3 and len(servers) == 1, group  # two ranks, the spare, the fork server
        launch.send_signal(signal.SIGUSR1)  # every thread's stack, and nothing else
        if how == "ctrl-c":
            os.killpg(launch.pid, signal.SIGINT)
        else:
            launch.terminate()
        try:
            _, stderr = launch.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(_stuck(launch))
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, 9)
    assert "Thread 0x" in stderr and "(most recent call first)" in stderr, stderr
    assert launch.returncode == 130, stderr
    assert "job stop stopped" in stderr and "Traceback" not in stderr, stderr
    for log in logs.glob("slot*.log"):
        text = log.read_text()
        assert "KeyboardInterrupt" not in text and "Traceback" not in text, text
    assert not [p for p in pids + servers if _alive(p)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_script_is_said_once(tmp_path: Path) -> None:
    """A script that raises on every rank: its message and traceback are on the launcher's
    stderr once (the ranks write theirs to --log-dir), with the launcher's final line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["FOREWARN_RUN_DIR"] = str(tmp_path / "run")
    launch = _forewarn(
        "launch", "--nproc", "2", "--spares", "1", "--job-id", "typo", "--timeout-s", "5",
        "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(SCRIPT),
        "--out", str(tmp_path / "out"), "--mode", "plain", "--crash-all-at", "2",
        env=env,
    )  # fmt: skip
    try:
        _, stderr = launch.communicate(timeout=240)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 1, stderr
    assert stderr.count("Traceback (most recent call last)") == 1, stderr
    assert stderr.count("ValueError: a typo on every rank") == 1, stderr
    assert "job typo failed: every rank exited at once" in stderr, stderr
