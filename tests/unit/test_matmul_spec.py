"""matmul spec, families and GEMM launch helpers: no GPU and no nvcc (templates are only rendered)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kernelmill.kernels.ops.base import SpecError, cdiv, numpy_dtype
from kernelmill.kernels.ops.matmul import (
    CORES,
    MATMUL,
    GemmFamily,
    gemm_check,
    gemm_check_shape,
    gemm_launches,
    gemm_workspace,
)
from kernelmill.kernels.render import environment, render

DTYPES = ("float32", "float16", "bfloat16")
# The families built on a GEMM core (split-K, every dtype); wgmma and gemv have their own tests.
FAMILIES = tuple(n for n, f in MATMUL.families.items() if isinstance(f, GemmFamily))
#: Ragged shapes (no tile multiples) and the big ones the op is tuned for.
SHAPES = [(1, 1, 1), (17, 33, 100), (255, 33, 7), (1, 4096, 11008), (16, 4096, 4096), (2048, 11008, 4096)]


def _points(family, dtype):
    """Defaults, the same with split-K, and a spread of the space (every 97th point)."""
    space = list(family.space(dtype))
    return [family.defaults(dtype), {**family.defaults(dtype), "split_k": 4}, *space[::97]]


# -- the op ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_a_times_b(dtype):
    shape = (5, 7, 3)
    inputs = MATMUL.make_inputs(shape, dtype, seed=1)
    assert inputs["A"].shape == (5, 3) and inputs["B"].shape == (3, 7)
    assert inputs["A"].dtype == numpy_dtype(dtype)
    out = MATMUL.reference(inputs, {})
    expected = inputs["A"].astype(np.float64) @ inputs["B"].astype(np.float64)
    assert out["C"].dtype == np.float64
    np.testing.assert_allclose(out["C"], expected, rtol=0, atol=0)


def test_reference_on_known_values():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert MATMUL.reference({"A": a, "B": b}, {})["C"].tolist() == (a @ b).tolist()


def test_shapes_flops_and_bytes():
    assert MATMUL.dims == ("M", "N", "K")
    assert MATMUL.inputs == ("A", "B") and MATMUL.outputs == ("C",)
    assert MATMUL.tensor_shapes((2, 3, 4)) == {"A": (2, 4), "B": (4, 3), "C": (2, 3)}
    assert MATMUL.flops((2, 3, 4)) == 2 * 2 * 3 * 4
    assert MATMUL.flops((4096, 4096, 4096)) == 2 * 4096**3
    assert MATMUL.min_bytes((2, 3, 4), "float16") == (2 * 4 + 4 * 3 + 2 * 3) * 2
    assert MATMUL.min_bytes((2, 3, 4), "float32") == (2 * 4 + 4 * 3 + 2 * 3) * 4
    assert MATMUL.input_scale("A", (2, 3, 4)) == 1.0
    assert MATMUL.parse_shape("17x33x100") == (17, 33, 100)


def test_families_and_precision():
    assert set(FAMILIES) == {"simt", "tensorcore"}
    simt, tc = MATMUL.family("simt"), MATMUL.family("tensorcore")
    assert [simt.precision(d) for d in DTYPES] == list(DTYPES)  # exact fp32: no TF32 on CUDA cores
    assert [tc.precision(d) for d in DTYPES] == ["tf32", "float16", "bfloat16"]
    assert simt.template == "matmul/simt.cu.j2" and tc.template == "matmul/tensorcore.cu.j2"


# -- parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_space_is_valid_and_moderate(family, dtype):
    fam = MATMUL.family(family)
    names = [p.name for p in fam.params]
    space = list(fam.space(dtype))
    assert 200 <= len(space) <= 5000
    assert fam.defaults(dtype) in space
    for params in space:
        assert list(params) == names
        assert fam.check(params, dtype) is None
        assert 32 <= fam.core.threads(params) <= 1024
        assert fam.core.smem_bytes(params, dtype) <= 227 * 1024


def test_defaults():
    simt, tc = MATMUL.family("simt"), MATMUL.family("tensorcore")
    for dtype in DTYPES:
        assert simt.defaults(dtype) == {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8, "split_k": 1}
        assert tc.defaults(dtype) == {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 32, "stages": 3, "split_k": 1}
    assert simt.core.threads(simt.defaults("float32")) == 256
    assert tc.core.threads(tc.defaults("float16")) == 256  # 8 warps of 64x32
    # The fp32 epilogue tile (128 x 132 floats) outgrows a 3-stage fp16 ring; the fp32 ring is bigger still.
    assert tc.core.smem_bytes(tc.defaults("float16"), "float16") == 128 * 132 * 4
    assert tc.core.smem_bytes(tc.defaults("float32"), "float32") == 3 * (128 * 36 + 32 * 132) * 4


@pytest.mark.parametrize(
    ("family", "override", "dtype", "reason"),
    [
        ("simt", {"TM": 8, "BM": 16, "TN": 1, "BN": 16}, "float32", "threads"),  # 2 x 16 = 32 threads
        ("simt", {"BM": 256, "BN": 256, "TM": 8, "TN": 8}, "float32", "threads"),  # 1024 threads
        ("simt", {"BK": 32}, "float32", "shared memory"),  # 2 * 32 * 264 floats
        ("simt", {"BM": 16, "BN": 16, "TM": 1, "TN": 1}, "float32", "outputs per thread"),
        ("simt", {"BM": 16, "BN": 256, "BK": 8, "TM": 1, "TN": 8}, "float16", "split evenly"),  # 512 threads
        ("tensorcore", {"BM": 32, "WM": 64}, "float16", "must divide"),
        ("tensorcore", {"BN": 32, "WN": 64}, "float16", "must divide"),
        ("tensorcore", {"BM": 256, "BN": 256, "WM": 32, "WN": 32}, "float16", "warps"),
        ("tensorcore", {"WM": 16, "WN": 16}, "float16", "fragments"),
        ("tensorcore", {"WM": 64, "WN": 64, "BK": 32}, "float32", "TF32"),
    ],
)
def test_check_rejects(family, override, dtype, reason):
    fam = MATMUL.family(family)
    params = {**fam.defaults(dtype), **override}
    message = fam.check(params, dtype)
    assert message is not None and reason in message
    with pytest.raises(SpecError, match="invalid parameters"):
        fam.resolve(override, dtype)


def test_check_rejects_more_than_227_kib():
    # Out of the tuned value lists (no listed point gets there), but other ops call the check directly.
    params = {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 32, "stages": 8, "split_k": 1}
    assert "shared memory" in gemm_check("tensorcore", params, "float16")


def test_resolve_coerces_and_rejects_unknown_values():
    tc = MATMUL.family("tensorcore")
    assert tc.resolve({"stages": "4", "split_k": "2"}, "float16")["stages"] == 4
    with pytest.raises(SpecError, match="not allowed"):
        tc.resolve({"stages": 5}, "float16")
    with pytest.raises(SpecError, match="no parameter"):
        tc.resolve({"TM": 4}, "float16")


def test_unknown_core():
    with pytest.raises(SpecError, match="unknown GEMM core"):
        gemm_check("wgmma", {}, "float16")


# -- launches and workspace -----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_launches_cover_the_output(family, dtype, shape):
    fam = MATMUL.family(family)
    M, N, K = shape  # noqa: N806
    for params in _points(fam, dtype):
        bm, bn = fam.core.tile(params)
        launches = fam.launches(shape, params, dtype)
        gemm = launches[0]
        gx, gy, gz = gemm.grid
        # Exactly enough tiles: all of C covered, no tile entirely outside it.
        assert gx * bn >= N and (gx - 1) * bn < N
        assert gy * bm >= M and (gy - 1) * bm < M
        assert gz == params["split_k"]
        assert gemm.block == (fam.core.threads(params), 1, 1)
        assert gemm.smem_bytes == fam.core.smem_bytes(params, dtype)
        if params["split_k"] == 1:
            assert len(launches) == 1
            assert gemm.args == ("A", "B", "C", M, N, K)
            assert fam.workspace(shape, params, dtype) == {}
        else:
            assert len(launches) == 2
            assert gemm.args == ("A", "B", "ws", M, N, K)
            reduce = launches[1]
            assert reduce.entry == gemm.entry + "_reduce"
            assert reduce.args == ("ws", "C", M, N, params["split_k"])
            assert reduce.block == (256, 1, 1) and reduce.smem_bytes == 0
            assert reduce.grid[0] * 256 * 4 >= M * N and (reduce.grid[0] - 1) * 256 * 4 < M * N
            assert fam.workspace(shape, params, dtype) == {"ws": params["split_k"] * M * N * 4}
        assert fam.check_shape(shape, params, dtype) is None


def test_tensorcore_shared_memory_formula():
    core = CORES["tensorcore"]
    params = {"BM": 64, "BN": 128, "BK": 64, "WM": 32, "WN": 64, "stages": 4, "split_k": 1}
    # fp16: rows padded by 8 halves; ring 4 * (64*72 + 64*136) halves > epilogue 64 * 132 floats.
    assert core.smem_bytes(params, "float16") == 4 * (64 * 72 + 64 * 136) * 2
    assert core.smem_bytes(params, "float32") == 4 * (64 * 68 + 64 * 132) * 4
    small = {**params, "BK": 16, "stages": 2}
    assert core.smem_bytes(small, "float16") == 64 * 132 * 4  # the epilogue tile dominates


def test_gemm_helpers_with_bias():
    params = {"BM": 64, "BN": 64, "BK": 32, "WM": 32, "WN": 32, "stages": 3, "split_k": 1}
    (one,) = gemm_launches("tensorcore", "up", 100, 300, 50, params, "float16", "x", "w1", "h", bias="b1")
    assert one.entry == "up" and one.args == ("x", "w1", "h", "b1", 100, 300, 50)
    assert one.grid == (cdiv(300, 64), cdiv(100, 64), 1)
    split = {**params, "split_k": 8}
    gemm, reduce = gemm_launches("tensorcore", "up", 100, 300, 50, split, "float16", "x", "w1", "h", "b1", ws="tmp")
    assert gemm.args == ("x", "w1", "tmp", 100, 300, 50)
    assert reduce.entry == "up_reduce" and reduce.args == ("tmp", "h", "b1", 100, 300, 8)
    assert gemm_workspace("tensorcore", 100, 300, 50, split) == 8 * 100 * 300 * 4
    assert gemm_workspace("simt", 100, 300, 50, {"split_k": 1}) == 0


def test_check_shape_limits_grid_rows():
    params = MATMUL.family("simt").defaults("float32")
    assert gemm_check_shape("simt", 65535 * 128, 8, 8, params) is None
    assert "grid y" in gemm_check_shape("simt", 65535 * 128 + 1, 8, 8, params)


def test_check_shape_limits_32_bit_offsets():
    params = MATMUL.family("tensorcore").defaults("float16")
    assert gemm_check_shape("tensorcore", 2048, 11008, 4096, params) is None
    assert "32-bit" in gemm_check_shape("tensorcore", 2**16, 8, 2**15, params)  # A has 2**31 elements
    assert "32-bit" in gemm_check_shape("tensorcore", 8, 2**16, 2**15, params)  # B
    assert "32-bit" in gemm_check_shape("tensorcore", 2**16, 2**15, 8, params)  # C


# -- templates (rendered only) --------------------------------------------------------------------

_KERNEL_RE = re.compile(r'extern "C" __global__ void __launch_bounds__\([^\n]*\)\n(\w+)\(([^)]*)\)')


def _kernels(source: str) -> dict[str, list[str]]:
    """Entry name -> parameter names, for every kernel in the source."""
    return {m.group(1): [a.split()[-1] for a in m.group(2).split(",")] for m in _KERNEL_RE.finditer(source)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rendered_entries_match_launches(family, dtype):
    fam = MATMUL.family(family)
    for split_k in (1, 4):
        params = {**fam.defaults(dtype), "split_k": split_k}
        source = render(fam, params, dtype)
        kernels = _kernels(source)
        launches = fam.launches((17, 33, 100), params, dtype)
        assert set(kernels) == {launch.entry for launch in launches}
        for launch in launches:
            assert len(kernels[launch.entry]) == len(launch.args)
        if family == "tensorcore":
            assert f"== {fam.core.smem_bytes(params, dtype)}, " in source  # static_assert against the C++ size


def test_macros_compose_in_one_translation_unit():
    """Two GEMMs of each core with different epilogues in one source, as fused_mlp builds it."""
    source = (
        environment()
        .from_string(
            '{% include "common/prelude.cuh.j2" %}\n'
            '{% from "common/gemm_tc.cuh.j2" import gemm_tc_kernel %}\n'
            '{% from "common/gemm_simt.cuh.j2" import gemm_simt_kernel %}\n'
            '{{ gemm_tc_kernel("up", BM=128, BN=128, BK=32, WM=64, WN=32, stages=3, bias=true, act="gelu_tanh") }}\n'
            '{{ gemm_tc_kernel("down", BM=64, BN=64, BK=32, WM=32, WN=32, stages=3, split_k=4, bias=true) }}\n'
            '{{ gemm_simt_kernel("s", BM=64, BN=64, BK=8, TM=4, TN=4, split_k=2, act="relu") }}\n'
        )
        .render(T="__half", dtype="float16")
    )
    kernels = _kernels(source)
    assert kernels == {
        "up": ["A", "B", "C", "bias", "M", "N", "K"],
        "down": ["A", "B", "ws", "M", "N", "K"],
        "down_reduce": ["ws", "C", "bias", "M", "N", "splits"],
        "s": ["A", "B", "ws", "M", "N", "K"],
        "s_reduce": ["ws", "C", "M", "N", "splits"],
    }
    assert "act_gelu_tanh(v + to_f32(bias[n]))" in source and "act_relu(v)" in source
    # Helpers are emitted once per macro call but guarded, so the preprocessor keeps one copy.
    assert source.count("#ifndef KM_GEMM_SHARED") == 3 and source.count("#ifndef KM_GEMM_TC") == 2
