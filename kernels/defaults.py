"""Shape-aware default parameters: what a family runs with when nothing was tuned for a problem.

The runtime compiles these on first use (runtime/registry.py) and every tuning job evaluates them first
(agents/loop.py), so a tuned kernel is never slower than the untuned default it replaces. The tables are
measured (docs/PERFORMANCE.md); the GEMM tiles come from a wave-count cost model.
"""

from __future__ import annotations

import math
from typing import Any

from kernelmill.kernels.ops.attention import Fused, Mma, Wgmma
from kernelmill.kernels.ops.base import Family, itemsize
from kernelmill.kernels.ops.gemv import GemvFamily
from kernelmill.kernels.ops.gemv_t import RowDotGemv
from kernelmill.kernels.ops.matmul import CORES, GemmFamily, WgmmaFamily
from kernelmill.kernels.ops.mlp_stack import Persistent

#: Streaming multiprocessors assumed when sizing default GEMM tiles without a device (an H100 SXM's).
DEFAULT_SM_COUNT = 132

#: Largest M the skinny (gemv) family takes by default: below it B streams once at the copy rate.
GEMV_MAX_M = 16


def default_rank(fam: Family, shape, dtype: str) -> int:
    """Order of the families a default tries (the first that accepts the shape wins). 16-bit types run on
    tensor cores: gemv (fused_mlp: small_batch) for skinny M, then wgmma (sm_90), then WMMA, and attention's
    mma before its CUDA-core fused family; the CUDA-core "simt" families go last; float32 stays exact (no
    TF32), with gemv / small_batch first for skinny M. Otherwise declaration order."""
    skinny = len(shape) >= 3 and shape[0] <= GEMV_MAX_M  # matmul / linear M, fused_mlp batch
    order = ["gemv", "small_batch", "wgmma", "tensorcore"] if skinny else ["wgmma", "tensorcore"]
    order.append("mma")  # attention / sdpa (16-bit only; head_dim a multiple of 16 up to 128), after wgmma (64 / 128)
    if itemsize(dtype) != 2:
        order = ["gemv", "small_batch"] if skinny else []
    if fam.name in order:
        return order.index(fam.name)
    return len(order) + (1 if fam.name == "simt" and itemsize(dtype) == 2 else 0)


#: Block tiles tried for a default GEMM (largest first), with the warp / thread tiles that go with them.
_TC_TILES = [
    {"BM": 128, "BN": 128, "WM": 64, "WN": 32},
    {"BM": 64, "BN": 128, "WM": 32, "WN": 32},
    {"BM": 64, "BN": 64, "WM": 32, "WN": 32},
    {"BM": 32, "BN": 64, "WM": 16, "WN": 32},
]
_SIMT_TILES = [
    {"BM": 128, "BN": 128, "TM": 8, "TN": 8},
    {"BM": 64, "BN": 128, "TM": 8, "TN": 4},
    {"BM": 64, "BN": 64, "TM": 4, "TN": 4},
    {"BM": 32, "BN": 64, "TM": 4, "TN": 2},
]
#: Relative throughput of a block tile (bigger tiles reuse more of what they load).
_TILE_EFFICIENCY = {16384: 1.0, 8192: 0.85, 4096: 0.7, 2048: 0.5}


def _gemms(spec, fam: Family, shape) -> tuple[str, list[tuple[int, int]]] | None:
    """(core, [(M, N) of each GEMM]) for families built on the matmul GEMM cores, else None."""
    if isinstance(fam, GemmFamily):
        return fam.core.name, [(shape[0], shape[1])]
    if spec.name == "fused_mlp" and fam.name == "epilogue":
        batch, _d_in, d_hidden, d_out = shape
        return "", [(batch, d_hidden), (batch, d_out)]
    return None


