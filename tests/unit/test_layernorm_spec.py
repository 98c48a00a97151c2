"""layernorm's inputs: the "offset" kind tells a centred variance from E[x^2] - E[x]^2, and its constant rows a
mean summed from the row's first element from one summed from zero (simulated in float32 the way the row family
sums: each thread's elements in turn, then a tree over the threads)."""

from __future__ import annotations

import numpy as np
import pytest

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import numpy_dtype
from kernelmill.kernels.ops.layernorm import EPS_VALUES
from kernelmill.kernels.verify import compare

F32 = np.float32
THREADS = 128


def _row_sums(x: np.ndarray) -> np.ndarray:
    rows, cols = x.shape
    per = -(-cols // THREADS)
    padded = np.zeros((rows, per * THREADS), F32)
    padded[:, :cols] = x
    acc = np.zeros((rows, THREADS), F32)
    for chunk in padded.reshape(rows, per, THREADS).transpose(1, 0, 2):
        acc = acc + chunk
    while acc.shape[1] > 1:
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0]


def _layernorm32(x, gamma, beta, eps: float, one_pass: bool, shifted: bool = True) -> np.ndarray:
    x = x.astype(F32)
    inv = F32(1.0 / x.shape[1])
    x0 = x[:, :1] if shifted else F32(0)  # the kernel sums x - x0, x0 the row's first element
    mean = x0 + (_row_sums(x - x0) * inv)[:, None]
    if one_pass:
        var = (_row_sums(x * x) * inv)[:, None] - mean * mean
    else:
        var = (_row_sums((x - mean) * (x - mean)) * inv)[:, None]
    rstd = F32(1.0) / np.sqrt(np.maximum(var, F32(0)) + F32(eps))
    return (x - mean) * rstd * gamma.astype(F32) + beta.astype(F32)


def _allowance_used(op_name: str, shape, dtype: str, seed: int, one_pass: bool, shifted: bool = True) -> float:
    op = get_op(op_name)
    inputs = op.make_inputs(shape, dtype, seed)
    x = op._x(inputs).astype(F32)  # X (+ R, summed in float32 as the kernel does)
    y = _layernorm32(x, inputs["gamma"], inputs["beta"], 1e-12, one_pass, shifted).astype(numpy_dtype(dtype))
    reference = op.reference(inputs, {"eps": 1e-12})["Y"]
    return compare(y, reference, seed, "Y", op.tolerance(shape, dtype)).allowance_used


@pytest.mark.parametrize("op_name", ["layernorm", "add_layernorm"])
@pytest.mark.parametrize("shape", [(64, 768), (16, 4096), (32, 1000)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_offset_rows_fail_a_one_pass_variance_and_pass_a_centred_one(op_name, shape, dtype):
    offset_seed = 1  # seed % 2 == 1: the "offset" kind
    assert get_op(op_name).input_kind(offset_seed) == "offset"
    centred = _allowance_used(op_name, shape, dtype, offset_seed, one_pass=False)
    assert centred < 0.5
    one_pass = _allowance_used(op_name, shape, dtype, offset_seed, one_pass=True, shifted=False)
    if dtype != "bfloat16":  # too few digits to tell them apart (the docstring of LayerNorm.make_inputs)
        assert one_pass > 2.0
    # On the uniform kind both pass: only the offset rows tell them apart.
    assert _allowance_used(op_name, shape, dtype, 0, one_pass=True) < 0.5
    # A centred variance about a mean summed from zero fails the constant rows (an ulp over sqrt(1e-12)) where
    # that mean is inexact: in float32; in 16 bits at 1000 columns (768 or 4096 copies of a 16-bit value sum
    # and divide exactly).
    unshifted = _allowance_used(op_name, shape, dtype, offset_seed, one_pass=False, shifted=False)
    if dtype == "float32" or shape[1] == 1000:
        assert unshifted > 100.0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cols", [1, 2, 3, 17])
def test_offset_rows_sit_far_from_zero_and_every_eighth_is_constant(dtype, cols):
    inputs = get_op("add_layernorm").make_inputs((200, cols), dtype, seed=3)
    x = inputs["X"].astype(np.float64) + inputs["R"].astype(np.float64)
    assert (np.abs(x).min(axis=1) > 50).all()
    constant = np.arange(200) % 8 == 7
    assert (x.max(axis=1) == x.min(axis=1))[constant].all()
    if cols > 1:
        assert (x.max(axis=1) > x.min(axis=1))[~constant].all()


@pytest.mark.parametrize("op_name", ["layernorm", "add_layernorm"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_kernel_taking_another_eps_fails_and_the_right_eps_passes(op_name, dtype):
    # A kernel that bakes in the wrong eps (1e-12 where 1e-5 is asked: BERT's against the usual) changed a row of
    # variance ~1.3 by 4e-6 of itself, inside every tolerance: the uniform kind's rows of small variance tell.
    op, shape = get_op(op_name), (16, 768)
    inputs = op.make_inputs(shape, dtype, seed=0)
    assert op.input_kind(0) == "uniform"
    x = op._x(inputs).astype(F32)
    tolerance = op.tolerance(shape, dtype)
    for eps in EPS_VALUES:
        reference = op.reference(inputs, {"eps": eps})["Y"]
        for kernel_eps in EPS_VALUES:
            y = _layernorm32(x, inputs["gamma"], inputs["beta"], kernel_eps, one_pass=False)
            check = compare(y.astype(numpy_dtype(dtype)), reference, 0, "Y", tolerance)
            if kernel_eps == eps:
                assert check.allowance_used < 0.5, (eps, check.failure())
            else:
                assert check.failure() is not None, (eps, kernel_eps, check.allowance_used)
