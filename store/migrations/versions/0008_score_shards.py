"""partitioned scoring: the control processes that share the fleet's scoring, and their scores

Revision ID: 0008_score_shards
Revises: 0007_arrival_after_tiers
Create Date: 2026-12-07 09:00:00
"""

from alembic import op

from store import control

revision = "0008_score_shards"
down_revision = "0007_arrival_after_tiers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    control.score_shards.create(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    control.score_shards.drop(op.get_bind(), checkfirst=True)
