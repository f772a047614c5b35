"""storage tiers: time-partitioned samples, packed per-minute rollups, tier marks

Revision ID: 0003_tiers
Revises: 0002
Create Date: 2026-12-03 06:30:00

PostgreSQL: ``samples`` becomes a parent partitioned by ``ts_ms`` (one partition an hour, plus
a default one); the existing rows are kept (the old table is renamed, the parent created with
the same columns and primary key, the rows copied, the old table dropped). Its time index
becomes a BRIN index (a few pages per partition instead of a B-tree entry per row).
SQLite keeps one ``samples`` table (see ``store/partitions.py``).
"""

import time

import sqlalchemy as sa
from alembic import op

from store import partitions

revision = "0003_tiers"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    columns: list[sa.schema.SchemaItem] = [
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("gpu", sa.SmallInteger(), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("end_ms", sa.BigInteger(), nullable=False),
        sa.Column("minutes", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("node", "gpu", "start_ms", name="pk_sample_rollups"),
    ]
    op.create_table(
        "sample_rollups",
        *columns,
        postgresql_partition_by="RANGE (start_ms)",
    )
    op.create_table(
        "tier_marks",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_tier_marks"),
    )
    if not postgres:
        op.create_index("ix_sample_rollups_start", "sample_rollups", ["start_ms"])
        return

    # The blobs are zstd already: store them as they are, out of line.
    op.execute("ALTER TABLE sample_rollups ALTER COLUMN data SET STORAGE EXTERNAL")
    op.execute("CREATE TABLE sample_rollups_default PARTITION OF sample_rollups DEFAULT")

    op.execute("ALTER TABLE samples RENAME TO samples_old")
    op.execute("ALTER TABLE samples_old RENAME CONSTRAINT pk_samples TO pk_samples_old")
    op.execute("ALTER INDEX ix_samples_ts RENAME TO ix_samples_old_ts")
    op.execute(
        "CREATE TABLE samples (LIKE samples_old INCLUDING DEFAULTS) PARTITION BY RANGE (ts_ms)"
    )
    op.execute("ALTER TABLE samples ADD CONSTRAINT pk_samples PRIMARY KEY (node, gpu, ts_ms)")
    op.execute("CREATE INDEX ix_samples_ts ON samples USING brin (ts_ms)")
    op.execute("CREATE TABLE samples_default PARTITION OF samples DEFAULT")

    # A partition for every hour that holds rows, and the hours around now.
    now_ms = int(time.time() * 1000)
    span = partitions.HOUR_MS
    hours = bind.execute(sa.text(f"SELECT DISTINCT ts_ms / {span} FROM samples_old")).scalars()
    for hour in sorted(hours):
        partitions.ensure(bind, "samples", start_ms=hour * span, end_ms=(hour + 1) * span)
    partitions.ensure(bind, "samples", start_ms=now_ms - 2 * span, end_ms=now_ms + 6 * span)
    day = partitions.DAY_MS
    partitions.ensure(bind, "sample_rollups", start_ms=now_ms - day, end_ms=now_ms + 2 * day)
    op.execute("INSERT INTO samples SELECT * FROM samples_old")
    op.execute("DROP TABLE samples_old")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("CREATE TABLE samples_flat (LIKE samples INCLUDING DEFAULTS)")
        op.execute("INSERT INTO samples_flat SELECT * FROM samples")
        op.execute("DROP TABLE samples CASCADE")
        op.execute("ALTER TABLE samples_flat RENAME TO samples")
        op.execute("ALTER TABLE samples ADD CONSTRAINT pk_samples PRIMARY KEY (node, gpu, ts_ms)")
        op.execute("CREATE INDEX ix_samples_ts ON samples (ts_ms)")
        op.execute("DROP TABLE sample_rollups CASCADE")
    else:
        op.drop_index("ix_sample_rollups_start", table_name="sample_rollups")
        op.drop_table("sample_rollups")
    op.drop_table("tier_marks")