#: gemv (mma engine) defaults by the largest M they serve: the best of sweeps over the family's space at
#: 1 and 16 x 4096 x 4096 / 4096 x 11008 / 11008 x 4096 on an H100 and an H200 (2026-11-22,
#: docs/PERFORMANCE.md). K is split 4 ways where N has many column strips and 8 ways where it has few (N <=
#: 96 x 64), with two groups of loads in flight at M <= 8 then (pipeline 2). At M = 16 and N = 11008 the
#: 4-way split took 37.5-38.4 us against 44.6-45.3 us for 8 ways on an H100 and 30.4 against 34.2 us on an
#: H200 (2026-11-24).
#: A's fragments come by vector loads (a_vec) everywhere: at 16 x 4096 x 11008 on an H200 32.8 -> 31.2 us, and
#: 28.4 us with two k16 steps a group (one 16-byte load of A per row for both); level at M = 1 (2026-11-25).
_GEMV_MMA_DEFAULTS = {
    8: {"max_m": 8, "block_cols": 64, "threads": 128, "k_splits": 4, "unroll": 1, "pipeline": 1, "a_vec": True},
    16: {"max_m": 16, "block_cols": 64, "threads": 128, "k_splits": 4, "unroll": 1, "pipeline": 1, "a_vec": True},
}
_GEMV_FEW_STRIPS = 96
_GEMV_FEW_STRIPS_CHANGES = {8: {"k_splits": 8, "pipeline": 2}, 16: {"k_splits": 8, "unroll": 2}}


def _gemv_params(params: dict[str, Any], shape) -> dict[str, Any]:
    m, n, _k = shape
    rows = 8 if m <= 8 else 16
    chosen = {**params, **_GEMV_MMA_DEFAULTS[rows]}
    if math.ceil(n / chosen["block_cols"]) <= _GEMV_FEW_STRIPS:
        chosen.update(_GEMV_FEW_STRIPS_CHANGES[rows])
    return chosen


#: wgmma tiles a default tries: (BM, BN, consumers, stages) and their relative throughput.
_WGMMA_TILES = [
    ((128, 256, 2, 4), 1.0),
    ((128, 192, 2, 5), 0.95),  # 5 stages: 44.4 vs 45.4 us at 256 x 11008 x 4096 on an H100
    ((128, 128, 2, 5), 0.85),
    ((128, 64, 2, 6), 0.72),  # measured ahead of 64 x 128 at 256 x 4096 x 11008 on an H100
    ((64, 128, 1, 6), 0.7),
    ((64, 64, 1, 6), 0.5),
]


#: Fewest k tiles (of 64) each block of a split-K cluster keeps.
_MIN_K_TILES_PER_SPLIT = 2
#: Shared memory of an sm_90 SM, and what the hardware reserves per resident block.
_SM_SMEM_BYTES, _BLOCK_RESERVED_SMEM_BYTES = 228 * 1024, 1024
#: Share of an SM's block slots that clusters of each size can fill at once: a cluster is placed on one GPC,
#: and GPC sizes do not divide by 3 or 4. cuOccupancyMaxActiveClusters on an H100 (132 SMs, 2026-11-24): at
#: one block per SM 66 / 39 / 30 clusters of 2 / 3 / 4 (132 / 117 / 120 blocks), at two 132 / 79 / 62 (264 /
#: 237 / 248). A grid past that runs a second wave: 128 x 256 tiles split 4 ways at 256 x 4096 x 11008 (128
#: blocks) took 80-83 us against 49-51 us split 3 ways (96 blocks) on an H100 and an H200.
_CLUSTER_SLOTS = {1: {1: 1.0, 2: 1.0, 3: 117 / 132, 4: 120 / 132}, 2: {1: 1.0, 2: 1.0, 3: 237 / 264, 4: 248 / 264}}


def _cluster_blocks(splits: int, blocks_per_sm: int, sm_count: int) -> int:
    """Blocks that clusters of ``splits`` blocks can hold at once."""
    share = _CLUSTER_SLOTS[min(blocks_per_sm, 2)][splits]
    return int(sm_count * blocks_per_sm * share) // splits * splits


