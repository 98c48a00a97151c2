import numpy as np
import pytest

from kernelmill.kernels.ops.softmax import (
    CLUSTER_ROW,
    SMEM_CACHE_LIMIT,
    SOFTMAX,
    estimated_regs,
    min_blocks,
    pass_elems,
)
from kernelmill.kernels.render import render


def test_reference_matches_direct_formula():
    x = SOFTMAX.make_inputs((7, 33), "float32", seed=3)["x"]
    y = SOFTMAX.reference({"x": x}, {})["y"]
    direct = np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y, direct, rtol=1e-12)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-12)


def test_min_bytes_is_one_read_one_write():
    assert SOFTMAX.min_bytes((8192, 8192), "float16") == 2 * 8192 * 8192 * 2


def test_families():
    assert list(SOFTMAX.families) == ["warp_row", "block_row", "split_row"]


def test_launch_geometry_covers_rows():
    warp = SOFTMAX.family("warp_row")
    params = warp.resolve({"rows_per_block": 8}, "float16")
    (launch,) = warp.launches((1000, 64), params, "float16")
    assert launch.grid[0] * 8 >= 1000 and launch.threads == 256
    block = SOFTMAX.family("block_row")
    params = block.resolve({"threads": 512}, "float32")
    (launch,) = block.launches((77, 100000), params, "float32")
    assert launch.grid == (77, 1, 1) and launch.threads == 512
    assert launch.args == ("x", "y", 77, 100000)


def test_defaults_keep_rows_up_to_32_per_thread_in_registers():
    for dtype, vec in (("float32", 4), ("float16", 8), ("bfloat16", 8)):
        fast = dtype != "float32"
        warp = SOFTMAX.family("warp_row").defaults(dtype)
        block = SOFTMAX.family("block_row").defaults(dtype)
        cluster = CLUSTER_ROW.defaults(dtype)
        assert warp == {"vec": vec, "unroll": 32 // vec, "rows_per_block": 4, "fast_exp": fast}
        assert block == {"vec": vec, "unroll": 32 // vec, "threads": 256, "fast_exp": fast}
        assert cluster == {"vec": vec, "unroll": 32 // vec, "threads": 256, "cluster": 4, "fast_exp": fast}
        assert pass_elems(32, warp) == 1024 and pass_elems(256, block) == 8192
        split = SOFTMAX.family("split_row").defaults(dtype)
        assert split["blocks_per_row"] == 32 and split["threads"] * split["vec"] * split["unroll"] == 1024


def test_register_budget_constraint():
    fam = SOFTMAX.family("block_row")
    assert fam.check({"vec": 8, "unroll": 16, "threads": 256, "fast_exp": False}, "float16") is not None
    assert fam.check({"vec": 4, "unroll": 16, "threads": 256, "fast_exp": False}, "float32") is None
    # 1024 threads leave 64 registers each: a 64-float pass would spill.
    assert "spill" in fam.check({"vec": 4, "unroll": 16, "threads": 1024, "fast_exp": False}, "float32")
    assert fam.check({"vec": 4, "unroll": 8, "threads": 1024, "fast_exp": False}, "float32") is None


def test_launch_bounds_promise():
    assert estimated_regs({"vec": 4, "unroll": 8}) == 64
    assert min_blocks(256, {"vec": 8, "unroll": 4}) == 4  # 64 registers: 4 blocks of 256
    assert min_blocks(1024, {"vec": 4, "unroll": 8}) == 1
    assert min_blocks(32, {"vec": 1, "unroll": 1}) == 32  # capped by the SM's block limit
    src = render(SOFTMAX.family("block_row"), SOFTMAX.family("block_row").defaults("float16"), "float16")
    assert "__launch_bounds__(KM_THREADS, 4)" in src and "softmax_block_row(" in src


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_shared_memory_copy_only_when_it_helps_and_fits(dtype):
    fam = SOFTMAX.family("block_row")
    size = 4 if dtype == "float32" else 2
    params = fam.resolve({"threads": 256}, dtype)  # one pass: 8192 elements
    assert fam.launches((10, 8192), params, dtype)[0].smem_bytes == 0  # fits registers
    (launch,) = fam.launches((10, 8193), params, dtype)
    assert launch.smem_bytes == 8200 * size and launch.args == ("x", "y", 10, 8193)  # rounded up to 8
    long_cols = SMEM_CACHE_LIMIT // size + 8
    assert fam.launches((10, long_cols), params, dtype)[0].smem_bytes == 0  # too long: second pass from L2


def test_cluster_row_shares_each_row():
    fam = CLUSTER_ROW
    assert fam.template == SOFTMAX.family("block_row").template
    params = fam.defaults("float16")
    (launch,) = fam.launches((4096, 32000), params, "float16")
    assert launch.entry == "softmax_cluster_row" and launch.args == ("x", "y", 4096, 32000)
    assert launch.grid == (4096 * 4, 1, 1) and launch.smem_bytes == 0  # 8000 elements a block: one pass
    assert fam.chunk(32000, params) == 8000 and fam.chunk(33, params) == 16  # multiples of vec
    assert fam.launches((3, 100003), params, "float16")[0].smem_bytes == 25008 * 2
    src = render(fam, params, "float16")
    assert "__cluster_dims__(KM_CS, 1, 1)" in src and "#define KM_CS 4" in src and "softmax_cluster_row(" in src
    assert "__cluster_dims__" not in render(SOFTMAX.family("block_row"), params | {"cluster": 1}, "float16")
    # Every element of a row lies in exactly one block's chunk; chunks start vec-aligned.
    for cols in (1, 7, 33, 1000, 32000, 100003):
        for cluster in (2, 4, 8):
            p = {**params, "cluster": cluster}
            chunk = fam.chunk(cols, p)
            spans = [(r * chunk, min(cols, (r + 1) * chunk)) for r in range(cluster)]
            assert sum(max(0, b - a) for a, b in spans) == cols and all(a % p["vec"] == 0 for a, _ in spans)
