"""matmul: C[M x N] = A[M x K] @ B[K x N], all row-major, fp32 accumulation.

Two GEMM "cores" live here as plain Python (knobs, constraints, launch geometry) so that other ops can
reuse them with a fused epilogue; their CUDA lives in templates/common/gemm_simt.cuh.j2 and
templates/common/gemm_tc.cuh.j2 (one Jinja macro each, documented at the top of those files).

Helpers for ops that embed a GEMM (e.g. fused_mlp), with ``core`` = "simt" or "tensorcore":

* ``gemm_launches(core, entry, M, N, K, params, dtype, a, b, c, bias=None, ws="ws") -> list[Launch]``:
  the launches of the kernels that the core's macro emitted under ``entry`` (with ``bias=True`` in the
  macro exactly when ``bias`` names a buffer here). One launch when split_k == 1; with split_k > 1 the
  GEMM writes fp32 partials to workspace ``ws`` and ``entry + "_reduce"`` sums them into ``c``.
* ``gemm_workspace(core, M, N, K, params) -> int``: bytes of ``ws`` needed (0 when split_k == 1).
* ``gemm_check(core, params, dtype) -> str | None``, ``gemm_check_shape(core, M, N, K, params)``,
  ``gemm_defaults(core, dtype)``, ``gemm_params(core)`` and ``gemm_smem_bytes(core, params, dtype)``.

``params`` holds the core's knobs by their own names (simt: BM BN BK TM TN split_k; tensorcore:
BM BN BK WM WN stages split_k); extra keys are ignored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

from kernelmill.kernels.ops.base import (
    MAX_INDEXED_ELEMS,
    MAX_SMEM_BYTES,
    MAX_THREAD_REGS,
    Family,
    Launch,
    OpSpec,
    Param,
    SpecError,
    cdiv,
    itemsize,
    tensor_map_arg,
)
from kernelmill.kernels.ops.gemv import GEMV

#: Threads per block and outputs per thread of the split-K reduce kernel (KM_REDUCE_THREADS, 4 per thread).
REDUCE_THREADS = 256
REDUCE_ELEMS_PER_THREAD = 4
#: A grid's y and z dimensions hold at most this many blocks.
MAX_GRID_YZ = 65535
#: Shared memory one block may use without opting in (static arrays; MAX_SMEM_BYTES with it, ops/base.py).
MAX_STATIC_SMEM_BYTES = 48 * 1024

_SPLIT_K = Param("split_k", (1, 2, 4, 8, 16), "K slices run in parallel, summed by a second kernel (1: none)")


class GemmCore(ABC):
    """One GEMM kernel design: its knobs, their constraints and its block size / shared memory."""

    name: str
    params: tuple[Param, ...]

    @abstractmethod
    def tile(self, params: Mapping[str, Any]) -> tuple[int, int]:
        """(BM, BN): the output tile of one block."""

    @abstractmethod
    def threads(self, params: Mapping[str, Any]) -> int:
        """Threads per (1-D) block of the GEMM kernel."""

    @abstractmethod
    def smem_bytes(self, params: Mapping[str, Any], dtype: str) -> int:
        """Dynamic shared memory the GEMM kernel's launch must pass (0 for static arrays only)."""

    @abstractmethod
    def check(self, params: Mapping[str, Any], dtype: str) -> str | None:
        """Why ``params`` break a constraint for ``dtype``, or None."""

    @abstractmethod
    def defaults(self, dtype: str) -> dict[str, Any]:
        """Good general-purpose knobs for ``dtype`` (large square problems)."""


