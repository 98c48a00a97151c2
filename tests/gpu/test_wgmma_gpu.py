"""The wgmma matmul family on a Hopper GPU (marker gpu): odd shapes verified, rejected shapes reported as
unsupported, and the big shapes' tuned points verified again after their timed launches. (Their speed next to
PyTorch is a benchmark's: benchmarks/kernels.py.)

One command: pytest -q tests/gpu/test_wgmma_gpu.py
"""

from __future__ import annotations

import pytest

from kernelmill.kernels.compile import Compiler
from kernelmill.kernels.evaluate import UNSUPPORTED, evaluate
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.variant import Variant

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16")
#: M anything; K and N multiples of 8 (TMA row strides): one row, ragged tiles, K tails and K < 64, a K of one
#: 8-element chunk, many tiles per persistent block, and the big square case.
SHAPES = [(1, 8, 8), (255, 136, 104), (300, 200, 512), (129, 264, 72), (64, 64, 8), (2048, 2048, 136)]
#: Deep K for the split-K points (at least k_splits k tiles), with K tails and ragged M and N.
DEEP = [(255, 136, 1032), (1, 200, 520), (300, 264, 4104)]
BIG = (4096, 4096, 4096)
#: The defaults and points that take the other code paths: one consumer (no setmaxnreg), two m64 rows per
#: consumer, BN of 64, 168 and 192, a block per tile and persistent grids, shallow and deep rings, stream-K,
#: split-K over clusters, swapped operands, TMA stores.
POINTS = [
    {},
    {"BM": 128, "BN": 128, "consumers": 2, "stages": 4, "ctas": 0},
    {"BM": 256, "BN": 128, "consumers": 2, "stages": 3, "ctas": 128},
    {"BM": 64, "BN": 192, "consumers": 1, "stages": 5, "ctas": 0},
    {"BM": 128, "BN": 64, "consumers": 1, "stages": 6, "ctas": 132},
    {"BM": 128, "BN": 192, "consumers": 2, "stages": 3, "ctas": 132},
    # stream-K: tiles shared by 2-3 blocks, blocks with nothing to do (tiny shapes), two m64 rows per consumer
    {"BM": 128, "BN": 192, "consumers": 2, "stages": 5, "ctas": 132, "stream_k": True},
    {"BM": 256, "BN": 128, "consumers": 2, "stages": 3, "ctas": 128, "stream_k": True},
    {"BM": 64, "BN": 64, "consumers": 1, "stages": 6, "ctas": 132, "stream_k": True},
    # a BN that is not a whole number of 64-column boxes (three loaded, 168 used), one tile per block and persistent
    {"BM": 128, "BN": 168, "consumers": 2, "stages": 4, "ctas": 0},
    {"BM": 128, "BN": 168, "consumers": 2, "stages": 4, "ctas": 132},
    # split-K over clusters of 2-4 blocks: one and two consumers, two m64 rows per consumer
    {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 0, "k_splits": 2},
    {"BM": 128, "BN": 192, "consumers": 2, "stages": 4, "ctas": 0, "k_splits": 3},
    {"BM": 64, "BN": 64, "consumers": 1, "stages": 6, "ctas": 0, "k_splits": 4},
    {"BM": 256, "BN": 128, "consumers": 2, "stages": 4, "ctas": 0, "k_splits": 2},
    # the deepest rings: 8 stages of 128 x 64 (the default where weights stream from DRAM), split; 12 of 64 x 64
    {"BM": 128, "BN": 64, "consumers": 2, "stages": 8, "ctas": 0, "k_splits": 2},
    {"BM": 64, "BN": 64, "consumers": 1, "stages": 12, "ctas": 132},
    # swapped operands (B as wgmma's A, M-major; A as a K-major B; C stored from the transposed staged tile):
    # one consumer with two m64 rows, a BN of 168 (a K-major box of 168 rows of A), split-K clusters
    {"BM": 128, "BN": 64, "consumers": 1, "stages": 6, "ctas": 0, "swap_ab": True},
    {"BM": 64, "BN": 168, "consumers": 1, "stages": 5, "ctas": 0, "swap_ab": True},
    {"BM": 128, "BN": 256, "consumers": 2, "stages": 4, "ctas": 0, "k_splits": 4, "swap_ab": True},
    {"BM": 256, "BN": 128, "consumers": 2, "stages": 4, "ctas": 0, "k_splits": 2, "swap_ab": True},
    # swapped tiles narrow on the batch side (wgmma n32 / n16) with deep rings: short M
    {"BM": 128, "BN": 32, "consumers": 2, "stages": 10, "ctas": 0, "k_splits": 2, "swap_ab": True},
    {"BM": 64, "BN": 16, "consumers": 1, "stages": 16, "ctas": 0, "swap_ab": True},
    # C through a shared tile and TMA stores: persistent grids storing a tile's columns at once, in two rounds
    # (4 stages of 128 x 256) and in three (5 of 128 x 192); a block per tile; one consumer; two m64 rows each
    {"BM": 128, "BN": 192, "consumers": 2, "stages": 4, "ctas": 132, "tma_store": True},
    {"BM": 128, "BN": 256, "consumers": 2, "stages": 4, "ctas": 128, "tma_store": True},
    {"BM": 128, "BN": 192, "consumers": 2, "stages": 5, "ctas": 132, "tma_store": True},
    {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 0, "tma_store": True},
    {"BM": 64, "BN": 64, "consumers": 1, "stages": 6, "ctas": 132, "tma_store": True},
    {"BM": 256, "BN": 128, "consumers": 2, "stages": 3, "ctas": 128, "tma_store": True},
    # a stream-K tail: the tiles of a short last round cut in 2-4 k parts (most SHAPES and DEEP have fewer tiles
    # than blocks; K tails leave uneven parts), stored by TMA or from registers, one consumer or two
    {"BM": 128, "BN": 256, "consumers": 2, "stages": 4, "ctas": 132, "tma_store": True, "sk_tail": True},
    {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 132, "sk_tail": True},
    {"BM": 64, "BN": 64, "consumers": 1, "stages": 6, "ctas": 128, "tma_store": True, "sk_tail": True},
]
#: Shapes where the family is timed against PyTorch, with the points worth comparing there.
_TMA = {"ctas": 128, "tma_store": True}
TIMED = {
    (4096, 4096, 4096): [{}, {"ctas": 128}, _TMA, {**_TMA, "stages": 3}],
    (8192, 8192, 8192): [{}, {"ctas": 128}, _TMA, {**_TMA, "stages": 3}],
    (2048, 11008, 4096): [{}, {"BN": 128, "stages": 6}, {"BM": 256, "BN": 128}, _TMA, {**_TMA, "BN": 128, "stages": 5}],
}


