"""split_row: chunking, launches and workspace, and a NumPy model of its two kernels (no GPU, no nvcc)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kernelmill.kernels.ops.base import SpecError
from kernelmill.kernels.ops.softmax import SOFTMAX
from kernelmill.kernels.render import render

FAM = SOFTMAX.family("split_row")
DTYPES = ("float32", "float16", "bfloat16")
#: Odd column counts: fewer columns than blocks, not multiples of vec, one long row.
COLS = [1, 3, 7, 31, 100, 1000, 4099, 32000, 100003]


def _chunks(cols: int, params) -> list[tuple[int, int]]:
    """[c0, c1) of each block of a row, as the kernels compute them (empty when c0 >= cols)."""
    chunk = FAM.chunk(cols, params)
    return [(b * chunk, min((b + 1) * chunk, cols)) for b in range(params["blocks_per_row"])]


@pytest.mark.parametrize("bpr", [2, 4, 32, 128])
@pytest.mark.parametrize("vec", [1, 4, 8])
@pytest.mark.parametrize("cols", COLS)
def test_chunks_cover_each_row_once_and_start_aligned(bpr, vec, cols):
    params = {"blocks_per_row": bpr, "vec": vec}
    chunk = FAM.chunk(cols, params)
    assert chunk % vec == 0 and chunk >= 1
    covered = np.zeros(cols, dtype=int)
    for c0, c1 in _chunks(cols, params):
        assert c0 % vec == 0
        if c1 > c0:
            covered[c0:c1] += 1
    assert (covered == 1).all()
    # The last block's chunk starts before cols + bpr * vec: within the 32-bit bound check_shape enforces.
    assert (bpr - 1) * chunk < cols + bpr * vec


def _rescale(s, m, to):
    """km_rescale: s * exp(m - to), exactly s when m == to (so -inf == -inf gives 0, not NaN)."""
    return s if m == to else s * np.exp(np.float32(m - to), dtype=np.float32)


def _combine(a, b):
    m = max(a[0], b[0])
    return (m, _rescale(a[1], a[0], m) + _rescale(b[1], b[0], m))


def _model(x: np.ndarray, params) -> np.ndarray:
    """softmax_split_stats then softmax_split_norm, in float32 like the kernels (one thread per chunk)."""
    rows, cols = x.shape
    bpr = params["blocks_per_row"]
    ws = np.full((rows, bpr, 2), np.nan, dtype=np.float32)  # poisoned like the verifier does
    for r in range(rows):
        for b, (c0, c1) in enumerate(_chunks(cols, params)):
            part = x[r, c0:c1].astype(np.float32)
            m = np.float32(part.max()) if part.size else np.float32(-np.inf)
            s = np.exp(part - m).sum(dtype=np.float32) if part.size else np.float32(0)
            ws[r, b] = (m, s)
    assert not np.isnan(ws).any(), "every workspace entry is written by the stats kernel"
    y = np.full(x.shape, np.nan, dtype=np.float32)
    for r in range(rows):
        # Each warp: lane i combines partials i, i + 32, ...; then the warp-wide max and rescaled sum.
        lanes = []
        for lane in range(32):
            t = (np.float32(-np.inf), np.float32(0))
            for i in range(lane, bpr, 32):
                t = _combine(t, tuple(ws[r, i]))
            lanes.append(t)
        m = max(t[0] for t in lanes)
        s = np.float32(sum(_rescale(t[1], t[0], m) for t in lanes))
        for c0, c1 in _chunks(cols, params):
            if c1 > c0:
                y[r, c0:c1] = np.exp(x[r, c0:c1].astype(np.float32) - m) * (np.float32(1) / s)
    return y


@pytest.mark.parametrize("bpr", [2, 32, 128])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 1000), (1, 32000), (2, 4099)])
def test_model_of_the_two_kernels_matches_the_reference(bpr, shape):
    params = {**FAM.defaults("float32"), "blocks_per_row": bpr}
    x = SOFTMAX.make_inputs(shape, "float32", seed=7)["x"]
    ref = SOFTMAX.reference({"x": x}, {})["y"]
    y = _model(x, params)
    assert np.isfinite(y).all()
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_launches_and_workspace(dtype):
    params = FAM.defaults(dtype)
    stats, norm = FAM.launches((3, 32000), params, dtype)
    assert stats.entry == "softmax_split_stats" and norm.entry == "softmax_split_norm"
    assert stats.grid == norm.grid == (3 * 32, 1, 1)
    assert stats.block == norm.block == (128, 1, 1)
    assert stats.args == ("x", "ws", 3, 32000) and norm.args == ("x", "y", "ws", 3, 32000)
    assert stats.smem_bytes == norm.smem_bytes == 0
    assert FAM.workspace((3, 32000), params, dtype) == {"ws": 3 * 32 * 8}
    # The default covers a 32000-column row in one pass per block.
    assert FAM.chunk(32000, params) <= params["threads"] * params["vec"] * params["unroll"]


def test_check_shape_limits():
    params = FAM.defaults("float16")
    assert FAM.check_shape((1, 32000), params, "float16") is None
    assert "grid" in FAM.check_shape((2**26, 8), params, "float16")  # 2**26 rows x 32 blocks
    assert "32 bits" in FAM.check_shape((1, 2**31 - 100), params, "float16")


def test_params_and_constraints():
    assert [p.name for p in FAM.params] == ["blocks_per_row", "threads", "vec", "unroll", "fast_exp"]
    assert FAM.check({**FAM.defaults("float32"), "vec": 8}, "float32") is not None  # 32-byte vector
    with pytest.raises(SpecError):
        FAM.resolve({"blocks_per_row": 3}, "float32")
    for dtype in DTYPES:
        assert 100 < FAM.space_size(dtype) < 2000


_KERNEL_RE = re.compile(r'extern "C" __global__ void __launch_bounds__\([^\n]*\)\n(\w+)\(([^)]*)\)')


@pytest.mark.parametrize("dtype", DTYPES)
def test_rendered_entries_match_launches(dtype):
    params = FAM.defaults(dtype)
    source = render(FAM, params, dtype)
    kernels = {m.group(1): [a.split()[-1] for a in m.group(2).split(",")] for m in _KERNEL_RE.finditer(source)}
    launches = FAM.launches((5, 1000), params, dtype)
    assert set(kernels) == {launch.entry for launch in launches}
    for launch in launches:
        assert len(kernels[launch.entry]) == len(launch.args)
    assert "#define KM_BPR 32" in source
