"""api tokens, stored hashed

Revision ID: 0003_tokens
Revises: 0002
Create Date: 2026-12-03 07:10:00

Bearer tokens created with ``forewarn token create`` or ``POST /v1/tokens``: only a SHA-256 of
each secret is kept, with its scopes and whether it was revoked (see ``store.tokens``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_tokens"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("scopes", sa.String(length=64), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("revoked_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("secret_sha256", name="uq_api_tokens_secret"),
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
