"""Every CPU op of the runtime against PyTorch (float32)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from kernelmill.runtime import Tensor, ops  # noqa: E402

RNG = np.random.default_rng(0)


def t(*shape, scale=1.0):
    return Tensor.from_numpy((RNG.standard_normal(shape) * scale).astype(np.float32))


def th(x: Tensor):
    return torch.from_numpy(np.array(x.numpy()))


def close(out: Tensor, ref, tol=1e-5, dtype="float32"):
    assert out.device == "cpu" and out.dtype == dtype
    ref = ref.detach().numpy() if hasattr(ref, "detach") else np.asarray(ref)
    assert out.shape == tuple(ref.shape)
    err = np.linalg.norm(out.numpy().astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < tol, err


def test_matmul():
    a, b = t(3, 5, 17), t(17, 9)
    close(ops.matmul(a, b), th(a) @ th(b))
    with pytest.raises(ValueError):
        ops.matmul(a, t(16, 9))


@pytest.mark.parametrize("act", ["none", "relu", "gelu_erf", "gelu_tanh", "silu"])
def test_linear_with_each_activation(act):
    x, w, b = t(4, 6, 33), t(33, 20), t(20)
    ref = th(x) @ th(w) + th(b)
    fn = {
        "none": lambda h: h,
        "relu": torch.relu,
        "gelu_erf": F.gelu,
        "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
        "silu": F.silu,
    }[act]
    close(ops.linear(x, w, b, act), fn(ref))
    close(ops.linear(x, w, None, act), fn(th(x) @ th(w)))


def test_activations_and_bias_act():
    x, b = t(7, 31, scale=3.0), t(31)
    close(ops.relu(x), torch.relu(th(x)))
    close(ops.gelu(x), F.gelu(th(x)))
    close(ops.gelu(x, approximate="tanh"), F.gelu(th(x), approximate="tanh"))
    close(ops.silu(x), F.silu(th(x)))
    close(ops.bias_act(x, b, "gelu"), F.gelu(th(x) + th(b)))
    with pytest.raises(ValueError, match="unknown activation"):
        ops.activation(x, "tanhshrink")
    scalar = t(scale=3.0)  # 0-d: elementwise ops keep it 0-d; ops along the last dim say it has none
    close(ops.gelu(scalar), F.gelu(th(scalar)))
    assert ops.relu(scalar).shape == () and ops.add(scalar, scalar).shape == ()
    for op in (ops.softmax, lambda x: ops.linear(x, t(1, 1)), lambda x: ops.layernorm(x, t(1), t(1))):
        with pytest.raises(ValueError, match="a 0-d input has no last dim to work along"):
            op(scalar)
    with pytest.raises(ValueError, match="gelu: approximate='tanhh'; use 'none' \\(erf\\) or 'tanh'"):
        ops.gelu(x, approximate="tanhh")  # was erf GELU, silently


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_cpu_gelus_in_float32_match_torch_in_float64_over_a_wide_range(approximate):
    x = np.linspace(-12, 12, 20001).astype(np.float32)
    want = F.gelu(torch.from_numpy(x).double(), approximate=approximate).numpy()
    got = ops.gelu(Tensor.from_numpy(x), approximate=approximate).numpy().astype(np.float64)
    assert np.max(np.abs(got - want)) < 1e-6
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-7
    near = np.abs(x) < 3  # where a model's activations are: relative error too
    assert np.max(np.abs(got - want)[near] / np.maximum(np.abs(want[near]), 1e-3)) < 1e-4


def test_ops_take_runtime_tensors_of_any_float_dtype():
    half = Tensor.from_numpy(np.linspace(-2, 2, 12, dtype=np.float16).reshape(3, 4))
    close(ops.relu(half), torch.relu(th(half).float()), 1e-3, "float16")  # refused: its zero bias was float32
    close(ops.gelu(half), F.gelu(th(half).float()), 1e-3, "float16")
    x = np.ones((2, 3), np.float32)
    for call, name, kind in (
        (lambda: ops.linear(x, t(3, 2)), "linear: x", "numpy.ndarray"),  # AttributeError: no attribute 'numel'
        (lambda: ops.softmax(torch.ones(2, 3)), "softmax: x", "torch.Tensor"),
        (lambda: ops.add(t(2, 3), [[1.0] * 3] * 2), "add: y", "list"),
    ):
        with pytest.raises(TypeError, match=rf"^{name} is a {kind}, not a runtime Tensor; wrap it with runtime"):
            call()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_module_runs_on_the_cpu_each_op_rounding_its_output(dtype):
    """Every CPU op answered float32, so a float16 module's second op mixed dtypes and was refused."""
    from kernelmill.runtime import nn

    model = nn.Sequential(nn.Linear.random(16, 32), nn.Activation("gelu"), nn.Linear.random(32, 8)).to("cpu", dtype)
    x = Tensor.from_numpy(RNG.standard_normal((4, 16)).astype(np.float32)).to("cpu", dtype)
    y = model.forward(x)
    ref = model.to("cpu", "float32").forward(x.to("cpu", "float32"))
    close(y, th(ref), 2e-2 if dtype == "bfloat16" else 2e-3, dtype)
    y16 = ops.add(y, y)
    assert y16.dtype == dtype
    with pytest.raises(TypeError, match=rf"^add: expected tensors of one float dtype, got {dtype}, float32$"):
        ops.add(y, y.to("cpu", "float32"))


