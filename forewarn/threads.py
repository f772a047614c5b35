"""Store work of the background tasks, run in a thread and never abandoned half done.

``asyncio.to_thread`` returns at once when its caller is cancelled, while the thread goes on
using the store. The service's shutdown cancels its background tasks and then closes the
store: a thread still holding a connection then loses it to garbage collection, open (and a
leader's lock with it). :func:`to_thread_to_end` is ``to_thread`` whose cancelled caller first
waits for the thread's call to end, then is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["to_thread_to_end"]

T = TypeVar("T")


async def to_thread_to_end(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a thread; if cancelled, wait for it to finish first."""
    call = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await call
        raise
