"""The op registry: one OpSpec per op."""

from kernelmill.kernels.ops.base import DTYPES, Family, Launch, OpSpec, Param, Problem, SpecError
from kernelmill.kernels.ops.fused_mlp import FUSED_MLP
from kernelmill.kernels.ops.matmul import MATMUL
from kernelmill.kernels.ops.softmax import SOFTMAX

OPS: dict[str, OpSpec] = {op.name: op for op in (SOFTMAX, MATMUL, FUSED_MLP)}


def get_op(name: str) -> OpSpec:
    """The OpSpec called ``name``; SpecError lists the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise SpecError(f"unknown op {name!r}; known ops: {', '.join(OPS)}") from None


__all__ = ["DTYPES", "OPS", "Family", "Launch", "OpSpec", "Param", "Problem", "SpecError", "get_op"]
