"""The op registry: one OpSpec per op."""

from kernelmill.kernels.ops.attention import ATTENTION, SDPA
from kernelmill.kernels.ops.base import DTYPES, Family, Launch, OpSpec, Param, Problem, SpecError
from kernelmill.kernels.ops.elementwise import ADD, BIAS_ACT
from kernelmill.kernels.ops.embedding import EMBEDDING
from kernelmill.kernels.ops.fused_mlp import FUSED_MLP
from kernelmill.kernels.ops.layernorm import ADD_LAYERNORM, LAYERNORM
from kernelmill.kernels.ops.linear import LINEAR, LINEAR_T
from kernelmill.kernels.ops.matmul import MATMUL
from kernelmill.kernels.ops.mlp_stack import MLP_STACK
from kernelmill.kernels.ops.softmax import SOFTMAX

OPS: dict[str, OpSpec] = {
    op.name: op
    for op in (SOFTMAX, MATMUL, FUSED_MLP)
    # The tensor runtime's ops (kernelmill.runtime): one template family each, tunable like the rest.
    + (LINEAR, LINEAR_T, BIAS_ACT, ADD, LAYERNORM, ADD_LAYERNORM, EMBEDDING, ATTENTION, SDPA, MLP_STACK)
}


def get_op(name: str) -> OpSpec:
    """The OpSpec called ``name``; SpecError lists the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise SpecError(f"unknown op {name!r}; known ops: {', '.join(OPS)}") from None


__all__ = ["DTYPES", "OPS", "Family", "Launch", "OpSpec", "Param", "Problem", "SpecError", "get_op", "register_op"]


def register_op(spec: OpSpec) -> OpSpec:
    """Add an op to the registry (plugins named in KERNELMILL_PLUGINS call this at import)."""
    if spec.name in OPS and OPS[spec.name] is not spec:
        raise SpecError(f"an op named {spec.name!r} is already registered")
    OPS[spec.name] = spec
    return spec


def load_plugins(modules: str | None = None) -> None:
    """Import the operator's plugin modules (comma-separated), which register their ops."""
    import importlib

    from kernelmill.settings import SettingsError, get_settings

    for name in (modules if modules is not None else get_settings().plugins).split(","):
        if name.strip():
            try:
                importlib.import_module(name.strip())
            except ImportError as exc:
                raise SettingsError(f"KERNELMILL_PLUGINS: cannot import {name.strip()!r} ({exc})") from None


load_plugins()
