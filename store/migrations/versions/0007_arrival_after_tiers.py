"""arrival numbering of samples, again after the tiers' rebuild of ``samples``

Revision ID: 0007_arrival_after_tiers
Revises: 0006_control_fencing
Depends on: 0003_tiers
Create Date: 2026-12-06 21:50:00

``0003_control`` numbers samples in arrival order with a trigger on ``samples`` (PostgreSQL);
``0003_tiers``, on another branch, rebuilds ``samples`` as a partitioned table (``LIKE``
copies the column, not the trigger). The branches may apply in either order, so this
revision, which runs after both, sets the numbering up again (idempotent). Until now a control
loop did it each time it became leader: schema changes are Alembic's alone.
"""

from alembic import op

from store import control

revision = "0007_arrival_after_tiers"
down_revision = "0006_control_fencing"
branch_labels = None
depends_on = "0003_tiers"


def upgrade() -> None:
    control.ensure_arrival(op.get_bind())


def downgrade() -> None:
    pass  # 0003_control's numbering stays: it is that revision's to drop
