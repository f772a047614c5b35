"""webhook subscriptions and deliveries

Revision ID: 0003_webhooks
Revises: 0002
Create Date: 2026-12-03 06:40:00

The webhooks branch off ``0002``: ``webhooks`` (subscriptions, their outbox cursor and the
dispatcher lease) and ``webhook_deliveries`` (one row per subscription and event).
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_webhooks"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("event_types", sa.Text(), nullable=False),
        sa.Column("job_id", sa.String(length=253), nullable=True),
        sa.Column("node", sa.String(length=253), nullable=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("secret", sa.String(length=128), nullable=False),
        sa.Column("previous_secret", sa.String(length=128), nullable=True),
        sa.Column("previous_secret_until_ms", sa.BigInteger(), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
        sa.Column("consecutive_failures", sa.Integer(), nullable=False),
        sa.Column("cursor_seq", sa.BigInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_until_ms", sa.BigInteger(), nullable=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("webhook_id", sa.String(length=40), nullable=False),
        sa.Column("event_id", sa.String(length=48), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("next_attempt_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_attempt_ms", sa.BigInteger(), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_latency_ms", sa.Integer(), nullable=True),
        sa.Column("delivered_ms", sa.BigInteger(), nullable=True),
        sa.Column("attempt_log", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["webhook_id"], ["webhooks.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("webhook_id", "event_id", name="uq_webhook_deliveries_event"),
    )
    op.create_index(
        "ix_webhook_deliveries_queue",
        "webhook_deliveries",
        ["webhook_id", "status", "event_seq"],
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_queue", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhooks")
