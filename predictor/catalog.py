"""Xid classes the features count, the Xids the rule baseline treats as fatal, and those
after which the control loop takes a GPU for failed.

The class of an Xid comes from the project's catalog (:mod:`collector.xid`, data shared with
the collector), renamed to short feature names: ``application`` -> ``app`` (13/31/43/45: the
job's own fault, never a hardware failure), ``interconnect`` -> ``nvlink``, ``firmware`` ->
``gsp``; ``memory``, ``bus``, ``thermal`` and ``other`` keep their names.
"""

from __future__ import annotations

from functools import lru_cache

from collector.xid import lookup

__all__ = ["FATAL_XIDS", "GPU_DOWN_XIDS", "XID_CLASSES", "xid_class"]

XID_CLASSES: tuple[str, ...] = ("app", "memory", "nvlink", "bus", "gsp", "thermal", "other")
"""Every class :func:`xid_class` returns, in feature order."""

_RENAME = {"application": "app", "interconnect": "nvlink", "firmware": "gsp"}

FATAL_XIDS: frozenset[int] = frozenset({48, 63, 64, 74, 79, 94, 95, 119, 120})
"""The Xids DCGM health watches and NVSentinel act on (the rule baseline's list)."""

GPU_DOWN_XIDS: frozenset[int] = FATAL_XIDS - {63}
"""The fatal Xids after which the GPU cannot go on running its job, so that the control loop
takes the GPU for failed (an unplanned migration). Xid 63 is not one: a row remap was
recorded, NVIDIA's catalog says IGNORE for it, and the GPU works on until its next reset. It
is a precursor of a memory failure, for the model and the rules, not the failure itself."""


@lru_cache(maxsize=1024)
def xid_class(code: int) -> str:
    """The feature class of an Xid code (``other`` for codes outside the catalog)."""
    name = str(lookup(int(code)).xid_class)
    return _RENAME.get(name, name)
