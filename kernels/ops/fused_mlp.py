"""fused_mlp: Y = act(X @ W1 + b1) @ W2 + b2, every matrix row-major.

X is batch x d_in, W1 d_in x d_hidden, W2 d_hidden x d_out. Three families:

* ``small_batch`` (decode-like batches): the hidden activation never reaches
  DRAM. Each block owns ``hidden_per_block`` hidden units, computes them for
  every batch row into shared memory, multiplies them by its rows of W2 and
  adds its partial Y into an fp32 workspace with atomics. A zeroing launch
  comes first and a launch that adds b2 and converts to T comes last.
* ``epilogue``: two GEMMs from the matmul op's templates, bias + activation
  fused into the first one's epilogue, H (batch x d_hidden, dtype T) in a
  workspace between them.
* ``wgmma`` (sm_90a, prefill-sized batches): the same two GEMMs as ``epilogue``
  on the Hopper wgmma + TMA kernel (common/gemm_wgmma.cuh.j2).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelmill.kernels.ops.base import (
    MAX_INDEXED_ELEMS,
    MAX_SMEM_BYTES,
    MAX_THREAD_REGS,
    SM_REGS,
    Family,
    Launch,
    OpSpec,
    Param,
    cdiv,
    itemsize,
)
from kernelmill.kernels.ops.matmul import (
    CORES,
    WgmmaFamily,
    gemm_check,
    gemm_check_shape,
    gemm_defaults,
    gemm_launches,
    gemm_smem_bytes,
    gemm_workspace,
)

ACTIVATIONS: tuple[str, ...] = ("gelu_tanh", "gelu_erf", "relu")

# -- small_batch -----------------------------------------------------------------

#: Threads of the two small helper launches (zero the workspace, finalize Y).
_AUX_THREADS = 256
#: Workspace rows are padded to this many floats so the vector atomics that cover
#: a row's tail stay inside the row and stay 16-byte aligned.
ACC_ROW_ALIGN_FLOATS = 16
#: The mma core's warp tile (fixed in small_batch_mma.cuh.j2): 64 hidden (phase 1) or output
#: (phase 2) columns, batch rows in m16 tiles.
_MMA_COLS_PER_WARP = 64
_MMA_M_TILE = 16
#: Padding (elements) of the mma core's hidden tile rows so A-fragment loads hit 32 banks.
_MMA_HIDDEN_PAD = 8
#: Floats a SIMT thread may hold as accumulators (max_batch * vec), so it does not spill.
_SIMT_MAX_ACC_FLOATS = 64
#: Registers a thread needs besides accumulators and loads in flight (addresses, indices, loop
#: state): about what ptxas reports beyond those two for the defaults, plus a margin.
_OTHER_REGS = 48

_CORE = Param("core", ("mma", "simt"), "mma: m16n8k16 tensor-core MMA (fp16/bf16 only); simt: fp32 FMA")
_MAX_BATCH = Param("max_batch", (1, 2, 4, 8, 16, 32), "largest batch a variant serves (rows held per thread)")
_HIDDEN_PER_BLOCK = Param("hidden_per_block", (16, 32, 64, 128, 256), "hidden units each block owns")
_THREADS = Param("threads", (128, 256, 512), "threads per block")
_VEC = Param("vec", (1, 2, 4, 8), "weight elements per load (simt; the mma core always loads 16 bytes)")
_UNROLL = Param("unroll", (1, 2, 4, 8), "weight loads in flight per thread: k rows (simt) or k16 steps (mma)")


@dataclass(frozen=True)
class SmallBatchLayout:
    """Thread partition and shared-memory layout of one small_batch variant.

    The template gets these numbers through ``context()`` and the launches take
    the shared-memory size from here, so Python and CUDA never disagree.
    """

    core: str
    max_batch: int
    hidden_per_block: int
    threads: int
    vec: int
    unroll: int
    elem_bytes: int

    @classmethod
    def of(cls, params: Mapping[str, Any], dtype: str) -> SmallBatchLayout:
        return cls(
            params["core"],
            params["max_batch"],
            params["hidden_per_block"],
            params["threads"],
            params["vec"],
            params["unroll"],
            itemsize(dtype),
        )

    @property
    def warps(self) -> int:
        return self.threads // 32

    # simt: threads are (k_groups x col_lanes); each lane loads `vec` hidden columns.
    @property
    def col_lanes(self) -> int:
        return self.hidden_per_block // self.vec

    # mma: warps are (k_warps x col_warps); each warp covers 64 hidden columns.
    @property
    def col_warps(self) -> int:
        return self.hidden_per_block // _MMA_COLS_PER_WARP

    @property
    def m_tiles(self) -> int:
        return cdiv(self.max_batch, _MMA_M_TILE)

    @property
    def estimated_registers(self) -> int:
        """Accumulators + one unroll group of loads in flight (weights as 32-bit words, X as
        floats or A-fragment words) + the rest: a screen against configs that must spill."""
        if self.core == "simt":
            weight_words = max(1, self.vec * self.elem_bytes // 4)
            return self.max_batch * self.vec + self.unroll * (weight_words + self.max_batch) + _OTHER_REGS
        # mma: 8 n-tiles x 4 floats per m-tile; per k step 4 x 16-byte weight loads + 4 A words per m-tile
        return 32 * self.m_tiles + self.unroll * (16 + 4 * self.m_tiles) + _OTHER_REGS

    @property
    def register_budget(self) -> int:
        """Registers a thread may have with one block of this size on an SM (at most 255)."""
        return min(MAX_THREAD_REGS, SM_REGS // self.threads)

    @property
    def partial_slots(self) -> int:
        """Phase-1 partial sums over d_in that meet in shared memory: one per warp (simt)
        or per k-warp (mma); the rest of the d_in reduction happens in registers/shuffles."""
        return self.warps if self.core == "simt" else self.warps // self.col_warps

    @property
    def partial_bytes(self) -> int:
        return self.partial_slots * self.max_batch * self.hidden_per_block * 4

    @property
    def hidden_row_elems(self) -> int:
        """Row length of the hidden tile: [hidden][max_batch] fp32 (simt) or
        [m_tiles*16][hidden + pad] T (mma, the A operand of phase 2)."""
        return self.max_batch if self.core == "simt" else self.hidden_per_block + _MMA_HIDDEN_PAD

    @property
    def hidden_bytes(self) -> int:
        if self.core == "simt":
            return self.hidden_per_block * self.max_batch * 4
        return self.m_tiles * _MMA_M_TILE * self.hidden_row_elems * self.elem_bytes

    @property
    def smem_bytes(self) -> int:
        return self.partial_bytes + _round_up(self.hidden_bytes, 16)

    def problems(self) -> str | None:
        """Why this layout cannot work, or None."""
        if self.core == "mma":
            if self.elem_bytes != 2:
                return "the mma core needs float16 or bfloat16 (small_batch keeps float32 exact)"
            if self.vec * self.elem_bytes != 16:
                return f"the mma core always loads 16 bytes: vec must be {16 // self.elem_bytes}"
            if self.max_batch % _MMA_M_TILE:
                return "the mma core pads the batch to 16 rows: max_batch must be 16 or 32"
            if self.hidden_per_block % _MMA_COLS_PER_WARP:
                return "the mma core needs hidden_per_block to be a multiple of 64"
            if self.col_warps > self.warps or self.warps % self.col_warps:
                return f"{self.warps} warps cannot split into {self.col_warps} column warps"
        else:
            if self.vec * self.elem_bytes > 16:
                return f"vec={self.vec} x {self.elem_bytes} bytes exceeds a 16-byte load"
            if self.col_lanes > 32:
                return f"hidden_per_block/vec={self.col_lanes} column lanes do not fit one warp"
            if self.col_lanes < 1 or self.hidden_per_block % self.vec:
                return "hidden_per_block must be a multiple of vec"
            if self.max_batch * self.vec > _SIMT_MAX_ACC_FLOATS:
                return f"max_batch*vec={self.max_batch * self.vec} accumulators > {_SIMT_MAX_ACC_FLOATS} per thread"
        if self.estimated_registers > self.register_budget:
            return (
                f"about {self.estimated_registers} registers per thread (accumulators + loads in flight) > "
                f"{self.register_budget} for {self.threads} threads: it would spill"
            )
        if self.smem_bytes > MAX_SMEM_BYTES:
            return f"{self.smem_bytes} bytes of shared memory > {MAX_SMEM_BYTES}"
        return None


def _round_up(value: int, multiple: int) -> int:
    return cdiv(value, multiple) * multiple


def acc_row_floats(d_out: int) -> int:
    """Row stride (floats) of small_batch's fp32 Y accumulator."""
    return _round_up(d_out, ACC_ROW_ALIGN_FLOATS)


