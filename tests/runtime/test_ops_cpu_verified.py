"""The runtime's CPU path (NumPy float32) of every op passes the verification its GPU kernels pass: the op's own
inputs (each input kind: attention's padding masks with -inf and the dtype's lowest, softmax's masked rows,
layernorm's offset and small-variance rows) at odd shapes, against the float64 reference and its tolerance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.elementwise import ELEMENTWISE_ACTIVATIONS
from kernelmill.kernels.ops.embedding import unpack_ids
from kernelmill.kernels.ops.fused_mlp import ACTIVATIONS as FUSED_ACTIVATIONS
from kernelmill.kernels.ops.layernorm import EPS_VALUES
from kernelmill.kernels.verify import compare
from kernelmill.runtime import Tensor, ops

EXAMPLES = settings(
    max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
DTYPES = st.sampled_from(["float32", "float16", "bfloat16"])
SEEDS = st.integers(0, 2**31 - 1)
DIMS = st.sampled_from([1, 2, 3, 7, 13, 16, 31, 64])


def _check(op_name: str, shape, dtype: str, seed: int, run, attrs=None) -> None:
    """``run(tensors)`` (the op's inputs as CPU tensors) gives the runtime's output: it must pass ``compare``."""
    op = get_op(op_name)
    attrs = op.resolve_attrs(attrs or {})
    inputs = op.make_inputs(shape, dtype, seed)
    (name,) = op.outputs
    reference = op.reference(inputs, attrs)[name]
    out = run({n: Tensor.from_numpy(a, "cpu", dtype) for n, a in inputs.items()}, inputs)
    assert out.device == "cpu" and out.dtype == dtype
    got = out.numpy().reshape(reference.shape)
    check = compare(got, reference, seed, name, op.tolerance(shape, dtype))
    assert check.failure() is None, check.failure()


@EXAMPLES
@given(DIMS, DIMS, DIMS, DTYPES, SEEDS, st.sampled_from(ELEMENTWISE_ACTIVATIONS))
def test_matmul_linear_and_bias_act(m, n, k, dtype, seed, act):
    _check("matmul", (m, n, k), dtype, seed, lambda t, _: ops.matmul(t["A"], t["B"]))
    _check("linear", (m, n, k), dtype, seed, lambda t, _: ops.linear(t["X"], t["W"], t["b"], act), {"act": act})
    _check("bias_act", (m, n), dtype, seed, lambda t, _: ops.bias_act(t["X"], t["b"], act), {"act": act})
    _check("add", (m * n,), dtype, seed, lambda t, _: ops.add(t["X"], t["R"]))


@EXAMPLES
@given(DIMS, st.sampled_from([1, 2, 17, 100, 1000]), DTYPES, SEEDS, st.sampled_from(EPS_VALUES))
def test_softmax_and_layernorms_on_each_input_kind(rows, cols, dtype, seed, eps):
    _check("softmax", (rows, cols), dtype, seed, lambda t, _: ops.softmax(t["x"]))
    attrs = {"eps": eps}
    plain = lambda t, _: ops.layernorm(t["X"], t["gamma"], t["beta"], eps)  # noqa: E731
    _check("layernorm", (rows, cols), dtype, seed, plain, attrs)
    add = lambda t, _: ops.layernorm(t["X"], t["gamma"], t["beta"], eps, residual=t["R"])  # noqa: E731
    _check("add_layernorm", (rows, cols), dtype, seed, add, attrs)


@EXAMPLES
@given(DIMS, DIMS, DIMS, DIMS, DTYPES, SEEDS, st.sampled_from(FUSED_ACTIVATIONS))
def test_fused_mlp(batch, d_in, d_hidden, d_out, dtype, seed, act):
    run = lambda t, _: ops.fused_mlp(t["X"], t["W1"], t["b1"], t["W2"], t["b2"], act)  # noqa: E731
    _check("fused_mlp", (batch, d_in, d_hidden, d_out), dtype, seed, run, {"act": act})


@EXAMPLES
@given(st.integers(1, 4), st.integers(1, 3), DIMS, st.sampled_from([1, 8, 64]), DTYPES, SEEDS)
def test_attention_and_sdpa_on_each_mask_kind(batch, heads, seq, head_dim, dtype, seed):
    shape = (batch, heads, seq, head_dim)

    def packed(t, _):
        return ops.attention(t["qkv"].reshape(batch, seq, 3 * heads * head_dim), heads, t["mask"])

    _check("attention", shape, dtype, seed, packed)
    run = lambda t, _: ops.scaled_dot_product_attention(t["q"], t["k"], t["v"], t["mask"])  # noqa: E731
    _check("sdpa", shape, dtype, seed, run)


@EXAMPLES
@given(DIMS, DIMS, DIMS, st.sampled_from([1, 5, 300]), st.integers(1, 3), DTYPES, SEEDS)
def test_embedding(batch, seq, hidden, vocab, type_vocab, dtype, seed):
    def run(t, inputs):
        ids, type_ids = (unpack_ids(inputs[n]).reshape(batch, seq) for n in ("ids", "type_ids"))
        return ops.embedding(ids, t["word"], t["pos"], t["types"], type_ids)

    _check("embedding", (batch, seq, hidden, vocab, type_vocab), dtype, seed, run)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_query_whose_every_key_is_masked_gives_zero_on_the_cpu_as_the_kernels_do(dtype):
    seed = 2  # the padding kind: from batch 3 a sequence whose every key is -inf
    assert get_op("attention").input_kind(seed) == "padding"
    captured = {}

    def run(t, inputs):
        captured["mask"] = inputs["mask"]
        return ops.attention(t["qkv"].reshape(3, 9, 3 * 2 * 8), 2, t["mask"])

    _check("attention", (3, 2, 9, 8), dtype, seed, run)
    assert np.isneginf(captured["mask"].astype(np.float32)).all(axis=1).any()
