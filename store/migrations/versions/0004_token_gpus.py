"""which token's batch first stored each GPU (the per-token GPU cap, counted fleet-wide)

Revision ID: 0004_token_gpus
Revises: 0003_tokens
Create Date: 2026-12-06 01:40:00
"""

from alembic import op

from store import tokens

revision = "0004_token_gpus"
down_revision = "0003_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tokens.token_gpus.create(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    tokens.token_gpus.drop(op.get_bind(), checkfirst=True)