class SmallBatch(Family):
    name = "small_batch"
    template = "fused_mlp/small_batch.cu.j2"
    description = (
        "decode-sized batches: each block owns a slice of hidden units, keeps them in shared memory "
        "and atomically adds its partial Y; weights are read once"
    )
    params = (_CORE, _MAX_BATCH, _HIDDEN_PER_BLOCK, _THREADS, _VEC, _UNROLL)

    def defaults(self, dtype: str) -> dict[str, Any]:
        if itemsize(dtype) == 2:
            return {"core": "mma", "max_batch": 16, "hidden_per_block": 64, "threads": 256, "vec": 8, "unroll": 2}
        return {"core": "simt", "max_batch": 8, "hidden_per_block": 32, "threads": 256, "vec": 4, "unroll": 4}

    def check(self, params, dtype):
        return SmallBatchLayout.of(params, dtype).problems()

    def check_shape(self, shape, params, dtype):
        batch, _d_in, _d_hidden, d_out = shape
        if batch > params["max_batch"]:
            return f"batch {batch} > max_batch {params['max_batch']} of this variant"
        if batch * acc_row_floats(d_out) >= MAX_INDEXED_ELEMS:
            return "the Y accumulator is too large for 32-bit indexing"
        return None

    def context(self, params, dtype, attrs):
        layout = SmallBatchLayout.of(params, dtype)
        return {
            "warps": layout.warps,
            "partial_floats": layout.partial_bytes // 4,
            "partial_slots": layout.partial_slots,
            "hidden_row_elems": layout.hidden_row_elems,
            "mma_type": {"float16": "f16", "bfloat16": "bf16"}.get(dtype, ""),
            "aux_threads": _AUX_THREADS,
        }

    def workspace(self, shape, params, dtype):
        batch, _d_in, _d_hidden, d_out = shape
        return {"y_acc": batch * acc_row_floats(d_out) * 4}

    def launches(self, shape, params, dtype):
        batch, d_in, d_hidden, d_out = shape
        layout = SmallBatchLayout.of(params, dtype)
        acc_floats = acc_row_floats(d_out)
        acc_float4s = batch * acc_floats // 4
        aux_block = (_AUX_THREADS, 1, 1)
        return [
            Launch("fused_mlp_zero_acc", (cdiv(acc_float4s, _AUX_THREADS), 1, 1), aux_block, 0, ("y_acc", acc_float4s)),
            Launch(
                "fused_mlp_small_batch",
                (cdiv(d_hidden, layout.hidden_per_block), 1, 1),
                (layout.threads, 1, 1),
                layout.smem_bytes,
                ("X", "W1", "b1", "W2", "y_acc", batch, d_in, d_hidden, d_out, acc_floats),
            ),
            Launch(
                "fused_mlp_finalize",
                (cdiv(batch * d_out, _AUX_THREADS), 1, 1),
                aux_block,
                0,
                ("y_acc", "b2", "Y", batch, d_out, acc_floats),
            ),
        ]