def test_erf_is_accurate():
    x = np.linspace(-6, 6, 10001)
    assert np.max(np.abs(ops.erf(x) - torch.erf(torch.from_numpy(x)).numpy())) < 2e-7


def test_softmax_add():
    x, y = t(5, 3, 40, scale=4.0), t(5, 3, 40)
    close(ops.softmax(x), torch.softmax(th(x), dim=-1))
    close(ops.add(x, y), th(x) + th(y))
    with pytest.raises(ValueError):
        ops.add(x, t(5, 3, 39))


@pytest.mark.parametrize("eps", [1e-12, 1e-5])
def test_layernorm_and_residual(eps):
    x, r, g, b = t(6, 4, 48, scale=2.0), t(6, 4, 48), t(48), t(48)
    close(ops.layernorm(x, g, b, eps), F.layer_norm(th(x), (48,), th(g), th(b), eps))
    close(ops.layernorm(x, g, b, eps, residual=r), F.layer_norm(th(x) + th(r), (48,), th(g), th(b), eps))


def test_layernorm_of_a_constant_row_is_beta_as_in_torch():
    """A float32 mean one ulp off, over sqrt(1e-12), gave -0.23 everywhere on a row of 1.7s."""
    x = np.full((3, 1000), 1.7, np.float32)
    x[1] = -3.14159
    x[2] = RNG.standard_normal(1000)
    g, b = t(1000), t(1000)
    out = ops.layernorm(Tensor.from_numpy(x), g, b, 1e-12).numpy()
    np.testing.assert_array_equal(out[:2], np.broadcast_to(b.numpy(), (2, 1000)))
    close(
        ops.layernorm(Tensor.from_numpy(x), g, b, 1e-12),
        F.layer_norm(torch.from_numpy(x), (1000,), th(g), th(b), 1e-12),
    )


@pytest.mark.parametrize("act", ["relu", "gelu_erf", "gelu_tanh", "silu"])
def test_fused_mlp(act):
    x, w1, b1, w2, b2 = t(5, 24), t(24, 40, scale=0.3), t(40), t(40, 12, scale=0.3), t(12)
    fn = {"relu": torch.relu, "gelu_erf": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "silu": F.silu}
    ref = fn[act](th(x) @ th(w1) + th(b1)) @ th(w2) + th(b2)
    close(ops.fused_mlp(x, w1, b1, w2, b2, act), ref)


def test_embedding():
    word, pos, types = t(50, 16), t(12, 16), t(3, 16)
    ids = RNG.integers(0, 50, size=(2, 9))
    tids = RNG.integers(0, 3, size=(2, 9))
    ref = th(word)[torch.from_numpy(ids)] + th(pos)[:9] + th(types)[torch.from_numpy(tids)]
    close(ops.embedding(ids, word, pos, types, tids), ref)
    close(
        ops.embedding(Tensor.from_numpy(ids), word, pos, types),
        th(word)[torch.from_numpy(ids)] + th(pos)[:9] + th(types)[0],
    )
    with pytest.raises(ValueError, match="position"):
        ops.embedding(RNG.integers(0, 50, size=(1, 13)), word, pos, types)
    with pytest.raises(IndexError):
        ops.embedding(np.array([[0, 50]]), word, pos, types)
    # What NumPy failed on deep inside (a float index, a 1-D unpack, a broadcast), named instead.
    for args, message in (
        ((ids.astype(np.float64), word, pos, types), r"ids must be integers of shape \(batch, seq\), not float64"),
        ((ids[0], word, pos, types), r"ids must be integers of shape \(batch, seq\), not int64 \(9,\)"),
        ((ids, word, pos, types, tids[:, :4]), r"type_ids \(2, 4\) for ids \(2, 9\)"),
        ((ids, word, pos, types, tids.astype(np.float32)), "type_ids must be integers"),
    ):
        with pytest.raises(ValueError, match=f"^embedding: {message}"):
            ops.embedding(*args)


