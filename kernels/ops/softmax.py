"""softmax over the last dim of a rows x cols matrix.

Families (templates/softmax/): ``warp_row`` (a warp per row), ``block_row`` (a block per row),
``cluster_row`` (a row shared by the blocks of a thread-block cluster, one launch), ``smem_row`` (a row, or a
cluster's share of it, requested whole into shared memory with cp.async: for long rows) and ``split_row`` (a
row split across several blocks in two launches). All share templates/softmax/row.cuh.j2; block_row,
cluster_row and smem_row also share their template; block_row and cluster_row copy a row (chunk) that needs
a second pass to shared memory when it fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kernelmill.kernels.ops.base import (
    MAX_SMEM_BYTES,
    SM_BLOCKS,
    SM_REGS,
    SM_THREADS,
    Family,
    Launch,
    OpSpec,
    Param,
    cdiv,
    itemsize,
)

_VEC = Param("vec", (1, 2, 4, 8), "elements per vector access (at most 16 bytes)")
_UNROLL = Param("unroll", (1, 2, 4, 8, 16), "vector accesses per thread held in registers per pass")
_FAST_EXP = Param("fast_exp", (False, True), "__expf instead of expf")

#: Registers a thread may spend on one pass of the row (floats), so a pass never spills.
_MAX_FLOATS_PER_THREAD = 64
#: Floats of a pass per thread that the defaults hold (a 16-byte vector times this over its width): rows up to
#: 32 * lanes elements stay in registers, read once.
_DEFAULT_FLOATS_PER_THREAD = 32
#: Registers per thread besides the pass's floats, for the __launch_bounds__ occupancy promise (fitted to
#: ptxas 13.0 over the parameter space: the largest overhead seen, rounded up). Left without a promise,
#: ptxas takes twice the registers it needs (e.g. 128 for a 32-float pass that fits 64 without spilling).
_OVERHEAD_REGS = 32
#: Dynamic shared memory a block_row / cluster_row launch may use for its row copy: at most half an SM's 227 KiB,
#: so two blocks still fit on an SM; longer rows (chunks) read their second pass from L2 instead.
SMEM_CACHE_LIMIT = MAX_SMEM_BYTES // 2
#: Dynamic shared memory one block may opt in to on sm_90 (227 KiB), less room for the kernel's static shared
#: memory (warp partials and the cluster's stats: under 300 bytes): smem_row's limit for a row (chunk) copy.
SMEM_ROW_LIMIT = MAX_SMEM_BYTES - 512
#: Most blocks a 1-D grid holds.
MAX_GRID_X = 2**31 - 1


def _check_vec_unroll(params: Mapping[str, Any], dtype: str) -> str | None:
    if params["vec"] * itemsize(dtype) > 16:
        return f"vec={params['vec']} x {itemsize(dtype)} bytes exceeds a 16-byte access"
    if params["vec"] * params["unroll"] > _MAX_FLOATS_PER_THREAD:
        return f"vec*unroll={params['vec'] * params['unroll']} > {_MAX_FLOATS_PER_THREAD} floats per thread"
    return None


def _vector_defaults(dtype: str) -> dict[str, Any]:
    vec = 16 // itemsize(dtype)
    return {"vec": vec, "unroll": _DEFAULT_FLOATS_PER_THREAD // vec, "fast_exp": dtype != "float32"}


def estimated_regs(params: Mapping[str, Any]) -> int:
    """Registers a thread needs without spilling: the pass's floats and the overhead, in steps of 8."""
    return cdiv(params["vec"] * params["unroll"] + _OVERHEAD_REGS, 8) * 8