# -- epilogue ----------------------------------------------------------------------

#: GEMM core by storage dtype: tensor cores for 16-bit types; float32 stays exact (no TF32), so every
#: variant's precision is its dtype and each dtype searches one core's knobs.
_EPILOGUE_CORE_BY_ITEMSIZE = {2: "tensorcore", 4: "simt"}
#: Where the defaults leave the matmul core's: with a bias and no activation, its SIMT default (BK=8)
#: spills 32 bytes in fused_mlp_down (nvcc 13.0, sm_90); BK=16 spills in neither GEMM for any act.
_EPILOGUE_DEFAULT_CHANGES = {"simt": {"BK": 16}, "tensorcore": {}}


def _union_params(cores) -> tuple[Param, ...]:
    """One Param per knob name over the given GEMM cores, with the union of their values
    (BM, BN, BK, split_k are shared names; each core checks its own values)."""
    merged: dict[str, Param] = {}
    for core in cores:
        for p in core.params:
            if p.name in merged:
                values = tuple(sorted(set(merged[p.name].values) | set(p.values)))
                merged[p.name] = Param(p.name, values, merged[p.name].doc)
            else:
                merged[p.name] = p
    return tuple(merged.values())


class Epilogue(Family):
    """Two GEMMs from the matmul op's templates: H = act(X @ W1 + b1) into a workspace (dtype T),
    then Y = H @ W2 + b2. Both GEMMs take the same knobs; with split_k > 1 each writes fp32
    partials to the shared workspace ``ws`` and its reduce kernel applies bias and activation."""

    name = "epilogue"
    template = "fused_mlp/epilogue.cu.j2"
    description = "two tiled GEMMs with bias + activation fused into their epilogues; H goes through DRAM"
    params = (
        Param("core", tuple(CORES), "GEMM core: tensorcore for float16/bfloat16, simt (exact fp32) for float32"),
        *_union_params(CORES.values()),
    )

    def core_for(self, dtype: str) -> str:
        return _EPILOGUE_CORE_BY_ITEMSIZE[itemsize(dtype)]

    def defaults(self, dtype):
        core = self.core_for(dtype)
        return self._canonical(core, {**gemm_defaults(core, dtype), **_EPILOGUE_DEFAULT_CHANGES[core]})

    def _canonical(self, core: str, knobs: Mapping[str, Any]) -> dict[str, Any]:
        """A full parameter set: the core, its knobs, and every other core's knobs at their first value."""
        own = {p.name for p in CORES[core].params}
        return {"core": core, **{p.name: knobs[p.name] if p.name in own else p.values[0] for p in self.params[1:]}}

    def check(self, params, dtype):
        core = params["core"]
        if core != self.core_for(dtype):
            return f"core {core} is not used for {dtype}; {dtype} runs on {self.core_for(dtype)}"
        for p in CORES[core].params:
            if params[p.name] not in p.values:
                return f"{p.name}={params[p.name]} is not a {core} value; choose one of {p.values}"
        unused = [p for p in self.params[1:] if p.name not in {q.name for q in CORES[core].params}]
        for p in unused:
            if params[p.name] != p.values[0]:
                return f"{p.name} is not a {core} knob: leave it at {p.values[0]}"
        return gemm_check(core, params, dtype)

    def space(self, dtype):
        """Only the core of ``dtype``, its own knobs crossed (the rest pinned): far fewer candidates."""
        core = self.core_for(dtype)
        knobs = CORES[core].params
        for combo in itertools.product(*(p.values for p in knobs)):
            params = self._canonical(core, dict(zip((p.name for p in knobs), combo, strict=True)))
            if self.check(params, dtype) is None:
                yield params

    def _gemms(self, shape):
        """(entry, M, N, K, a, b, c, bias) of the up and down projections."""
        batch, d_in, d_hidden, d_out = shape
        return (
            ("fused_mlp_up", batch, d_hidden, d_in, "X", "W1", "H", "b1"),
            ("fused_mlp_down", batch, d_out, d_hidden, "H", "W2", "Y", "b2"),
        )

    def check_shape(self, shape, params, dtype):
        for _entry, m, n, k, *_ in self._gemms(shape):
            reason = gemm_check_shape(params["core"], m, n, k, params)
            if reason:
                return reason
        return None

    def workspace(self, shape, params, dtype):
        batch, _d_in, d_hidden, _d_out = shape
        split_bytes = max(gemm_workspace(params["core"], m, n, k, params) for _e, m, n, k, *_ in self._gemms(shape))
        hidden = {"H": batch * d_hidden * itemsize(dtype)}
        return {**hidden, "ws": split_bytes} if split_bytes else hidden

    def launches(self, shape, params, dtype):
        launches: list[Launch] = []
        for entry, m, n, k, a, b, c, bias in self._gemms(shape):
            launches += gemm_launches(params["core"], entry, m, n, k, params, dtype, a, b, c, bias=bias, ws="ws")
        return launches

    def context(self, params, dtype, attrs):
        return {"smem_bytes": gemm_smem_bytes(params["core"], params, dtype)}


