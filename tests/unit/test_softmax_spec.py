import numpy as np
import pytest

from kernelmill.kernels.ops.softmax import (
    CLUSTER_ROW,
    SMEM_CACHE_LIMIT,
    SMEM_ROW,
    SMEM_ROW_LIMIT,
    SOFTMAX,
    estimated_regs,
    min_blocks,
    pass_elems,
)
from kernelmill.kernels.render import render


def test_reference_matches_direct_formula():
    x = SOFTMAX.make_inputs((7, 33), "float32", seed=3)["x"]  # a "uniform" seed: "offset" ones overflow exp here
    assert SOFTMAX.input_kind(3) == "uniform"
    y = SOFTMAX.reference({"x": x}, {})["y"]
    direct = np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y, direct, rtol=1e-12)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("shape", [(9, 1), (12, 5), (30, 4096), (3, 70000)])
def test_masked_inputs_hold_minus_infinity_in_rows_that_keep_an_element(shape):
    """Kernels special-case -inf (a chunk or block whose max is -inf); verification never fed them one."""
    seeds = [s for s in range(40) if SOFTMAX.input_kind(s) == "masked"][:4]
    masked = 0
    for seed in seeds:
        x = SOFTMAX.make_inputs(shape, "float16", seed)["x"].astype(np.float64)
        assert np.isfinite(x).any(axis=1).all() and not np.isnan(x).any() and not (x == np.inf).any()
        masked += int(np.isneginf(x).sum())
        y = SOFTMAX.reference({"x": x}, {})["y"]
        assert np.isfinite(y).all() and (y[np.isneginf(x)] == 0).all()
        np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-12)
    assert masked > 0 if shape[1] > 1 else masked == 0
    if shape[1] >= 4096:  # whole 1024-element blocks of -inf, at a row's start as well as its end
        x = SOFTMAX.make_inputs(shape, "float32", seeds[0])["x"]
        runs = [np.isneginf(row[i : i + 1024]).all() for row in x for i in range(0, shape[1] - 1023, 1024)]
        assert any(runs) and np.isneginf(x[:, 0]).any()


def test_min_bytes_is_one_read_one_write():
    assert SOFTMAX.min_bytes((8192, 8192), "float16") == 2 * 8192 * 8192 * 2


