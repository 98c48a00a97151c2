"""kernels served per GPU model: the GPU model (device_key) joins the problem's unique key (an H100's best
tiles are not an H200's), so each model of an arch keeps its own best kernel

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_KEY = ("op", "shape_key", "dtype", "arch", "attrs_key", "precision")


def upgrade() -> None:
    # device_key: the GPU model in the unique key, "" where it is not known (NULLs never collide in a unique key).
    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("device_key", sa.String(length=128), nullable=False, server_default=""))
    kernels = sa.table("kernels", sa.column("device_name", sa.String), sa.column("device_key", sa.String))
    op.get_bind().execute(
        kernels.update().where(kernels.c.device_name.is_not(None)).values(device_key=kernels.c.device_name)
    )
    with op.batch_alter_table("kernels") as batch:
        batch.drop_constraint("uq_kernel_problem", type_="unique")
        batch.create_unique_constraint("uq_kernel_problem", [*_KEY, "device_key"])


def downgrade() -> None:
    # One kernel per problem again: of each problem's kernels the one with the highest speedup stays.
    bind = op.get_bind()
    kernels = sa.table(
        "kernels", *(sa.column(name, sa.String) for name in _KEY), sa.column("id", sa.Integer),
        sa.column("speedup", sa.Float),
    )  # fmt: skip
    rows = bind.execute(sa.select(kernels)).mappings().all()
    keep: dict[tuple, tuple[float, int]] = {}
    for row in rows:
        key, rank = tuple(row[name] for name in _KEY), (row["speedup"] or 0.0, -row["id"])
        if key not in keep or rank > keep[key]:
            keep[key] = rank
    kept = {-rank[1] for rank in keep.values()}
    dropped = [row["id"] for row in rows if row["id"] not in kept]
    if dropped:
        bind.execute(kernels.delete().where(kernels.c.id.in_(dropped)))
    with op.batch_alter_table("kernels") as batch:
        batch.drop_constraint("uq_kernel_problem", type_="unique")
        batch.create_unique_constraint("uq_kernel_problem", list(_KEY))
        batch.drop_column("device_key")