# -- wgmma ---------------------------------------------------------------------------


def _mlp_gemms(shape) -> tuple[tuple[str, tuple[int, int, int], tuple[str, ...]], ...]:
    """(entry, (M, N, K), buffers A, B, C, bias) of the up and down projections."""
    batch, d_in, d_hidden, d_out = shape
    return (
        ("fused_mlp_up", (batch, d_hidden, d_in), ("X", "W1", "H", "b1")),
        ("fused_mlp_down", (batch, d_out, d_hidden), ("H", "W2", "Y", "b2")),
    )


class FusedWgmma(WgmmaFamily):
    """The up and down projections on the Hopper wgmma + TMA GEMM (sm_90a), bias + activation in the up
    projection's epilogue and bias in the down one's, H (batch x d_hidden, T) in a workspace between them.
    Both GEMMs take the same tile; the parameters are the matmul wgmma family's."""

    template = "fused_mlp/wgmma.cu.j2"
    entry = "fused_mlp_up"
    description = "two Hopper wgmma + TMA GEMMs, bias + activation in their epilogues; H goes through DRAM (sm_90a)"

    def check_shape(self, shape, params, dtype):
        for _entry, gemm, _buffers in _mlp_gemms(shape):
            reason = super().check_shape(gemm, params, dtype)
            if reason:
                return reason
        return None

    def workspace(self, shape, params, dtype):
        batch, _d_in, d_hidden, _d_out = shape
        gemms = [gemm for _entry, gemm, _buffers in _mlp_gemms(shape)]
        return {"H": batch * d_hidden * itemsize(dtype), **self.stream_k_workspace(gemms, params)}

    def launches(self, shape, params, dtype):
        launches = []
        for entry, gemm, buffers in _mlp_gemms(shape):
            launches += self.gemm_launches(entry, gemm, params, dtype, buffers)
        return launches


