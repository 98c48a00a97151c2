"""The ``gemv`` family of ``linear_t``: Y = act(X @ W^T + b) for small M, by row dot products on W (N x K).

One launch, no workspace (templates/linear/gemv_t.cu.j2 says how): block b of ``blocks`` takes the rows b,
b + blocks, ... of W, its threads split each row's K in 16-byte chunks, and a row's sum meets inside the
block in a fixed order. With torch's weight layout a row is a whole dot product, so there is no split-K
across blocks (the ``linear`` op's gemv, on the (K, N) layout, needs clusters for that). At batch 1 on an
H200, eight of these kernels ran the 4 x (4096-11008-4096) MLP 2-3% faster than the linear op's gemv kernels
(docs/PERFORMANCE.md). Kernel times on an H200 put it level with the linear op's gemv at M = 1 and ahead of
linear_t's wgmma tiles there (27.7-28.4 us against 33.1-46.2 at 4096 x 11008 both ways). At M = 2 it stays
ahead on the 4096-output projection (30.8-33.0 against 50.0) and is level on the 11008-output one. From
M = 4 on it falls behind, because each row of X costs the warps another shuffle sum: so M <= 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelmill.kernels.ops.base import (
    MAX_INDEXED_ELEMS,
    MAX_SMEM_BYTES,
    MAX_THREAD_REGS,
    SM_REGS,
    SM_THREADS,
    Family,
    Launch,
    Param,
    cdiv,
    itemsize,
)

#: Registers a thread needs besides the loads in flight and the sums (addresses, loop).
_OTHER_REGS = 28


class RowDotGemv(Family):
    name = "gemv"
    template = "linear/gemv_t.cu.j2"
    entry = "linear_t_gemv"
    description = "skinny linear on an (N x K) weight: a block's rows as whole dot products, no split-K; one launch"
    buffers = ("X", "W", "Y", "b")
    dtypes = ("float16", "bfloat16")  # as linear_t's wgmma family: the op takes 16-bit types
    # In a graph its blocks may load their first rows of W before they wait for the kernel before them;
    # the runtime launches it so only where W is one of the model's parameters.
    pdl = True
    pdl_early_reads = ("W",)
    params = (
        Param("max_m", (1, 2), "most rows of X (and Y) a variant serves (a shuffle sum per row of W and of X)"),
        Param("threads", (256, 512, 1024), "threads per block: they split a row's K in 16-byte chunks"),
        Param("k_chunks", (1, 2, 3, 4, 6, 8), "16-byte chunks of a row per thread: K <= k_chunks x threads x 16 B"),
        Param("rows", (1, 2, 4, 8), "rows of W a warp has in flight"),
        Param("blocks", (132, 264, 396, 528), "blocks of the grid (the row stride): a multiple of an H100's 132 SMs"),
    )

    def defaults(self, dtype):
        return {"max_m": 1, "threads": 512, "k_chunks": 3, "rows": 2, "blocks": 264}

    def shape_defaults(self, shape, dtype: str, sm_count: int) -> dict[str, Any]:
        """For M x N x K: max_m the batch rounded up, as few chunks a thread as cover K, 4 rows in flight where
        a row is one chunk a thread and 2 otherwise (the best of H200 sweeps at 1 x 11008 x 4096 and 1 x 4096
        x 11008), two 512-thread blocks an SM."""
        m, _n, k = shape
        threads = 512
        max_m = next((v for v in self.param("max_m").values if v >= m), 2)
        chunks = cdiv(cdiv(k, self.vec(dtype)), threads)
        k_chunks = next((v for v in self.param("k_chunks").values if v >= chunks), 8)
        blocks = min(self.param("blocks").values, key=lambda b: abs(b - 2 * sm_count))
        rows = 4 if k_chunks == 1 else 2
        params = {"max_m": max_m, "threads": threads, "k_chunks": k_chunks, "rows": rows, "blocks": blocks}
        while params["rows"] > 1 and self.check(params, dtype):
            params["rows"] //= 2
        return params

    @staticmethod
    def vec(dtype: str) -> int:
        return 16 // itemsize(dtype)

    def data_regs(self, params: Mapping[str, Any]) -> int:
        """Registers of the rows in flight (16 bytes a chunk) and of their sums."""
        return params["rows"] * (4 * params["k_chunks"] + params["max_m"])

    def estimated_regs(self, params: Mapping[str, Any]) -> int:
        return cdiv(self.data_regs(params) + _OTHER_REGS, 8) * 8

    def min_blocks(self, params: Mapping[str, Any]) -> int:
        threads = params["threads"]
        return max(1, min(SM_THREADS // threads, SM_REGS // (threads * self.estimated_regs(params))))

    def check(self, params, dtype):
        regs = self.estimated_regs(params)
        if regs > MAX_THREAD_REGS:
            inflight = f"{params['rows']} rows x {params['k_chunks']} chunks"
            return f"~{regs} registers per thread for {inflight} in flight (spills)"
        if params["threads"] * regs > SM_REGS:
            return f"{params['threads']} threads x ~{regs} registers exceed an SM's {SM_REGS}"
        return None

    def smem_bytes(self, shape, params, dtype) -> int:
        """X (max_m rows of K) and the warps' shares of the block's rows (ceil(N / blocks) x max_m x warps)."""
        _m, n, k = shape
        x = params["max_m"] * k * itemsize(dtype)
        return x + cdiv(n, params["blocks"]) * params["max_m"] * (params["threads"] // 32) * 4

    def check_shape(self, shape, params, dtype):
        m, n, k = shape
        vec = self.vec(dtype)
        if m > params["max_m"]:
            return f"M={m} > max_m={params['max_m']} (gemv serves skinny products; wgmma runs this)"
        if k % vec:
            return f"K={k} is not a multiple of {vec} ({dtype} rows of 16-byte chunks)"
        most = params["k_chunks"] * params["threads"] * vec
        if k > most:
            return f"K={k} > k_chunks x threads x {vec} = {most}"
        if m * k >= MAX_INDEXED_ELEMS or m * n >= MAX_INDEXED_ELEMS:  # W's offsets are 64-bit
            return "X or Y has 2**31 elements or more; the kernel indexes them with 32-bit offsets"
        smem = self.smem_bytes(shape, params, dtype)
        if smem > MAX_SMEM_BYTES:
            return f"{smem} bytes of shared memory (X and the row sums) > {MAX_SMEM_BYTES}"
        return None

    def launches(self, shape, params, dtype):
        m, n, k = shape
        return [
            Launch(
                self.entry,
                (params["blocks"], 1, 1),
                (params["threads"], 1, 1),
                self.smem_bytes(shape, params, dtype),
                (*self.buffers, m, n, k),
            )
        ]

    def context(self, params, dtype, attrs):
        return {
            "min_blocks": self.min_blocks(params),
            "entry": self.entry,
            "act": attrs.get("act", "none"),
        }
