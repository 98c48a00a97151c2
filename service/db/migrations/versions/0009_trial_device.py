"""trials.device_name: the GPU model a trial was timed on

A job queued again (its service stopped, its GPU went away) may resume on another GPU model of its arch. Its
trials from before were timed there: the served kernel is the fastest trial of the GPU the job ends on, against
that GPU's own PyTorch baseline. Rows from before this revision have none, and count as the job's GPU's.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("device_name", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("device_name")
