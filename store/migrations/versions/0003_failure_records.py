"""operator failure records

Revision ID: 0003_failure_records
Revises: 0002
Create Date: 2026-12-03 10:05:00

The GPUs an operator says really failed (``POST /v1/failures``): ground-truth labels for the
Parquet history's ``failures.parquet`` (see ``store.failures``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_failure_records"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "failure_records",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=True),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("note", sa.String(length=2000), nullable=True),
        sa.Column("recorded_ms", sa.BigInteger(), nullable=False),
        sa.Column("retracted_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_failure_records"),
    )
    op.create_index("ix_failure_records_ts", "failure_records", ["ts_ms"])


def downgrade() -> None:
    op.drop_index("ix_failure_records_ts", table_name="failure_records")
    op.drop_table("failure_records")
