"""The one contract every telemetry source keeps.

A source is anything that can be asked, at an instant, for the latest readings of the GPUs it
watches: NVML, AMD SMI, a kernel log, a dcgm-exporter endpoint or the fleet simulator. The
sampling loop (not the source) owns the clock and the rate; a source only answers ``read``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Protocol, runtime_checkable

from forewarn.wire import Event, GpuSample

__all__ = ["Reading", "Source"]

Reading = GpuSample | Event


@runtime_checkable
class Source(Protocol):
    """A telemetry source.

    ``read(now)`` returns the samples taken at ``now`` and every event seen since the previous
    call. It must not block for longer than a fraction of the sampling interval, must not raise
    for one GPU's failure (a lost GPU becomes a ``gpu_lost`` event and the others still
    answer), and raises :class:`forewarn.errors.SourceUnavailable` only when nothing at all can
    be read. ``close()`` releases handles; it is safe to call twice.
    """

    name: str

    def read(self, now: datetime) -> Iterable[Reading]: ...

    def close(self) -> None: ...
