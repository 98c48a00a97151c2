import numpy as np

from kernelmill.kernels.ops.softmax import SOFTMAX


def test_reference_matches_direct_formula():
    x = SOFTMAX.make_inputs((7, 33), "float32", seed=3)["x"]
    y = SOFTMAX.reference({"x": x}, {})["y"]
    direct = np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y, direct, rtol=1e-12)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-12)


def test_min_bytes_is_one_read_one_write():
    assert SOFTMAX.min_bytes((8192, 8192), "float16") == 2 * 8192 * 8192 * 2


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


def test_register_budget_constraint():
    fam = SOFTMAX.family("block_row")
    assert fam.check({"vec": 8, "unroll": 16, "threads": 256, "fast_exp": False}, "float16") is not None
    assert fam.check({"vec": 4, "unroll": 16, "threads": 256, "fast_exp": False}, "float32") is None