# -- the op ------------------------------------------------------------------------


# The GELUs without cancellation: 1 + erf(z) = erfc(-z) and 1 + tanh(u) = 2 / (1 + exp(-2u)) keep their
# relative precision for negative x, where the textbook forms leave float64 rounding noise.
def gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * np.vectorize(math.erfc, otypes=[np.float64])(-x / math.sqrt(2.0))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-2u) = inf for very negative x: the GELU is -0 there
        return x / (1.0 + np.exp(-2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


#: float64 activation by attribute value (the templates call act_<name> from the prelude).
ACTIVATION_FUNCTIONS = {"gelu_tanh": gelu_tanh, "gelu_erf": gelu_erf, "relu": relu}


class FusedMlp(OpSpec):
    name = "fused_mlp"
    matrix_bound = True
    dims = ("batch", "d_in", "d_hidden", "d_out")
    example_shape = "32x4096x16384x4096"
    inputs = ("X", "W1", "b1", "W2", "b2")
    outputs = ("Y",)
    attributes = (Param("act", ACTIVATIONS, "activation between the two projections"),)
    families = {f.name: f for f in (SmallBatch(), Epilogue(), FusedWgmma())}

    def tensor_shapes(self, shape):
        batch, d_in, d_hidden, d_out = shape
        return {
            "X": (batch, d_in),
            "W1": (d_in, d_hidden),
            "b1": (d_hidden,),
            "W2": (d_hidden, d_out),
            "b2": (d_out,),
            "Y": (batch, d_out),
        }

    def summed_terms(self, shape):
        _batch, d_in, d_hidden, _d_out = shape
        return d_in + d_hidden + 2  # both projections' products and biases

    def input_scale(self, name, shape):
        _batch, d_in, d_hidden, _d_out = shape
        # Uniform [-s, s] has variance s^2/3: these keep X @ W1 and H @ W2 of order one.
        return {"W1": math.sqrt(3.0 / d_in), "W2": math.sqrt(3.0 / d_hidden), "b1": 0.5, "b2": 0.5}.get(name, 1.0)

    def reference(self, inputs, attrs):
        x, w1, b1, w2, b2 = (inputs[n].astype(np.float64) for n in self.inputs)
        act = ACTIVATION_FUNCTIONS[attrs.get("act", ACTIVATIONS[0])]
        return {"Y": act(x @ w1 + b1) @ w2 + b2}

    def flops(self, shape):
        batch, d_in, d_hidden, d_out = shape
        return 2.0 * batch * (d_in * d_hidden + d_hidden * d_out)

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch
        import torch.nn.functional as F

        x, w1, b1, w2, b2 = (tensors[n] for n in self.inputs)
        act = attrs.get("act", ACTIVATIONS[0])
        if act == "relu":
            activate = torch.relu
        else:
            approximate = "tanh" if act == "gelu_tanh" else "none"

            def activate(h):
                return F.gelu(h, approximate=approximate)

        return lambda: torch.addmm(b2, activate(torch.addmm(b1, x, w1)), w2)


FUSED_MLP = FusedMlp()
