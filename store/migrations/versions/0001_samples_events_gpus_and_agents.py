"""samples, events, gpus and agents

Revision ID: 0001
Revises:
Create Date: 2026-12-02 17:44:06.124095
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "agents",
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("agent_id", sa.String(length=128), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=32), nullable=False),
        sa.Column("started_ms", sa.BigInteger(), nullable=True),
        sa.Column("last_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("sent_total", sa.BigInteger(), nullable=False),
        sa.Column("spooled", sa.BigInteger(), nullable=False),
        sa.Column("dropped_total", sa.BigInteger(), nullable=False),
        sa.Column("interval_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("node", "agent_id", name="pk_agents"),
    )
    op.create_table(
        "events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("gpu", sa.SmallInteger(), nullable=False),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("xid", sa.Integer(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("source", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node", "gpu", "ts_ms", "kind", "xid", name="uq_events_key"),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_ts", ["ts_ms"], unique=False)

    op.create_table(
        "gpus",
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("gpu", sa.SmallInteger(), nullable=False),
        sa.Column("uuid", sa.String(length=96), nullable=True),
        sa.Column("vendor", sa.String(length=16), nullable=True),
        sa.Column("first_seen_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_seen_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("node", "gpu", name="pk_gpus"),
    )
    op.create_table(
        "samples",
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("gpu", sa.SmallInteger(), nullable=False),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("uuid", sa.String(length=96), nullable=True),
        sa.Column("vendor", sa.String(length=16), nullable=True),
        sa.Column("temp_gpu_c", sa.Float(), nullable=True),
        sa.Column("temp_mem_c", sa.Float(), nullable=True),
        sa.Column("power_w", sa.Float(), nullable=True),
        sa.Column("sm_clock_mhz", sa.Float(), nullable=True),
        sa.Column("mem_clock_mhz", sa.Float(), nullable=True),
        sa.Column("throttle_reasons", sa.BigInteger(), nullable=True),
        sa.Column("util_gpu_pct", sa.Float(), nullable=True),
        sa.Column("util_mem_pct", sa.Float(), nullable=True),
        sa.Column("mem_used_mib", sa.Float(), nullable=True),
        sa.Column("mem_total_mib", sa.Float(), nullable=True),
        sa.Column("ecc_sbe_volatile", sa.BigInteger(), nullable=True),
        sa.Column("ecc_dbe_volatile", sa.BigInteger(), nullable=True),
        sa.Column("ecc_sbe_aggregate", sa.BigInteger(), nullable=True),
        sa.Column("ecc_dbe_aggregate", sa.BigInteger(), nullable=True),
        sa.Column("ecc_deferred", sa.BigInteger(), nullable=True),
        sa.Column("retired_pages_sbe", sa.BigInteger(), nullable=True),
        sa.Column("retired_pages_dbe", sa.BigInteger(), nullable=True),
        sa.Column("retired_pages_pending", sa.Boolean(), nullable=True),
        sa.Column("remap_correctable", sa.BigInteger(), nullable=True),
        sa.Column("remap_uncorrectable", sa.BigInteger(), nullable=True),
        sa.Column("remap_pending", sa.Boolean(), nullable=True),
        sa.Column("remap_failure", sa.Boolean(), nullable=True),
        sa.Column("nvlink_crc_flit", sa.BigInteger(), nullable=True),
        sa.Column("nvlink_crc_data", sa.BigInteger(), nullable=True),
        sa.Column("nvlink_replay", sa.BigInteger(), nullable=True),
        sa.Column("nvlink_recovery", sa.BigInteger(), nullable=True),
        sa.Column("pcie_replay", sa.BigInteger(), nullable=True),
        sa.Column("pcie_link_width", sa.BigInteger(), nullable=True),
        sa.Column("pcie_link_width_max", sa.BigInteger(), nullable=True),
        sa.Column("pcie_link_gen", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("node", "gpu", "ts_ms", name="pk_samples"),
    )
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.create_index("ix_samples_ts", ["ts_ms"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_index("ix_samples_ts")

    op.drop_table("samples")
    op.drop_table("gpus")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_ts")

    op.drop_table("events")
    op.drop_table("agents")
