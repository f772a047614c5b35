"""The wire schema: what collectors send, what the service stores, what jobs receive.

Both sides of every connection import this one module — the node collector, the service and
the in-job migrator — so it depends on pydantic alone. Field names carry their unit
(``_c`` degrees Celsius, ``_w`` watts, ``_mhz``, ``_mib``, ``_pct``); counters are cumulative
as the hardware reports them (they may reset to zero on a driver reload or reboot); ``None``
means "this GPU or source does not report it", never zero. ``docs/telemetry.md`` lists every
field with its source API.

Timestamps are absolute: on the wire, ISO 8601 strings with an offset (``Z``) or Unix seconds;
a naive timestamp is refused. In the store they are integer milliseconds since the epoch, UTC
(``ts_ms``).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "COUNTER_FIELDS",
    "SAMPLE_FIELDS",
    "SCHEMA_VERSION",
    "AgentStatus",
    "Event",
    "EventKind",
    "GpuSample",
    "IngestBatch",
    "IngestResult",
    "JobHeartbeat",
    "JobRegistration",
    "MigrationCommand",
    "MigrationProgress",
    "MigrationReason",
    "MigrationReport",
    "Placement",
    "RankTimings",
    "RowError",
    "Vendor",
    "sample_columns",
    "to_ms",
]

SCHEMA_VERSION = 1
"""Bumped on any change a reader of the previous version would misread."""

# Upper bound of any hardware counter we accept. Real counters are 32- or 64-bit, but a value
# past 2**48 (2.8e14) errors has never been a real reading: it is a corrupted register or a
# collector bug, and storing it would poison every delta computed from it.
MAX_COUNTER = 2**48

# Bounds of the job-side integers: far past any real job, and inside a signed 64-bit column.
MAX_RANK = 2**20 - 1
MAX_INT = 2**62


# A timestamp must say where it is: ISO 8601 with an offset ("Z" or "+00:00") or Unix seconds
# (read as UTC). A naive time is refused rather than guessed, and no per-row Python validator
# runs (it would cost a tenth of the ingest path).
UtcDatetime = AwareDatetime
Counter = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
Celsius = Annotated[float, Field(ge=-60.0, le=250.0, allow_inf_nan=False)]
Percent = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0.0, le=86400.0, allow_inf_nan=False)]
# At least one character that is not a dot: "." and ".." cannot be read back by URL.
Name = Annotated[
    str,
    Field(
        min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._:-]*[A-Za-z0-9_:-][A-Za-z0-9._:-]*$"
    ),
]


def to_ms(ts: datetime) -> int:
    """Milliseconds since the Unix epoch of an aware datetime (the store's time unit)."""
    return int(ts.timestamp() * 1000)


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"


class _Wire(BaseModel):
    # Unknown fields are refused: a typo in a collector must not silently drop a signal.
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuSample(_Wire):
    """One reading of one GPU at one instant."""

    node: Name = Field(description="Host name of the GPU node.")
    gpu: int = Field(ge=0, le=255, description="GPU index on the node (NVML/AMD SMI order).")
    ts: UtcDatetime = Field(description="When the reading was taken (UTC).")
    uuid: str | None = Field(default=None, max_length=96, description="GPU UUID.")
    vendor: Vendor = Vendor.NVIDIA

    # Thermals, power, clocks, load.
    temp_gpu_c: Celsius | None = Field(default=None, description="Die/edge temperature, °C.")
    temp_mem_c: Celsius | None = Field(default=None, description="Memory (HBM) temperature, °C.")
    power_w: float | None = Field(default=None, ge=0, le=5000, allow_inf_nan=False)
    sm_clock_mhz: float | None = Field(default=None, ge=0, le=10000, allow_inf_nan=False)
    mem_clock_mhz: float | None = Field(default=None, ge=0, le=20000, allow_inf_nan=False)
    throttle_reasons: int | None = Field(
        default=None, ge=0, le=2**53 - 1, description="Clock-event reasons bitmask (NVML)."
    )
    util_gpu_pct: Percent | None = None
    util_mem_pct: Percent | None = None
    mem_used_mib: float | None = Field(default=None, ge=0, le=2**24, allow_inf_nan=False)
    mem_total_mib: float | None = Field(default=None, ge=0, le=2**24, allow_inf_nan=False)

    # Memory errors (cumulative counts).
    ecc_sbe_volatile: Counter | None = Field(default=None, description="Corrected, since boot.")
    ecc_dbe_volatile: Counter | None = Field(default=None, description="Uncorrected, since boot.")
    ecc_sbe_aggregate: Counter | None = Field(default=None, description="Corrected, lifetime.")
    ecc_dbe_aggregate: Counter | None = Field(default=None, description="Uncorrected, lifetime.")
    ecc_deferred: Counter | None = Field(default=None, description="AMD deferred errors.")
    retired_pages_sbe: Counter | None = Field(default=None, description="Pre-Ampere.")
    retired_pages_dbe: Counter | None = Field(default=None, description="Pre-Ampere.")
    retired_pages_pending: bool | None = None
    remap_correctable: Counter | None = Field(default=None, description="Ampere+ rows remapped.")
    remap_uncorrectable: Counter | None = None
    remap_pending: bool | None = Field(default=None, description="A remap awaits a GPU reset.")
    remap_failure: bool | None = Field(default=None, description="No spare row was left.")

    # Interconnect (totals over all links; XGMI on AMD).
    nvlink_crc_flit: Counter | None = None
    nvlink_crc_data: Counter | None = None
    nvlink_replay: Counter | None = None
    nvlink_recovery: Counter | None = None
    pcie_replay: Counter | None = None
    pcie_link_width: int | None = Field(default=None, ge=0, le=64, description="Lanes now.")
    pcie_link_width_max: int | None = Field(default=None, ge=0, le=64)
    pcie_link_gen: int | None = Field(default=None, ge=0, le=10)


SAMPLE_FIELDS: tuple[str, ...] = tuple(GpuSample.model_fields)
"""Every sample column, in schema order."""

COUNTER_FIELDS: tuple[str, ...] = (
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "ecc_sbe_aggregate",
    "ecc_dbe_aggregate",
    "ecc_deferred",
    "retired_pages_sbe",
    "retired_pages_dbe",
    "remap_correctable",
    "remap_uncorrectable",
    "nvlink_crc_flit",
    "nvlink_crc_data",
    "nvlink_replay",
    "nvlink_recovery",
    "pcie_replay",
)
"""Cumulative counters: features take their deltas and must survive resets."""


class EventKind(StrEnum):
    XID = "xid"
    ECC_STORM = "ecc_storm"
    GPU_LOST = "gpu_lost"
    GPU_RECOVERED = "gpu_recovered"
    COUNTER_RESET = "counter_reset"
    THERMAL_SHUTDOWN = "thermal_shutdown"
    LINK_DOWN = "link_down"
    POWER_LOSS = "power_loss"
    TELEMETRY_STALLED = "telemetry_stalled"


class Event(_Wire):
    """Something that happened at an instant: an Xid, a lost GPU, a reset."""

    node: Name
    gpu: int | None = Field(default=None, ge=0, le=255, description="None: the whole node.")
    ts: UtcDatetime
    kind: EventKind
    xid: int | None = Field(default=None, ge=0, le=1023, description="Xid code, for kind=xid.")
    message: str | None = Field(default=None, max_length=2000)
    source: str | None = Field(default=None, max_length=64, description="nvml, kmsg, dcgm, …")


class AgentStatus(_Wire):
    """The collector's own health, sent with every batch (a batch with no rows is a heartbeat)."""

    agent_id: str = Field(min_length=1, max_length=128)
    source: str = Field(max_length=64)
    version: str = Field(default="", max_length=32)
    started_at: UtcDatetime | None = None
    sent_total: Counter = 0
    spooled: Counter = 0
    dropped_total: Counter = 0
    interval_s: float | None = Field(default=None, gt=0, le=3600, allow_inf_nan=False)


class IngestBatch(BaseModel):
    """``POST /v1/ingest`` body: the samples and events of one node.

    The envelope is strict; rows are validated one by one so that one bad row does not cost
    the good ones beside it.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    node: Name
    samples: list[Any] = Field(default_factory=list, max_length=100_000)
    events: list[Any] = Field(default_factory=list, max_length=100_000)
    agent: AgentStatus | None = None
    sample_columns: dict[str, list[Any]] | None = Field(
        default=None,
        description=(
            "The samples as columns instead of rows (not both): one list per GpuSample field, "
            "all the same length, `ts_ms` (integer ms since the epoch, UTC) in place of `ts`, "
            "`null` for a field not reported, the node implied by the batch."
        ),
    )


def sample_columns(rows: list[dict[str, Any]], node: str) -> dict[str, list[Any]] | None:
    """The ``sample_columns`` of a batch from wire-shaped sample dicts, or None if they don't fit.

    Columns are what the service decodes fastest and a third the size of rows. Rows that are
    not plainly a sample of ``node`` (another node, an unknown field, a timestamp that is not
    ISO 8601 with an offset) give None: send them as rows, and the service says what is wrong.
    """
    if not rows:
        return None
    known = set(SAMPLE_FIELDS)
    present: set[str] = set()
    ts_ms = []
    for row in rows:
        present.update(row)
        ts = row.get("ts")
        if row.get("node") != node or not isinstance(ts, str):
            return None
        try:
            parsed = datetime.fromisoformat(ts)
        except ValueError:
            return None
        if parsed.tzinfo is None:
            return None
        ts_ms.append(to_ms(parsed))
    if not present <= known or "gpu" not in present:
        return None
    columns: dict[str, list[Any]] = {"ts_ms": ts_ms}
    for name in SAMPLE_FIELDS:
        if name in present and name not in ("node", "ts"):
            columns[name] = [row.get(name) for row in rows]
    return columns


class RowError(BaseModel):
    kind: Literal["sample", "event"]
    index: int
    reason: str


class IngestResult(BaseModel):
    stored_samples: int
    duplicate_samples: int
    stored_events: int
    duplicate_events: int
    rejected: list[RowError]


class MigrationReason(StrEnum):
    PREVENTIVE = "preventive"
    PLANNED = "planned"
    UNPLANNED = "unplanned"


class Placement(_Wire):
    rank: int = Field(ge=0, le=MAX_RANK)
    node: Name
    gpu: int | None = Field(default=None, ge=0, le=255)
    pid: int | None = Field(default=None, ge=0, le=2**31 - 1)
    role: Literal["active", "spare", "retired"] = "active"
    """``retired``: no longer serves the job (the source of a completed migration)."""
    slot: int | None = Field(
        default=None, ge=0, le=MAX_RANK, description="The agent's process slot."
    )
    uuid: str | None = Field(default=None, max_length=96, description="GPU UUID, if known.")


class JobRegistration(_Wire):
    """What a job agent tells the service when a job starts or its placement changes."""

    job_id: Name
    world_size: int = Field(ge=1, le=MAX_RANK + 1)
    spares: int = Field(ge=0, le=MAX_RANK + 1)
    placement: list[Placement]
    agent_url: str | None = Field(
        default=None, max_length=2048, description="Where commands may be pushed."
    )


class MigrationCommand(_Wire):
    """Move ``rank`` of ``job_id`` to a spare at the next step boundary."""

    migration_id: str = Field(min_length=1, max_length=64)
    job_id: Name
    rank: int = Field(ge=0, le=MAX_RANK)
    reason: MigrationReason
    requested_at: UtcDatetime
    detail: str | None = Field(default=None, max_length=2000)
    trigger: str | None = Field(
        default=None,
        max_length=32,
        description="preventive, planned, unplanned, manual or straggler.",
    )
    target: Placement | None = Field(
        default=None, description="The spare the service chose (its ``slot``); None: any."
    )


class MigrationProgress(_Wire):
    """A job agent's report of one transition of a migration it was commanded to make."""

    migration_id: str = Field(min_length=1, max_length=64)
    job_id: Name
    state: Literal["acknowledged", "transferring", "failed"]
    step: int | None = Field(
        default=None, ge=0, le=MAX_INT, description="The handover step boundary, if known."
    )
    error: str | None = Field(default=None, max_length=2000)


class RankTimings(_Wire):
    """Each active rank's step timing, as the job wrapper measured it: medians over its last steps.

    Under data parallelism the all-reduce makes every rank's step take the same wall time, so a
    slow rank cannot be told from step times: it shows in ``compute_s`` (from the step's start
    to the rank's arrival at the step's first collective) and its peers show it in ``wait_s``
    (from their arrival to that collective's end). Columns, one entry per active rank, so that
    the heartbeat of a 16,384-rank job stays well inside the request size limit.
    """

    window: int = Field(ge=1, le=100_000, description="Steps each median is taken over.")
    step: int = Field(ge=0, le=MAX_INT, description="The newest step measured.")
    total_steps: int | None = Field(
        default=None, ge=0, le=MAX_INT, description="Steps the job runs in all; None: unknown."
    )
    rank: list[Annotated[int, Field(ge=0, le=MAX_RANK)]] = Field(max_length=MAX_RANK + 1)
    compute_s: list[Seconds] = Field(max_length=MAX_RANK + 1)
    wait_s: list[Seconds] = Field(max_length=MAX_RANK + 1)
    step_s: list[Seconds] = Field(max_length=MAX_RANK + 1)

    @model_validator(mode="after")
    def _one_row_per_rank(self) -> RankTimings:
        n = len(self.rank)
        if not len(self.compute_s) == len(self.wait_s) == len(self.step_s) == n:
            raise ValueError("rank, compute_s, wait_s and step_s must have the same length")
        if len(set(self.rank)) != n:
            raise ValueError("a rank appears more than once")
        return self


class JobHeartbeat(_Wire):
    """A job agent's periodic sign of life."""

    status: str = Field(
        max_length=32, description="starting, running, paused, stopping, completed, failed, stopped"
    )
    generation: int = Field(default=0, ge=0, le=MAX_INT)
    message: str | None = Field(default=None, max_length=2000)
    timings: RankTimings | None = Field(
        default=None, description="The active ranks' step timing; None: not measured yet."
    )


class MigrationReport(_Wire):
    """What the job agent reports back when a migration ends."""

    migration_id: str = Field(min_length=1, max_length=64)
    job_id: Name
    rank: int = Field(ge=0, le=MAX_RANK)
    outcome: Literal["completed", "failed", "cancelled"]
    step: int | None = Field(
        default=None, ge=0, le=MAX_INT, description="Training resumed at step+1."
    )
    source: Placement | None = None
    target: Placement | None = None
    pause_s: float | None = Field(default=None, ge=0)
    transfer_s: float | None = Field(default=None, ge=0)
    bytes_moved: int | None = Field(default=None, ge=0, le=MAX_INT)
    steps_lost: int = Field(default=0, ge=0, le=MAX_INT)
    error: str | None = None
    finished_at: UtcDatetime
