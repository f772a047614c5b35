"""Xid events from the kernel log: ``/dev/kmsg``, or a log file such as a journal export.

The NVIDIA driver writes every Xid to the kernel log::

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.

This source follows the log without blocking and turns each such line into an ``xid`` event
for the GPU whose PCI bus id it names (the map comes from the NVML or dcgm-exporter source;
an unknown bus id gives a node-wide event that still names the bus in its message). It sees
Xids even when NVML itself no longer answers, which is when they matter most.

Formats understood: ``/dev/kmsg`` records (``6,1234,5678901,-;NVRM: ...``, timestamp in µs
since boot), ``dmesg`` lines (``[ 5678.901234] NVRM: ...``) and syslog/journal lines
(``Dec  2 17:00:00 host kernel: NVRM: ...``), whose own time is not trusted: they are stamped
with the read time. ``/dev/kmsg`` is read from the start of the ring buffer so an agent
restart re-sends the same events with the same timestamps (the service keeps them once);
a plain file is followed from its end, across rotation and truncation.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TextIO

from collector.base import Reading
from collector.nvml import normalise_bus_id
from collector.xid import describe
from forewarn.errors import SourceUnavailable
from forewarn.wire import Event, EventKind

__all__ = ["KernelLogSource", "XidLine", "parse_line"]

XID_RE = re.compile(
    r"NVRM: Xid \(PCI:(?P<bus>[0-9a-fA-F]{2,8}:[0-9a-fA-F]{2}(?::[0-9a-fA-F]{2})?(?:\.\d)?)\):"
    r"\s*(?P<code>\d+)\s*,?\s*(?P<detail>.*)$"
)
KMSG_RE = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<msg>.*)$")


@dataclass(frozen=True)
class XidLine:
    bus_id: str
    code: int
    detail: str
    boot_usec: int | None = None
    """Microseconds since boot (``/dev/kmsg`` records only)."""


def parse_line(line: str) -> XidLine | None:
    """The Xid of one log line, or None if the line is not an Xid report."""
    boot_usec = None
    m = KMSG_RE.match(line)
    if m is not None:
        boot_usec, line = int(m["usec"]), m["msg"]
    x = XID_RE.search(line.rstrip("\n"))
    if x is None:
        return None
    code = int(x["code"])
    if code > 1023:
        return None
    return XidLine(normalise_bus_id(x["bus"]), code, x["detail"].strip(), boot_usec)


def _boot_time(now: Callable[[], float] = time.time) -> datetime:
    return datetime.fromtimestamp(now() - time.clock_gettime(time.CLOCK_MONOTONIC), UTC)


class KernelLogSource:
    """Follows ``path`` (``/dev/kmsg`` or a log file) and reports Xid events.

    Args:
        node: this node's name.
        path: ``/dev/kmsg`` or a text log file.
        bus_ids: PCI bus id (``0000:3b:00``, any case or form) -> GPU index; a callable is
            asked again on each read (the map may arrive after this source starts).
        from_start: read a plain file from its beginning (default: only new lines).

    Raises:
        SourceUnavailable: the path cannot be opened (``/dev/kmsg`` needs root or
            CAP_SYSLOG when ``kernel.dmesg_restrict`` is set).
    """

    name = "kmsg"

    def __init__(
        self,
        node: str,
        path: str | os.PathLike[str] = "/dev/kmsg",
        *,
        bus_ids: Mapping[str, int] | Callable[[], Mapping[str, int]] | None = None,
        from_start: bool = False,
        max_lines_per_read: int = 10_000,
    ) -> None:
        self.node = node
        self.path = Path(path)
        self._bus_ids = bus_ids or {}
        self.max_lines = max_lines_per_read
        self.kmsg = self.path.as_posix() == "/dev/kmsg" or self.path.is_char_device()
        self._boot = _boot_time()
        self._fd: int | None = None
        self._fh: TextIO | None = None
        self._inode: int | None = None
        self._partial = ""
        self._open(from_start=from_start)

    def _open(self, *, from_start: bool) -> None:
        try:
            if self.kmsg:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            else:
                self._fh = open(self.path, encoding="utf-8", errors="replace")  # noqa: SIM115
                st = os.fstat(self._fh.fileno())
                self._inode = st.st_ino
                if not from_start:
                    self._fh.seek(0, os.SEEK_END)
        except OSError as exc:
            raise SourceUnavailable(
                f"kernel log {self.path}: {exc.strerror or exc} "
                "(/dev/kmsg needs root or CAP_SYSLOG; or pass --kernel-log FILE)"
            ) from None

    def _map(self) -> Mapping[str, int]:
        return self._bus_ids() if callable(self._bus_ids) else self._bus_ids

    def _lines(self) -> Iterable[str]:
        if self._fd is not None:
            for _ in range(self.max_lines):
                try:
                    record = os.read(self._fd, 8192)
                except BlockingIOError:
                    return
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # overwritten in the ring buffer: go on
                        continue
                    raise
                if not record:
                    return
                yield record.decode("utf-8", errors="replace")
            return
        assert self._fh is not None
        self._reopen_if_rotated()
        chunk = self._partial + self._fh.read()
        lines = chunk.split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for its end
        yield from lines[: self.max_lines]

    def _reopen_if_rotated(self) -> None:
        assert self._fh is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return  # between rotation and the new file: keep the old handle
        if st.st_ino != self._inode:
            self._fh.close()
            self._partial = ""
            self._open(from_start=True)
        elif st.st_size < self._fh.tell():  # truncated in place
            self._fh.seek(0)
            self._partial = ""

    def read(self, now: datetime) -> list[Reading]:
        out: list[Reading] = []
        bus_map = {normalise_bus_id(k): v for k, v in self._map().items()}
        for line in self._lines():
            x = parse_line(line)
            if x is None:
                continue
            ts = now
            if x.boot_usec is not None:
                ts = min(now, self._boot + timedelta(microseconds=x.boot_usec))
            gpu = bus_map.get(x.bus_id)
            detail = x.detail if gpu is not None else f"PCI {x.bus_id}: {x.detail}"
            out.append(
                Event(
                    node=self.node,
                    gpu=gpu,
                    ts=ts,
                    kind=EventKind.XID,
                    xid=x.code,
                    message=describe(x.code, detail),
                    source="kmsg",
                )
            )
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
