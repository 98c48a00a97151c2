"""The ``gemv`` matmul family: C = A @ B for small M (at most ``max_m`` rows), bandwidth-bound on B.

One launch, no workspace (templates/matmul/gemv.cu.j2 says how): a block streams a strip of
``block_cols`` columns of B over a slice of K; the ``k_splits`` blocks of a strip form a thread-block
cluster and add their fp32 partial sums through distributed shared memory, so nothing needs zeroing
and no second kernel reduces split-K partials. Inside a block the warps split K further and meet in
shared memory.

Two engines: ``mma=False`` multiplies on CUDA cores (exact fp32 FMA, every dtype); ``mma=True`` (16-bit
types) loads B straight from DRAM into tensor-core fragments (16-byte loads of four k rows per lane, byte
permutes pair the rows; no shared memory on the way) and multiplies on tensor cores (mma.m16n8k16, fp32
accumulators) with A, padded to 16 rows, as the A operand: the FMA pipe stays out of the way for M up to 32.

The linear op runs the same kernel with a bias and an activation in the final sum (its ``LinearGemv``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelmill.kernels.ops.base import (
    MAX_INDEXED_ELEMS,
    SM_BLOCKS,
    SM_REGS,
    SM_THREADS,
    Family,
    Launch,
    Param,
    cdiv,
    itemsize,
)

#: Static shared memory a block may declare.
MAX_STATIC_SMEM_BYTES = 48 * 1024
#: Registers beyond the accumulators and the loads in flight (addresses, bounds, loop state), fitted to
#: ptxas 13.0 over the space so that the __launch_bounds__ promise does not make it spill.
_OVERHEAD_REGS = {False: 40, True: 40}
#: Most registers a thread's accumulators and loads in flight may take, per engine.
_MAX_DATA_REGS = {False: 96, True: 128}
#: Columns of B one warp of the mma engine covers (8 n-tiles of 8).
MMA_WARP_COLS = 64
#: Most values of A one step of the FMA engine uses (max_m rows x unroll): ptxas hoists their loads, and more
#: of them spilled (e.g. max_m=32, unroll=8 in fp32).
_MAX_A_VALUES = 64


class GemvFamily(Family):
    name = "gemv"
    template = "matmul/gemv.cu.j2"
    entry = "matmul_gemv"
    description = "skinny matmul (M <= max_m): B streamed once, split-K over a thread-block cluster; one launch"
    #: Buffers of the launch: A, B, C (and the bias after C when ``bias``).
    buffers = ("A", "B", "C")
    #: The kernel adds bias[n] and applies the ``act`` attribute in its final sum (the linear op's subclass).
    bias = False
    params = (
        Param("max_m", (1, 2, 4, 8, 16, 32), "most rows of A (and C) a variant serves"),
        Param("mma", (False, True), "tensor cores (mma.m16n8k16, 16-bit types) instead of fp32 FMA"),
        Param("vec", (1, 2, 4, 8), "columns per thread of the FMA engine, one vector load (mma: 16 bytes)"),
        Param("block_cols", (32, 64, 128, 256), "columns of B (and C) per block (mma: 64 per warp along N)"),
        Param("threads", (64, 128, 256, 512), "threads per block; warps beyond block_cols split its K slice"),
        Param("k_splits", (1, 2, 4, 8), "blocks (a cluster) sharing a column strip, one K slice each"),
        Param("unroll", (1, 2, 4, 8), "rows of B per thread (FMA) or 16-row tiles per warp (mma) in flight"),
        Param("pipeline", (1, 2), "groups of unroll tiles in flight per warp (mma): 2 loads the next before the mma"),
        Param("a_vec", (False, True), "A's fragments by one 8- or 16-byte load per row, k reordered to match (mma)"),
    )

    def precision(self, dtype):
        return dtype  # fp32 stays fp32 (FMA engine only); 16-bit inputs accumulate in fp32 either way

    def needs_sm90(self, params: Mapping[str, Any]) -> str | None:
        if params.get("k_splits", 1) > 1:
            return f"with k_splits={params['k_splits']} shares a column strip between blocks of a thread-block cluster"
        return None

    # -- geometry ---------------------------------------------------------------------------------

    @staticmethod
    def k_warps(params: Mapping[str, Any]) -> int:
        """Warps along K in a block: all of them (FMA), or those beyond the 64-column strips (mma)."""
        warps = params["threads"] // 32
        return warps // (params["block_cols"] // MMA_WARP_COLS) if params["mma"] else warps

    def smem_bytes(self, params: Mapping[str, Any], dtype: str) -> int:
        """Static shared memory: the reduction buffer (every K warp's sums, max_m rows), plus the cluster's
        partial sums when k_splits > 1 (the kernel static_asserts the first)."""
        return self.red_smem_bytes(params) + self.part_bytes(params)

    def red_smem_bytes(self, params: Mapping[str, Any]) -> int:
        return self.k_warps(params) * params["max_m"] * (params["block_cols"] + 4) * 4

    def part_bytes(self, params: Mapping[str, Any]) -> int:
        return params["max_m"] * (params["block_cols"] + 4) * 4 if params["k_splits"] > 1 else 0

    def data_regs(self, params: Mapping[str, Any], dtype: str) -> int:
        """Registers of the accumulators and of the loads in flight per thread."""
        u = params["unroll"]
        if params["mma"]:
            # 8 n-tiles x 4 accumulators per m16 tile, 4 x 16 bytes of B and the A fragments per k16 step.
            mt = cdiv(params["max_m"], 16)
            return mt * 32 + params["pipeline"] * (u * 16 + u * mt * (4 if params["max_m"] > 8 else 2))
        vec = params["vec"]
        return params["max_m"] * vec + cdiv(u * vec * itemsize(dtype), 4) + u

    def estimated_regs(self, params: Mapping[str, Any], dtype: str) -> int:
        return cdiv(self.data_regs(params, dtype) + _OVERHEAD_REGS[params["mma"]], 8) * 8

    def min_blocks(self, params: Mapping[str, Any], dtype: str) -> int:
        threads = params["threads"]
        by_regs = SM_REGS // (threads * self.estimated_regs(params, dtype))
        return max(1, min(SM_THREADS // threads, SM_BLOCKS, by_regs))

    # -- Family interface -------------------------------------------------------------------------

    def defaults(self, dtype):
        if itemsize(dtype) == 2:
            # 8 warps of 64-column tiles, 2 tiles in flight (8 x 16 bytes a lane); M up to 16; clusters of 4.
            mma = {"mma": True, "vec": 8, "block_cols": 64, "threads": 256, "k_splits": 4, "unroll": 2}
            return {"max_m": 16, **mma, "pipeline": 1, "a_vec": True}
        fma = {"mma": False, "vec": 4, "block_cols": 32, "threads": 256, "k_splits": 4, "unroll": 4}
        return {"max_m": 16, **fma, "pipeline": 1, "a_vec": False}

    def check(self, params, dtype):
        size = itemsize(dtype)
        vec, bn = params["vec"], params["block_cols"]
        if params["mma"]:
            if size != 2:
                return f"the mma engine takes 16-bit types, not {dtype}"
            if vec * size != 16:
                return f"the mma engine loads 16 bytes (vec={16 // size})"
            if params["max_m"] < 8:
                return "the mma engine pads M to 16 rows: use max_m >= 8"
            if bn % MMA_WARP_COLS:
                return f"block_cols={bn}: the mma engine's warps take {MMA_WARP_COLS} columns each"
            if (params["threads"] // 32) % (bn // MMA_WARP_COLS):
                return f"{params['threads'] // 32} warps do not split into {bn // MMA_WARP_COLS} column strips"
        else:
            if params["pipeline"] != 1:
                return "pipeline applies to the mma engine (the FMA engine keeps unroll rows in flight)"
            if params.get("a_vec"):
                return "a_vec applies to the mma engine (the FMA engine loads A in runs of unroll values)"
            if vec * size > 16:
                return f"vec={vec} x {size} bytes exceeds a 16-byte access"
            lanes = bn // vec
            if not 4 <= lanes <= 32:
                return f"block_cols / vec = {lanes} lanes along N; use 4..32 (rows of 4 to 32 vectors per warp)"
            if params["max_m"] * params["unroll"] > _MAX_A_VALUES:
                return f"max_m * unroll = {params['max_m'] * params['unroll']} values of A per step > {_MAX_A_VALUES}"
        data, most = self.data_regs(params, dtype), _MAX_DATA_REGS[params["mma"]]
        if data > most:
            return f"~{data} registers of accumulators and loads in flight per thread > {most} (spills)"
        regs = self.estimated_regs(params, dtype)
        if params["threads"] * regs > SM_REGS:
            return f"{params['threads']} threads x ~{regs} registers exceed an SM's {SM_REGS}"
        smem = self.smem_bytes(params, dtype)
        if smem > MAX_STATIC_SMEM_BYTES:
            return f"{smem} bytes of static shared memory > {MAX_STATIC_SMEM_BYTES}"
        return None

    def check_shape(self, shape, params, dtype):
        M, N, K = shape  # noqa: N806
        if params["max_m"] < M:
            return f"M={M} > max_m={params['max_m']} (gemv serves skinny products; simt/tensorcore run this)"
        for name, elems in (("A", M * K), ("B", K * N), ("C", M * N)):
            if elems >= MAX_INDEXED_ELEMS:
                return f"{name} has {elems} elements; the kernel indexes with 32-bit offsets (< 2**31)"
        if N + params["block_cols"] >= MAX_INDEXED_ELEMS:
            return f"N={N}: the column offsets of the last strip would overflow 32 bits"
        return None

    def launches(self, shape, params, dtype):
        M, N, K = shape  # noqa: N806
        grid = (cdiv(N, params["block_cols"]), params["k_splits"], 1)
        return [Launch(self.entry, grid, (params["threads"], 1, 1), 0, (*self.buffers, M, N, K))]

    def context(self, params, dtype, attrs):
        return {
            "red_smem_bytes": self.red_smem_bytes(params),
            "min_blocks": self.min_blocks(params, dtype),
            "entry": self.entry,
            "bias": self.bias,
            "act": attrs.get("act", "none"),
            "pdl": self.pdl,
            "early_b": self.buffers[1] in self.pdl_early_reads,  # B (the weights) read before the PDL wait
        }


GEMV = GemvFamily()