def test_attention_and_narrow_check_their_arguments():
    qkv = t(2, 5, 24)
    for heads in (0, -2, 2.0, True):  # ZeroDivisionError, a reshape error, or a float head count before
        with pytest.raises(ValueError, match=f"^attention: heads must be a positive integer, not {heads!r}"):
            ops.attention(qkv, heads)
    with pytest.raises(ValueError, match=r"^attention: qkv \(5, 24\), expected \(batch, seq, 3 \* hidden\)"):
        ops.attention(t(5, 24), 2)
    with pytest.raises(ValueError, match=r"^narrow: x \(5,\), expected \(batch, seq, ...\)"):
        ops.narrow(t(5), 2)


def test_attention_matches_torch_sdpa():
    batch, seq, heads, head_dim = 3, 11, 4, 8
    qkv = t(batch, seq, 3 * heads * head_dim)
    mask_np = np.zeros((batch, seq), np.float32)
    mask_np[1, 7:] = -1e9
    mask_np[2, 4:] = -np.inf
    mask_np[0] = -np.inf  # every key masked: torch's sdpa gives 0 there, not NaN
    mask = Tensor.from_numpy(mask_np)
    x = th(qkv).view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    for m in (None, mask):
        am = None if m is None else th(m)[:, None, None, :]
        ref = F.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=am).transpose(1, 2).reshape(batch, seq, -1)
        close(ops.attention(qkv, heads, m), ref)
    q, k, v = (Tensor.from_numpy(np.ascontiguousarray(x[i].numpy())) for i in range(3))
    with ops.recording() as seen:
        for m in (None, mask):
            am = None if m is None else th(m)[:, None, None, :]
            close(ops.scaled_dot_product_attention(q, k, v, m), F.scaled_dot_product_attention(x[0], x[1], x[2], am))
    assert seen == [("sdpa", (batch, heads, seq, head_dim), "float32", {})]
    with pytest.raises(ValueError, match="3 \\* heads"):
        ops.attention(qkv, 5)
    with pytest.raises(ValueError, match=r"mask \(3, 1, 1, 11\), expected an additive key mask \(3, 11\)"):
        ops.scaled_dot_product_attention(q, k, v, Tensor.from_numpy(mask_np[:, None, None, :]))
    with pytest.raises(ValueError, match="expected 4-D, alike"):
        ops.scaled_dot_product_attention(q, k, t(batch, heads, seq, head_dim + 1))


def test_recording_collects_problems_once():
    x, w, b = t(4, 8), t(8, 6), t(6)
    with ops.recording() as seen:
        ops.linear(x, w, b, "relu")
        ops.linear(x, w, b, "relu")
        ops.softmax(x)
    assert seen == [("linear", (4, 6, 8), "float32", {"act": "relu"}), ("softmax", (4, 8), "float32", {})]


def test_recording_calls_each_with_every_op_as_it_begins_repeats_included():
    x, w, b = t(4, 8), t(8, 6), t(6)
    met, seen_then = [], []
    with ops.recording(each=met.append) as seen, ops.recording() as inner:
        ops.linear(x, w, b, "relu")
        ops.linear(x, w, b, "relu")
        seen_then.append(list(seen))
        ops.softmax(x)
    linear = ("linear", (4, 6, 8), "float32", {"act": "relu"})
    assert met == [linear, linear, ("softmax", (4, 8), "float32", {})]
    assert seen == inner == [linear, ("softmax", (4, 8), "float32", {})] and seen_then == [[linear]]
    with ops.recording() as after:  # each watches its own block only
        ops.softmax(x)
    assert len(met) == 3 and after == [("softmax", (4, 8), "float32", {})]


def test_mixed_devices_are_refused():
    x = t(2, 3)
    fake_cuda = Tensor((3, 3), "float32", "cuda", buffer=object())
    with pytest.raises(ValueError, match="different devices"):
        ops.matmul(x, fake_cuda)


def test_integer_inputs_are_refused_on_the_cpu_as_on_the_gpu():
    ids = Tensor.from_numpy(np.ones((2, 3), dtype=np.int64))
    with pytest.raises(TypeError, match="one float dtype, got float32, int64"):
        ops.linear(ids, t(3, 4), t(4))
    with pytest.raises(TypeError, match="one float dtype, got int64"):
        ops.softmax(ids)
    with pytest.raises(TypeError, match="one float dtype"):
        ops.fused_mlp(ids, t(3, 5), t(5), t(5, 3), t(3))


