"""control loop: risk (latest and history), jobs and placement, migrations, audit, drain,
policy, and arrival numbering of samples on PostgreSQL

Revision ID: 0003_control
Revises: 0002
Create Date: 2026-12-03 06:50:00
"""

from alembic import op

from store import control

revision = "0003_control"
down_revision = "0002"
branch_labels = None
depends_on = None

_TABLES = (
    control.risk_latest,
    control.risk_history,
    control.jobs,
    control.job_ranks,
    control.migrations,
    control.audit,
    control.node_drain,
    control.policy,
    control.control_state,
)


def upgrade() -> None:
    bind = op.get_bind()
    for table in _TABLES:
        table.create(bind, checkfirst=True)
    control.ensure_arrival(bind)


def downgrade() -> None:
    bind = op.get_bind()
    for table in reversed(_TABLES):
        table.drop(bind, checkfirst=True)
    if bind.dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS samples_arrival ON samples")
        op.execute("DROP FUNCTION IF EXISTS samples_arrival()")
        op.execute("DROP INDEX IF EXISTS ix_samples_arrival")
        op.execute("ALTER TABLE samples DROP COLUMN IF EXISTS arrival_seq")
        op.execute("DROP SEQUENCE IF EXISTS samples_arrival_seq")
