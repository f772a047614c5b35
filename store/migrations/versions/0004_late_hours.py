"""late hours: rolled hours that rows reached after their roll-up, rolled up again at the
next tiering pass instead of at their archiving

Revision ID: 0004_late_hours
Revises: 0003_tiers
Create Date: 2026-12-06 00:40:00
"""

from alembic import op

from store import tiers

revision = "0004_late_hours"
down_revision = "0003_tiers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tiers.late_hours.create(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    tiers.late_hours.drop(op.get_bind(), checkfirst=True)
