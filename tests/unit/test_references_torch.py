"""Every op's float64 reference (what verification holds kernels to) against PyTorch in float64 on the CPU, on the
op's own inputs (each input kind: attention's padding masks with -inf, softmax's masked rows, layernorm's offset
rows) at odd shapes (1, primes), and on values PyTorch propagates (inf, NaN)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernelmill.kernels.ops import get_op  # noqa: E402
from kernelmill.kernels.ops.elementwise import ELEMENTWISE_ACTIVATIONS  # noqa: E402
from kernelmill.kernels.ops.embedding import unpack_ids  # noqa: E402

#: Examples per property, the same every run: each draws an op's inputs at a small shape (< 2 s a property).
EXAMPLES = settings(
    max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
DTYPES = st.sampled_from(["float32", "float16", "bfloat16"])
SEEDS = st.integers(0, 2**31 - 1)
#: Dims that catch off-by-one tiling in a reference's reshapes: 1, primes, and a few powers of two.
DIMS = st.sampled_from([1, 2, 3, 5, 7, 8, 13, 16, 31, 64])

TORCH_ACTS = {
    "none": lambda h: h,
    "relu": torch.relu,
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def _assert_close(ours: np.ndarray, theirs: torch.Tensor) -> None:
    # float64 both; torch's GELU erf is 0.5 x (1 + erf(x / sqrt 2)), which cancels below x = -5 (an absolute
    # error of ~1e-16 there, the reference's erfc form has none): atol covers that, nothing else.
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-10, atol=1e-13)


def _reference(name: str, shape, dtype: str, seed: int, attrs=None):
    op = get_op(name)
    inputs = op.make_inputs(shape, dtype, seed)
    attrs = op.resolve_attrs(attrs or {})
    return inputs, attrs, op.reference(inputs, attrs)


@EXAMPLES
@given(DIMS, DIMS, DIMS, DTYPES, SEEDS)
def test_matmul(m, n, k, dtype, seed):
    inputs, _, ref = _reference("matmul", (m, n, k), dtype, seed)
    _assert_close(ref["C"], _t(inputs["A"]) @ _t(inputs["B"]))


@EXAMPLES
@given(DIMS, DIMS, DIMS, DTYPES, SEEDS, st.sampled_from(ELEMENTWISE_ACTIVATIONS), st.booleans())
def test_linear_and_linear_t_with_each_activation(m, n, k, dtype, seed, act, transposed):
    name = "linear_t" if transposed else "linear"
    inputs, _, ref = _reference(name, (m, n, k), dtype, seed, {"act": act})
    weight = _t(inputs["W"]) if transposed else _t(inputs["W"]).T  # F.linear takes (out, in)
    _assert_close(ref["Y"], TORCH_ACTS[act](F.linear(_t(inputs["X"]), weight, _t(inputs["b"]))))


@EXAMPLES
@given(DIMS, DIMS, DTYPES, SEEDS, st.sampled_from(ELEMENTWISE_ACTIVATIONS))
def test_bias_act_and_add(rows, cols, dtype, seed, act):
    inputs, _, ref = _reference("bias_act", (rows, cols), dtype, seed, {"act": act})
    _assert_close(ref["Y"], TORCH_ACTS[act](_t(inputs["X"]) + _t(inputs["b"])))
    inputs, _, ref = _reference("add", (rows * cols,), dtype, seed)
    _assert_close(ref["Y"], _t(inputs["X"]) + _t(inputs["R"]))


@EXAMPLES
@given(DIMS, st.sampled_from([1, 2, 3, 17, 100, 1000]), DTYPES, SEEDS)
def test_softmax_on_each_input_kind(rows, cols, dtype, seed):
    inputs, _, ref = _reference("softmax", (rows, cols), dtype, seed)
    _assert_close(ref["y"], torch.softmax(_t(inputs["x"]), dim=-1))


@EXAMPLES
@given(DIMS, st.sampled_from([1, 2, 3, 17, 100, 768]), DTYPES, SEEDS, st.sampled_from([1e-12, 1e-5, 1e-8]))
def test_layernorm_and_add_layernorm_on_each_input_kind(rows, cols, dtype, seed, eps):
    for name in ("layernorm", "add_layernorm"):
        inputs, _, ref = _reference(name, (rows, cols), dtype, seed, {"eps": eps})
        x = _t(inputs["X"]) + (_t(inputs["R"]) if "R" in inputs else 0.0)
        # The offset kind's rows sit ~1000 from 0: float64 keeps ~1e-13 of their normalised values there.
        expected = F.layer_norm(x, (cols,), _t(inputs["gamma"]), _t(inputs["beta"]), eps)
        np.testing.assert_allclose(ref["Y"], expected.numpy(), rtol=1e-9, atol=1e-9)


@EXAMPLES
@given(DIMS, DIMS, DIMS, DIMS, DTYPES, SEEDS, st.sampled_from(["gelu_erf", "gelu_tanh", "relu"]))
def test_fused_mlp(batch, d_in, d_hidden, d_out, dtype, seed, act):
    inputs, _, ref = _reference("fused_mlp", (batch, d_in, d_hidden, d_out), dtype, seed, {"act": act})
    x, w1, b1, w2, b2 = (_t(inputs[n]) for n in ("X", "W1", "b1", "W2", "b2"))
    _assert_close(ref["Y"], TORCH_ACTS[act](x @ w1 + b1) @ w2 + b2)


@EXAMPLES
@given(DIMS, DIMS, DIMS, st.integers(1, 3), DTYPES, SEEDS, st.sampled_from(ELEMENTWISE_ACTIVATIONS))
def test_mlp_stack(batch, d_model, d_hidden, layers, dtype, seed, act):
    inputs, _, ref = _reference("mlp_stack", (batch, d_model, d_hidden, layers), dtype, seed, {"act": act})
    x = _t(inputs["X"])
    for layer in range(layers):
        up = TORCH_ACTS[act](x @ _t(inputs["W1"][layer]) + _t(inputs["b1"][layer]))
        x = up @ _t(inputs["W2"][layer]) + _t(inputs["b2"][layer])
    _assert_close(ref["Y"], x)


@EXAMPLES
@given(DIMS, DIMS, DIMS, st.sampled_from([1, 2, 300, 70000]), st.integers(1, 3), DTYPES, SEEDS)
def test_embedding(batch, seq, hidden, vocab, type_vocab, dtype, seed):
    shape = (batch, seq, hidden, vocab, type_vocab)
    inputs, _, ref = _reference("embedding", shape, dtype, seed)
    ids, type_ids = (torch.from_numpy(unpack_ids(inputs[n]).reshape(batch, seq)) for n in ("ids", "type_ids"))
    assert int(ids.max()) < vocab and int(type_ids.max()) < type_vocab
    positions = torch.arange(seq).expand(batch, seq)
    expected = F.embedding(ids, _t(inputs["word"])) + F.embedding(positions, _t(inputs["pos"]))
    expected += F.embedding(type_ids, _t(inputs["types"]))
    _assert_close(ref["Y"].reshape(batch, seq, hidden), expected)


def _torch_attention(q, k, v, mask):
    # torch's math path on the CPU, float64: a query whose every key is -inf gives 0 (its "safe" softmax).
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])


@EXAMPLES
@given(st.integers(1, 4), st.integers(1, 3), DIMS, st.sampled_from([1, 8, 16, 64]), DTYPES, SEEDS)
def test_attention_and_sdpa_on_each_mask_kind(batch, heads, seq, head_dim, dtype, seed):
    shape = (batch, heads, seq, head_dim)
    inputs, _, ref = _reference("attention", shape, dtype, seed)
    qkv = _t(inputs["qkv"]).permute(2, 0, 3, 1, 4)  # (3, batch, heads, seq, head_dim)
    expected = _torch_attention(qkv[0], qkv[1], qkv[2], _t(inputs["mask"])).permute(0, 2, 1, 3)
    _assert_close(ref["out"], expected)
    inputs, _, ref = _reference("sdpa", shape, dtype, seed)
    _assert_close(ref["out"], _torch_attention(*(_t(inputs[n]) for n in ("q", "k", "v", "mask"))))


def test_attention_whose_every_key_is_masked_gives_zero_as_torch_and_the_kernels_do():
    # The padding kind from batch 3 has a sequence whose every key is -inf: the kernels write 0 there (verified
    # against this reference), as torch does; BERT's finfo.min mask instead gives the mean of the values.
    shape, seed = (3, 2, 7, 8), 2
    op = get_op("attention")
    assert op.input_kind(seed) == "padding"
    inputs, _, ref = _reference("attention", shape, "float32", seed)
    masked = np.isneginf(inputs["mask"]).all(axis=1)
    assert masked.any()
    assert (ref["out"][masked] == 0).all()
    lowest = np.where(np.isneginf(inputs["mask"]), np.finfo(np.float32).min, inputs["mask"])
    qkv = inputs["qkv"].astype(np.float64)
    out = op.reference({"qkv": inputs["qkv"], "mask": lowest}, {})["out"]
    values_mean = qkv[:, :, 2].mean(axis=1)  # (batch, heads, head_dim): every key weighted alike
    np.testing.assert_allclose(out[masked], np.repeat(values_mean[masked][:, None], shape[2], axis=1), rtol=1e-12)


SPECIAL = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30, 3.0, -3.0]


@pytest.mark.parametrize("act", ELEMENTWISE_ACTIVATIONS)
def test_activations_propagate_inf_and_nan_as_torch_does(act):
    op = get_op("bias_act")
    x = np.array(SPECIAL, np.float32)[None, :]
    b = np.zeros(x.shape[1], np.float32)
    with np.errstate(all="ignore"):  # inf - inf in the references, as in torch
        ours = op.reference({"X": x, "b": b}, {"act": act})["Y"]
    np.testing.assert_allclose(ours, TORCH_ACTS[act](_t(x)).numpy(), rtol=1e-12)  # NaN where torch has NaN


def test_matmul_and_softmax_propagate_inf_and_nan_as_torch_does():
    a = np.array([[1.0, np.nan], [np.inf, 1.0], [1.0, 2.0]], np.float32)
    b = np.array([[1.0, -1.0, 0.5], [2.0, 0.0, 1.0]], np.float32)
    with np.errstate(all="ignore"):
        ours = get_op("matmul").reference({"A": a, "B": b}, {})["C"]
    np.testing.assert_allclose(ours, (_t(a) @ _t(b)).numpy(), rtol=1e-12)
    x = np.array([[0.0, -np.inf, 1.0], [-np.inf] * 3, [np.inf, 0.0, 1.0], [np.nan, 0.0, 1.0]], np.float32)
    with np.errstate(all="ignore"):
        ours = get_op("softmax").reference({"x": x}, {})["y"]
    np.testing.assert_allclose(ours, torch.softmax(_t(x), dim=-1).numpy(), rtol=1e-12)
    assert math.isnan(ours[1, 0])  # softmax of a row of -inf is NaN in both (attention's masked rows give 0)
