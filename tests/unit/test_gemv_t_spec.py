"""linear_t's gemv family (row dot products on the (N, K) weight): space, shape defaults, constraints, launches,
and a NumPy model of its kernel's work split checked against X @ W^T at ragged shapes. No GPU, no nvcc."""

from __future__ import annotations

import numpy as np
import pytest

from kernelmill.kernels.defaults import default_params, default_rank
from kernelmill.kernels.ops.base import cdiv, itemsize
from kernelmill.kernels.ops.gemv_t import MAX_SMEM_BYTES
from kernelmill.kernels.ops.linear import GEMV_T, LINEAR_T, WGMMA_T
from kernelmill.kernels.render import render

DTYPES = ("float16", "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_space_is_valid_and_moderate(dtype):
    space = list(GEMV_T.space(dtype))
    assert 300 <= len(space) <= 1000
    assert GEMV_T.defaults(dtype) in space
    for params in space:
        assert params["threads"] * GEMV_T.estimated_regs(params) <= 65536
        assert GEMV_T.min_blocks(params) >= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 11008, 4096), (1, 4096, 11008), (2, 1000, 72), (2, 257, 520), (2, 1, 8)])
def test_shape_defaults_run_the_shape_with_the_fewest_chunks(dtype, shape):
    params = default_params(LINEAR_T, GEMV_T, shape, dtype, 132)
    assert GEMV_T.check(params, dtype) is None and GEMV_T.check_shape(shape, params, dtype) is None
    m, _n, k = shape
    assert params["max_m"] == min(v for v in (1, 2) if v >= m)
    assert params["blocks"] == 264  # two blocks an SM on 132 SMs
    chunks = cdiv(k * itemsize(dtype), 16)
    smaller = [v for v in GEMV_T.param("k_chunks").values if v < params["k_chunks"]]
    assert params["k_chunks"] * params["threads"] >= chunks
    assert all(v * params["threads"] < chunks for v in smaller)


def test_shape_defaults_follow_the_sm_count():
    assert default_params(LINEAR_T, GEMV_T, (1, 4096, 4096), "float16", 66)["blocks"] == 132
    assert default_params(LINEAR_T, GEMV_T, (1, 4096, 4096), "float16", 264)["blocks"] == 528


def test_check_shape_says_why():
    params = {"max_m": 2, "threads": 256, "k_chunks": 2, "rows": 2, "blocks": 264}
    assert "max_m" in GEMV_T.check_shape((3, 64, 64), params, "float16")
    assert "multiple of 8" in GEMV_T.check_shape((1, 64, 100), params, "bfloat16")
    assert "k_chunks x threads" in GEMV_T.check_shape((1, 64, 2 * 256 * 8 + 8), params, "float16")
    assert GEMV_T.check_shape((1, 64, 2 * 256 * 8), params, "float16") is None
    big = {"max_m": 2, "threads": 1024, "k_chunks": 8, "rows": 1, "blocks": 264}
    assert "shared memory" in GEMV_T.check_shape((2, 4096, 65536), big, "float16")
    assert GEMV_T.smem_bytes((2, 4096, 65536), big, "float16") > MAX_SMEM_BYTES
    assert "float32" not in GEMV_T.dtypes


def test_check_bounds_registers():
    heavy = {"max_m": 2, "threads": 1024, "k_chunks": 8, "rows": 8, "blocks": 264}
    assert "registers" in GEMV_T.check(heavy, "float16")


def test_launch_geometry():
    params = {"max_m": 2, "threads": 512, "k_chunks": 3, "rows": 2, "blocks": 264}
    (launch,) = GEMV_T.launches((2, 4096, 11008), params, "float16")
    assert launch.entry == "linear_t_gemv" and launch.grid == (264, 1, 1) and launch.block == (512, 1, 1)
    assert launch.smem_bytes == 2 * 11008 * 2 + cdiv(4096, 264) * 2 * 16 * 4
    assert launch.args == ("X", "W", "Y", "b", 2, 4096, 11008)


def test_ranked_first_for_skinny_products_and_wgmma_takes_the_rest():
    assert default_rank(GEMV_T, (1, 4096, 4096), "float16") < default_rank(WGMMA_T, (1, 4096, 4096), "float16")
    params = default_params(LINEAR_T, GEMV_T, (3, 4096, 4096), "float16", 132)
    assert "max_m" in GEMV_T.check_shape((3, 4096, 4096), params, "float16")  # M > 2: wgmma runs it


def test_rendered_kernel_loads_weights_before_its_pdl_wait():
    params = {"max_m": 1, "threads": 512, "k_chunks": 1, "rows": 4, "blocks": 264}
    src = render(GEMV_T, params, "float16", {"act": "gelu_erf"})
    body = src[src.index('extern "C" __global__') :]
    assert f"__launch_bounds__(GT_THREADS, {GEMV_T.min_blocks(params)})" in body
    assert body.index("load(0);") < body.index("km_pdl_start();")
    assert "act_gelu_erf(" in body


def model_kernel(x, w, b, params, act=lambda v: v):
    """The kernel's work split in NumPy: block b takes rows b, b + G, ...; thread t of a block the 16-byte
    chunks t, t + threads, ... of a row (k_chunks at most); a warp's share of a row is the sum over its lanes;
    the shares add in warp order. Counts how often each (row, chunk) is read."""
    m_rows, k = x.shape
    n = w.shape[0]
    vec = 8
    kc, threads, grid = k // vec, params["threads"], params["blocks"]
    y = np.full((m_rows, n), np.nan)
    reads = np.zeros((n, kc), dtype=int)
    for block in range(grid):
        rows = cdiv(n - block, grid) if block < n else 0
        for i in range(rows):
            row = block + i * grid
            shares = np.zeros((threads // 32, m_rows))
            for t in range(threads):
                for j in range(params["k_chunks"]):
                    c = t + j * threads
                    if c < kc:
                        reads[row, c] += 1
                        sl = slice(c * vec, (c + 1) * vec)
                        shares[t // 32] += x[:, sl] @ w[row, sl]
            y[:, row] = act(shares.sum(axis=0) + b[row])
    return y, reads


@pytest.mark.parametrize(
    ("shape", "blocks", "threads"), [((2, 37, 72), 132, 256), ((1, 5, 520), 132, 256), ((2, 300, 16), 264, 256)]
)
def test_model_of_the_work_split_reads_each_chunk_once_and_matches(shape, blocks, threads):
    m, n, k = shape
    params = {"max_m": 2, "threads": threads, "k_chunks": cdiv(cdiv(k, 8), threads), "rows": 2, "blocks": blocks}
    assert GEMV_T.check_shape(shape, params, "float16") is None
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((m, k)), rng.standard_normal((n, k)), rng.standard_normal(n)
    y, reads = model_kernel(x, w, b, params)
    assert (reads == 1).all()
    np.testing.assert_allclose(y, LINEAR_T.reference({"X": x, "W": w, "b": b}, {"act": "none"})["Y"], rtol=1e-12)
