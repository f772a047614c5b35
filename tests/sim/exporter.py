"""``forewarn simulate --serve-dcgm-exporter`` as a test's context manager."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def stop(proc: subprocess.Popen[str]) -> None:
    """Terminate ``proc`` (kill it after 10 s) and close its output."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


@contextmanager
def served_exporter(*args: str) -> Iterator[str]:
    """Start ``forewarn simulate --serve-dcgm-exporter 0 ARGS`` and yield the ``/metrics``
    URL it prints first; the simulator is stopped on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "simulate", "--serve-dcgm-exporter", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"http://\S+/metrics", line)
        assert url, f"simulate printed {line!r}"
        yield url[0]
    finally:
        stop(proc)
