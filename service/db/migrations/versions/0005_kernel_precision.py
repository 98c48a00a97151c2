"""kernels.precision: the arithmetic a served kernel computes its dtype in (float32 in tf32, say), part of what
it is served for, so that a TF32 kernel never takes the slot of an IEEE float32 one

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_OLD = ("op", "shape_key", "dtype", "arch", "attrs_key")


def _precision(op_name: str, family: str, dtype: str) -> str:
    """What this version's family computes ``dtype`` in; the dtype itself where the op or family is unknown
    (a plugin not loaded), which is what every family but the TF32 ones computes."""
    try:
        from kernelmill.kernels.ops import get_op

        return get_op(op_name).family(family).precision(dtype)
    except Exception:  # noqa: BLE001 - a migration must not fail on one row it cannot place
        return dtype


def upgrade() -> None:
    with op.batch_alter_table("kernels") as batch:
        batch.add_column(sa.Column("precision", sa.String(length=16), nullable=True))
    kernels = sa.table(
        "kernels",
        sa.column("id", sa.Integer),
        sa.column("op", sa.String),
        sa.column("family", sa.String),
        sa.column("dtype", sa.String),
        sa.column("precision", sa.String),
    )
    bind = op.get_bind()
    rows = bind.execute(sa.select(kernels.c.id, kernels.c.op, kernels.c.family, kernels.c.dtype)).all()
    for kernel_id, op_name, family, dtype in rows:
        precision = _precision(op_name, family, dtype)
        bind.execute(kernels.update().where(kernels.c.id == kernel_id).values(precision=precision))
    with op.batch_alter_table("kernels") as batch:
        batch.alter_column("precision", existing_type=sa.String(length=16), nullable=False)
        batch.drop_constraint("uq_kernel_problem", type_="unique")
        batch.create_unique_constraint("uq_kernel_problem", [*_OLD, "precision"])


def downgrade() -> None:
    # Where a problem has kernels of several precisions, the IEEE one (precision == dtype) stays served.
    kernels = sa.table("kernels", sa.column("dtype", sa.String), sa.column("precision", sa.String))
    op.get_bind().execute(kernels.delete().where(kernels.c.precision != kernels.c.dtype))
    with op.batch_alter_table("kernels") as batch:
        batch.drop_constraint("uq_kernel_problem", type_="unique")
        batch.create_unique_constraint("uq_kernel_problem", list(_OLD))
        batch.drop_column("precision")