def min_blocks(threads: int, params: Mapping[str, Any]) -> int:
    """Blocks per SM to promise in __launch_bounds__: as many as the estimated registers allow (at most the
    SM's thread and block limits), so ptxas does not take registers that would cost occupancy for nothing."""
    by_regs = SM_REGS // (threads * estimated_regs(params))
    return max(1, min(SM_THREADS // threads, SM_BLOCKS, by_regs))


def _check_registers(threads: int, params: Mapping[str, Any]) -> str | None:
    regs = estimated_regs(params)
    if threads * regs > SM_REGS:
        return f"{threads} threads x ~{regs} registers exceed an SM's {SM_REGS} (it would spill)"
    return None


def pass_elems(lanes: int, params: Mapping[str, Any]) -> int:
    """Elements of one pass of `lanes` threads: rows up to this long stay in registers."""
    return lanes * params["vec"] * params["unroll"]


class WarpRow(Family):
    name = "warp_row"
    template = "softmax/warp_row.cu.j2"
    pdl = True
    description = "one warp per row, several rows per block; best for short rows"
    params = (_VEC, _UNROLL, Param("rows_per_block", (1, 2, 4, 8, 16), "warps (rows) per block"), _FAST_EXP)

    def defaults(self, dtype: str) -> dict[str, Any]:
        d = _vector_defaults(dtype)
        return {"vec": d["vec"], "unroll": d["unroll"], "rows_per_block": 4, "fast_exp": d["fast_exp"]}

    def check(self, params, dtype):
        return _check_vec_unroll(params, dtype)

    def context(self, params, dtype, attrs):
        return {"min_blocks": min_blocks(32 * params["rows_per_block"], params)}

    def launches(self, shape, params, dtype):
        rows, cols = shape
        rpb = params["rows_per_block"]
        return [Launch("softmax_warp_row", (cdiv(rows, rpb), 1, 1), (32 * rpb, 1, 1), 0, ("x", "y", rows, cols))]

    def check_shape(self, shape, params, dtype):
        if cdiv(shape[0], params["rows_per_block"]) > MAX_GRID_X:
            return "more row blocks than a grid's x dimension holds"
        return None


class BlockRow(Family):
    name = "block_row"
    template = "softmax/block_row.cu.j2"
    pdl = True
    description = "one block per row with block-wide reductions; best for long rows"
    params = (_VEC, _UNROLL, Param("threads", (64, 128, 256, 512, 1024), "threads per block (per row)"), _FAST_EXP)
    #: Blocks sharing a row (cluster_row's knob; one here).
    cluster_size = 1
    entry = "softmax_block_row"
    #: Request the whole row (chunk) into shared memory before using it (smem_row) instead of the passes
    #: through registers with an optional shared copy.
    prefetch = False

    def defaults(self, dtype: str) -> dict[str, Any]:
        d = _vector_defaults(dtype)
        return {"vec": d["vec"], "unroll": d["unroll"], "threads": 256, "fast_exp": d["fast_exp"]}

    def check(self, params, dtype):
        return _check_vec_unroll(params, dtype) or _check_registers(params["threads"], params)

    def cluster(self, params: Mapping[str, Any]) -> int:
        return self.cluster_size

    def needs_sm90(self, params: Mapping[str, Any]) -> str | None:
        if (blocks := self.cluster(params)) > 1:
            return f"shares a row between {blocks} blocks of a thread-block cluster"
        return None

    def context(self, params, dtype, attrs):
        return {
            "min_blocks": min_blocks(params["threads"], params),
            "cluster": self.cluster(params),
            "entry": self.entry,
            "prefetch": self.prefetch,
        }

    def chunk(self, cols: int, params: Mapping[str, Any]) -> int:
        """Elements of a row per block: the row, or with a cluster its share rounded up to a multiple of vec."""
        cluster = self.cluster(params)
        return cols if cluster == 1 else cdiv(cdiv(cols, cluster), params["vec"]) * params["vec"]

    def cache_bytes(self, shape, params, dtype) -> int:
        """Dynamic shared memory for a copy of the block's chunk: given when the chunk takes a second pass and
        the copy fits the limit, else 0 (the kernel reads its size to decide)."""
        chunk = self.chunk(shape[1], params)
        if chunk <= pass_elems(params["threads"], params):
            return 0
        nbytes = cdiv(chunk, 8) * 8 * itemsize(dtype)
        return nbytes if nbytes <= SMEM_CACHE_LIMIT else 0

    def launches(self, shape, params, dtype):
        rows, cols = shape
        grid = (rows * self.cluster(params), 1, 1)
        smem = self.cache_bytes(shape, params, dtype)
        return [Launch(self.entry, grid, (params["threads"], 1, 1), smem, ("x", "y", rows, cols))]

    def check_shape(self, shape, params, dtype):
        rows, cols = shape
        if rows * self.cluster(params) > MAX_GRID_X:
            return "more blocks than a grid's x dimension holds"
        if cols + self.cluster(params) * params["vec"] > 2**31 - 1:
            return "chunk offsets would overflow 32 bits"
        return None


class ClusterRow(BlockRow):
    name = "cluster_row"
    description = "a row shared by a thread-block cluster, (max, sum) exchanged in distributed shared memory"
    params = (
        _VEC,
        _UNROLL,
        Param("threads", (64, 128, 256, 512, 1024), "threads per block"),
        Param("cluster", (2, 4, 8), "blocks of a thread-block cluster sharing each row"),
        _FAST_EXP,
    )
    entry = "softmax_cluster_row"

    def defaults(self, dtype: str) -> dict[str, Any]:
        # Its niche is a few long rows (many long rows: smem_row): 8 blocks of 256 threads hold a 32000-column row
        # in registers, one pass each (H100, 1x32000: 7.0 us against 8.1 us with 4 blocks of 32 floats a thread).
        d = _vector_defaults(dtype)
        return {"vec": d["vec"], "unroll": d["unroll"] // 2, "threads": 256, "cluster": 8, "fast_exp": d["fast_exp"]}

    def cluster(self, params: Mapping[str, Any]) -> int:
        return params["cluster"]


class SmemRow(BlockRow):
    name = "smem_row"
    description = (
        "a row (with cluster > 1, a cluster block's share of it) requested whole into shared memory with cp.async, "
        "then reduced and normalised from there: each element read from DRAM once; for long rows"
    )
    params = (
        _VEC,
        _UNROLL,
        Param("threads", (128, 256, 512, 1024), "threads per block"),
        Param("cluster", (1, 2, 4, 8), "blocks of a thread-block cluster sharing each row (1: no cluster)"),
        _FAST_EXP,
    )
    entry = "softmax_smem_row"
    prefetch = True

    def defaults(self, dtype: str) -> dict[str, Any]:
        # 16 floats a pass: the loads need no registers here, so passes only bound the arithmetic's registers;
        # 512 threads: a 32000-column fp16 row is 64 KB, three blocks (1536 threads) to an SM.
        vec = 16 // itemsize(dtype)
        return {"vec": vec, "unroll": 16 // vec, "threads": 512, "cluster": 1, "fast_exp": dtype != "float32"}

    def cluster(self, params: Mapping[str, Any]) -> int:
        return params["cluster"]

    def cache_bytes(self, shape, params, dtype) -> int:
        """Dynamic shared memory for the block's whole chunk (always given: the kernel has no other path)."""
        return cdiv(self.chunk(shape[1], params), 8) * 8 * itemsize(dtype)

    def check_shape(self, shape, params, dtype):
        nbytes = self.cache_bytes(shape, params, dtype)
        if nbytes > SMEM_ROW_LIMIT:
            return (
                f"a block's share of a row is {nbytes} bytes, over the {SMEM_ROW_LIMIT} bytes of shared memory a "
                "block can have (a larger cluster splits it further)"
            )
        return super().check_shape(shape, params, dtype)


class SplitRow(Family):
    name = "split_row"
    template = "softmax/split_row.cu.j2"
    pdl = True
    description = "a row split across blocks_per_row blocks: (max, sum) per chunk, then combine and normalise"
    params = (
        Param("blocks_per_row", (2, 4, 8, 16, 32, 64, 128), "blocks sharing one row"),
        Param("threads", (64, 128, 256, 512), "threads per block"),
        _VEC,
        _UNROLL,
        _FAST_EXP,
    )

    def defaults(self, dtype: str) -> dict[str, Any]:
        vec = 16 // itemsize(dtype)
        # 8 elements per thread: a 1x32000 row in 32 blocks of 128 threads is one pass per block.
        return {"blocks_per_row": 32, "threads": 128, "vec": vec, "unroll": 8 // vec, "fast_exp": dtype != "float32"}

    def check(self, params, dtype):
        return _check_vec_unroll(params, dtype) or _check_registers(params["threads"], params)

    def context(self, params, dtype, attrs):
        return {"min_blocks": min_blocks(params["threads"], params)}

    @staticmethod
    def chunk(cols: int, params: Mapping[str, Any]) -> int:
        """Elements of a row per block (a multiple of vec; the last blocks of a short row may get none)."""
        return cdiv(cdiv(cols, params["blocks_per_row"]), params["vec"]) * params["vec"]

    def launches(self, shape, params, dtype):
        rows, cols = shape
        grid = (rows * params["blocks_per_row"], 1, 1)
        block = (params["threads"], 1, 1)
        return [
            Launch("softmax_split_stats", grid, block, 0, ("x", "ws", rows, cols)),
            Launch("softmax_split_norm", grid, block, 0, ("x", "y", "ws", rows, cols)),
        ]

    def workspace(self, shape, params, dtype):
        rows, _ = shape
        return {"ws": rows * params["blocks_per_row"] * 8}  # (max, sum) float pairs

    def check_shape(self, shape, params, dtype):
        rows, cols = shape
        if rows * params["blocks_per_row"] > MAX_GRID_X:
            return "rows * blocks_per_row exceeds a grid's x dimension"
        if cols + params["blocks_per_row"] * params["vec"] > 2**31 - 1:
            return "chunk offsets would overflow 32 bits"
        return None


def _mask_rows(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Where a row is masked (-inf), as attention masks and causal masks put it, each row one of: a causal
    prefix kept (the rest masked: whole vectors, chunks and blocks of -inf at the row's end), one run of -inf
    from a random start (at the row's start too, so a chunk's max can be -inf before the row's is), or all
    but one random element masked. Never a whole row: its softmax is NaN, in torch too."""
    rows, cols = shape
    masked = np.zeros(shape, bool)
    col = np.arange(cols)
    for r in range(rows):
        pattern = r % 3
        if pattern == 0:
            masked[r] = col >= 1 + (r * 7919 + int(rng.integers(cols))) % cols
        elif pattern == 1:
            start, length = int(rng.integers(cols)), int(rng.integers(1, cols + 1))
            masked[r] = (col >= start) & (col < start + length)
            if masked[r].all():
                masked[r, int(rng.integers(cols))] = False
        else:
            masked[r] = col != int(rng.integers(cols))
    return masked


class Softmax(OpSpec):
    name = "softmax"
    intermediates = False  # only the output is rounded (OpSpec.intermediates)
    cancels = False  # each output a positive exp over a positive sum: held to its own size
    input_kinds = ("uniform", "offset", "masked")
    dims = ("rows", "cols")
    example_shape = "8192x8192"
    inputs = ("x",)
    outputs = ("y",)
    families = {f.name: f for f in (WarpRow(), BlockRow(), ClusterRow(), SmemRow(), SplitRow())}

    def tensor_shapes(self, shape):
        return {"x": shape, "y": shape}

    def summed_terms(self, shape):
        return shape[1]  # the row's exps

    def input_scale(self, name, shape):
        return 8.0  # a wide range so exp() and the max subtraction matter

    def make_inputs(self, shape, dtype, seed):
        """Uniform in [-8, 8]; on the "offset" kind's seeds each row moved by 100 to 2000 either way, where exp()
        overflows or underflows float32 unless the row's max is subtracted first; on the "masked" kind's, -inf
        in every row as masks put it (``_mask_rows``), at least one element of each row kept."""
        out = super().make_inputs(shape, dtype, seed)
        kind = self.input_kind(seed)
        rows = shape[0]
        rng = np.random.default_rng([seed, 1])
        if kind == "offset":
            offset = rng.uniform(100.0, 2000.0, size=(rows, 1)) * rng.choice([-1.0, 1.0], size=(rows, 1))
            x = out["x"]
            out["x"] = (x.astype(np.float32) + offset.astype(np.float32)).astype(x.dtype)
        elif kind == "masked":
            out["x"][_mask_rows(shape, rng)] = -np.inf
        return out

    def reference(self, inputs, attrs):
        x = inputs["x"].astype(np.float64)
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return {"y": e / e.sum(axis=-1, keepdims=True)}

    def flops(self, shape):
        rows, cols = shape
        return 4.0 * rows * cols  # max, subtract+exp, sum, scale

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch

        x = tensors["x"]
        return lambda: torch.softmax(x, dim=-1)


SOFTMAX = Softmax()
CLUSTER_ROW = SOFTMAX.families["cluster_row"]
SMEM_ROW = SOFTMAX.families["smem_row"]
