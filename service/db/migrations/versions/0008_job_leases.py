"""jobs.runner, jobs.lease_until: the job runner that owns a running job, and until when its claim holds

A runner renews the lease of each job it runs; another runner on the same database (a second ``serve``, an
API replica) queues a running job again only once its lease has lapsed (its owner died), never while its
owner is alive. Rows from before this revision have no lease: they are taken as lapsed.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("runner", sa.String(96), nullable=True))
        batch.add_column(sa.Column("lease_until", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("lease_until")
        batch.drop_column("runner")
