"""Keep the garbage collector off what a long-running process loaded once.

CPython's cyclic collector walks every tracked object of the generation it collects; a full
(generation 2) collection in a service that imported FastAPI, SQLAlchemy, pandas, LightGBM and
the risk model walks a few hundred thousand objects that live as long as the process: ~0.13 s
with the interpreter held, about once a control tick at 16,384 GPUs, stalling every request
behind it (``benchmarks/control.py``; measured with ``gc.callbacks``). :func:`settle` collects
once, then moves every object alive into the permanent generation (``gc.freeze``), so later
collections walk only what was made since. Called when the service has started, and when the
control loop (in the service's thread or in its own process) has loaded its model.

:func:`keep_large_blocks` is for a process whose every cycle allocates and frees the same
large arrays (the control loop's own process).
"""

from __future__ import annotations

import ctypes
import gc
import logging

__all__ = ["keep_large_blocks", "settle"]

log = logging.getLogger("forewarn.heap")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1


def settle() -> int:
    """Collect, then freeze what survived; returns the objects frozen in all (so far)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def keep_large_blocks(limit: int = 1 << 30) -> bool:
    """Serve allocations of up to ``limit`` bytes from the heap and keep freed memory in it,
    for the allocator to hand out again; True where it applied (glibc's ``mallopt``). Call it
    before the process starts threads: every thread then allocates from the one heap (a
    thread's own arena maps every block above 64 MiB afresh whatever the threshold).

    glibc maps a fresh region for every block above its mmap threshold (at most 32 MiB) and
    unmaps it when freed, so each use faults in and zero-fills every page again: a control tick
    at 100,000 GPUs allocates its read (500,000 rows x 25 values, 100 MB), the fold's
    temporaries and the feature matrix (74 MB) anew every 5 s. Kept in the heap, the tick took
    3.26-3.82 s against 3.69-4.33 s (``benchmarks/control.py --part t --gpus 100000 --backend
    postgres``, its ticks in a thread as the control process runs them, runs in turn; with the
    threshold alone, no gain), at the same peak memory: the process's resident size then stays
    near its peak instead of falling back between ticks (flat over 30 ticks at 16,384 GPUs).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = all(
        mallopt(param, value)
        for param, value in (
            (_M_ARENA_MAX, 1),
            (_M_MMAP_THRESHOLD, min(limit, _INT_MAX)),
            (_M_TRIM_THRESHOLD, _INT_MAX),
        )
    )
    if not applied:
        log.warning("the allocator refused to keep large blocks; left as it was")
    return applied
