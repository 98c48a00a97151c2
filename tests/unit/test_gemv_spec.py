"""The gemv matmul family: space, constraints, launches, and a NumPy model of its kernel's work split
(both engines, fragment layouts included), checked against A @ B at ragged shapes. No GPU, no nvcc."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kernelmill.kernels.ops.base import SpecError, cdiv
from kernelmill.kernels.ops.gemv import GEMV, MAX_STATIC_SMEM_BYTES
from kernelmill.kernels.ops.matmul import MATMUL
from kernelmill.kernels.render import render

DTYPES = ("float32", "float16", "bfloat16")


# -- space and constraints --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_space_is_valid_and_moderate(dtype):
    space = list(GEMV.space(dtype))
    assert 500 <= len(space) <= 5000
    assert GEMV.defaults(dtype) in space
    for params in space:
        assert GEMV.smem_bytes(params, dtype) <= MAX_STATIC_SMEM_BYTES
        assert params["threads"] * GEMV.estimated_regs(params, dtype) <= 65536
        if params["mma"]:
            assert dtype != "float32" and params["max_m"] >= 8 and params["vec"] == 8
        else:
            assert 4 <= params["block_cols"] // params["vec"] <= 32
    assert any(p["mma"] for p in space) == (dtype != "float32")


def test_defaults():
    for dtype in ("float16", "bfloat16"):
        assert GEMV.defaults(dtype) == {
            "max_m": 16,
            "mma": True,
            "vec": 8,
            "block_cols": 64,
            "threads": 256,
            "k_splits": 4,
            "unroll": 2,
            "pipeline": 1,
            "a_vec": True,
        }
    assert GEMV.defaults("float32") == {
        "max_m": 16,
        "mma": False,
        "vec": 4,
        "block_cols": 32,
        "threads": 256,
        "k_splits": 4,
        "unroll": 4,
        "pipeline": 1,
        "a_vec": False,
    }
    assert [GEMV.precision(d) for d in DTYPES] == list(DTYPES)  # fp32 is exact FMA, never TF32


@pytest.mark.parametrize(
    ("override", "dtype", "reason"),
    [
        ({"mma": True, "vec": 8}, "float32", "16-bit"),
        ({"mma": True, "vec": 4}, "float16", "16 bytes"),
        ({"mma": True, "max_m": 4}, "float16", "max_m >= 8"),
        ({"mma": False, "vec": 8}, "float32", "16-byte"),
        ({"mma": False, "vec": 8, "block_cols": 512 // 2, "a_vec": False}, "float16", "registers"),  # 16 x 8 acc.
        ({"mma": False, "vec": 8, "a_vec": True}, "float16", "a_vec applies to the mma engine"),
        ({"mma": False, "vec": 2, "block_cols": 128}, "float32", "lanes along N"),  # 64 lanes
        ({"mma": False, "vec": 4, "max_m": 32, "unroll": 2, "block_cols": 32}, "float32", "registers"),
        ({"mma": False, "vec": 1, "max_m": 32, "unroll": 4, "block_cols": 32}, "float32", "values of A"),
        ({"mma": True, "max_m": 32, "unroll": 8}, "float16", "registers"),  # 64 + 128 + 64
        ({"mma": True, "threads": 512, "block_cols": 64, "max_m": 16, "unroll": 1}, "float16", "shared memory"),
        ({"mma": True, "block_cols": 32}, "float16", "64 columns each"),
        ({"mma": True, "max_m": 16, "unroll": 4, "pipeline": 2}, "float16", "registers"),  # 32 + 2 x 80
        ({"mma": False, "pipeline": 2}, "float32", "mma engine"),
        ({"mma": True, "threads": 64, "block_cols": 192 - 64 + 128}, "float16", "column strips"),
    ],
)
def test_check_rejects(override, dtype, reason):
    params = {**GEMV.defaults(dtype), **override}
    message = GEMV.check(params, dtype)
    assert message is not None and reason in message, message
    with pytest.raises(SpecError, match="invalid parameters"):
        GEMV.resolve(override, dtype)


def test_check_shape():
    params = GEMV.defaults("float16")
    assert GEMV.check_shape((16, 4096, 4096), params, "float16") is None
    assert GEMV.check_shape((1, 4096, 11008), params, "float16") is None
    assert "max_m" in GEMV.check_shape((17, 4096, 4096), params, "float16")
    assert "32-bit" in GEMV.check_shape((1, 2**16, 2**15), params, "float16")


def test_registered_in_matmul():
    assert MATMUL.family("gemv") is GEMV


# -- launches and rendering -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (16, 4096, 4096), (1, 4096, 11008), (3, 1000, 77)])
def test_launch_covers_the_columns(dtype, shape):
    M, N, K = shape  # noqa: N806
    for params in [GEMV.defaults(dtype), *list(GEMV.space(dtype))[::211]]:
        (launch,) = GEMV.launches(shape, params, dtype)
        gx, gy, gz = launch.grid
        assert gx * params["block_cols"] >= N and (gx - 1) * params["block_cols"] < N
        assert (gy, gz) == (params["k_splits"], 1)
        assert launch.block == (params["threads"], 1, 1) and launch.smem_bytes == 0
        assert launch.args == ("A", "B", "C", M, N, K)
        assert GEMV.workspace(shape, params, dtype) == {}


_KERNEL_RE = re.compile(r'extern "C" __global__ void __launch_bounds__\(([^)\n]*)\)([^\n]*)\n(\w+)\(([^)]*)\)')


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_splits", [1, 4])
def test_rendered_kernel(dtype, k_splits):
    params = {**GEMV.defaults(dtype), "k_splits": k_splits}
    source = render(GEMV, params, dtype)
    (match,) = _KERNEL_RE.finditer(source)
    bounds, attrs, entry, args = match.groups()
    assert entry == "matmul_gemv" and [a.split()[-1] for a in args.split(",")] == ["A", "B", "C", "M", "N", "K"]
    assert bounds == f"KM_THREADS, {GEMV.min_blocks(params, dtype)}"
    assert ("__cluster_dims__(1, KM_KS, 1)" in attrs) == (k_splits > 1)
    assert (("cluster.sync()" in source) == (k_splits > 1)) and ("map_shared_rank" in source) == (k_splits > 1)
    assert f"== {GEMV.red_smem_bytes(params)}, " in source
    if dtype == "bfloat16":
        assert '"bf16.bf16"' in source
    elif dtype == "float16":
        assert '"f16.f16"' in source and "ld.global.nc.L1::no_allocate.v4.u32" in source


# -- a NumPy model of the kernel ----------------------------------------------------------------------


def _slice(K, params, multiple):  # noqa: N803
    """kb, ke of each cluster rank: K slices rounded up to `multiple` rows (the last ones may be empty)."""
    ks = params["k_splits"]
    kslice = cdiv(cdiv(K, ks), multiple) * multiple
    return [(r * kslice, min(K, r * kslice + kslice)) for r in range(ks)]


def _finish(C, parts, M, N, n0, params, mp):  # noqa: N803
    """The cluster's sum over ranks of each block's part (red summed over warps): rank r, thread tid takes
    e = r * THREADS + tid, stepping KS * THREADS (KS = 1: e = tid, stepping THREADS)."""
    bn, threads, ks = params["block_cols"], params["threads"], params["k_splits"]
    rows = min(M, mp)
    for rank in range(ks):
        for tid in range(threads):
            for e in range(rank * threads + tid, rows * bn, ks * threads):
                m, nl = divmod(e, bn)
                s = sum(p[m, nl] for p in parts)
                if n0 + nl < N:
                    assert np.isnan(C[m, n0 + nl]), f"C[{m}, {n0 + nl}] written twice"
                    C[m, n0 + nl] = s


def _model_simt(A, B, params):  # noqa: N803
    M, K = A.shape  # noqa: N806
    N = B.shape[1]  # noqa: N806
    vec, bn, u = params["vec"], params["block_cols"], params["unroll"]
    warps = params["threads"] // 32
    tx_n = bn // vec
    tyw = 32 // tx_n
    ty_n = warps * tyw
    mp = params["max_m"]
    C = np.full((M, N), np.nan)  # noqa: N806
    for bx in range(cdiv(N, bn)):
        n0 = bx * bn
        parts = []
        for kb, ke in _slice(K, params, u):
            red = np.zeros((warps, mp, bn))
            seen = np.zeros(K, dtype=int)  # row groups that took each row of B (counted at tx == 0)
            for warp in range(warps):
                acc = np.zeros((32, mp, vec))
                for lane in range(32):
                    tx, ty = lane % tx_n, warp * tyw + lane // tx_n
                    n = n0 + tx * vec
                    for k in range(kb + ty * u, ke, ty_n * u):
                        for uu in range(u):
                            kr = k + uu
                            if kr >= ke:
                                continue  # B row read as zeros, A value zero
                            seen[kr] += tx == 0
                            for v in range(vec):
                                if n + v < N:
                                    acc[lane, :M, v] += A[:, kr] * B[kr, n + v]
                # Shuffle sums over lanes tx, tx + TX, ...: lanes 0..TX-1 write red.
                for tx in range(tx_n):
                    red[warp, :, tx * vec : (tx + 1) * vec] = acc[tx::tx_n].sum(axis=0)
            assert (seen[kb:ke] == 1).all() and seen.sum() == max(0, ke - kb)
            parts.append(red.sum(axis=0))
        _finish(C, parts, M, N, n0, params, mp)
    return C


def _mma(d, a, b):
    """d (32 x 4) += A (16 x 16 from a: 32 x 4 x 2) @ B (16 x 8 from b: 32 x 2 x 2), PTX fragment layouts."""
    am, bm, dm = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for q, (row, col) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
            am[row, col : col + 2] = a[lane, q]
        for q, row in enumerate((2 * c, 2 * c + 8)):
            bm[row : row + 2, g] = b[lane, q]
        for i in range(4):
            dm[g + 8 * (i // 2), 2 * c + i % 2] = d[lane, i]
    dm += am @ bm
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for i in range(4):
            d[lane, i] = dm[g + 8 * (i // 2), 2 * c + i % 2]


def _model_mma(A, B, params):  # noqa: N803
    """The mma engine: warp (cw, kw) takes 64 columns and every KW-th group of UNROLL k16 steps; lane (g, t)
    loads 8 columns (col = strip + 8g) of rows 2t, 2t+1, 2t+8, 2t+9 and pairs them into n-tile i's b0/b1.
    With a_vec the fragment slots of lane t hold the k 4Pt + 4(s % P) + {0, 1, 2, 3} of each pack of P steps
    (P = 2 for even unroll, else 1) instead, in A and in B alike (km_b_row)."""
    M, K = A.shape  # noqa: N806
    N = B.shape[1]  # noqa: N806
    bn, u = params["block_cols"], params["unroll"]
    colw = bn // 64
    kwarps = params["threads"] // 32 // colw
    mt_n, mr = cdiv(params["max_m"], 16), params["max_m"]
    pack = 2 if u % 2 == 0 else 1
    C = np.full((M, N), np.nan)  # noqa: N806

    def k_of(k, s, t, half, q):
        """Row of B (and column of A) behind fragment k slot 2t + half + 8q of step s of the group at k."""
        if params.get("a_vec"):
            return k + 16 * pack * (s // pack) + 4 * pack * t + 4 * (s % pack) + 2 * q + half
        return k + 16 * s + 2 * t + half + 8 * q

    def a_val(m, k, ke):
        return A[m, k] if m < M and k < ke else 0.0

    def b_row(kr, col, ke):
        row = np.zeros(8)
        if kr < ke:
            valid = [v for v in range(8) if col + v < N]
            row[valid] = B[kr, [col + v for v in valid]]
        return row

    for bx in range(cdiv(N, bn)):
        n0 = bx * bn
        parts = []
        for kb, ke in _slice(K, params, 16):
            red = np.zeros((kwarps, mr, bn))
            seen = np.zeros((K, bn), dtype=int)
            for cw in range(colw):
                for kw in range(kwarps):
                    d = np.zeros((mt_n, 8, 32, 4))
                    for k in range(kb + kw * 16 * u, ke, kwarps * 16 * u):
                        for s in range(u):
                            rows = np.zeros((32, 4, 8))  # lane, q (row 2t + q % 2 + 8 (q // 2)), 8 columns
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                for q in range(4):
                                    kr = k_of(k, s, t, q % 2, q // 2)
                                    rows[lane, q] = b_row(kr, n0 + cw * 64 + 8 * g, ke)
                                    if kr < ke:
                                        seen[kr, cw * 64 + 8 * g : cw * 64 + 8 * g + 8] += 1
                            a = np.zeros((mt_n, 32, 4, 2))
                            for mt in range(mt_n):
                                for lane in range(32):
                                    g, t = lane // 4, lane % 4
                                    for q, (dm, kq) in enumerate(((0, 0), (8, 0), (0, 1), (8, 1))):
                                        m = 16 * mt + g + dm
                                        if dm and params["max_m"] <= 8:
                                            continue  # constant zeros
                                        a[mt, lane, q] = [a_val(m, k_of(k, s, t, h, kq), ke) for h in (0, 1)]
                            for i in range(8):
                                b = np.zeros((32, 2, 2))
                                for lane in range(32):
                                    b[lane, 0] = rows[lane, 0:2, i]  # (row 2t, 2t + 1) of column i
                                    b[lane, 1] = rows[lane, 2:4, i]
                                for mt in range(mt_n):
                                    _mma(d[mt, i], a[mt], b)
                    for mt in range(mt_n):
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            for q in range(4):
                                m = 16 * mt + g + 8 * (q // 2)
                                if m < mr:
                                    for i in range(8):
                                        red[kw, m, cw * 64 + 16 * t + 8 * (q % 2) + i] = d[mt, i, lane, q]
            assert (seen[kb:ke] == 1).all() and seen.sum() == max(0, ke - kb) * bn, "each element of B once"
            parts.append(red.sum(axis=0))
        _finish(C, parts, M, N, n0, params, mr)
    return C


SIMT_CASES = [
    ((1, 1, 1), {"max_m": 1, "vec": 4, "block_cols": 32, "threads": 64, "k_splits": 1, "unroll": 4}),
    ((3, 37, 29), {"max_m": 4, "vec": 4, "block_cols": 32, "threads": 64, "k_splits": 2, "unroll": 2}),
    ((2, 70, 300), {"max_m": 2, "vec": 2, "block_cols": 64, "threads": 64, "k_splits": 4, "unroll": 8}),
    ((5, 33, 100), {"max_m": 8, "vec": 1, "block_cols": 32, "threads": 128, "k_splits": 8, "unroll": 1}),
]
MMA_CASES = [
    ((1, 1, 1), {"max_m": 8, "block_cols": 64, "threads": 64, "k_splits": 1, "unroll": 1}),
    ((3, 40, 45), {"max_m": 8, "block_cols": 64, "threads": 64, "k_splits": 2, "unroll": 2}),
    ((16, 136, 70), {"max_m": 16, "block_cols": 128, "threads": 128, "k_splits": 1, "unroll": 1}),
    ((17, 64, 33), {"max_m": 32, "block_cols": 64, "threads": 64, "k_splits": 4, "unroll": 1}),
    ((5, 70, 100), {"max_m": 8, "block_cols": 64, "threads": 128, "k_splits": 1, "unroll": 2}),
    ((13, 64, 230), {"max_m": 16, "block_cols": 64, "threads": 64, "k_splits": 2, "unroll": 4}),
]


def _inputs(shape):
    M, N, K = shape  # noqa: N806
    rng = np.random.default_rng(sum(shape))
    return rng.uniform(-1, 1, (M, K)), rng.uniform(-1, 1, (K, N))


@pytest.mark.parametrize(("shape", "params"), SIMT_CASES)
def test_model_of_the_fma_engine(shape, params):
    a, b = _inputs(shape)
    params = {**params, "mma": False, "pipeline": 1}
    assert GEMV.check_shape(shape, params, "float32") is None
    c = _model_simt(a, b, params)
    assert not np.isnan(c).any(), "every element of C is written"
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("a_vec", [False, True])
@pytest.mark.parametrize(("shape", "params"), MMA_CASES)
def test_model_of_the_mma_engine(shape, params, a_vec):
    a, b = _inputs(shape)
    params = {**params, "mma": True, "vec": 8, "pipeline": 1, "a_vec": a_vec}
    assert GEMV.check(params, "float16") is None and GEMV.check_shape(shape, params, "float16") is None
    c = _model_mma(a, b, params)
    assert not np.isnan(c).any(), "every element of C is written"
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "k_splits", "pipeline", "unroll"),
    [
        ((1, 4096, 11008), 8, 2, 1),  # few column strips (64): the deep split, two groups in flight
        ((1, 11008, 4096), 4, 1, 1),
        ((16, 11008, 4096), 4, 1, 1),  # 172 strips: 4-way (37.5-38.4 against 44.6-45.3 us on an H100)
        ((16, 4096, 11008), 8, 1, 2),  # two k16 steps a group: one 16-byte load of A per row covers both
    ],
)
def test_shape_defaults_split_k_by_column_strips(shape, k_splits, pipeline, unroll):
    from kernelmill.kernels.defaults import default_params
    from kernelmill.kernels.ops import get_op

    spec = get_op("linear")
    params = default_params(spec, spec.family("gemv"), shape, "float16")
    assert params["max_m"] == (8 if shape[0] <= 8 else 16) and params["mma"]
    assert (params["k_splits"], params["pipeline"], params["unroll"]) == (k_splits, pipeline, unroll)
    assert params["a_vec"]
