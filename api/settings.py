"""The service's one settings object (environment variables with the ``FOREWARN_`` prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from control.policy import Policy
from store.engine import default_data_dir, default_database_url
from store.tiers import TierPolicy

__all__ = ["SCOPES", "Scope", "Settings"]

Scope = Literal["ingest", "read", "operate", "admin"]
SCOPES: tuple[Scope, ...] = ("ingest", "read", "operate", "admin")

DEV_TOKEN = "forewarn-dev-token"
"""The single all-scope token of a development service started with no tokens configured."""


class Settings(BaseSettings):
    """Service configuration. Every field can be set as ``FOREWARN_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="FOREWARN_", extra="ignore")

    environment: Literal["development", "production"] = "development"
    """``production`` refuses development shortcuts (the built-in token, short tokens)."""

    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the SQLite database, models and spool files live (default ``./var``)."""

    database_url: str | None = None
    """SQLAlchemy URL; default a SQLite file in ``data_dir``. PostgreSQL: ``postgresql://…``."""

    tokens: dict[str, list[Scope]] = Field(default_factory=dict)
    """Bearer tokens and their scopes, as JSON: ``{"secret": ["ingest"], …}``."""

    development_token: bool = True
    """Accept ``forewarn-dev-token`` (every scope, from this machine only) while no token is
    configured in development. ``forewarn serve`` on an address that is not loopback turns it
    off: a service that listens on the network never accepts it."""

    metrics_require_token: bool = False
    """``/metrics`` answers only a token with the ``read`` scope. Without one (the default)
    it is open but leaves out every per-GPU series (node names and risks)."""

    metrics_max_gpu_series: int = Field(default=1000, ge=0)
    """Most ``forewarn_gpu_risk`` series one ``/metrics`` answer holds (the highest risks),
    served to a ``read`` token only."""

    ingest_token: str | None = None
    """Shorthand for one token with the ``ingest`` scope (what collectors use)."""

    read_token: str | None = None
    """Shorthand for one token with the ``read`` scope."""

    admin_token: str | None = None
    """Shorthand for one token with every scope."""

    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    """Largest ingest body accepted, after gzip decompression (larger: 413)."""

    max_request_body_bytes: int = Field(default=1024 * 1024, gt=0)
    """Largest body accepted by every route but ingest (larger: 413, counted as it arrives,
    after the token was checked)."""

    max_body_objects: int = Field(default=250_000, gt=0)
    """Most JSON objects and arrays one ingest body may hold (refused before parsing; bounds
    memory)."""

    max_batch_rows: int = Field(default=100_000, gt=0, le=100_000)
    """Most samples (and, apart, events) in one ingest batch."""

    max_fleet_gpus: int = Field(default=65_536, gt=0)
    """Most GPUs the fleet may hold: a batch that would add GPUs past it is refused (422
    ``fleet_limit``), so a stolen ingest token cannot grow the store and the scorer without
    bound."""

    max_gpus_per_token: int = Field(default=65_536, gt=0)
    """Most GPUs the batches sent with one token may add to the fleet (the same guard, per
    token), counted in the database: the same count on every replica (away from the caps a
    replica decides on a count at most a second old plus what it admitted since, for at most
    1 % of the cap, at least 64 GPUs; within that of a cap it counts afresh: a token sprayed
    over N service processes, replicas times workers, passes a cap by at most N - 1 such
    margins), and a GPU is charged once its batch has committed, so a batch refused with 503
    and sent again is charged once."""

    writer_process: bool = True
    """Insert through a child process (its own GIL) rather than a thread of the service, so
    that validation and the database insert run on two cores instead of taking turns on one:
    per ``sample_columns`` batch the service spends about as much CPU either way, split about
    evenly between the two processes (``benchmarks/ingest.py``, ``us/sample``). Applies to a
    database on file or a server; an in-memory SQLite database is written by a thread."""

    max_clock_skew_s: float = Field(default=300.0, ge=0)
    """Samples stamped further than this into the future are rejected."""

    max_sample_age_s: float = Field(default=14 * 86400.0, gt=0)
    """Samples older than this are rejected; so are samples of an hour that has left the raw
    window (``raw_window_h``), which the storage tiers have archived."""

    retention_days: float = Field(default=30.0, gt=0)
    """The Parquet history keeps raw samples this long (see ``docs/storage.md``)."""

    retention_interval_s: float = Field(default=600.0, gt=0)
    """How often the storage-tier task runs (roll-up, archive, retention)."""

    raw_window_h: float = Field(default=24.0, gt=0)
    """Raw samples are kept this long, then rolled up per minute and archived."""

    rollup_days: float = Field(default=30.0, gt=0)
    """Per-minute rollups are kept this long, and until their day is in the hourly tier."""

    hourly_days: float = Field(default=365.0, gt=0)
    """Per-hour rollups are kept this long; events as long as the longer rollup window."""

    history_url: str | None = None
    """Where closed raw hours go as Parquet: a path or fsspec URL (``s3://…``); default
    ``<data_dir>/history``; ``none`` keeps no history."""

    def tier_policy(self) -> TierPolicy:
        """The storage tiers these settings ask for."""
        url = self.history_url or str(self.data_dir / "history")
        return TierPolicy(
            raw_window_s=self.raw_window_h * 3600,
            rollup_window_s=self.rollup_days * 86400,
            hourly_window_s=self.hourly_days * 86400,
            history_url=None if url.lower() == "none" else url,
            history_window_s=self.retention_days * 86400,
        )

    control_enabled: bool = True
    """Run the control loop (scoring, policy, migrations); it acts while it leads."""

    control_process: bool = True
    """Run the control loop in a process of its own (``forewarn control``, started and kept
    running by the service), so that scoring the fleet never holds the interpreter that
    answers ingest and the dashboard; ``false``: in a thread of the service."""

    control_by_serve: bool = False
    """Set by ``forewarn serve --workers N`` for its worker processes: the serve command runs
    the service's one control process (started again, watched and stopped as a service does),
    so no worker starts one; they show the loop from what it publishes, as any replica."""

    replica_id: str | None = None
    """This service's name among replicas, as its control loop names itself in the status it
    publishes (default: a new random one at each start; ``forewarn serve --workers N`` gives
    its workers one, so that they are one replica)."""

    control_tick_s: float = Field(default=5.0, gt=0)
    """Interval of the control loop: score the fleet, apply the policy."""

    partitioned_scoring: bool = False
    """Share the scoring among the replicas' control loops (``FOREWARN_PARTITIONED_SCORING``;
    PostgreSQL only): each scores a share of the fleet's nodes, the leader merges the shares
    and decides (docs/control.md, "Partitioned scoring"). Off: the leader scores the fleet."""

    model: Path | None = None
    """Model card to score with (``FOREWARN_MODEL``); default the newest in ``models_dir``."""

    models_dir: Path = Path("models")
    """Where trained models live (the newest is loaded when ``model`` is not set; with none
    there, the model shipped with Forewarn)."""

    retrain_every_h: float | None = Field(default=None, gt=0, le=24 * 365)
    """Retrain on the fleet's own history this often (``FOREWARN_RETRAIN_EVERY_H``), as
    ``POST /v1/models/retrain`` does; the lifecycle promotes the candidate only if it beats the
    model in force. None: only on demand. With replicas, only the control loop's leader does."""

    retrain_holdout_days: float = Field(default=1.0, gt=0, le=30)
    """The history's last days held out to judge a scheduled retraining's candidate."""

    policy: Policy = Field(default_factory=Policy)
    """Default policy as JSON (``FOREWARN_POLICY='{"hysteresis": 3}'``); PUT /v1/policy wins."""

    warm_window_s: float = Field(default=900.0, gt=0)
    """How much stored history warms the scorer when a replica takes over the loop (its cost
    grows with the rows read: GPUs x seconds / sampling interval)."""

    risk_history_interval_s: float = Field(default=60.0, gt=0)
    """One stored risk point per GPU per interval (and on every alarm change)."""

    risk_history_days: float = Field(default=7.0, gt=0)
    """Risk history older than this is pruned."""

    ack_timeout_s: float = Field(default=120.0, gt=0)
    """A requested migration no job agent acknowledged within this fails."""

    agent_timeout_s: float = Field(default=60.0, gt=0)
    """An in-flight migration fails when its job agent stops heartbeating for this long."""

    webhook_dispatch: bool = True
    """Run the webhook dispatcher in this process (replicas share the work through leases)."""

    webhook_allow: str = ""
    """Webhook targets allowed past the guard: comma-separated host names and IP networks
    (``127.0.0.1,10.0.0.0/8,hooks.internal``); allow-listed hosts may also use http."""

    webhook_timeout_s: float = Field(default=10.0, gt=0)
    """One delivery attempt, from DNS to the last byte read; slower receivers fail it."""

    webhook_max_response_bytes: int = Field(default=64 * 1024, gt=0)
    """The most of a receiver's answer that is read."""

    webhook_retry_base_s: float = Field(default=5.0, gt=0)
    """The first retry's delay; it doubles per attempt (with jitter)."""

    webhook_retry_max_s: float = Field(default=3600.0, gt=0)
    """The longest delay between two attempts."""

    webhook_retry_horizon_s: float = Field(default=86400.0, gt=0)
    """A delivery is given up this long after it was queued."""

    webhook_disable_after_failures: int = Field(default=30, gt=0)
    """Consecutive failed attempts that disable a subscription (announced as webhook.disabled)."""

    webhook_poll_interval_s: float = Field(default=0.2, gt=0)
    """How often the dispatcher looks for new events."""

    webhook_lease_s: float = Field(default=30.0, gt=0)
    """How long a replica's hold on a subscription lasts unless renewed (a crashed replica's
    subscriptions move on after it); longer than ``webhook_timeout_s``."""

    webhook_secret_grace_s: float = Field(default=86400.0, ge=0)
    """After a secret rotation, how long the old secret also signs deliveries."""

    @model_validator(mode="after")
    def _refuse_unsafe_production(self) -> Settings:
        if self.environment == "production":
            tokens = self.token_scopes()
            if not tokens:
                raise ValueError("production needs at least one token (FOREWARN_TOKENS)")
            short = [t for t in tokens if len(t) < 16]
            if short or DEV_TOKEN in tokens:
                raise ValueError(
                    "production tokens must be at least 16 characters, not the dev one"
                )
        return self

    def resolved_database_url(self) -> str:
        return self.database_url or default_database_url(self.data_dir)

    def token_scopes(self) -> dict[str, frozenset[str]]:
        """Every configured token with its scopes; ``admin`` implies all of them."""
        table: dict[str, set[str]] = {t: set(s) for t, s in self.tokens.items()}
        for token, scope in (
            (self.ingest_token, "ingest"),
            (self.read_token, "read"),
            (self.admin_token, "admin"),
        ):
            if token:
                table.setdefault(token, set()).add(scope)
        if not table and self.environment == "development" and self.development_token:
            table[DEV_TOKEN] = {"admin"}
        return {t: frozenset(SCOPES) if "admin" in s else frozenset(s) for t, s in table.items()}