def test_families():
    assert list(SOFTMAX.families) == ["warp_row", "block_row", "cluster_row", "smem_row", "split_row"]
    assert SOFTMAX.family("cluster_row") is CLUSTER_ROW and SOFTMAX.family("smem_row") is SMEM_ROW


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
        assert cluster == {"vec": vec, "unroll": 16 // vec, "threads": 256, "cluster": 8, "fast_exp": fast}
        assert CLUSTER_ROW.chunk(32000, cluster) <= pass_elems(256, cluster)  # 1x32000: one pass a block
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
    params = {**fam.defaults("float16"), "cluster": 4, "unroll": 4}
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


#: The shapes the GPU tests run the row-splitting families at: odd column counts (rows that start misaligned),
#: one element, a long odd row, and the issue-8 long rows.
ODD_SHAPES = [(3, 17), (1, 1), (5, 33333), (2, 32000), (1, 32000), (4096, 32000), (7, 4099)]


def _vector_starts(fam, shape, params, dtype):
    """Byte offsets of every vector access a block makes, modelled on the template: rows at row * cols,
    chunks at rank * chunk, vector accesses only when km_vec_ok (row stride a multiple of vec)."""
    rows, cols = shape
    vec, size = params["vec"], 4 if dtype == "float32" else 2
    vec_ok = cols % vec == 0  # km_vec_ok: decided by the row stride, never by a chunk's length
    chunk = fam.chunk(cols, params)
    for row in range(min(rows, 3)):
        for rank in range(fam.cluster(params)):
            c0 = rank * chunk
            length = min(chunk, cols - c0)
            for e in range(0, max(length, 0) - vec + 1, vec):
                if vec_ok:
                    yield (row * cols + c0 + e) * size


def test_the_old_alignment_rule_was_wrong_at_3x17():
    """The fault's mechanism: a chunk of 8 fp32 elements (a multiple of vec) starting at row 1 of a 17-column
    matrix is 68 bytes in, not 16-byte aligned. Alignment follows from the row stride alone."""
    params = {**CLUSTER_ROW.defaults("float32"), "cluster": 4}
    chunk = CLUSTER_ROW.chunk(17, params)
    assert chunk == 8 and chunk % params["vec"] == 0  # the old rule said: vector accesses are fine
    assert (1 * 17 + 0) * 4 % 16 != 0  # row 1, rank 0: misaligned
    assert list(_vector_starts(CLUSTER_ROW, (3, 17), params, "float32")) == []  # now: no vector access at all


@pytest.mark.parametrize("family", ["cluster_row", "smem_row"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_row_splitting_families_only_make_aligned_vector_accesses(family, dtype, shape):
    # cluster_row faulted (misaligned address) at 3x17 fp32: it took vector accesses when a chunk's length was
    # a multiple of vec, though with cols odd the chunk starts misaligned on every other row.
    fam = SOFTMAX.family(family)
    for cluster in fam.param("cluster").values:
        params = {**fam.defaults(dtype), "cluster": cluster}
        for start in _vector_starts(fam, shape, params, dtype):
            assert start % (params["vec"] * (4 if dtype == "float32" else 2)) == 0, (params, start)
    source = render(fam, fam.defaults(dtype), dtype)
    assert "const bool vec_ok = km_vec_ok(x, y, cols);" in source
    assert "cols % KM_VEC == 0" in source and "% A == 0" in source  # row stride and both base pointers


def test_smem_row_gives_shared_memory_for_the_whole_chunk():
    fam = SMEM_ROW
    for dtype, size in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        params = fam.defaults(dtype)
        assert params["cluster"] == 1 and params["vec"] * size == 16
        assert fam.check(params, dtype) is None
        (launch,) = fam.launches((4096, 32000), params, dtype)
        assert launch.entry == "softmax_smem_row" and launch.grid == (4096, 1, 1)
        assert launch.smem_bytes == 32000 * size and launch.args == ("x", "y", 4096, 32000)
        assert fam.launches((3, 17), params, dtype)[0].smem_bytes == 24 * size  # rounded up to 8 elements
        assert fam.check_shape((1, 1), params, dtype) is None
    # fp32 32000: 128000 bytes for one block, or 64000 for each of a 2-block cluster.
    p2 = {**fam.defaults("float32"), "cluster": 2}
    (launch,) = fam.launches((4096, 32000), p2, "float32")
    assert launch.grid == (8192, 1, 1) and launch.smem_bytes == 64000
    assert fam.check_shape((4096, 32000), fam.defaults("float32"), "float32") is None
    # Rows longer than a block's shared memory need a cluster: the shape check says so (data, not a fault).
    too_long = SMEM_ROW_LIMIT // 4 + 8
    assert "shared memory" in fam.check_shape((1, too_long), fam.defaults("float32"), "float32")
    assert fam.check_shape((1, too_long), p2, "float32") is None
    src = render(fam, p2, "float32")
    assert "softmax_smem_row(" in src and "#define KM_CS 2" in src and "km_softmax_row_smem<KM_THREADS>" in src
    assert "cp.async.cg.shared.global" in src
    block = SOFTMAX.family("block_row")
    kernel = render(block, block.defaults("float32"), "float32").split('extern "C"')[1]
    assert "km_softmax_row_smem" not in kernel and "km_softmax_row<KM_THREADS, true>" in kernel


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_long_row_variants_are_in_the_space(dtype):
    """Variants meant for 4096x32000 and 1x32000 are valid points (the tuner can reach them)."""
    vec = 4 if dtype == "float32" else 8
    wanted = {
        "smem_row": [
            {"vec": vec, "unroll": 16 // vec, "threads": 512, "cluster": 1},
            {"vec": vec, "unroll": 16 // vec, "threads": 256, "cluster": 2},
            {"vec": vec, "unroll": 32 // vec, "threads": 256, "cluster": 8},
        ],
        "cluster_row": [
            {"vec": vec, "unroll": 32 // vec, "threads": 256, "cluster": 4},
            {"vec": vec, "unroll": 16 // vec, "threads": 256, "cluster": 8},
        ],
    }
    for family, points in wanted.items():
        fam = SOFTMAX.family(family)
        space = list(fam.space(dtype))
        for point in points:
            params = {**point, "fast_exp": dtype != "float32"}
            assert params in space, (family, params)
            assert fam.check_shape((4096, 32000), params, dtype) is None
            assert fam.check_shape((1, 32000), params, dtype) is None
    # cluster_row 4096x32000 with 4 blocks a row: 8000 elements a block, one register pass (no shared copy).
    params = {"vec": vec, "unroll": 32 // vec, "threads": 256, "cluster": 4, "fast_exp": False}
    assert CLUSTER_ROW.launches((4096, 32000), params, dtype)[0].smem_bytes == 0
