"""mlp_stack: ``layers`` MLP blocks in a row, Y = block_{L-1}(... block_0(X)), at decode-sized batches.

block_l(x) = act(x @ W1[l] + b1[l]) @ W2[l] + b2[l], every matrix row-major; X is batch x d_model, W1
layers x d_model x d_hidden, b1 layers x d_hidden, W2 layers x d_hidden x d_model, b2 layers x d_model.

One family, ``persistent`` (templates/mlp_stack/persistent.cu.j2): the 2 x layers products are phases of one
persistent grid (one block per SM). A producer warp per block streams its 512-byte strips of the weights
with TMA into a ring and never waits for other blocks, so the weight stream need not stop at a phase
boundary the way it stops between kernels. The blocks' fp32 partial sums per K slice meet in a fixed order
(deterministic results); a block waits only for the tasks that wrote the inputs it needs (a done flag per
task), not for the whole grid.

Measured on an H100 at 1 x 4096 x 11008 x 4 (docs/PERFORMANCE.md): about 289-297 us, level with PyTorch
eager and slower than the runtime's eight gemv kernels (272 us), so the runtime does not route to this op;
it is verified and tunable like any other.

Its blocks must all be resident at once (they wait for each other): the grid is one block per SM of an
H100 / H200 (132); on a GPU with fewer SMs the blocks past %nsmid leave at once and the rest split the
work. %nsmid counts SM ids, which may exceed the SMs a part has: there some blocks would never be resident,
a wait times out after seconds and the launch fails (a trap) instead of hanging the GPU. Tested on an H100
SXM only (132 SMs, %nsmid 132).
"""

from __future__ import annotations

import math

import numpy as np

from kernelmill.kernels.ops.base import (
    MAX_SMEM_BYTES,
    SM_REGS,
    Family,
    Launch,
    OpSpec,
    Param,
    cdiv,
    itemsize,
    tensor_map_arg,
)
from kernelmill.kernels.ops.elementwise import ACT_FUNCTIONS, ELEMENTWISE_ACTIVATIONS, torch_activation

#: Blocks launched: one per SM of the largest sm_90 parts (H100 SXM / H200: 132 SMs).
GRID_BLOCKS = 132
#: Bytes of one weight load (a column group is 16 bytes of a row; a warp reads 32 of them, a 512-byte strip).
_LOAD_BYTES = 16
_STRIP_BYTES = 32 * _LOAD_BYTES
#: Most shared memory the ring may take (the rest holds the warps' sums, gather lanes and x rows).
_RING_BYTES = 192 * 1024
#: Registers a thread needs besides accumulators and loads (addresses, task, loop).
_OTHER_REGS = 32
#: Activations of the up projections (the first is the default).
_ACTS = ("gelu_erf", *(a for a in ELEMENTWISE_ACTIVATIONS if a != "gelu_erf"))


