"""How a rank learns of a planned or preventive migration without a round trip per step.

A :class:`CommandWatcher` thread in each rank polls the agent's key-value store for the current
generation's command (``g{g}/cmd``) and, when one appears, raises a local flag and
acknowledges it with the last step boundary its rank passed (``m/{id}/ack/{rank}``). At
each step boundary the training loop reads only the flag: one attribute read on the common
path.

A planned or preventive move's command is first handed to ``on_command`` (the
:class:`~migrator.membership.Membership` starts forming generation g+1 with the spare in a
thread); when the spare is up, the flag is raised and acknowledged only once every member
of g+1 has formed it (``formed``), so S falls after the formation and the switch at S never
waits for it (a spare still starting is waited for at S, as the source always did).
Training goes on on g meanwhile; an abort (or a change of generation: a recovery) seen while
it forms drops the command (``on_abort``).

Why the handover step S is still the same on every rank: the watcher raises the flag
*before* it reads the boundary counter, and the loop bumps the counter *before* it reads the
flag. So once a rank's acknowledgement says "boundary b", its loop cannot pass another
boundary without seeing the flag. The agent waits for every rank's acknowledgement and sets
S = max(b) + 1 (every rank computes the same from the acknowledgements, and the agent
writes it to ``g{g}/stop/{id}``): no rank has passed S, and every rank that sees the flag
stops at its next boundary until S is known (:meth:`CommandWatcher.await_stop`). Ranks
stopped there are outside any collective, so they watch for the agent's suspicion of a
failure (``g{g}/suspect``) as well, and join the recovery from the boundary.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from migrator import protocol as P

__all__ = ["CommandWatcher", "ack_key", "handover_step"]

log = logging.getLogger(__name__)

POLL_S = 0.01
"""How often the watcher looks for a command (seconds): a command waits at most this long,
plus one step, before the ranks agree on S."""


class CommandWatcher:
    """Watches the key-value store for this rank's migration commands; see the module docstring.

    Args:
        kv: a client of the agent's key-value store (TCPStore operations are thread-safe).
        where: returns (generation, rank) of the process now; rank None: a spare.
        poll_s: seconds between two looks at the key-value store.
    """

    def __init__(
        self,
        kv: P.KVStore,
        where: Callable[[], tuple[int, int | None]],
        *,
        poll_s: float = POLL_S,
    ) -> None:
        self.kv = kv
        self.where = where
        self.poll_s = poll_s
        self.flag: P.Command | None = None
        # Called with each command when first seen; True: the next generation is being
        # formed ahead (the membership's thread), and the flag waits until ``formed`` says
        # every member of it is done. Neither may block.
        self.on_command: Callable[[P.Command], bool] | None = None
        self.formed: Callable[[P.Command], bool] = lambda cmd: True
        self.on_abort: Callable[[str], Any] | None = None
        self._forming: P.Command | None = None  # a command whose g+1 is being formed
        self.passed = -1  # the last step boundary the training loop passed (or stands at)
        self.ended: set[str] = set()  # migrations that were aborted
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="forewarn-commands", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def close(self) -> None:
        """Stop the thread and wait for it: a thread killed inside a key-value store call at
        interpreter exit aborts the process (C++ ``terminate``)."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Look for a command once (the thread does it every ``poll_s``; a caller that just
        posted one may do it at once)."""
        gen, rank = self.where()
        if rank is None or self.flag is not None:
            return
        forming = self._forming
        if forming is not None:
            self._check_forming(forming, gen)
            return
        try:
            if not self.kv.check([P.cmd_key(gen)]):
                return
            cmd: P.Command = P.get_json(self.kv, P.cmd_key(gen))
        except (
            RuntimeError,
            ValueError,
            OSError,
        ):  # deleted meanwhile, or the key-value store is gone
            return
        mid = cmd["migration_id"]
        if mid not in self.ended:
            cmd["gen"] = gen
            if self.on_command is not None and self.on_command(cmd):
                self._forming = cmd  # flagged once g+1 is formed: training goes on meanwhile
                return
            self._raise(cmd, rank)

    @property
    def idle(self) -> bool:
        """No command is being formed ahead (none seen, or it was dropped)."""
        return self._forming is None

    def _check_forming(self, cmd: P.Command, gen: int) -> None:
        """The command's g+1 is being formed: raise the flag once every member formed it;
        forget it when the move was aborted or the generation changed (a recovery)."""
        mid = cmd["migration_id"]
        try:
            if cmd["gen"] != gen or self.kv.check([P.MigrationKeys(mid).aborted]):
                self._forming = None
                self.ended.add(mid)
                if self.on_abort is not None:
                    self.on_abort(mid)
                return
            if not self.formed(cmd):
                return
        except (RuntimeError, OSError):  # the key-value store is gone
            return
        rank = self.where()[1]
        self._forming = None
        if rank is not None:
            self._raise(cmd, rank)

    def _raise(self, cmd: P.Command, rank: int) -> None:
        mid = cmd["migration_id"]
        self.flag = cmd  # first the flag ...
        passed = self.passed  # ... then the boundary counter (see the module docstring)
        try:
            self.kv.set(ack_key(mid, rank), str(passed))
        except (RuntimeError, OSError) as exc:
            log.warning("could not acknowledge migration %s: %s", mid, exc)

    def pending(self, gen: int) -> P.Command | None:
        """The command flagged for generation ``gen``, if any (a local read)."""
        flag = self.flag
        if flag is None:
            return None
        if flag["gen"] != gen:  # read just before this rank changed generation
            self.flag = None
            return None
        return flag

    def clear(self) -> None:
        self.flag = None
        self._forming = None

    def abort(self, migration_id: str) -> None:
        self.ended.add(migration_id)
        self.flag = None

    def await_stop(self, cmd: P.Command, *, world_size: int, timeout_s: float) -> str | int:
        """Wait for S (or an abort, a failure, a suspected lost peer).

        Every rank computes S itself from the acknowledgements (they never change once
        written, so all compute the same value) and the agent writes it too; so a busy agent
        does not hold the ranks up. Returns S, or the key that appeared:
        :attr:`MigrationKeys.aborted <protocol.MigrationKeys.aborted>`, ``.failed`` or
        :func:`protocol.suspect_key`.

        Raises:
            HandoverTimeout: nothing within ``timeout_s``.
        """
        gen, mid = cmd["gen"], cmd["migration_id"]
        m = P.MigrationKeys(mid)
        keys = [m.aborted, m.failed, P.suspect_key(gen)]
        deadline = time.monotonic() + timeout_s
        poll = P.POLL_S
        while True:
            for key in keys:
                if self.kv.check([key]):
                    return key
            step = handover_step(self.kv, mid, range(world_size))
            if step is not None:
                return step
            if time.monotonic() >= deadline:
                raise P.HandoverTimeout(f"waited {timeout_s:.1f} s for the handover step")
            time.sleep(poll)
            poll = min(poll * 1.5, 0.02)


def ack_key(migration_id: str, rank: int) -> str:
    """See :meth:`protocol.MigrationKeys.ack`."""
    return P.MigrationKeys(migration_id).ack(rank)


def handover_step(kv: P.KVStore, migration_id: str, ranks: range) -> int | None:
    """The agent's side: S = max(acknowledged boundary) + 1 once every rank acknowledged."""
    keys = [ack_key(migration_id, r) for r in ranks]
    if not all(kv.check([k]) for k in keys):
        return None
    return max(int(kv.get(k)) for k in keys) + 1
