"""stragglers: each active rank's newest step timing and its straggler state

Revision ID: 0005_stragglers
Revises: 0003_control
Create Date: 2026-12-06 03:40:00
"""

from alembic import op

from store import control

revision = "0005_stragglers"
down_revision = "0003_control"
branch_labels = None
depends_on = None


def upgrade() -> None:
    control.rank_timings.create(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    control.rank_timings.drop(op.get_bind(), checkfirst=True)
