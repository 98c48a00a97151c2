"""trials.code_sha256, kernels.code_sha256: the code a cubin was built from

A trial's cubin is served beside the source this version renders for its family and params. Where the
template changed between the trial and the publish (a job recorded before an upgrade and resumed after it),
the two differed: the digest of the code the cubin was built from (kernels.render.code_digest) lets the
publish pass such a trial over, and the served kernel says what its cubin was built from. Rows from before
this revision have none.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("trials", "kernels"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("code_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    for table in ("kernels", "trials"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("code_sha256")