def test_operands_of_the_wrong_shape_are_refused_before_any_kernel():
    """The GPU kernels read exactly N bias / scale elements: a short one would be read past its end, so the
    shapes are checked (on every device, before the device branch) and the error names both."""
    x = t(3, 8)
    with pytest.raises(ValueError, match=r"linear: bias \(15,\) for weight \(8, 16\): expected \(16,\)"):
        ops.linear(x, t(8, 16), t(15))
    with pytest.raises(ValueError, match=r"linear: weight \(2, 8, 16\) is not a matrix"):
        ops.linear(x, t(2, 8, 16), t(16))
    with pytest.raises(ValueError, match="matmul: b"):
        ops.matmul(x, t(8))
    with pytest.raises(ValueError, match=r"fused_mlp: b1 \(40,\) for w1 \(8, 24\): expected \(24,\)"):
        ops.fused_mlp(x, t(8, 24), t(40), t(24, 8), t(8))
    with pytest.raises(ValueError, match=r"fused_mlp: b2 \(7,\) for w2 \(24, 8\): expected \(8,\)"):
        ops.fused_mlp(x, t(8, 24), t(24), t(24, 8), t(7))
    with pytest.raises(ValueError, match=r"layernorm: gamma \(7,\) for input \(3, 8\)"):
        ops.layernorm(x, t(7), t(8))
    with pytest.raises(ValueError, match=r"layernorm: beta \(1, 8\) for input \(3, 8\)"):
        ops.layernorm(x, t(8), t(1, 8), residual=t(3, 8))
    with pytest.raises(ValueError, match=r"embedding: position embeddings \(12, 8\) for word embeddings \(50, 16\)"):
        ops.embedding(RNG.integers(0, 50, size=(1, 4)), t(50, 16), t(12, 8), t(3, 16))
    with pytest.raises(ValueError, match="token type embeddings"):
        ops.embedding(RNG.integers(0, 50, size=(1, 4)), t(50, 16), t(12, 16), t(3, 15))


def test_a_gpu_problem_with_an_empty_dimension_launches_nothing(monkeypatch):
    """A batch of 0 reached the registry and a kernel with a zero-size grid, which CUDA refuses."""
    from types import SimpleNamespace

    def no_registry():
        raise AssertionError("no kernel is looked up for an empty problem")

    monkeypatch.setattr(ops, "current_registry", no_registry)
    empty, some = SimpleNamespace(numel=0), SimpleNamespace(numel=160)
    with ops.recording() as met:
        assert ops._launch("softmax", (0, 64), "float16", {}, {"x": empty, "y": empty}) is None
    assert not met  # nor a problem to tune
    with pytest.raises(ValueError, match=r"^matmul: 0x32x0 has an empty dimension to reduce over; no GPU kernel"):
        ops._launch("matmul", (0, 32, 0), "float16", {}, {"A": empty, "B": empty, "C": some})


def test_an_empty_batch_on_the_cpu_answers_empty_and_records_no_problem():
    with ops.recording() as met:
        assert ops.softmax(t(0, 64)).shape == (0, 64) and ops.linear(t(0, 8), t(8, 4), t(4)).shape == (0, 4)
    assert met == []


def test_rows_of_no_element_answer_empty_without_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mean of an empty row warned
        assert ops.softmax(t(3, 0)).shape == (3, 0)  # max() of nothing raised inside NumPy
        assert ops.layernorm(t(3, 0), t(0), t(0)).shape == (3, 0)
        q = t(1, 2, 0, 4)
        assert ops.scaled_dot_product_attention(q, q, q).shape == (1, 2, 0, 4)


def test_type_ids_of_another_rank_on_the_cpu_are_refused_by_name():
    """A 3-D type_ids tensor passed as if packed for the GPU, and NumPy failed to broadcast."""
    word, pos, types = t(10, 4), t(8, 4), t(2, 4)
    bad = Tensor.from_numpy(np.zeros((1, 2, 3), np.int64))
    with pytest.raises(ValueError, match=r"^embedding: type_ids must be integers of shape \(batch, seq\), not int64"):
        ops.embedding(np.array([[1, 2]]), word, pos, types, bad)


def test_a_softmax_row_of_only_minus_inf_is_nan_as_in_torch_without_a_warning():
    import warnings

    x = np.zeros((3, 4), np.float32)
    x[1] = -np.inf  # a row every element of which a mask removed
    x[2, 1:] = -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -inf - (-inf) warned "invalid value", an error under -W error
        out = ops.softmax(Tensor.from_numpy(x))
    np.testing.assert_array_equal(out.numpy(), torch.softmax(torch.from_numpy(x), dim=-1).numpy())
    assert np.isnan(out.numpy()[1]).all() and out.numpy()[2].tolist() == [1.0, 0.0, 0.0, 0.0]
