"""linear_t: linear on nn.Linear's (N, K) weight, run by the wgmma family with a K-major B (the row-dot gemv family:
test_gemv_t_spec.py). No GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import TensorMapArg, cdiv
from kernelmill.kernels.ops.linear import GEMV_T, LINEAR, LINEAR_T, WGMMA, WGMMA_T
from kernelmill.kernels.render import render

DTYPES = ("float16", "bfloat16")


def test_registered_with_the_k_major_wgmma_family_and_the_row_dot_gemv():
    assert get_op("linear_t") is LINEAR_T
    assert list(LINEAR_T.families) == ["wgmma", "gemv"] and LINEAR_T.family("wgmma") is WGMMA_T
    assert LINEAR_T.family("gemv") is GEMV_T
    assert WGMMA_T.b_kmajor and not WGMMA.b_kmajor
    assert WGMMA_T.dtypes == DTYPES and WGMMA_T.arch_suffix == "a"
    assert LINEAR_T.attributes == LINEAR.attributes


def test_tensors_and_reference_are_linear_on_the_transposed_weight():
    shape = (3, 5, 7)
    assert LINEAR_T.tensor_shapes(shape) == {"X": (3, 7), "W": (5, 7), "b": (5,), "Y": (3, 5)}
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((3, 7)), rng.standard_normal((5, 7)), rng.standard_normal(5)
    for act in ("none", "gelu_erf", "silu"):
        got = LINEAR_T.reference({"X": x, "W": w, "b": b}, {"act": act})["Y"]
        want = LINEAR.reference({"X": x, "W": w.T.copy(), "b": b}, {"act": act})["Y"]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_space_is_valid(dtype):
    space = list(WGMMA_T.space(dtype))
    assert WGMMA_T.defaults(dtype) in space
    assert {p["BN"] for p in space} >= {96, 168, 176}  # not whole 64-column boxes: allowed K-major
    for params in space:
        assert WGMMA_T.check(params, dtype) is None
        assert WGMMA_T.bn_loaded(params) == params["BN"]  # one box of exactly BN rows
        assert WGMMA_T.smem_bytes(params, dtype) <= 227 * 1024


def test_stage_holds_exactly_bn_rows_and_the_map_is_k_major():
    params = {**WGMMA_T.defaults("float16"), "BN": 168, "ctas": 0, "stages": 6}
    assert WGMMA_T.smem_bytes(params, "float16") == 6 * (128 + 168) * 64 * 2 + 6 * 16 + 1024
    assert WGMMA_T.tiles((256, 11008, 4096), params) == 132
    (launch,) = WGMMA_T.launches((256, 11008, 4096), params, "float16")
    a_map, b_map, *rest = launch.args
    assert rest == ["X", "W", "Y", "b", 256, 11008, 4096]
    assert isinstance(b_map, TensorMapArg) and launch.args[b_map.of] == "W"
    assert b_map.dims == (4096, 11008) and b_map.box == (64, 168)  # (K, N) innermost first, BN rows of 64 k
    assert a_map.dims == (4096, 256) and a_map.box == (64, 128)
    assert launch.grid == (cdiv(256, 128) * cdiv(11008, 168), 1, 1)


def test_check_shape_needs_only_k_aligned():
    params = WGMMA_T.defaults("float16")
    assert WGMMA_T.check_shape((5, 61, 8), params, "float16") is None  # W rows are K long: N is free
    assert "K=100" in WGMMA_T.check_shape((5, 64, 100), params, "float16")
    assert "tensorcore" not in WGMMA_T.check_shape((5, 64, 100), params, "float16")  # linear_t has no other family
    assert WGMMA.check_shape((5, 61, 8), WGMMA.defaults("float16"), "float16") is not None  # (K, N) needs N too


@pytest.mark.parametrize("dtype", DTYPES)
def test_rendered_kernel_reads_b_k_major(dtype):
    params = {**WGMMA_T.defaults(dtype), "BN": 168, "ctas": 0}
    source = render(WGMMA_T, params, dtype, {"act": "gelu_erf"})
    kind = "f16" if dtype == "float16" else "bf16"
    assert f"wgmma.mma_async.sync.aligned.m64n168k16.f32.{kind}.{kind}" in source
    assert "p, 1, 1, 0, 0;" in source and "p, 1, 1, 0, 1;" not in source  # imm-trans-b = 0: B K-major
    assert "km_gemm_wgmma_smem_bytes<128, 168, 4, true, false>()" in source
    plain = render(WGMMA, {**WGMMA.defaults(dtype), "BN": 168, "ctas": 0}, dtype, {"act": "gelu_erf"})
    assert "p, 1, 1, 0, 1;" in plain and "p, 1, 1, 0, 0;" not in plain