class Persistent(Family):
    name = "persistent"
    template = "mlp_stack/persistent.cu.j2"
    description = "the whole stack in one persistent grid (TMA ring, done flags between its GEMVs); weights read once"
    params = (
        Param("max_m", (1, 2, 4, 8), "most rows of X a variant serves"),
        Param("threads", (256, 512, 768), "consumer threads per block (plus a producer warp; one block per SM)"),
        Param("rows", (16, 32, 64, 128), "rows of a TMA box (512 bytes wide): one stage of the ring"),
        Param("stages", (4, 6, 8, 12, 16), "stages of the ring (boxes in flight)"),
    )

    def defaults(self, dtype):
        return {"max_m": 1, "threads": 768, "rows": 32, "stages": 8}

    def needs_sm90(self, params):
        return "streams its weights with TMA and mbarriers"

    def shape_defaults(self, shape, dtype) -> dict:
        """The defaults with max_m the batch rounded up, and as deep a ring as shared memory holds."""
        params = dict(self.defaults(dtype))
        params["max_m"] = next((m for m in self.param("max_m").values if m >= shape[0]), params["max_m"])
        if params["max_m"] >= 4:
            params["threads"] = 512 if params["max_m"] == 4 else 256  # 8 x vec accumulators spilled at 512
        for stages in self.param("stages").values[::-1]:
            params["stages"] = stages
            if self.check(params, dtype) is None and self.check_shape(shape, params, dtype) is None:
                break
        return params

    @staticmethod
    def vec(dtype: str) -> int:
        return _LOAD_BYTES // itemsize(dtype)

    def registers(self, params, dtype) -> int:
        """Accumulators (max_m x vec floats) + a box row (4 words) + the rest."""
        return params["max_m"] * self.vec(dtype) + 4 + _OTHER_REGS

    @staticmethod
    def stage_bytes(params) -> int:
        return params["rows"] * _STRIP_BYTES

    def check(self, params, dtype):
        regs = self.registers(params, dtype)
        threads = params["threads"] + 32
        if threads > 1024:
            return f"{params['threads']} consumer threads + a producer warp > 1024 threads per block"
        if threads * regs > SM_REGS:
            return f"{threads} threads x ~{regs} registers exceed an SM's {SM_REGS}"
        if params["rows"] < params["threads"] // 32:
            return f"rows={params['rows']} leaves consumer warps without a row of a box"
        ring = params["stages"] * self.stage_bytes(params)
        if ring > _RING_BYTES:
            return f"a ring of {ring} bytes > {_RING_BYTES}"
        return None

    def smem_bytes(self, shape, params, dtype) -> int:
        """The ring and its mbarriers, the warps' sums of a strip (warps x 32 x vec floats), a float per thread,
        x rows (max_m x the longer of d_model / d_hidden, T)."""
        _batch, d_model, d_hidden, _layers = shape
        ring = params["stages"] * (self.stage_bytes(params) + 16)
        red = (params["threads"] * self.vec(dtype) + params["threads"]) * 4
        return ring + red + params["max_m"] * max(d_model, d_hidden) * itemsize(dtype)

    def check_shape(self, shape, params, dtype):
        batch, d_model, d_hidden, _layers = shape
        if batch > params["max_m"]:
            return f"batch={batch} > max_m={params['max_m']}"
        vec = self.vec(dtype)
        for name, n in (("d_model", d_model), ("d_hidden", d_hidden)):
            if n % vec:
                return f"{name}={n} is not a multiple of {vec} (16-byte loads of {dtype})"
        smem = self.smem_bytes(shape, params, dtype)
        if smem > MAX_SMEM_BYTES:
            return f"{smem} bytes of shared memory > {MAX_SMEM_BYTES}"
        return None

    def launches(self, shape, params, dtype):
        batch, d_model, d_hidden, layers = shape
        box = (self.box_cols(dtype), params["rows"], 1)
        # Boxes of the stacked weights (layers x K x N), innermost first; built from the buffers at 3 and 5.
        map_w1 = tensor_map_arg(3, (d_hidden, d_model, layers), box, dtype, swizzle=0)
        map_w2 = tensor_map_arg(5, (d_model, d_hidden, layers), box, dtype, swizzle=0)
        flags = self.flag_count(shape, dtype)
        return [
            Launch("mlp_stack_zero", (1, 1, 1), (256, 1, 1), 0, ("flags", flags)),
            Launch(
                "mlp_stack_persistent",
                (GRID_BLOCKS, 1, 1),
                (params["threads"] + 32, 1, 1),
                self.smem_bytes(shape, params, dtype),
                (map_w1, map_w2, "X", "W1", "b1", "W2", "b2", "Y", "P", "flags", batch, d_model, d_hidden, layers),
            ),
        ]

    @staticmethod
    def box_cols(dtype: str) -> int:
        return _STRIP_BYTES // itemsize(dtype)

    def phase_floats(self, shape, dtype) -> int:
        """fp32 partial sums of one phase: K slices x N x batch, for the larger kind of phase (as the kernel
        computes it, with at most GRID_BLOCKS blocks)."""
        batch, d_model, d_hidden, _layers = shape
        per = [max(1, GRID_BLOCKS // cdiv(n, self.box_cols(dtype))) * n for n in (d_hidden, d_model)]
        return batch * max(per)

    def flag_count(self, shape, dtype) -> int:
        """A done flag per task and phase: tasks are at most max(blocks, strips of the widest row)."""
        _batch, d_model, d_hidden, layers = shape
        return 2 * layers * max(GRID_BLOCKS, cdiv(max(d_model, d_hidden), self.box_cols(dtype)))

    def workspace(self, shape, params, dtype):
        """Every phase's partial sums (a block reads its inputs while others run ahead) and the done flags."""
        layers = shape[3]
        return {"P": 2 * layers * self.phase_floats(shape, dtype) * 4, "flags": self.flag_count(shape, dtype) * 4}

    def context(self, params, dtype, attrs):
        return {"act": attrs.get("act", "gelu_erf")}


class MlpStack(OpSpec):
    name = "mlp_stack"
    dims = ("batch", "d_model", "d_hidden", "layers")
    example_shape = "1x4096x11008x4"
    inputs = ("X", "W1", "b1", "W2", "b2")
    outputs = ("Y",)
    attributes = (Param("act", _ACTS, "activation of each block's up projection"),)
    families = {f.name: f for f in (Persistent(),)}

    def tensor_shapes(self, shape):
        batch, d_model, d_hidden, layers = shape
        return {
            "X": (batch, d_model),
            "W1": (layers, d_model, d_hidden),
            "b1": (layers, d_hidden),
            "W2": (layers, d_hidden, d_model),
            "b2": (layers, d_model),
            "Y": (batch, d_model),
        }

    def summed_terms(self, shape):
        _batch, d_model, d_hidden, layers = shape
        return (d_model + d_hidden + 2) * layers

    def layers(self, shape):
        return shape[3]

    def input_scale(self, name, shape):
        _batch, d_model, d_hidden, _layers = shape
        # Uniform [-s, s] has variance s^2 / 3: these keep every block's products of order one.
        return {"W1": math.sqrt(3.0 / d_model), "W2": math.sqrt(3.0 / d_hidden), "b1": 0.5, "b2": 0.5}.get(name, 1.0)

    def reference(self, inputs, attrs):
        x, w1, b1, w2, b2 = (inputs[n].astype(np.float64) for n in self.inputs)
        act = ACT_FUNCTIONS[attrs.get("act", "gelu_erf")]
        for layer in range(w1.shape[0]):
            x = act(x @ w1[layer] + b1[layer]) @ w2[layer] + b2[layer]
        return {"Y": x}

    def flops(self, shape):
        batch, d_model, d_hidden, layers = shape
        return 4.0 * batch * d_model * d_hidden * layers

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch

        x, w1, b1, w2, b2 = (tensors[n] for n in self.inputs)
        fn = torch_activation(attrs.get("act", "gelu_erf"))

        def run():
            y = x
            for layer in range(w1.shape[0]):
                y = torch.addmm(b2[layer], fn(torch.addmm(b1[layer], y, w1[layer])), w2[layer])
            return y

        return run


MLP_STACK = MlpStack()