class SimtCore(GemmCore):
    """CUDA-core GEMM: TM x TN outputs per thread, double-buffered fp32 shared tiles (gemm_simt.cuh.j2)."""

    name = "simt"
    params = (
        Param("BM", (16, 32, 64, 128, 256), "block tile rows (M)"),
        Param("BN", (16, 32, 64, 128, 256), "block tile columns (N)"),
        Param("BK", (8, 16, 32), "K depth of one shared-memory tile"),
        Param("TM", (1, 2, 4, 8), "rows of C per thread"),
        Param("TN", (1, 2, 4, 8), "columns of C per thread"),
        _SPLIT_K,
    )
    #: Block sizes worth trying: 64-thread blocks of big thread tiles spilled under any occupancy promise and
    #: hide latency poorly; above 512 threads registers run out.
    min_threads, max_threads = 128, 512
    #: Outputs per thread: 4 or more amortize the shared loads; above 64 the accumulators crowd registers.
    min_outputs, max_outputs = 4, 64

    def tile(self, params):
        return params["BM"], params["BN"]

    def threads(self, params):
        return (params["BM"] // params["TM"]) * (params["BN"] // params["TN"])

    def static_smem_bytes(self, params) -> int:
        """The two fp32 buffers of As[BK][BM+4] and Bs[BK][BN+4]."""
        return 2 * params["BK"] * (params["BM"] + 4 + params["BN"] + 4) * 4

    def smem_bytes(self, params, dtype):
        return 0  # static shared arrays only

    def check(self, params, dtype):
        bm, bn, bk, tm, tn = (params[k] for k in ("BM", "BN", "BK", "TM", "TN"))
        if bm % tm or bn % tn:
            return f"thread tile {tm}x{tn} must divide the block tile {bm}x{bn}"
        threads = self.threads(params)
        if not self.min_threads <= threads <= self.max_threads:
            return f"{threads} threads per block; use {self.min_threads}..{self.max_threads}"
        if not self.min_outputs <= tm * tn <= self.max_outputs:
            return f"TM*TN={tm * tn} outputs per thread; use {self.min_outputs}..{self.max_outputs}"
        if (bm * bk) % threads or (bk * bn) % threads:
            return f"the {bm}x{bk} and {bk}x{bn} tiles must split evenly over {threads} threads"
        smem = self.static_smem_bytes(params)
        if smem > MAX_STATIC_SMEM_BYTES:
            return f"{smem} bytes of static shared memory > {MAX_STATIC_SMEM_BYTES}"
        return None

    def defaults(self, dtype):
        return {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8, "split_k": 1}


class TensorCoreCore(GemmCore):
    """WMMA GEMM: a cp.async ring of `stages` shared tiles, WM x WN outputs per warp (gemm_tc.cuh.j2)."""

    name = "tensorcore"
    params = (
        Param("BM", (16, 32, 64, 128, 256), "block tile rows (M)"),
        Param("BN", (32, 64, 128, 256), "block tile columns (N)"),
        Param("BK", (16, 32, 64), "K depth of one shared-memory tile"),
        Param("WM", (16, 32, 64), "warp tile rows (multiple of the 16-row fragment)"),
        Param("WN", (16, 32, 64), "warp tile columns (multiple of the 16-column fragment)"),
        Param("stages", (2, 3, 4), "depth of the cp.async shared-memory ring"),
        _SPLIT_K,
    )
    #: WMMA blocks beyond 8 warps were never the fastest in practice and crowd the register file.
    max_warps = 8
    #: A 16x16 warp tile does one mma per fragment pair loaded: shared-memory bound; need two or more.
    min_fragments_per_warp = 2
    #: fp32 accumulator registers one block may hold (half the register file), so blocks of many warps
    #: with big warp tiles, which would spill, are not tried.
    max_acc_regs_per_block = 32768
    max_regs_per_thread = MAX_THREAD_REGS

    def tile(self, params):
        return params["BM"], params["BN"]

    def warps(self, params) -> int:
        return (params["BM"] // params["WM"]) * (params["BN"] // params["WN"])

    def threads(self, params):
        return 32 * self.warps(params)

    def tf32_register_estimate(self, params) -> int:
        """Registers a float32 (TF32) thread needs: accumulators, 4 per cp.async chunk it issues per tile
        (address, bounds), 2 per k of the tile (converted fragments ptxas hoists) and 72 more. Fitted to
        ptxas 13.0: above 255 it spilled (e.g. 64x64 warps at BK=32, 1-2 warp blocks of 128x32 tiles)."""
        bm, bn, bk = params["BM"], params["BN"], params["BK"]
        chunks = cdiv((bm * bk + bk * bn) // 4, self.threads(params))
        return params["WM"] * params["WN"] // 32 + 4 * chunks + 2 * bk + 72

    def smem_bytes(self, params, dtype):
        """km_gemm_tc_smem_bytes: the ring (rows padded by 16 bytes) or the fp32 epilogue tile, if larger."""
        bm, bn, bk, stages = params["BM"], params["BN"], params["BK"], params["stages"]
        size = itemsize(dtype)
        pad = 16 // size
        ring = stages * (bm * (bk + pad) + bk * (bn + pad)) * size
        epilogue = bm * (bn + 4) * 4
        return max(ring, epilogue)

    def check(self, params, dtype):
        bm, bn, wm, wn = params["BM"], params["BN"], params["WM"], params["WN"]
        if bm % wm or bn % wn:
            return f"warp tile {wm}x{wn} must divide the block tile {bm}x{bn}"
        if (wm // 16) * (wn // 16) < self.min_fragments_per_warp:
            return f"warp tile {wm}x{wn} holds fewer than {self.min_fragments_per_warp} 16x16 fragments"
        warps = self.warps(params)
        if warps > self.max_warps:
            return f"{warps} warps per block > {self.max_warps}"
        acc_regs = self.threads(params) * (wm * wn // 32)
        if acc_regs > self.max_acc_regs_per_block:
            return f"{acc_regs} accumulator registers per block > {self.max_acc_regs_per_block}"
        if dtype == "float32":
            tf32_regs = self.tf32_register_estimate(params)
            if tf32_regs > self.max_regs_per_thread:
                return f"TF32 tile {wm}x{wn} (BK={params['BK']}) needs ~{tf32_regs} registers a thread (spills)"
        smem = self.smem_bytes(params, dtype)
        if smem > MAX_SMEM_BYTES:
            return f"{smem} bytes of shared memory > {MAX_SMEM_BYTES} (227 KiB)"
        return None

    def defaults(self, dtype):
        # 8 warps of 64x32; the fp32 (tf32) ring is twice as big, so it keeps 3 stages as well (104 KiB).
        return {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 32, "stages": 3, "split_k": 1}


CORES: dict[str, GemmCore] = {core.name: core for core in (SimtCore(), TensorCoreCore())}


def gemm_core(core: str) -> GemmCore:
    try:
        return CORES[core]
    except KeyError:
        raise SpecError(f"unknown GEMM core {core!r}; choose one of {', '.join(CORES)}") from None


def gemm_params(core: str) -> tuple[Param, ...]:
    return gemm_core(core).params


def gemm_defaults(core: str, dtype: str) -> dict[str, Any]:
    return gemm_core(core).defaults(dtype)


def gemm_check(core: str, params: Mapping[str, Any], dtype: str) -> str | None:
    return gemm_core(core).check(params, dtype)


def gemm_smem_bytes(core: str, params: Mapping[str, Any], dtype: str) -> int:
    return gemm_core(core).smem_bytes(params, dtype)


def gemm_check_shape(core: str, M: int, N: int, K: int, params: Mapping[str, Any]) -> str | None:  # noqa: N803
    """Why the kernels cannot run this shape: too many tile rows for the grid, or matrices past 32-bit offsets."""
    bm, _ = gemm_core(core).tile(params)
    if cdiv(M, bm) > MAX_GRID_YZ:
        return f"M={M} needs {cdiv(M, bm)} tile rows > {MAX_GRID_YZ} (grid y); use a larger BM"
    # 32-bit offsets: 64-bit ones cost the registers that let the default tiles fit 128 accumulators a thread.
    for name, elems in (("A", M * K), ("B", K * N), ("C", M * N)):
        if elems >= MAX_INDEXED_ELEMS:
            return f"{name} has {elems} elements; the kernels index with 32-bit offsets (< 2**31)"
    return None


def gemm_workspace(core: str, M: int, N: int, K: int, params: Mapping[str, Any]) -> int:  # noqa: N803
    """Bytes of the fp32 split-K partials (split_k slices of M x N), 0 without split-K."""
    gemm_core(core)  # validate the name
    split_k = params["split_k"]
    return split_k * M * N * 4 if split_k > 1 else 0


def gemm_launches(
    core: str,
    entry: str,
    M: int,  # noqa: N803
    N: int,  # noqa: N803
    K: int,  # noqa: N803
    params: Mapping[str, Any],
    dtype: str,
    a: str,
    b: str,
    c: str,
    bias: str | None = None,
    ws: str = "ws",
) -> list[Launch]:
    """Launches of the kernels a GEMM macro emitted under ``entry``, computing c = act(a @ b [+ bias]).

    a, b, c, bias and ws are buffer names; bias must be given exactly when the macro had bias=true.
    """
    g = gemm_core(core)
    bm, bn = g.tile(params)
    split_k = params["split_k"]
    grid = (cdiv(N, bn), cdiv(M, bm), split_k)
    block = (g.threads(params), 1, 1)
    smem = g.smem_bytes(params, dtype)
    bias_args: tuple[str, ...] = (bias,) if bias else ()
    if split_k == 1:
        return [Launch(entry, grid, block, smem, (a, b, c, *bias_args, M, N, K))]
    reduce_grid = (cdiv(M * N, REDUCE_THREADS * REDUCE_ELEMS_PER_THREAD), 1, 1)
    return [
        Launch(entry, grid, block, smem, (a, b, ws, M, N, K)),
        Launch(f"{entry}_reduce", reduce_grid, (REDUCE_THREADS, 1, 1), 0, (ws, c, *bias_args, M, N, split_k)),
    ]


class GemmFamily(Family):
    """A matmul family that is one GEMM core with no epilogue."""

    def __init__(self, core: GemmCore, name: str, template: str, entry: str, description: str) -> None:
        self.core = core
        self.name = name
        self.template = template
        self.entry = entry
        self.description = description
        self.params = core.params

    def defaults(self, dtype):
        return self.core.defaults(dtype)

    def check(self, params, dtype):
        return self.core.check(params, dtype)

    def check_shape(self, shape, params, dtype):
        return gemm_check_shape(self.core.name, *shape, params)

    def launches(self, shape, params, dtype):
        M, N, K = shape  # noqa: N806
        return gemm_launches(self.core.name, self.entry, M, N, K, params, dtype, "A", "B", "C")

    def workspace(self, shape, params, dtype):
        nbytes = gemm_workspace(self.core.name, *shape, params)
        return {"ws": nbytes} if nbytes else {}

    def context(self, params, dtype, attrs):
        return {"smem_bytes": self.core.smem_bytes(params, dtype)}


class TensorCoreFamily(GemmFamily):
    def precision(self, dtype):
        return "tf32" if dtype == "float32" else dtype


SIMT = GemmFamily(
    CORES["simt"],
    "simt",
    "matmul/simt.cu.j2",
    "matmul_simt",
    "CUDA-core tiled GEMM, exact fp32 FMA; any dtype",
)
TENSORCORE = TensorCoreFamily(
    CORES["tensorcore"],
    "tensorcore",
    "matmul/tensorcore.cu.j2",
    "matmul_tc",
    "WMMA tensor-core GEMM with a cp.async ring; float32 runs as TF32",
)


#: sk_tail: the most blocks that share a tile of the last round (KM_WGMMA_SK_PARTS; the op templates assert that
#: the two agree).
SK_MAX_PARTS = 4


class WgmmaFamily(Family):
    """Hopper GEMM: wgmma from a TMA-filled shared ring on mbarriers, a producer warpgroup and 1-2 MMA
    warpgroups, optionally persistent (common/gemm_wgmma.cuh.j2). sm_90a, float16/bfloat16 only.

    The tiles come from TMA tensor maps that the launcher encodes on the host (``TensorMapArg``), so A's and
    B's row strides must be multiples of 16 bytes: K and N multiples of 8. Other shapes are rejected by
    ``check_shape`` (the simt and tensorcore families run them).
    """

    name = "wgmma"
    template = "matmul/wgmma.cu.j2"
    entry = "matmul_wgmma"
    dtypes = ("float16", "bfloat16")
    arch_suffix = "a"
    pdl = True
    description = "Hopper wgmma GEMM, TMA ring on mbarriers, warp-specialised (sm_90a; fp16/bf16; K, N % 8 == 0)"
    params = (
        Param("BM", (64, 128, 256), "block tile rows (M)"),
        Param(
            "BN",
            (16, 32, 64, 128, 168, 192, 256),
            "block tile columns (N): the wgmma N (168 reads 168 of 3 TMA boxes; 16 and 32 with swap_ab: short M)",
        ),
        Param("consumers", (1, 2), "MMA warpgroups; each owns BM / consumers rows (64 or 128)"),
        Param("stages", (3, 4, 5, 6, 8, 10, 12, 16), "depth of the TMA shared-memory ring"),
        Param("ctas", (0, 128, 132), "persistent grid of this many blocks (at most one per tile); 0: a block per tile"),
        Param("stream_k", (False, True), "all tiles' k iterations split evenly over the ctas blocks (fp32 partials)"),
        Param("k_splits", (1, 2, 3, 4), "blocks (a cluster) sharing a tile's k, adding partial sums in shared memory"),
        Param("swap_ab", (False, True), "B as wgmma's A (C^T = B^T A^T): BM tiles N, BN tiles M; for short M"),
        Param(
            "tma_store",
            (False, True),
            "C leaves through a shared tile by TMA stores: a persistent block's next tile runs while they drain",
        ),
        Param(
            "sk_tail",
            (False, True),
            "persistent grid: whole tiles over its full rounds, a short last round's tiles cut in k over the blocks",
        ),
    )
    #: K depth of one ring stage: one 128-byte swizzle row of 16-bit elements.
    BK = 64
    #: fp32 accumulators one consumer thread may hold (the rest of its 232 registers is addresses and loop state).
    max_acc_regs = 128
    #: Most row tiles (M / BM) a stream-K variant takes: its groups hold a block per row tile.
    stream_k_max_row_tiles = 8
    #: stream_k's and sk_tail's arrival counts: zeroed when allocated, left zero by every launch.
    counter_workspaces = ("sk_flags",)
    #: TMA needs the row strides (K * 2 and N * 2 bytes) to be multiples of this.
    stride_align_bytes = 16
    #: Buffers of the launch after the two tensor maps (built over the first two): A, B, C [, bias].
    buffers = ("A", "B", "C")
    #: B given as (N, K), K-major (nn.Linear's weight layout; the linear_t op) instead of (K, N): a stage
    #: then holds one TMA box of exactly BN rows, so any BN that is a multiple of 8 loads only what it reads.
    b_kmajor = False

    def precision(self, dtype):
        return dtype

    def threads(self, params: Mapping[str, Any]) -> int:
        return 128 * (params["consumers"] + 1)

    def bn_loaded(self, params: Mapping[str, Any]) -> int:
        """Columns of wgmma's B a ring stage holds: whole 64-column TMA boxes (km_wgmma_bn_loaded), or BN rows
        of a K-major B (a K-major weight, or A itself with swap_ab)."""
        if self.b_kmajor or params.get("swap_ab"):
            return params["BN"]
        return cdiv(params["BN"], 64) * 64

    @staticmethod
    def staged_row_floats(params: Mapping[str, Any]) -> int:
        """Row stride (floats) of the fp32 tile an epilogue stages in the ring (the template's RS): BN rounded
        up so that it is 8 mod 32; with swap_ab the tile is staged transposed and its rows are BM rounded up
        so that it is 4 mod 32. Either keeps the fragment writes free of bank conflicts."""
        if params.get("swap_ab"):
            return params["BM"] + (4 - params["BM"] % 32) % 32
        return params["BN"] + (8 - params["BN"] % 32) % 32

    def staged_bytes(self, params: Mapping[str, Any]) -> int:
        """The fp32 tile an epilogue stages in the ring: [BM][RS], or [BN][RS] with swap_ab."""
        rows = params["BN"] if params.get("swap_ab") else params["BM"]
        return rows * self.staged_row_floats(params) * 4

    def ring_bytes(self, params: Mapping[str, Any], dtype: str) -> int:
        """The shared ring: stages of A (BM x 64) and B (64 x bn_loaded); split-K's partial sums reuse it."""
        return params["stages"] * (params["BM"] + self.bn_loaded(params)) * self.BK * itemsize(dtype)

    def base_smem_bytes(self, params: Mapping[str, Any], dtype: str) -> int:
        """km_wgmma_base_smem_bytes: the ring, a full and an empty mbarrier per stage, 1 KiB alignment slack."""
        return self.ring_bytes(params, dtype) + 16 * params["stages"] + 1024

    def c_cols(self, params: Mapping[str, Any], dtype: str) -> int:
        """Columns of C the shared C tile of tma_store holds at once (km_wgmma_c_cols): the most that divide BN
        in 64-column boxes and fit beside the ring, its barriers and the alignment slack; 0 where none fit.
        A wider tile goes out in rounds (128 x 256 with 4 stages: two of 128 columns)."""
        base = self.base_smem_bytes(params, dtype)
        for cols in range(params["BN"] // 64 * 64, 0, -64):
            if params["BN"] % cols == 0 and base + params["BM"] * cols * itemsize(dtype) <= MAX_SMEM_BYTES:
                return cols
        return 0

    def c_tile_bytes(self, params: Mapping[str, Any], dtype: str) -> int:
        """The shared tile of C that TMA stores read (tma_store), else nothing."""
        return params["BM"] * self.c_cols(params, dtype) * itemsize(dtype) if params.get("tma_store") else 0

    def smem_bytes(self, params: Mapping[str, Any], dtype: str) -> int:
        """km_gemm_wgmma_smem_bytes: the ring with its barriers and slack, and the C tile of tma_store."""
        return self.base_smem_bytes(params, dtype) + self.c_tile_bytes(params, dtype)

    def acc_regs(self, params: Mapping[str, Any]) -> int:
        """fp32 accumulators per consumer thread: (BM / consumers) x BN over 128 threads."""
        return params["BM"] // params["consumers"] * params["BN"] // 128

    def tiles(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> int:
        M, N, _ = shape  # noqa: N806
        if params.get("swap_ab"):
            M, N = N, M  # noqa: N806 (the tiles of C^T)
        return cdiv(M, params["BM"]) * cdiv(N, params["BN"])

    def grid(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> int:
        tiles = self.tiles(shape, params)
        if params.get("stream_k") or params.get("sk_tail"):
            return params["ctas"]  # every block takes a share, also where there are fewer tiles than blocks
        if params.get("k_splits", 1) > 1:
            return tiles * params["k_splits"]  # a cluster of k_splits blocks per tile
        return min(tiles, params["ctas"]) if params["ctas"] else tiles

    def defaults(self, dtype):
        # 128x256 tiles, two consumers of 64x256 (128 accumulators each), 4 stages (193 KiB), persistent.
        tile = {"BM": 128, "BN": 256, "consumers": 2, "stages": 4}
        return {
            **tile,
            "ctas": 132,
            "stream_k": False,
            "k_splits": 1,
            "swap_ab": False,
            "tma_store": False,
            "sk_tail": False,
        }

    def check(self, params, dtype):
        if dtype not in self.dtypes:
            return f"wgmma runs {' and '.join(self.dtypes)} only, not {dtype}"
        rows = params["BM"] // params["consumers"]
        if params["BM"] % params["consumers"] or rows not in (64, 128):
            return f"BM / consumers = {params['BM']} / {params['consumers']}: each consumer needs 64 or 128 rows"
        if params["BN"] < 64 and not (params.get("swap_ab") or self.b_kmajor):
            return f"BN={params['BN']} needs swap_ab (a K-major box of BN rows; N-major boxes are 64 columns)"
        acc = self.acc_regs(params)
        if acc > self.max_acc_regs:
            return f"{acc} accumulators per consumer thread > {self.max_acc_regs} (spills)"
        smem = self.smem_bytes(params, dtype)
        if smem > MAX_SMEM_BYTES:
            return f"{smem} bytes of shared memory > {MAX_SMEM_BYTES} (227 KiB)"
        if params.get("stream_k") and not params["ctas"]:
            return "stream_k shares the k iterations over a persistent grid: set ctas"
        if params.get("sk_tail") and not params["ctas"]:
            return "sk_tail shares the last round's tiles over a persistent grid: set ctas"
        if params.get("sk_tail") and params.get("stream_k"):
            return "sk_tail and stream_k are two ways to share k iterations: choose one"
        splits = params.get("k_splits", 1)
        if splits > 1 and (params["ctas"] or params.get("stream_k")):
            return f"k_splits={splits} runs a cluster per tile: use ctas=0 and no stream_k"
        if params.get("swap_ab") and (params["ctas"] or params.get("stream_k")):
            return "swap_ab stores through the staged tile of a block per tile: use ctas=0 and no stream_k"
        if params.get("tma_store"):
            if splits > 1 or params.get("swap_ab") or params.get("stream_k"):
                return "tma_store stores whole tiles of C as they are: use k_splits=1, no swap_ab and no stream_k"
            if params["BN"] % 64:
                return f"tma_store stores 64-column boxes: BN={params['BN']} must be a multiple of 64"
            if not self.c_cols(params, dtype):
                return f"tma_store: no room for a {params['BM']} x 64 tile of C beside a {params['stages']}-stage ring"
        if splits > 1 or params.get("swap_ab"):
            ring, staged = self.ring_bytes(params, dtype), self.staged_bytes(params)
            if staged > ring:
                tile = f"{params['BM']}x{params['BN']}"
                return f"the {tile} fp32 tile staged for the epilogue ({staged} bytes) exceeds the {ring}-byte ring"
        return None

    def check_shape(self, shape, params, dtype):
        M, N, K = shape  # noqa: N806
        size = itemsize(dtype)
        # Rows of A and of a K-major B are K long; rows of an N-major B are N long.
        for dim, value in (("K", K),) if self.b_kmajor else (("K", K), ("N", N)):
            if value * size % self.stride_align_bytes:
                return (
                    f"{dim}={value}: TMA needs row strides that are multiples of {self.stride_align_bytes} bytes "
                    f"({dim} a multiple of {self.stride_align_bytes // size})"
                    + ("" if self.b_kmajor else "; the tensorcore family runs this shape")
                )
        if params.get("tma_store") and N * size % self.stride_align_bytes:
            align = self.stride_align_bytes
            return f"N={N}: TMA stores need C's rows in multiples of {align} bytes (use tma_store=False)"
        if cdiv(M, params["BM"]) * cdiv(N, params["BN"]) >= 2**31 // 8:
            return "too many output tiles for the kernel's 32-bit tile index"
        splits = params.get("k_splits", 1)
        if cdiv(K, self.BK) < splits:
            return f"K={K} has {cdiv(K, self.BK)} k tiles of {self.BK}, fewer than k_splits={splits}"
        if params.get("stream_k") and cdiv(M, params["BM"]) > self.stream_k_max_row_tiles:  # (never swap_ab)
            return (
                f"stream_k serves short, wide problems: {cdiv(M, params['BM'])} row tiles > "
                f"{self.stream_k_max_row_tiles} (a block per row tile walks each share in lockstep)"
            )
        return None

    def launches(self, shape, params, dtype):
        return self.gemm_launches(self.entry, shape, params, dtype, self.buffers)

    def workspace(self, shape, params, dtype):
        return self.stream_k_workspace([shape], params)

    def sk_tail_split(self, shape: tuple[int, ...], params: Mapping[str, Any]) -> tuple[int, int]:
        """With sk_tail: (tiles of the last, partial round, k parts each) as the kernel cuts them (its
        tail_tiles and sk_parts). One part means whole tiles: nothing is shared."""
        tiles, ctas = self.tiles(shape, params), params["ctas"]
        tail = tiles % ctas
        if not params.get("sk_tail") or not tail:
            return 0, 1
        return tail, max(1, min(ctas // tail, SK_MAX_PARTS, cdiv(shape[2], self.BK)))

    def stream_k_workspace(self, shapes, params) -> dict[str, int]:
        """With stream_k: two fp32 tile slots per block for the parts of tiles it shares; with sk_tail, one per
        block that takes a part of a tail tile. And an arrival count per tile and consumer. Sized for the
        largest of the GEMMs in ``shapes`` (run one by one)."""
        if not (params.get("stream_k") or params.get("sk_tail")):
            return {}
        tiles = max(self.tiles(shape, params) for shape in shapes)
        if params.get("stream_k"):
            slots = 2 * params["ctas"]
        else:
            splits = [self.sk_tail_split(shape, params) for shape in shapes]
            slots = max(tail * parts if parts > 1 else 0 for tail, parts in splits)
        tile_bytes = params["BM"] * params["BN"] * 4
        return {"sk_ws": max(slots * tile_bytes, 4), "sk_flags": tiles * params["consumers"] * 4}

    def gemm_launches(self, entry: str, shape, params, dtype, buffers: tuple[str, ...]) -> list[Launch]:
        """The launches of one GEMM, kernel ``entry`` over ``buffers`` (A, B, C [, bias]) at ``shape``
        (M, N, K). (stream_k's and sk_tail's arrival counts, sk_flags, are counter_workspaces: the kernel leaves
        them zero.)"""
        M, N, K = shape  # noqa: N806
        # The maps come first (device.py pads them to ptxas's offsets), then the buffers: A at position a, B at
        # a + 1, C at a + 2, where a is the number of maps. With swap_ab wgmma's A is B and its B is A, K-major.
        # tma_store adds a third map, over C: 64-column boxes of one consumer's rows, stored from the C tile.
        a = 3 if params.get("tma_store") else 2
        if params.get("swap_ab"):
            if self.b_kmajor:
                a_map = tensor_map_arg(a + 1, (K, N), (self.BK, params["BM"]), dtype)
            else:
                a_map = tensor_map_arg(a + 1, (N, K), (64, self.BK), dtype)
            b_map = tensor_map_arg(a, (K, M), (self.BK, params["BN"]), dtype)
        else:
            a_map = tensor_map_arg(a, (K, M), (self.BK, params["BM"]), dtype)
            if self.b_kmajor:
                b_map = tensor_map_arg(a + 1, (K, N), (self.BK, params["BN"]), dtype)
            else:
                b_map = tensor_map_arg(a + 1, (N, K), (64, self.BK), dtype)
        maps = (a_map, b_map)
        if params.get("tma_store"):
            maps += (tensor_map_arg(a + 2, (N, M), (64, params["BM"] // params["consumers"]), dtype),)
        extra = ("sk_ws", "sk_flags") if params.get("stream_k") or params.get("sk_tail") else ()
        return [
            Launch(
                entry,
                (self.grid(shape, params), 1, 1),
                (self.threads(params), 1, 1),
                self.smem_bytes(params, dtype),
                (*maps, *buffers, *extra, M, N, K),
            )
        ]

    def context(self, params, dtype, attrs):
        swap = params.get("swap_ab", False)
        return {
            "smem_bytes": self.smem_bytes(params, dtype),
            "staged_row_floats": self.staged_row_floats(params),
            "b_kmajor": self.b_kmajor,
            "swap_ab": swap,
            "tma_store": params.get("tma_store", False),
            "sk_tail": params.get("sk_tail", False),
            "sk_max_parts": SK_MAX_PARTS,
        }


WGMMA = WgmmaFamily()


class Matmul(OpSpec):
    name = "matmul"
    intermediates = False  # only the output is rounded (OpSpec.intermediates)
    matrix_bound = True
    dims = ("M", "N", "K")
    example_shape = "4096x4096x4096"
    inputs = ("A", "B")
    outputs = ("C",)
    families = {f.name: f for f in (SIMT, TENSORCORE, WGMMA, GEMV)}

    def tensor_shapes(self, shape):
        M, N, K = shape  # noqa: N806
        return {"A": (M, K), "B": (K, N), "C": (M, N)}

    def summed_terms(self, shape):
        return shape[2]  # K

    def reference(self, inputs, attrs):
        return {"C": inputs["A"].astype(np.float64) @ inputs["B"].astype(np.float64)}

    def flops(self, shape):
        M, N, K = shape  # noqa: N806
        return 2.0 * M * N * K

    def input_scale(self, name, shape):
        return 1.0  # sums of K products of O(1) values: |C| ~ sqrt(K) / 3, well inside fp16 range

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch

        a, b = tensors["A"], tensors["B"]
        return lambda: torch.matmul(a, b)


MATMUL = Matmul()
