"""The fork server: a forked process of the job behaves as ``python script.py`` would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from migrator import nodes, preload
from migrator.agent import Agent, AgentConfig
from migrator.preload import ForkedProc, ForkServer, preloadable
from tests.migrator.harness import ROOT, SCRIPT, Run, assert_same, launch, reference

PROBE = """\
import atexit, json, os, signal, sys

def bye():
    print("atexit ran", flush=True)

atexit.register(bye)
print(json.dumps({
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "var": os.environ.get("PROBE_VAR"),
    "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
}), flush=True)
what = sys.argv[1]
if what == "raise":
    def inner():
        raise ValueError("the script's own error")
    inner()
if what == "hang":
    import time
    time.sleep(60)
if what.startswith("until:"):  # until:PATH:CODE
    import time
    _, path, code = what.split(":")
    while not os.path.exists(path):
        time.sleep(0.02)
    sys.exit(int(code))
sys.exit(int(what))
"""


@pytest.fixture(scope="module")
def server() -> ForkServer:
    """One fork server for the module (light imports: the tests are about its semantics)."""
    srv = ForkServer(dict(os.environ), ("json",))
    yield srv
    srv.close()


def _probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def _run_both(
    server: ForkServer, tmp_path: Path, arg: str
) -> tuple[tuple[int, str], tuple[int, str]]:
    """(code, output) of the probe forked by the server and run as a new process."""
    script = _probe(tmp_path)
    env = {**os.environ, "PROBE_VAR": "forked"}
    command = [sys.executable, str(script), arg]
    log = tmp_path / "forked.log"
    proc = server.spawn(command, env, log_path=log)
    assert isinstance(proc, ForkedProc)
    forked = (proc.wait(timeout=60), log.read_text())
    env["PROBE_VAR"] = "new"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    return forked, (done.returncode, done.stdout + done.stderr)


def test_a_forked_script_sees_what_a_new_process_would(server, tmp_path):
    (code, out), (new_code, new_out) = _run_both(server, tmp_path, "3")
    assert code == new_code == 3
    seen, new_seen = json.loads(out.splitlines()[0]), json.loads(new_out.splitlines()[0])
    assert seen.pop("var") == "forked" and new_seen.pop("var") == "new"
    assert seen.pop("sigint") is True  # the job's processes ignore SIGINT (nodes.spawn)
    new_seen.pop("sigint")
    assert seen == new_seen
    assert seen["name"] == "__main__" and seen["path0"] == str(tmp_path)
    assert out.splitlines()[1:] == new_out.splitlines()[1:] == ["atexit ran"]


def test_an_uncaught_error_exits_1_with_the_interpreters_traceback(server, tmp_path):
    (code, out), (new_code, new_out) = _run_both(server, tmp_path, "raise")
    assert code == new_code == 1
    assert out.count("ValueError: the script's own error") == 1
    # the same frames as a new process shows: none of the fork server's or runpy's
    frames = [line for line in out.splitlines() if line.startswith('  File "')]
    new_frames = [line for line in new_out.splitlines() if line.startswith('  File "')]
    assert frames == new_frames and len(frames) == 2
    assert "atexit ran" in out


def test_a_module_runs_as_with_dash_m(server, tmp_path):
    pkg = tmp_path / "probepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "run.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log = tmp_path / "m.log"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        proc = server.spawn([sys.executable, "-m", "probepkg.run", "0"], env, log_path=log)
    finally:
        os.chdir(cwd)
    assert proc is not None and proc.wait(timeout=60) == 0
    seen = json.loads(log.read_text().splitlines()[0])
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["0"]
    assert seen["file"] == str(pkg / "run.py") and seen["path0"] == str(tmp_path)


def test_signals_reach_the_forked_process_and_its_code_says_which(server, tmp_path):
    script = _probe(tmp_path)
    proc = server.spawn([sys.executable, str(script), "hang"], dict(os.environ), log_path=None)
    assert proc is not None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    proc.send_signal(signal.SIGINT)  # ignored, as by every process of the job
    time.sleep(0.3)
    assert proc.poll() is None
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.kill()  # after the end: nothing, as Popen.kill


def test_a_server_that_cannot_import_its_modules_leaves_spawn_to_new_processes(tmp_path):
    script = _probe(tmp_path)
    srv = ForkServer(dict(os.environ), ("no_such_module_here",))
    try:
        command = [sys.executable, str(script), "0"]
        assert srv.spawn(command, dict(os.environ), log_path=None) is None
        assert "no_such_module_here" in (srv.failed or "")
        proc = nodes.spawn(command, dict(os.environ), log_dir=tmp_path, index=0, forks=srv)
        assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
        assert "atexit ran" in (tmp_path / "slot0.log").read_text()
    finally:
        srv.close()


def test_a_killed_servers_children_run_on_and_their_exit_codes_still_come(tmp_path):
    """SIGKILL the server: its children become the launcher's (a subreaper), which reads
    their exit codes itself: a rank that ends normally is not taken for a killed one."""
    script = _probe(tmp_path)
    srv = ForkServer(dict(os.environ), ("json",))
    go = tmp_path / "go"
    try:
        ends = srv.spawn(
            [sys.executable, str(script), f"until:{go}:0"], dict(os.environ), log_path=None
        )
        dies = srv.spawn([sys.executable, str(script), "hang"], dict(os.environ), log_path=None)
        assert ends is not None and dies is not None
        srv._proc.kill()
        srv._proc.wait()
        deadline = time.monotonic() + 10
        while not srv.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.lost and ends.poll() is None and dies.poll() is None  # orphans, running
        assert {ends.pid, dies.pid} <= _children(os.getpid())  # adopted by this launcher
        go.touch()
        assert ends.wait(timeout=30) == 0
        os.kill(dies.pid, signal.SIGKILL)
        assert dies.wait(timeout=30) == -signal.SIGKILL
        assert (
            srv.spawn([sys.executable, str(script), "0"], dict(os.environ), log_path=None) is None
        )
    finally:
        srv.close()


def test_only_this_interpreter_on_a_script_or_module_is_forked(tmp_path):
    script = _probe(tmp_path)
    assert preloadable([sys.executable, str(script)])
    assert preloadable([sys.executable, "-m", "json.tool"])
    assert not preloadable([sys.executable, "-u", str(script)])
    assert not preloadable([sys.executable, str(tmp_path / "missing.py")])
    assert not preloadable(["/bin/sh", "-c", "true"])
    assert not preloadable([sys.executable])


def test_a_job_forked_from_the_server_equals_one_of_new_processes(tmp_path_factory, tmp_path):
    """The bitwise check of every migrator test, across the two ways of starting ranks."""
    base = reference(tmp_path_factory, steps=20)
    run = launch(tmp_path / "new", steps=20, spares=0, preload=())
    assert all(isinstance(s.proc, subprocess.Popen) for s in run.agent.table.slots)
    assert_same(base, run)
    forked = launch(tmp_path / "forked", steps=20, spares=0)
    assert all(isinstance(s.proc, ForkedProc) for s in forked.agent.table.slots)
    assert_same(base, forked)


def test_ps_shows_a_forked_process_with_its_own_command(server, tmp_path):
    script = _probe(tmp_path)
    command = [sys.executable, str(script), "hang"]
    proc = server.spawn(command, dict(os.environ), log_path=None)
    assert proc is not None
    try:
        deadline = time.monotonic() + 30
        cmdline = b""
        while time.monotonic() < deadline:
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            if str(script).encode() in cmdline:
                break
            time.sleep(0.05)
        assert str(script).encode() in cmdline and b"migrator.preload" not in cmdline, cmdline
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def test_a_stopped_server_neither_hides_an_exit_nor_forks_late(tmp_path):
    """SIGSTOP the server: a child's exit is still seen at once (the kernel's zombie status),
    a request it cannot answer in time falls back to a new process, and the server, let go,
    forks nothing for that request."""
    script = _probe(tmp_path)
    srv = ForkServer(dict(os.environ), ("json",), answer_s=1.0)
    try:
        hang = srv.spawn([sys.executable, str(script), "hang"], dict(os.environ), log_path=None)
        assert hang is not None
        server = srv._proc.pid
        os.kill(server, signal.SIGSTOP)
        try:
            hang.kill()
            assert hang.wait(timeout=10) == -signal.SIGKILL  # unreaped: its zombie says so
            late = [sys.executable, str(script), "hang"]  # a late fork would still run
            assert srv.spawn(late, dict(os.environ), log_path=None) is None
            assert srv.failed and "no answer" in srv.failed
            quick = [sys.executable, str(script), "7"]
            proc = nodes.spawn(quick, dict(os.environ), log_dir=tmp_path, index=1, forks=srv)
            assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 7
        finally:
            os.kill(server, signal.SIGCONT)
        time.sleep(1.0)  # the server reads the stale request now
        assert _children(server) == set()  # it forked nothing for it (and reaped the hang)
    finally:
        srv.close()


def test_a_job_whose_fork_server_is_killed_runs_on_and_recovers_a_rank_bitwise(
    tmp_path_factory, tmp_path
):
    """SIGKILL the job's fork server mid-run, then a rank: the ranks and the spare it forked
    run on (adopted by the launcher), the killed rank is rebuilt on the spare, the others'
    normal ends are seen as such, and the job ends bitwise equal to the undisturbed run."""
    base = reference(tmp_path_factory, steps=40)
    out = tmp_path / "run"
    cfg = AgentConfig(
        command=[
            *(sys.executable, str(SCRIPT), "--out", str(out), "--steps", "40"),
            *("--step-sleep", "0.1"),  # the same steps, paced to leave room for the attack
        ],
        nproc=2,
        spares=1,
        timeout_s=10.0,
        log_dir=out / "logs",
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    agent = Agent(cfg)
    killed: list[int] = []

    def attack() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = out / "log.slot1.jsonl"
            if (
                agent._forks is not None
                and rows.exists()
                and len(rows.read_text().splitlines()) >= 5
            ):
                server = agent._forks._proc.pid
                os.kill(server, signal.SIGKILL)
                killed.append(server)
                time.sleep(0.5)
                os.kill(agent.table.slots[1].proc.pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    code = agent.run()
    thread.join(timeout=10)
    assert killed, "the job ended before the attack"
    assert code == 0, agent.message
    assert [(r.rank, r.outcome) for r in agent.reports] == [(1, "completed")]
    run = Run(out, code, list(agent.reports), agent)
    assert_same(base, run, unlogged={(1, s) for s in range(41)})


def test_a_preload_that_initialises_cuda_is_refused(tmp_path):
    """A forked child cannot use CUDA initialised in its parent: a server whose imports did
    so forks nothing (torch's own state says so; this machine has no GPU, so the module
    sets that state as CUDA's lazy init would)."""
    (tmp_path / "inits_cuda.py").write_text("import torch.cuda\ntorch.cuda._initialized = True\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    srv = ForkServer(env, ("torch", "inits_cuda"))
    try:
        script = _probe(tmp_path)
        assert srv.spawn([sys.executable, str(script), "0"], env, log_path=None) is None
        assert "CUDA" in (srv.failed or "")
    finally:
        srv.close()


MP_SCRIPT = """\
import multiprocessing as mp


def square(x):
    return x * x


if __name__ == "__main__":
    for method in ("spawn", "forkserver", "fork"):
        with mp.get_context(method).Pool(2) as pool:
            print(method, pool.map(square, range(4)), flush=True)
"""


def test_a_forked_script_starts_processes_of_its_own_every_way(server, tmp_path):
    """multiprocessing in a forked rank (a data loader's workers): spawn and forkserver
    children find the script's functions through its ``__main__`` as with a new process."""
    script = tmp_path / "mp_script.py"
    script.write_text(MP_SCRIPT)
    log = tmp_path / "mp.log"
    proc = server.spawn([sys.executable, str(script)], dict(os.environ), log_path=log)
    assert proc is not None and proc.wait(timeout=120) == 0, log.read_text()
    assert log.read_text().splitlines() == [
        f"{method} [0, 1, 4, 9]" for method in ("spawn", "forkserver", "fork")
    ]


def test_the_launchers_preload_flag(tmp_path):
    import argparse

    from migrator.launch_cli import configure
    from migrator.preload import DEFAULT_PRELOAD

    parser = argparse.ArgumentParser()
    configure(parser)
    parse = parser.parse_args
    assert parse(["--", "x"]).preload == DEFAULT_PRELOAD
    assert parse(["--preload", "none", "--", "x"]).preload == ()
    assert parse(["--preload", "torch, numpy", "--", "x"]).preload == ("torch", "numpy")
    with pytest.raises(SystemExit):
        parse(["--preload", "torch;rm -rf /", "--", "x"])


def test_a_server_whose_imports_never_end_is_given_up_once(tmp_path, monkeypatch):
    """Imports still running when the first request has waited its bound: that request and
    every later one start their processes on their own, without waiting again."""
    (tmp_path / "sleepy.py").write_text("import time\ntime.sleep(60)\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    monkeypatch.setattr(preload, "_SPAWN_TIMEOUT_S", 1.0)
    srv = ForkServer(env, ("sleepy",))
    try:
        command = [sys.executable, "-c", "pass"]
        assert srv.spawn(command, env, log_path=None) is None
        assert srv.failed and "did not finish in 1 s" in srv.failed
        t0 = time.monotonic()
        assert srv.spawn(command, env, log_path=None) is None
        assert time.monotonic() - t0 < 0.5  # not another wait for the imports
    finally:
        srv.close()
