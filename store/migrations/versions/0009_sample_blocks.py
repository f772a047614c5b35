"""packed raw samples: ``sample_blocks``, one blob per GPU and minute of a closed hour

Revision ID: 0009_sample_blocks
Revises: 0008_score_shards
Create Date: 2026-12-07 18:00:00

PostgreSQL: partitioned by ``start_ms``, one partition an hour like ``samples`` (retention
drops them whole), plus a default one. Hours rolled up before this revision keep their wide
rows until they leave the raw window; the tiering task packs the hours it rolls from now on.
A downgrade puts the packed samples back as wide rows, an hour at a time (on PostgreSQL into
the default partition, their hours' own being gone), then drops the table.
"""

import sqlalchemy as sa
from alembic import op

from store import blocks, partitions, schema

revision = "0009_sample_blocks"
down_revision = "0008_score_shards"
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "sample_blocks",
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("gpu", sa.SmallInteger(), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("node", "gpu", "start_ms", name="pk_sample_blocks"),
        postgresql_partition_by="RANGE (start_ms)",
    )
    op.create_index("ix_sample_blocks_start", "sample_blocks", ["start_ms"])
    if postgres:
        # The blobs are zstd already: PostgreSQL need not try to compress them again.
        op.execute("ALTER TABLE sample_blocks ALTER COLUMN data SET STORAGE EXTERNAL")
        op.execute("CREATE TABLE sample_blocks_default PARTITION OF sample_blocks DEFAULT")


def downgrade() -> None:
    bind = op.get_bind()
    hours = bind.execute(
        sa.text(f"SELECT DISTINCT start_ms - start_ms % {partitions.HOUR_MS} FROM sample_blocks")
    ).scalars()
    for hour in sorted(hours):
        frame = blocks.read(bind, since_ms=hour, until_ms=hour + partitions.HOUR_MS)
        wide = frame[list(schema.SAMPLE_COLUMNS)].astype(object)
        values = wide.where(wide.notna(), None).itertuples(index=False)
        rows = [dict(zip(schema.SAMPLE_COLUMNS, row, strict=True)) for row in values]
        if rows:
            bind.execute(schema.samples.insert(), rows)
    op.drop_table("sample_blocks")
