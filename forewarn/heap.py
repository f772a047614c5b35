"""Keep the garbage collector off what a long-running process loaded once.

CPython's cyclic collector walks every tracked object of the generation it collects; a full
(generation 2) collection in a service that imported FastAPI, SQLAlchemy, pandas, LightGBM and
the risk model walks a few hundred thousand objects that live as long as the process: ~0.13 s
with the interpreter held, about once a control tick at 16,384 GPUs, stalling every request
behind it (``benchmarks/control.py``; measured with ``gc.callbacks``). :func:`settle` collects
once, then moves every object alive into the permanent generation (``gc.freeze``), so later
collections walk only what was made since. Called when the service has started, and when the
control loop (in the service's thread or in its own process) has loaded its model.
"""

from __future__ import annotations

import gc

__all__ = ["settle"]


def settle() -> int:
    """Collect, then freeze what survived; returns the objects frozen in all (so far)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