@pytest.fixture(scope="module")
def device():
    from kernelmill.kernels.device import get_device

    dev = get_device()
    if not dev.info.arch.startswith("sm_90"):
        pytest.skip(f"wgmma needs a Hopper GPU (sm_90a); this is {dev.info.name} ({dev.info.arch})")
    return dev


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return Compiler(cache_dir=tmp_path_factory.mktemp("wgmma-cubins"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("point", range(len(POINTS)))
def test_verifies_on_odd_shapes(device, compiler, dtype, point):
    variant = Variant.create("matmul", "wgmma", dtype, POINTS[point])
    shapes = SHAPES + DEEP + ([BIG] if point == 0 else [])
    ran = 0
    for shape in shapes:
        if variant.check_shape(shape):
            continue  # stream-K at more row tiles than its groups hold; split-K at fewer k tiles than splits
        ev = evaluate(variant, shape, device, compiler, seeds=2, timed=False)
        assert ev.ok, f"{variant.describe()} at {shape}: {ev.status}: {ev.reason}"
        ran += 1
    assert ran >= len(SHAPES) - 1 if variant.params["k_splits"] == 1 else ran >= len(DEEP) + 1


#: Swapped operands in the ops with a bias (along C's rows, so along the staged tile's columns) and an
#: activation: the (K, N) weight as an M-major wgmma A (linear, both GEMMs of fused_mlp), the (N, K) one as a
#: K-major A (linear_t).
SWAPPED = {
    "linear": [(255, 136, 104), (17, 264, 136), (3, 200, 520), (256, 1032, 1032)],
    "linear_t": [(255, 136, 104), (17, 61, 136), (3, 200, 520), (256, 1000, 1032)],
    "fused_mlp": [(3, 136, 256, 64), (17, 256, 520, 136)],
}
SWAPPED_POINTS = [
    {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 0, "k_splits": 2, "swap_ab": True},
    {"BM": 64, "BN": 64, "consumers": 1, "stages": 6, "ctas": 0, "swap_ab": True},
]


def _verify_with_activations(device, compiler, op, dtype, points, shapes):
    """Every point at every shape: the first point with each of the op's activations, the others with GELU."""
    spec = get_op(op)
    for i, params in enumerate(points):
        for act in spec.attributes[0].values if i == 0 else ("gelu_erf",):
            variant = Variant.create(op, "wgmma", dtype, params, {"act": act})
            for shape in shapes:
                assert not variant.check_shape(shape), f"{variant.describe()} rejects {shape}"
                ev = evaluate(variant, shape, device, compiler, seeds=2, timed=False)
                assert ev.ok, f"{variant.describe()} {act} at {shape}: {ev.status}: {ev.reason}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(SWAPPED))
def test_swapped_linears_verify(device, compiler, op, dtype):
    _verify_with_activations(device, compiler, op, dtype, SWAPPED_POINTS, SWAPPED[op])


#: TMA stores in the ops with a bias and an activation, the (N, K) weight of linear_t included: N a multiple of 8
#: (C's rows in 16-byte units), ragged tiles, K tails, and both GEMMs of fused_mlp.
TMA_STORED = {
    "linear": [(255, 136, 104), (300, 200, 520), (1000, 1032, 1032)],
    "linear_t": [(255, 136, 104), (300, 200, 520), (17, 64, 136)],
    "fused_mlp": [(3, 136, 256, 64), (300, 256, 520, 136)],
}
TMA_STORED_POINTS = [
    {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 132, "tma_store": True},
    {"BM": 128, "BN": 256, "consumers": 2, "stages": 4, "ctas": 128, "tma_store": True},
    {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 132, "tma_store": True, "sk_tail": True},
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(TMA_STORED))
def test_tma_stored_linears_verify(device, compiler, op, dtype):
    _verify_with_activations(device, compiler, op, dtype, TMA_STORED_POINTS, TMA_STORED[op])


@pytest.mark.parametrize("op", ["matmul", "linear", "linear_t"])
def test_shape_defaults_past_one_wave_verify(device, compiler, op):
    # More tiles than SMs: the shape defaults run a persistent grid with TMA stores (where the GPU has the SMs
    # for it), with a ragged last row tile and N not a multiple of the tile.
    from kernelmill.kernels.defaults import default_params

    spec = get_op(op)
    fam = spec.family("wgmma")
    shape = (2000, 2312, 264)
    params = default_params(spec, fam, shape, "float16", device.info.sm_count)
    assert fam.tiles(shape, params) > device.info.sm_count
    assert params["tma_store"] == (device.info.sm_count >= 128)
    attrs = {} if op == "matmul" else {"act": "gelu_erf"}
    ev = evaluate(Variant.create(op, "wgmma", "float16", params, attrs), shape, device, compiler, seeds=2, timed=False)
    assert ev.ok, f"{op} {params} at {shape}: {ev.status}: {ev.reason}"


#: Full rounds of whole tiles, then a last round cut in k (sk_tail): (tiles, tail tiles, parts) on 132 blocks.
SK_TAIL_PAST_ROUNDS = {
    (2000, 2312, 264): {"BN": 128, "stages": 5},  # 304 tiles: 2 rounds and 40 tiles in 3 parts of 1-2 k tiles
    (2047, 1288, 1032): {"BN": 256, "stages": 4},  # 96 tiles: no full round, 96 in one part (whole tiles)
    (2100, 2560, 1032): {"BN": 256, "stages": 4},  # 170 tiles: 1 round and 38 tiles in 3 parts of 5-6 k tiles
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["matmul", "linear", "fused_mlp"])
def test_sk_tail_past_full_rounds_verifies(device, compiler, op, dtype):
    for shape, tile in SK_TAIL_PAST_ROUNDS.items():
        params = {"BM": 128, "consumers": 2, "ctas": 132, "tma_store": True, "sk_tail": True, **tile}
        attrs = {} if op == "matmul" else {"act": "gelu_erf"}
        if op == "fused_mlp":
            shape = (shape[0], shape[2], shape[1], shape[2])  # (batch, d_in, d_hidden, d_out): up then down
        variant = Variant.create(op, "wgmma", dtype, params, attrs)
        ev = evaluate(variant, shape, device, compiler, seeds=2, timed=False)
        assert ev.ok, f"{variant.describe()} at {shape}: {ev.status}: {ev.reason}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_tma_cannot_address_are_unsupported(device, compiler, dtype):
    variant = Variant.create("matmul", "wgmma", dtype)
    for shape in [(1, 1, 1), (255, 129, 100), (300, 200, 513)]:
        ev = evaluate(variant, shape, device, compiler, seeds=1, timed=False)
        assert ev.status == UNSUPPORTED and "multiple of 8" in ev.reason


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_big_shapes_points_verify_before_and_after_their_timed_launches(device, compiler, dtype):
    """Their speed next to cuBLAS is measured in benchmarks/kernels.py (docs/PERFORMANCE.md), not here."""
    for shape, points in TIMED.items():
        for overrides in points:
            variant = Variant.create("matmul", "wgmma", dtype, overrides)
            ev = evaluate(variant, shape, device, compiler, seeds=1, timed=True, warmup=2, reps=5)
            assert ev.ok, f"{variant.describe()} at {shape}: {ev.status}: {ev.reason}"
