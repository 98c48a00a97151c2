"""Elementwise ops the runtime needs between the GEMMs: ``bias_act`` and ``add``.

* ``bias_act`` (rows x cols): Y = act(X + b[col]); act in none, relu, gelu_erf, gelu_tanh, silu. A
  standalone activation is bias_act with a zero bias (the runtime keeps one per width).
* ``add`` (n): Y = X + R (residual connections), over a flat n elements.

One family each (``vec``): each thread handles ``vec`` consecutive elements, one vector access when
the run is whole and aligned, element accesses otherwise. Not tuned yet; the knobs are there for it.
"""

from __future__ import annotations

import math

import numpy as np

from kernelmill.kernels.ops.base import MAX_INDEXED_ELEMS, Family, Launch, OpSpec, Param, cdiv, itemsize
from kernelmill.kernels.ops.fused_mlp import ACTIVATION_FUNCTIONS

#: Activation names (templates call act_<name>: the prelude has none/relu/gelu_*; silu comes from
#: templates/elementwise/silu.cuh.j2). The first is the default attribute value.
ELEMENTWISE_ACTIVATIONS: tuple[str, ...] = ("none", "relu", "gelu_erf", "gelu_tanh", "silu")

#: Largest grid x (blocks).
MAX_GRID_X = 2**31 - 1


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


#: float64 activation by name (fused_mlp's three, plus none and silu).
ACT_FUNCTIONS = {**ACTIVATION_FUNCTIONS, "none": lambda x: x, "silu": silu}

_VEC = Param("vec", (1, 2, 4, 8), "elements per thread (one access of at most 16 bytes)")
_THREADS = Param("threads", (64, 128, 256, 512, 1024), "threads per block")


def torch_activation(act: str):  # pragma: no cover - GPU
    """PyTorch's function for one of ELEMENTWISE_ACTIVATIONS (the baselines' epilogues)."""
    import torch
    import torch.nn.functional as F

    return {
        "none": lambda h: h,
        "relu": torch.relu,
        "gelu_erf": lambda h: F.gelu(h),
        "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
        "silu": F.silu,
    }[act]


class VecFamily(Family):
    """``vec`` consecutive elements per thread over a flat range; grid = cdiv(elements, threads * vec)."""

    name = "vec"
    params = (_VEC, _THREADS)
    pdl = True

    def __init__(self, template: str, entry: str, description: str, args: tuple[str, ...]) -> None:
        self.template = template
        self.entry = entry
        self.description = description
        self._args = args

    def defaults(self, dtype):
        return {"vec": 16 // itemsize(dtype), "threads": 256}

    def check(self, params, dtype):
        if params["vec"] * itemsize(dtype) > 16:
            return f"vec={params['vec']} x {itemsize(dtype)} bytes exceeds a 16-byte access"
        return None

    def _elements(self, shape) -> int:
        return math.prod(shape)

    def check_shape(self, shape, params, dtype):
        n = self._elements(shape)
        if n >= MAX_INDEXED_ELEMS:
            return f"{n} elements; the kernels index with 32-bit element counts (< 2**31)"
        if cdiv(n, params["threads"] * params["vec"]) > MAX_GRID_X:  # pragma: no cover - needs n >= 2**31
            return "too many blocks for the grid"
        return None

    def launches(self, shape, params, dtype):
        n = self._elements(shape)
        grid = (cdiv(n, params["threads"] * params["vec"]), 1, 1)
        return [Launch(self.entry, grid, (params["threads"], 1, 1), 0, (*self._args, *shape))]


class BiasAct(OpSpec):
    name = "bias_act"
    intermediates = False  # only the output is rounded (OpSpec.intermediates)
    dims = ("rows", "cols")
    example_shape = "1024x3072"
    inputs = ("X", "b")
    outputs = ("Y",)
    attributes = (Param("act", ELEMENTWISE_ACTIVATIONS, "activation after the bias"),)
    families = {
        "vec": VecFamily(
            "elementwise/bias_act.cu.j2",
            "bias_act",
            "Y = act(X + b[col]); vec consecutive elements per thread",
            ("X", "b", "Y"),
        )
    }

    def tensor_shapes(self, shape):
        rows, cols = shape
        return {"X": (rows, cols), "b": (cols,), "Y": (rows, cols)}

    def input_scale(self, name, shape):
        # X + b in [-2, 2], the activations' bend. Further below, the GELU formulas every framework uses
        # (1 + erf(.), 1 + tanh(.)) cancel: an output of one element at x = -5 is 1e-3 off in fp32, past the
        # 1e-5 tolerance, whatever the kernel (prelude.cuh.j2 says why those formulas stay).
        return 1.0

    def reference(self, inputs, attrs):
        x, b = (inputs[n].astype(np.float64) for n in self.inputs)
        return {"Y": ACT_FUNCTIONS[attrs.get("act", "none")](x + b)}

    def flops(self, shape):
        return 2.0 * math.prod(shape)

    def min_bytes(self, shape, dtype):
        rows, cols = shape
        return (2 * rows * cols + cols) * itemsize(dtype)

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        x, b = tensors["X"], tensors["b"]
        fn = torch_activation(attrs.get("act", "none"))
        return lambda: fn(x + b)


class Add(OpSpec):
    name = "add"
    intermediates = False  # only the output is rounded (OpSpec.intermediates)
    dims = ("n",)
    example_shape = "786432"
    inputs = ("X", "R")
    outputs = ("Y",)
    families = {
        "vec": VecFamily(
            "elementwise/add.cu.j2", "add", "Y = X + R; vec consecutive elements per thread", ("X", "R", "Y")
        )
    }

    def tensor_shapes(self, shape):
        return {"X": shape, "R": shape, "Y": shape}

    def reference(self, inputs, attrs):
        return {"Y": inputs["X"].astype(np.float64) + inputs["R"].astype(np.float64)}

    def flops(self, shape):
        return float(shape[0])

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        x, r = tensors["X"], tensors["R"]
        return lambda: x + r


BIAS_ACT = BiasAct()
ADD = Add()