def _k_splits(fam: WgmmaFamily, shape, params: dict[str, Any], dtype: str, sm_count: int) -> int:
    """Blocks per tile for a one-wave grid of few tiles: the most k_splits that the family takes with
    ``params`` and whose clusters still fit in one wave (no more blocks than SMs, and no more clusters than
    the GPCs place at once: ``_CLUSTER_SLOTS``).
    Measured on an H100 (docs/PERFORMANCE.md): BERT-base's 128 x 768 x 3072 linear 19.0 -> 12.2 us with 4,
    128 x 768 x 768 11.7 -> 9.9 us, 256 x 1024 x 8192 35.5 -> 24.1 us with 2; shapes with more tiles than
    half the SMs were slower split (the partial sums cost more than the idle SMs)."""
    tiles, k_tiles = fam.tiles(shape, params), math.ceil(shape[2] / fam.BK)
    per_sm = max(1, _SM_SMEM_BYTES // (fam.smem_bytes(params, dtype) + _BLOCK_RESERVED_SMEM_BYTES))
    fitting = [
        splits
        for splits in fam.param("k_splits").values
        if tiles * splits <= min(sm_count, _cluster_blocks(splits, per_sm, sm_count))
        and k_tiles >= _MIN_K_TILES_PER_SPLIT * splits
        and fam.check({**params, "k_splits": splits}, dtype) is None
    ]
    return max(fitting, default=1)


def _wgmma_params(fam: WgmmaFamily, shape, dtype: str, sm_count: int) -> dict[str, Any]:
    """The tile with the best estimated time (waves of tiles times a tile's work over its efficiency), a
    block per tile, split over the k of a cluster's blocks when there are too few tiles to fill the SMs."""
    best = _wgmma_tile(fam, shape, dtype, sm_count)
    return {**best, "k_splits": _k_splits(fam, shape, best, dtype, sm_count)}


def _wgmma_tile(fam: WgmmaFamily, shape, dtype: str, sm_count: int) -> dict[str, Any]:
    costed = _costed_wgmma_tiles(fam, shape, dtype, sm_count)
    return min(costed, key=lambda c: c[0])[1] if costed else fam.defaults(dtype)


#: Bytes of an H100's or H200's L2: weights larger than this stream from DRAM on every pass over them.
_L2_BYTES = 50 * 2**20


def _weights_from_dram(shape, dtype: str) -> bool:
    """Whether the K x N weights of an (M, N, K) GEMM outgrow L2, so every pass streams them from DRAM."""
    _m, n, k = shape
    return n * k * itemsize(dtype) > _L2_BYTES


#: Ring depth of 128 x 64 tiles over weights that stream from DRAM (192 KiB; one block per SM as with 6): more
#: weight boxes in flight. 256 x 4096 x 11008: 48.6 -> 43.5 us on an H100, 44.2 -> 41.1 us on an H200 (torch
#: 47.3 / 39.0); 128 x 4096 x 11008 split 2 ways: 39.9 -> 40.6 / 32.2 -> 31.4 us (2026-11-25,
#: docs/PERFORMANCE.md). The 64-row tiles at M = 32-64 gained nothing from deeper rings on both GPUs.
_STREAMED_128x64_STAGES = 8


#: Past one wave of tiles, a persistent grid of this many blocks whose stores leave by TMA from a shared C tile
#: (tma_store), so that each block's next tile runs while they drain. Against a block per tile (fp16, us, H200,
#: torch in brackets; 2026-11-25, docs/PERFORMANCE.md): 4096^3 193.1 -> 183.0 (179.2); 2048 x 11008 x 4096 +
#: gelu 299.3 -> 295.9 (282.6); 2048 x 4096 x 11008 244.7 -> 239.8 (236.1); 1024 x 11008 x 4096 + gelu 151.1 ->
#: 147.8 (143.0); 512 x 11008 x 4096 + gelu (128 x 192, 132 blocks) 80.8 -> 76.8 (74.9), 75.7 with 128. 128
#: blocks ran level with or ahead of 132 at 128 x 256. Without TMA stores a persistent grid was the slower one
#: (4096^3 201.9 against 193.5 a block per tile): its consumers stored their fragments from registers while the
#: tensor cores idled.
_PERSISTENT_CTAS = 128
#: Ring depth of a persistent tile with TMA stores where it differs from the tile's own: 128 x 192 in 4 stages
#: keeps its whole C tile in shared memory (5 stages leave room for 64 columns at a time: 78.8 against 76.8 us
#: at 512 x 11008 x 4096, 296.0 against 290.7 at 2048 x 11008 x 4096).
_TMA_STORE_STAGES = {(128, 192): 4}
#: Where the last round of a grid of this many blocks would hold at most half of them, the persistent grid is
#: this size and cuts that round's tiles in k over all its blocks (sk_tail). 2048 x 11008 x 4096 + gelu, 128 x 256
#: (688 tiles: 5 rounds and 28 tiles cut in 4): 288.0-292.7 -> 271.9 us on an H200 (torch 280.3). A longer last
#: round gains nothing: its cut tiles run no faster than whole ones while every block is busy (512 x 11008 x 4096:
#: 172 tiles, 40 of them cut in 3, 85.0 against 101.6 whole and 75.6 for the 128 x 192 default; 2026-11-25,
#: docs/PERFORMANCE.md).
_SK_TAIL_CTAS = 132


def _persistent(fam: WgmmaFamily, shape, dtype: str, params: dict[str, Any], sm_count: int) -> dict[str, Any]:
    """``params`` on a persistent grid with TMA stores (``_PERSISTENT_CTAS``, or ``_SK_TAIL_CTAS`` with a
    stream-K tail where its last round is short), where the family takes that at ``shape`` (BN a multiple of 64;
    C's rows a multiple of 16 bytes); else ``params`` as they are."""

    def runs(p: dict[str, Any]) -> bool:
        return fam.check(p, dtype) is None and fam.check_shape(shape, p, dtype) is None

    stages = _TMA_STORE_STAGES.get((params["BM"], params["BN"]), params["stages"])
    persistent = {**params, "ctas": _PERSISTENT_CTAS, "tma_store": True, "stages": stages}
    if not runs(persistent):
        return params
    tail = fam.tiles(shape, persistent) % _SK_TAIL_CTAS
    cut = {**persistent, "ctas": _SK_TAIL_CTAS, "sk_tail": True}
    if sm_count >= _SK_TAIL_CTAS and 0 < tail <= _SK_TAIL_CTAS // 2 and runs(cut):
        return cut
    return persistent


def _costed_wgmma_tiles(fam: WgmmaFamily, shape, dtype: str, sm_count: int) -> list[tuple[float, dict[str, Any]]]:
    """(estimated cost, params) of the valid tiles of ``_WGMMA_TILES``, in the table's order: waves of tiles
    times a tile's work over its efficiency.

    Where the weights (K x N) outgrow L2 and the largest tile's rows cover M, tiles that split M over several
    row tiles are left out: each row tile streams all of the weights again. At 128 x 4096 x 11008 64 x 64
    tiles (two row tiles) took 42.1 us (H200) and 43.6 us (H100) against 32.2 and 39.9 us for 128 x 64 split
    2 ways (torch 34.6 and 40.0; 2026-11-25, docs/PERFORMANCE.md)."""
    m, n, k = shape
    one_row_tile = max(bm for (bm, *_rest), _eff in _WGMMA_TILES)
    from_dram = _weights_from_dram(shape, dtype)
    streamed = m <= one_row_tile and from_dram
    costed = []
    for (bm, bn, consumers, stages), efficiency in _WGMMA_TILES:
        if streamed and bm < m:
            continue
        if from_dram and (bm, bn) == (128, 64):
            stages = _STREAMED_128x64_STAGES
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        params = {**fam.defaults(dtype), "BM": bm, "BN": bn, "consumers": consumers, "stages": stages, "ctas": 0}
        if fam.check(params, dtype) is not None:
            continue
        if tiles > sm_count >= _PERSISTENT_CTAS:
            params = _persistent(fam, shape, dtype, params, sm_count)
        costed.append((math.ceil(tiles / sm_count) * bm * bn / efficiency, params))
    return costed


#: A swapped tile narrow on the batch side, with a deep ring, for 16 < M <= 32 over weights that stream from DRAM:
#: the kind of tile cuBLAS runs there (nvjet 64x16 with 16 stages, 128x32 with 10). 32 x 4096 x 11008 in two-block
#: clusters: 30.6 us on an H200 against 37.1 for the shape default (torch 25.7; three blocks 32.6), but 41.5
#: against 37.8 on an H100; 32 x 11008 x 4096 unsplit 30.2 against 31.2 / 39.7 against 38.7 (2026-11-25,
#: docs/PERFORMANCE.md). So it is a runner-up the runtime times in place, not a default.
_SHORT_M_SWAPPED = {"BM": 128, "BN": 32, "consumers": 2, "stages": 10, "ctas": 0, "stream_k": False, "swap_ab": True}


def wgmma_seeds(fam: WgmmaFamily, shape, dtype: str, sm_count: int = DEFAULT_SM_COUNT, top: int = 3) -> list[dict]:
    """Starting points for a search beyond the shape default: the ``top`` tiles by estimated time once split as
    ``_k_splits`` splits them (a split tile's waves over its splits), each as it is and, where M is the
    shorter side, with swapped operands (``swap_ab``, a block per tile, split for its own tiles). The shape
    default ranks tiles unsplit, as measured on an H100; on an H200 the best 256 x 4096 x 11008 down
    projection is 128 x 128 split 2 ways and swapped (docs/PERFORMANCE.md), which this ranking puts first.
    At 16 < M <= 32 over weights streamed from DRAM, a swapped tile 32 wide on the batch side with a 10-stage
    ring comes second (``_SHORT_M_SWAPPED``)."""
    ranked = []
    for cost, tile in _costed_wgmma_tiles(fam, shape, dtype, sm_count):
        splits = _k_splits(fam, shape, tile, dtype, sm_count)
        waves = math.ceil(fam.tiles(shape, tile) * splits / sm_count)
        unsplit_waves = math.ceil(fam.tiles(shape, tile) / sm_count)
        ranked.append((cost * waves / unsplit_waves / splits, {**tile, "k_splits": splits}))
    seeds: list[dict[str, Any]] = []
    short_m = shape[0] < shape[1]  # swapped operands put M on wgmma's N: for the short side
    for _cost, tile in sorted(ranked, key=lambda c: c[0])[:top]:
        for swap in (False, True) if short_m else (False,):
            params = {**tile, "swap_ab": swap, **({"ctas": 0, "k_splits": 1, "tma_store": False} if swap else {})}
            if fam.check(params, dtype) is not None:
                continue
            if swap:
                params["k_splits"] = _k_splits(fam, shape, params, dtype, sm_count)
            if params not in seeds:
                seeds.append(params)
    if 16 < shape[0] <= 32 and _weights_from_dram(shape, dtype):
        narrow = {**fam.defaults(dtype), **_SHORT_M_SWAPPED}
        narrow["k_splits"] = min(2, _k_splits(fam, shape, narrow, dtype, sm_count))  # 3 ways was slower (32.6 us)
        if fam.check(narrow, dtype) is None and narrow not in seeds:
            seeds.insert(1, narrow)  # second: within the runners-up the runtime times
    return seeds


def default_alternatives(spec, fam: Family, shape, dtype: str, sm_count: int = DEFAULT_SM_COUNT) -> list[dict]:
    """Runners-up to ``default_params`` worth timing where the problem can be measured in place (the runtime's
    capture-time choice, ``Model.tune_kernels``): for the wgmma GEMMs the search's seeds (the cost model's best
    tiles once split, and their swapped forms where M is short), which the shape default ranks below its own
    tile although some GPUs run them faster (docs/PERFORMANCE.md: at 256 x 4096 x 11008 128 x 128 split 2 ways
    on an H200, the default 128 x 64 on an H100); none for other families."""
    if not (isinstance(fam, WgmmaFamily) and len(shape) == 3):
        return []
    default = default_params(spec, fam, shape, dtype, sm_count)
    return [p for p in wgmma_seeds(fam, shape, dtype, sm_count) if p != default]


def default_params(spec, fam: Family, shape, dtype: str, sm_count: int = DEFAULT_SM_COUNT) -> dict[str, Any]:
    """The family's defaults; for GEMM families the block tile with the best estimated time for this
    shape (waves of blocks over the SMs times the work of a tile, discounted by the tile's efficiency),
    so a small M or N does not leave most of the GPU idle; for gemv the measured best by M."""
    params = dict(fam.defaults(dtype))
    if isinstance(fam, Persistent):
        return fam.shape_defaults(shape, dtype)
    if isinstance(fam, RowDotGemv):
        return fam.shape_defaults(shape, dtype, sm_count)
    if isinstance(fam, (Mma, Wgmma)):
        return fam.shape_defaults(shape, dtype, sm_count)
    if isinstance(fam, Fused):
        return fam.shape_defaults(shape, dtype)
    if isinstance(fam, WgmmaFamily) and len(shape) == 3:
        return _wgmma_params(fam, shape, dtype, sm_count)
    if isinstance(fam, GemvFamily) and params["mma"] and len(shape) == 3:
        return _gemv_params(params, shape)
    gemms = _gemms(spec, fam, shape)
    if gemms is None:
        return params
    core_name, sizes = gemms
    core_name = core_name or params.get("core", "")
    core = CORES.get(core_name)
    if core is None:
        return params
    tiles = _TC_TILES if core_name == "tensorcore" else _SIMT_TILES
    best, best_cost = params, math.inf
    for tile in tiles:
        candidate = {**params, **tile}
        if fam.check(candidate, dtype) is not None:
            continue
        area = tile["BM"] * tile["BN"]
        cost = 0.0
        for m, n in sizes:
            # Tiles per SM (the busiest one) times the time of a tile; blocks sharing an SM share its rate.
            blocks = math.ceil(m / tile["BM"]) * math.ceil(n / tile["BN"])
            cost += math.ceil(blocks / sm_count) * area / _TILE_EFFICIENCY.get(area, 0.4)
        if cost < best_cost:
            best, best_cost = candidate, cost
    return best
