"""control fencing: at most one active migration per (job, rank)

Revision ID: 0006_control_fencing
Revises: 0005_stragglers
Create Date: 2026-12-06 04:30:00

Before the index is built, any (job, rank) that already has several active migrations keeps
its oldest one; the others become ``failed`` with the reason. The leadership epoch the ticks
are fenced with is a row of ``control_state`` (no schema change).
"""

from alembic import op

revision = "0006_control_fencing"
down_revision = "0005_stragglers"
branch_labels = None
depends_on = None

_ACTIVE = "('requested', 'acknowledged', 'transferring')"


def upgrade() -> None:
    op.execute(
        "UPDATE migrations SET state = 'failed', finished_ms = requested_ms, "
        "error = 'another migration of this rank was in flight (revision 0006)' "
        f"WHERE state IN {_ACTIVE} AND EXISTS (SELECT 1 FROM migrations o "
        "WHERE o.job_id = migrations.job_id AND o.rank = migrations.rank "
        f"AND o.state IN {_ACTIVE} AND (o.requested_ms < migrations.requested_ms "
        "OR (o.requested_ms = migrations.requested_ms AND o.id < migrations.id)))"
    )
    op.execute(
        "CREATE UNIQUE INDEX IF NOT EXISTS ux_migrations_active_rank "
        f"ON migrations (job_id, rank) WHERE state IN {_ACTIVE}"
    )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ux_migrations_active_rank")
