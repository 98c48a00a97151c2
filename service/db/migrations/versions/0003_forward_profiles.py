"""forward_profiles: nsys summaries of model forwards (kernelmill profile-forward)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "forward_profiles",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=512), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=True),
        sa.Column("iters", sa.Integer(), nullable=False),
        sa.Column("graphs", sa.Boolean(), nullable=False),
        sa.Column("device_name", sa.String(length=128), nullable=True),
        sa.Column("nsys_version", sa.String(length=32), nullable=True),
        sa.Column("kernel_time_ms", sa.Float(), nullable=False),
        sa.Column("kernel_launches", sa.Integer(), nullable=False),
        sa.Column("kernel_ms_per_forward", sa.Float(), nullable=False),
        sa.Column("gap_total_ms", sa.Float(), nullable=False),
        sa.Column("gap_median_us", sa.Float(), nullable=True),
        sa.Column("gap_max_us", sa.Float(), nullable=True),
        sa.Column("memcpy_time_ms", sa.Float(), nullable=False),
        sa.Column("memcpy_bytes", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("forward_profiles") as batch:
        batch.create_index(batch.f("ix_forward_profiles_created_at"), ["created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("forward_profiles") as batch:
        batch.drop_index(batch.f("ix_forward_profiles_created_at"))
    op.drop_table("forward_profiles")
