"""Step timing: each rank's compute before the step's first collective and its wait inside it.

Under synchronous data parallelism the all-reduce makes every rank's step take the same wall
time, so a slow rank (a throttled GPU) cannot be named from step times. It shows in what the
wrapper measures around the step's first collective:

- ``compute_s``: from the step's start (``with step:`` entering) to this rank's arrival at the
  step's first collective (DDP's first gradient bucket, or the first :meth:`Job.all_reduce`);
- ``wait_s``: from that arrival until that collective completed (the slowest rank's lateness);
  under DDP until the backward's collectives completed (every bucket's all-reduce);
- ``step_s``: the step's wall time.

The slow rank has the largest ``compute_s`` and the smallest ``wait_s``; its peers wait for it.

Rank side, a :class:`StepClock` keeps this rank's last ``window`` rows; the job writes them at
each step boundary in the same key-value store round trip as its state mirror (``t/{r}``,
:func:`encode`). Agent side, :func:`summarize` reads those blobs into one
:class:`forewarn.wire.RankTimings` of medians, rank by rank. A blob written by a slot that no
longer holds the rank (the source of a migration) is ignored: the new rank starts fresh.
"""

from __future__ import annotations

import statistics
import struct
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from forewarn.wire import RankTimings
from migrator.protocol import timing_key

__all__ = ["DEFAULT_WINDOW", "StepClock", "decode", "encode", "summarize", "timing_key"]

DEFAULT_WINDOW = 20
"""Steps each median is taken over (``FOREWARN_TIMING_WINDOW``, ``--timing-window``)."""

Row = tuple[float, float, float, float]
"""(step, compute_s, wait_s, step_s)"""

_HEAD = struct.Struct("=2d")  # slot, total steps (-1: unknown)
_ROW = struct.Struct("=4d")


class StepClock:
    """This rank's step timing, kept over its last ``window`` steps.

    The step calls :meth:`begin` and :meth:`end`; the first collective of the step calls
    :meth:`arrive` (True for the first of the step) and, for that one, :meth:`completed` when
    it finished (under DDP both at the end of the backward, the arrival with the time noted
    when the first bucket was ready). A step with no collective (FSDP's own all-gathers are
    not timed) leaves no row.

    Args:
        window: how many steps to keep.
        clock: seconds, monotonic (default ``time.perf_counter``).
    """

    def __init__(
        self, window: int = DEFAULT_WINDOW, clock: Callable[[], float] = time.perf_counter
    ):
        if window < 1:
            raise ValueError(f"timing window {window} must be at least 1 step")
        self.window = window
        self.clock = clock
        self._rows: deque[bytes] = deque(maxlen=window)  # each row packed once, when taken
        self.total: int | None = None  # steps the job runs in all (Job.steps)
        self.fresh = False  # a row was added since the last take()
        self.begun = 0  # steps begun: tells one step's callbacks from the next's
        self._start = 0.0
        self._arrived: float | None = None
        self._done: float | None = None

    def begin(self) -> None:
        self.begun += 1
        self._start = self.clock()
        self._arrived = self._done = None

    def arrive(self, at: float | None = None) -> bool:
        """This rank reached a collective (now, or ``at``, a reading of :attr:`clock`); True
        when it is the step's first."""
        if self._arrived is not None:
            return False
        self._arrived = self.clock() if at is None else at
        return True

    def completed(self) -> None:
        """The step's first collective finished."""
        if self._done is None:
            self._done = self.clock()

    def end(self, step: int) -> None:
        """The step's body finished: keep its row (if a collective was timed)."""
        arrived, done = self._arrived, self._done
        if arrived is None or done is None:
            return
        now = self.clock()
        start = self._start
        self._rows.append(_ROW.pack(step, arrived - start, max(0.0, done - arrived), now - start))
        self.fresh = True

    @property
    def rows(self) -> list[Row]:
        """The kept rows, oldest first."""
        return [_ROW.unpack(r) for r in self._rows]

    def take(self, slot: int) -> bytes | None:
        """This rank's rows, encoded for the key-value store, if any came since the last take."""
        if not self.fresh:
            return None
        self.fresh = False
        total = -1.0 if self.total is None else float(self.total)
        return _HEAD.pack(slot, total) + b"".join(self._rows)


def encode(slot: int, total: int | None, rows: Any) -> bytes:
    """``slot``, ``total`` (-1: unknown) and the rows as float64s (20 rows: 656 bytes)."""
    head = _HEAD.pack(slot, -1.0 if total is None else float(total))
    return head + b"".join(_ROW.pack(*row) for row in rows)


def decode(blob: bytes) -> tuple[int, int | None, list[Row]]:
    """(slot, total, rows) of an :func:`encode` blob; (-1, None, []) for an empty one."""
    if len(blob) < 16 or len(blob) % 32 != 16:
        return -1, None, []
    flat = array("d")
    flat.frombytes(blob)
    total = int(flat[1])
    rows = [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(2, len(flat), 4)]
    return int(flat[0]), None if total < 0 else total, rows


def summarize(
    blobs: Mapping[int, bytes], roster: Mapping[int, int], *, window: int = DEFAULT_WINDOW
) -> RankTimings | None:
    """Medians over each active rank's last ``window`` steps, as the heartbeat carries them.

    Args:
        blobs: rank -> its ``t/{r}`` blob (:func:`encode`).
        roster: rank -> the slot holding it now; a blob from another slot (the rank's
            previous holder) is ignored, so a moved rank starts fresh.
        window: steps each median is taken over (the newest ones).

    Returns:
        The ranks with at least one measured step, in rank order; None when none has.
    """
    ranks: list[int] = []
    compute: list[float] = []
    wait: list[float] = []
    step_s: list[float] = []
    newest = -1
    total: int | None = None
    for rank in sorted(roster):
        blob = blobs.get(rank)
        if not blob:
            continue
        slot, rank_total, rows = decode(blob)
        if slot != roster[rank] or not rows:
            continue
        rows = rows[-window:]
        ranks.append(rank)
        compute.append(statistics.median(r[1] for r in rows))
        wait.append(statistics.median(r[2] for r in rows))
        step_s.append(statistics.median(r[3] for r in rows))
        newest = max(newest, int(rows[-1][0]))
        total = rank_total if rank_total is not None else total
    if not ranks:
        return None
    return RankTimings(
        window=window,
        step=newest,
        total_steps=total,
        rank=ranks,
        compute_s=compute,
        wait_s=wait,
        step_s=step_s,
    )
