"""hourly rollups: ``hourly_rollups``, one chunk of per-hour rows per GPU and day

Revision ID: 0010_hourly_rollups
Revises: 0009_sample_blocks
Create Date: 2026-12-07 22:00:00

PostgreSQL: partitioned by ``start_ms``, one partition a week, plus a default one. The
tiering task fills it from the minute rollups a day at a time, the days already in the store
first (the minute tier keeps each day until it is in this one). A downgrade drops the table:
every hour it holds is still in the minute tier unless that tier's window has passed it.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_hourly_rollups"
down_revision = "0009_sample_blocks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hourly_rollups",
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("gpu", sa.SmallInteger(), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("end_ms", sa.BigInteger(), nullable=False),
        sa.Column("hours", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("node", "gpu", "start_ms", name="pk_hourly_rollups"),
        postgresql_partition_by="RANGE (start_ms)",
    )
    op.create_index("ix_hourly_rollups_start", "hourly_rollups", ["start_ms"])
    if op.get_bind().dialect.name == "postgresql":
        # The blobs are zstd already: PostgreSQL need not try to compress them again.
        op.execute("ALTER TABLE hourly_rollups ALTER COLUMN data SET STORAGE EXTERNAL")
        op.execute("CREATE TABLE hourly_rollups_default PARTITION OF hourly_rollups DEFAULT")


def downgrade() -> None:
    op.drop_table("hourly_rollups")
