"""event outbox

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 06:20:00

The root of this wave's branches: the control loop, the webhooks and the storage tiers each add
their own revisions with ``down_revision = "0002"`` (``store.migrate.upgrade`` takes every head).
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("id", sa.String(length=48), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.String(length=253), nullable=True),
        sa.Column("node", sa.String(length=253), nullable=True),
        sa.Column("data", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("id", name="uq_outbox_id"),
    )
    op.create_index("ix_outbox_ts", "outbox", ["ts_ms"])


def downgrade() -> None:
    op.drop_index("ix_outbox_ts", table_name="outbox")
    op.drop_table("outbox")
