"""The counts ingest decides the fleet caps by (``FOREWARN_MAX_FLEET_GPUS``,
``FOREWARN_MAX_GPUS_PER_TOKEN``; :func:`api.ingest._admit_new_gpus`)."""

from __future__ import annotations

__all__ = ["CAP_COUNTS_FRESH_S", "CAP_MARGIN", "CapCounts", "margin", "near"]

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
    grow to the fleet's size per batch, quadratic in all, and held ingest's p99 at 3-7 s for
    the first 20 s on PostgreSQL. Away from a cap, a count at most :data:`CAP_COUNTS_FRESH_S`
    old plus what this replica admitted since decides as well, for at most a margin's worth of
    GPUs (:func:`margin`); near a cap, or past that many, the database counts. So the GPUs
    admitted on counts other replicas have not seen are at most a margin per replica (per
    process: a replica with ``--workers`` has one each): a token sprayed over N such processes
    passes a cap by at most (N - 1) margins. (Between the check and the batch's commit other
    replicas may admit GPUs too: the caps were never transactional, a bound against a runaway
    collector, not an exact quota.)
    """

    def __init__(self) -> None:
        # (count as read, when, GPUs this replica admitted since)
        self.fleet: tuple[int, float, int] | None = None
        self.charged: dict[str, tuple[int, float, int]] = {}

    def fresh(
        self, who: str, now: float, *, fleet_cap: int, token_cap: int
    ) -> tuple[int, int] | None:
        """(fleet, charged to ``who``) counting this replica's admissions since they were read,
        if both were read within the freshness window and neither has had a margin's worth
        admitted since."""
        charged = self.charged.get(who)
        if self.fleet is None or charged is None:
            return None
        if now - min(self.fleet[1], charged[1]) > CAP_COUNTS_FRESH_S:
            return None
        if self.fleet[2] >= margin(fleet_cap) or charged[2] >= margin(token_cap):
            return None
        return self.fleet[0] + self.fleet[2], charged[0] + charged[2]

    def counted(self, who: str, fleet: int, charged: int, now: float) -> None:
        self.fleet = (fleet, now, 0)
        self.charged[who] = (charged, now, 0)
        if len(self.charged) > 10_000:  # tokens seen long ago: counted afresh when they return
            self.charged = {k: v for k, v in self.charged.items() if now - v[1] <= 60.0}

    def admitted(self, who: str, gpus: int) -> None:
        if self.fleet is not None:
            self.fleet = (*self.fleet[:2], self.fleet[2] + gpus)
        if who in self.charged:
            count, at, since = self.charged[who]
            self.charged[who] = (count, at, since + gpus)


def margin(cap: int) -> int:
    """How close to ``cap`` a batch is decided on fresh counts (1 % of it, at least 64)."""
    return max(CAP_MARGIN, cap // 100)


def near(count: int, cap: int) -> bool:
    """Whether ``count`` GPUs come within the margin of ``cap``."""
    return count > cap - margin(cap)
