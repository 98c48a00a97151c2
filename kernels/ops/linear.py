"""linear: Y[M x N] = act(X[M x K] @ W[K x N] + b[N]), all row-major (W is the transposed nn.Linear weight);
linear_t: the same with W[N x K] as nn.Linear stores it (Y = act(X @ W^T + b)).

The matmul op's kernels with the bias and the activation fused into their epilogue (or into the
split-K reduce or the final sum): ``simt`` (exact fp32 FMA, any dtype), ``tensorcore`` (WMMA, 16-bit
types), ``wgmma`` (Hopper wgmma + TMA, sm_90a) and ``gemv`` (skinny M, B streamed once). act is an
attribute: none, relu, gelu_erf, gelu_tanh, silu.
"""

from __future__ import annotations

import numpy as np

from kernelmill.kernels.ops.base import OpSpec, Param
from kernelmill.kernels.ops.elementwise import ACT_FUNCTIONS, ELEMENTWISE_ACTIVATIONS, torch_activation
from kernelmill.kernels.ops.gemv import GemvFamily
from kernelmill.kernels.ops.gemv_t import RowDotGemv
from kernelmill.kernels.ops.matmul import CORES, GemmFamily, WgmmaFamily, gemm_launches

#: Where the defaults leave the core's: with a bias, the SIMT default (BK=8) spills (see fused_mlp).
_DEFAULT_CHANGES = {"simt": {"BK": 16}, "tensorcore": {}}


class LinearFamily(GemmFamily):
    def defaults(self, dtype):
        return {**self.core.defaults(dtype), **_DEFAULT_CHANGES[self.core.name]}

    def launches(self, shape, params, dtype):
        M, N, K = shape  # noqa: N806
        return gemm_launches(self.core.name, self.entry, M, N, K, params, dtype, "X", "W", "Y", bias="b")


class LinearTensorCore(LinearFamily):
    # 16-bit types only: with float32 as TF32, a GELU epilogue amplifies TF32's ~1e-3 operand rounding past
    # TF32's tolerance at short K (seen at 1x1x1 on an H200), and the runtime wants exact float32 anyway.
    dtypes = ("float16", "bfloat16")


SIMT = LinearFamily(CORES["simt"], "simt", "linear/simt.cu.j2", "linear_simt", "CUDA-core GEMM + bias + act")
TENSORCORE = LinearTensorCore(
    CORES["tensorcore"],
    "tensorcore",
    "linear/tensorcore.cu.j2",
    "linear_tc",
    "WMMA tensor-core GEMM + bias + act (16-bit types)",
)


class LinearWgmma(WgmmaFamily):
    template = "linear/wgmma.cu.j2"
    entry = "linear_wgmma"
    description = WgmmaFamily.description + "; bias + activation epilogue"
    buffers = ("X", "W", "Y", "b")


class LinearGemv(GemvFamily):
    template = "linear/gemv.cu.j2"
    entry = "linear_gemv"
    description = GemvFamily.description + "; bias + activation in the final sum"
    buffers = ("X", "W", "Y", "b")
    bias = True
    # In a graph its blocks may start while the kernel before finishes and load their first weights (the
    # mma engine: a group of k16 steps per warp) before they wait for it; the runtime launches it so only
    # where W is one of the model's parameters.
    pdl = True
    pdl_early_reads = ("W",)


class LinearTWgmma(LinearWgmma):
    name = "wgmma"
    entry = "linear_wgmma"
    description = "Hopper wgmma GEMM on a K-major weight (N x K), TMA ring on mbarriers; bias + activation epilogue"
    b_kmajor = True
    # A K-major B box is BN rows of 64 k, so BN need not be a whole number of 64-column boxes: 168 makes 132
    # tiles of 128 x 168 at 256 x 11008 (one per H100 SM), 96 and 176 other tile counts.
    params = tuple(
        Param(p.name, (64, 96, 128, 168, 176, 192, 256), "block tile columns (N): the wgmma N, any multiple of 8")
        if p.name == "BN"
        else p
        for p in LinearWgmma.params
    )


WGMMA = LinearWgmma()
GEMV = LinearGemv()
WGMMA_T = LinearTWgmma()
GEMV_T = RowDotGemv()


class Linear(OpSpec):
    name = "linear"
    intermediates = False  # only the output is rounded (OpSpec.intermediates)
    matrix_bound = True
    dims = ("M", "N", "K")
    example_shape = "1024x3072x768"
    inputs = ("X", "W", "b")
    outputs = ("Y",)
    attributes = (Param("act", ELEMENTWISE_ACTIVATIONS, "activation after the bias"),)
    families = {f.name: f for f in (SIMT, TENSORCORE, WGMMA, GEMV)}

    def tensor_shapes(self, shape):
        M, N, K = shape  # noqa: N806
        return {"X": (M, K), "W": (K, N), "b": (N,), "Y": (M, N)}

    def summed_terms(self, shape):
        return shape[2] + 1  # K products and the bias

    def input_scale(self, name, shape):
        _m, _n, k = shape
        return {"W": (3.0 / k) ** 0.5 * 2.0, "b": 0.5}.get(name, 1.0)

    def reference(self, inputs, attrs):
        x, w, b = (inputs[n].astype(np.float64) for n in self.inputs)
        return {"Y": ACT_FUNCTIONS[attrs.get("act", "none")](x @ w + b)}

    def flops(self, shape):
        M, N, K = shape  # noqa: N806
        return 2.0 * M * N * K

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch

        x, w, b = tensors["X"], tensors["W"], tensors["b"]
        fn = torch_activation(attrs.get("act", "none"))
        return lambda: fn(torch.addmm(b, x, w))


LINEAR = Linear()


class LinearT(Linear):
    """linear with the weight as nn.Linear stores it: W (N, K), K-major. On Hopper the wgmma tiles then take
    any BN that is a multiple of 8 (the box is BN rows of W), which fills the SMs at shapes where the (K, N)
    layout's 64-column boxes cannot (256 x 11008 x 4096: 132 tiles of 128 x 168). For M <= 2 the gemv family
    computes whole rows of W as dot products (kernels/ops/gemv_t.py)."""

    name = "linear_t"
    families = {f.name: f for f in (WGMMA_T, GEMV_T)}

    def tensor_shapes(self, shape):
        M, N, K = shape  # noqa: N806
        return {"X": (M, K), "W": (N, K), "b": (N,), "Y": (M, N)}

    def reference(self, inputs, attrs):
        x, w, b = (inputs[n].astype(np.float64) for n in self.inputs)
        return {"Y": ACT_FUNCTIONS[attrs.get("act", "none")](x @ w.T + b)}

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch.nn.functional as F  # noqa: N812

        x, w, b = tensors["X"], tensors["W"], tensors["b"]
        fn = torch_activation(attrs.get("act", "none"))
        return lambda: fn(F.linear(x, w, b))


LINEAR_T = LinearT()
