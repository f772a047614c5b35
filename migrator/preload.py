"""Start a job's processes from a fork server that has already imported torch.

A Python rank or spare spends most of its start importing: ``import torch`` and the
``torch._dynamo`` that the optimizers and DDP pull in cost about three CPU-seconds per process,
paid again by every spare and every replacement. A launcher instead starts one *fork server*
per job and node: a Python process with the job's environment that imports the preload
modules (by default torch, torch.distributed, torch._dynamo and the job wrapper) once and then
forks one child per process of the job. The child sets its own variables (rank, slot ...),
its working directory and its log file, and runs the script as ``python script.py`` or
``python -m module`` would: ``__main__``, ``sys.argv``, ``sys.path[0]``, exit code, traceback
and exit handlers as there. A spare or a replacement then starts in a fraction of a second
(``benchmarks/spawn.py``).

Only commands that run this very interpreter (``sys.executable``) on a script or a ``-m``
module are forked; any other command, and every command when the fork server cannot import
its modules, is started as a new process (:func:`migrator.nodes.spawn`). The server is
single-threaded (forking a threaded process would copy its other threads' locks), ignores
SIGINT as the job's processes do, reaps its children and reports their exit codes to the
launcher, and exits when the launcher closes its request pipe.

Wire between a launcher and its server: JSON lines over two pipes. Requests:
``{"id", "argv", "env", "cwd", "log", "deadline"}`` (wall-clock seconds: a request read past
it is answered with pid null, not forked); replies: ``{"ready": true}`` or ``{"error": why}``
once, after the imports; ``{"id", "pid"}`` per request; ``{"exit": pid, "code": c}`` per child
that ended (``c`` as :attr:`subprocess.Popen.returncode`: negative for a signal).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PRELOAD", "ForkServer", "ForkedProc", "fork_server", "preloadable"]

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "migrator")
"""What a job's fork server imports before it forks the job's processes."""

_SPAWN_TIMEOUT_S = 300.0  # the first request waits for the server's imports


def preloadable(command: list[str]) -> bool:
    """Whether ``command`` runs this interpreter on a script or a ``-m`` module (the only
    commands a fork server can run)."""
    if len(command) < 2:
        return False
    exe = shutil.which(command[0])
    if exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return False
    if command[1] == "-m":
        return len(command) >= 3
    return not command[1].startswith("-") and os.path.isfile(command[1])


def fork_server(
    command: list[str], env: dict[str, str], modules: tuple[str, ...]
) -> ForkServer | None:
    """The fork server a launcher starts for a job running ``command`` with ``env`` (less each
    process's own variables); None when there is nothing to preload or ``command`` cannot be
    forked (:func:`preloadable`)."""
    if not modules or not preloadable(command):
        return None
    return ForkServer(env, modules)


class ForkedProc:
    """A process of the job forked by a :class:`ForkServer` (duck-types ``subprocess.Popen``:
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.peek(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._ended.wait(0.2 if left is None else min(0.2, left))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's end of one fork server (started at once; its imports run meanwhile).

    Args:
        env: the environment of the job's processes, less what differs between them; the
            server runs with it, so what the preload modules read at import is the job's.
        modules: what the server imports before it forks.
        answer_s: how long a request waits for its pid once the imports are done; a server
            that does not answer in time (stopped, wedged) is used no more, and forks nothing
            for that request later.
    """

    def __init__(
        self,
        env: dict[str, str],
        modules: tuple[str, ...] = DEFAULT_PRELOAD,
        *,
        answer_s: float = 20.0,
    ) -> None:
        self.answer_s = answer_s
        self._closed = False
        _subreaper(+1)
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "migrator.preload", str(req_r), str(rep_w), *modules],
            env=env,
            pass_fds=(req_r, rep_w),
        )
        os.close(req_r)
        os.close(rep_w)
        self.lost = False
        self.failed: str | None = None
        self._lock = threading.Lock()  # one request at a time: the reply names its pid
        self._ready = threading.Event()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._procs: dict[int, ForkedProc] = {}
        self._early: dict[int, int] = {}  # exits read before their pid's reply was taken
        self._next_id = 0
        self._answered = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    def spawn(
        self, command: list[str], env: dict[str, str], *, log_path: Path | None
    ) -> ForkedProc | None:
        """Fork one process running ``command`` (see :func:`preloadable`) with ``env``;
        None if the server cannot (its imports failed, or it is gone)."""
        if self.failed or self.lost:
            return None
        if not self._ready.wait(_SPAWN_TIMEOUT_S):
            # Imports that never end: given up once, not waited for again by every request.
            self.failed = f"its imports did not finish in {_SPAWN_TIMEOUT_S:.0f} s"
            log.warning("fork server: %s; the processes start on their own", self.failed)
            self._proc.kill()  # it has forked nothing yet
            return None
        if self.failed or self.lost:
            return None
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            request = {
                "id": rid,
                "argv": command,
                "env": env,
                "cwd": os.getcwd(),
                "log": str(log_path) if log_path else None,
                # A server stopped (SIGSTOP) past this forks nothing when it comes back:
                # the launcher has started the process on its own by then.
                "deadline": time.time() + self.answer_s,
            }
            try:
                os.write(self._req_w, (json.dumps(request) + "\n").encode())
            except OSError:
                return None
            with self._answered:
                answered = self._answered.wait_for(
                    lambda: rid in self._pids or self.lost, self.answer_s + 1.0
                )
                if not answered:
                    self.failed = f"no answer to a request in {self.answer_s + 1.0:.0f} s"
                    log.warning("fork server: %s; the processes start on their own", self.failed)
                pid = self._pids.pop(rid, None)
                if pid is None:
                    return None
                proc = ForkedProc(pid, self)
                self._procs[pid] = proc
                if pid in self._early:
                    proc._exited(self._early.pop(pid))
                return proc

    def close(self) -> None:
        """Stop the server (its children, if any still run, go on without it)."""
        if self._closed:
            return
        self._closed = True
        _subreaper(-1)
        with contextlib.suppress(OSError):
            os.close(self._req_w)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def peek(self, proc: ForkedProc) -> None:
        """``proc``'s exit as the kernel shows it, for when the server has not reported it:
        a zombie's exit status (``/proc/<pid>/stat``, field 52), so that an exit is seen at
        once even while the server is stopped or slow. Once the server is gone its children
        are this process's (a subreaper), which reaps them itself; a pid gone elsewhere (no
        subreaper here) counts as killed."""
        if self.lost:
            try:
                pid, status = os.waitpid(proc.pid, os.WNOHANG)
            except ChildProcessError:
                pass  # not adopted: reaped by someone else, or still the server's
            else:
                if pid:
                    proc._exited(os.waitstatus_to_exitcode(status))
                return
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
        except OSError:
            if self.lost:
                proc._exited(-signal.SIGKILL)
            return
        fields = stat.rpartition(")")[2].split()
        if fields[:1] == ["Z"] and len(fields) >= 50:
            proc._exited(os.waitstatus_to_exitcode(int(fields[49])))

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._rep_r, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._take(json.loads(line))
        os.close(self._rep_r)
        with self._answered:
            self.lost = True
            self._answered.notify_all()
        if self._procs and any(p.returncode is None for p in self._procs.values()):
            log.warning(
                "the fork server of the job's processes is gone (exit %s)", self._proc.poll()
            )
        self._ready.set()

    def _take(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self._ready.set()
        elif "error" in msg:
            self.failed = msg["error"]
            log.warning("fork server: %s; the job's processes start on their own", msg["error"])
            self._ready.set()
        elif "id" in msg:
            with self._answered:
                self._pids[msg["id"]] = msg["pid"]
                self._answered.notify_all()
        elif "exit" in msg:
            with self._answered:
                proc = self._procs.get(msg["exit"])
                if proc is None:
                    self._early[msg["exit"]] = msg["code"]
                else:
                    proc._exited(msg["code"])


_servers_open = 0
_servers_lock = threading.Lock()


def _subreaper(servers: int) -> None:
    """Count the fork servers open in this process (+1, -1): while any is open, adopt the
    orphans among this process's descendants (Linux ``PR_SET_CHILD_SUBREAPER``). If a fork
    server dies, the job's processes it forked become this launcher's children, whose exit
    codes it then reads itself instead of losing them to init. An orphan that is not one of
    the job's processes (a rank's own child left behind) stays a zombie until the launcher
    exits; none is adopted once the last server closed."""
    global _servers_open
    with _servers_lock:
        before, _servers_open = _servers_open, _servers_open + servers
        if (before == 0) == (_servers_open == 0) or not sys.platform.startswith("linux"):
            return
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(36, 1 if _servers_open else 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError) as exc:
            log.debug("subreaper: %s", exc)


# -- the server -----------------------------------------------------------------------------


def _serve(req_fd: int, rep_fd: int, modules: list[str]) -> dict[str, Any] | None:
    """Import ``modules``, then fork a child per request until the request pipe closes.
    Returns the request in a child (which then runs it), None in the server at its end."""

    def reply(msg: dict[str, Any]) -> None:
        os.write(rep_fd, (json.dumps(msg) + "\n").encode())

    # A Ctrl-C or a scheduler's SIGTERM to the launcher's process group is the launcher's to
    # act on: the server stays to report its children's exits, and goes when the launcher
    # closes its pipe (or dies). Children ignore SIGINT as every process of the job does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A module that asks torch whether CUDA is there must not initialise CUDA here: a child
    # forked after that cannot use its GPU. torch's NVML-based check does not (the children
    # get the job's own environment back).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import failure: the launcher starts processes itself
            reply({"error": f"cannot import {name}: {exc!r}"})
            return None
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():
        reply({"error": f"importing {', '.join(modules)} initialised CUDA, which no fork can use"})
        return None
    gc.collect()
    gc.freeze()  # the children share these pages instead of touching them in collections
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    reply({"ready": True})
    buf = b""
    while True:
        try:
            readable, _, _ = select.select([req_fd, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(reply)
        if req_fd in readable:
            chunk = os.read(req_fd, 1 << 20)
            if not chunk:
                return None
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                if time.time() > request["deadline"]:  # the launcher gave up on it
                    reply({"id": request["id"], "pid": None})
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    for fd in (req_fd, rep_fd, wake_r, wake_w):
                        os.close(fd)
                    return dict(request)
                reply({"id": request["id"], "pid": pid})


def _reap(reply: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _run(request: dict[str, Any]) -> int:
    """In a forked child: become the job's process ``request`` describes and run it."""
    import runpy
    import traceback

    if request["log"]:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    argv = request["argv"]
    try:  # ps and top show the job's command, not the server's (before environ changes:
        from setproctitle import setproctitle  # the title may take over its memory)
    except ImportError:
        pass
    else:
        setproctitle(shlex.join(argv))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[0] = os.path.dirname(os.path.realpath(argv[1]))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        ours = (__file__, runpy.__file__, "<frozen runpy>")
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        return 1
    return 0


def main() -> int:
    request = _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
    if request is None:
        return 0
    return _run(request)


if __name__ == "__main__":
    sys.exit(main())
