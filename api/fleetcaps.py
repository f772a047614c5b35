"""The counts ingest decides the fleet caps by (``FOREWARN_MAX_FLEET_GPUS``,
``FOREWARN_MAX_GPUS_PER_TOKEN``; :func:`api.ingest._admit_new_gpus`)."""

from __future__ import annotations

__all__ = ["CAP_COUNTS_FRESH_S", "CAP_MARGIN", "CapCounts", "near"]

CAP_COUNTS_FRESH_S = 1.0
"""How long a replica decides a batch's new GPUs against the fleet's and a token's GPU counts
it read (plus the GPUs it admitted since) before it counts in the database again."""
CAP_MARGIN = 64
"""A batch whose new GPUs come within this many (or 1 % of the cap, if more) of a cap is always
decided on counts read afresh."""


class CapCounts:
    """The GPU counts the fleet caps are decided on, as one replica last read them.

    Counting in the database for every batch that brings new GPUs cost a fleet coming up (a
    service restarted under 16,384 reporting GPUs: every batch new) two counts of tables that
    grow to the fleet's size per batch, quadratic in all, and held ingest's p99 at 6-7 s for
    the first 20 s on PostgreSQL. Away from a cap, a count at most :data:`CAP_COUNTS_FRESH_S`
    old plus what this replica admitted since decides as well; near one, the database counts.
    (Between the check and the batch's commit other replicas may admit GPUs too: the caps were
    never transactional, a bound against a runaway collector, not an exact quota.)
    """

    def __init__(self) -> None:
        self.fleet: tuple[int, float] | None = None
        self.charged: dict[str, tuple[int, float]] = {}

    def fresh(self, who: str, now: float) -> tuple[int, int] | None:
        """(fleet, charged to ``who``) if both were counted within the freshness window."""
        charged = self.charged.get(who)
        if self.fleet is None or charged is None:
            return None
        if now - min(self.fleet[1], charged[1]) > CAP_COUNTS_FRESH_S:
            return None
        return self.fleet[0], charged[0]

    def counted(self, who: str, fleet: int, charged: int, now: float) -> None:
        self.fleet = (fleet, now)
        self.charged[who] = (charged, now)
        if len(self.charged) > 10_000:  # tokens seen long ago: counted afresh when they return
            self.charged = {k: v for k, v in self.charged.items() if now - v[1] <= 60.0}

    def admitted(self, who: str, gpus: int) -> None:
        if self.fleet is not None:
            self.fleet = (self.fleet[0] + gpus, self.fleet[1])
        if who in self.charged:
            count, at = self.charged[who]
            self.charged[who] = (count + gpus, at)


def near(count: int, cap: int) -> bool:
    """Whether ``count`` GPUs come within the margin of ``cap``."""
    return count > cap - max(CAP_MARGIN, cap // 100)
