import math

import ml_dtypes
import numpy as np
import pytest
from ml_dtypes import bfloat16

from kernelmill.kernels.bench import Timing
from kernelmill.kernels.ops import OPS, get_op
from kernelmill.kernels.ops.base import UNIT_ROUNDOFF, Tolerance
from kernelmill.kernels.verify import compare, fresh_seeds

FP32, FP16 = Tolerance.of("float32"), Tolerance.of("float16")
STORAGE = {"float16": np.float16, "bfloat16": bfloat16}


def test_exact_output_passes():
    ref = np.random.default_rng(0).standard_normal((8, 9))
    check = compare(ref.astype(np.float32), ref, 1, "y", FP32)
    assert check.failure() is None
    assert check.rel_err < 1e-7


def test_nan_never_passes_and_is_located():
    ref = np.ones((4, 5))
    out = ref.astype(np.float16)
    out[2, 3] = np.nan
    check = compare(out, ref, 7, "y", Tolerance(1.0, 1.0, 1.0))
    assert check.nan_count == 1 and check.first_bad_index == (2, 3)
    assert "non-finite" in check.failure()


def test_small_norm_error_but_one_wrong_element_fails():
    ref = np.random.default_rng(1).uniform(0.5, 1.0, size=(256, 256))
    out = ref.copy()
    out[100, 7] += 0.5  # one element 50% off: tiny in norm, gross elementwise
    check = compare(out, ref, 0, "C", Tolerance(1e-2, 1.0, 1.0))
    assert check.rel_err < 1e-2
    assert "max elementwise" in check.failure()
    assert check.first_bad_index == (100, 7)


def test_element_over_its_allowance_is_named_with_its_values():
    ref = np.random.default_rng(1).uniform(0.5, 1.0, size=(64, 64))
    out = ref.astype(np.float16)
    out[3, 5] = np.float16(ref[3, 5] * 1.01)  # 1%: inside the norm and max checks, 5x float16's 4 ulps
    check = compare(out, ref, 9, "C", FP16)
    assert check.rel_err < FP16.norm and check.max_abs_rel_err < FP16.norm
    why = check.failure()
    assert why and "element (3, 5)" in why and "seed 9" in why
    assert check.worst_element == (3, 5) and check.allowance_used > 1


def test_the_per_element_check_sees_every_chunk_and_names_the_element(monkeypatch):
    """compare() walks large outputs in chunks (an 8192 x 8192 softmax is four): a wrong element in the last
    one fails, at its own index."""
    from kernelmill.kernels import verify

    monkeypatch.setattr(verify, "_CHUNK", 7)
    ref = np.random.default_rng(3).uniform(0.5, 1.0, size=(6, 5))
    out = ref.astype(np.float16)
    out[5, 3] = np.float16(ref[5, 3] * 1.01)  # element 28: the fifth chunk of 7
    check = compare(out, ref, 0, "y", FP16)
    assert check.allowance_used > 1 and check.worst_element == (5, 3)
    assert check.worst_values == (float(out[5, 3]), ref[5, 3])


def test_an_output_of_negative_values_is_held_to_its_largest_magnitude():
    ref = -np.random.default_rng(4).uniform(1.0, 2.0, size=(64, 64))
    out = ref.copy()
    out[7, 7] += 0.1  # 5% of max |ref|: the max elementwise check, against -min, fails it
    check = compare(out, ref, 0, "y", Tolerance(1e-2, 1.0, 1.0))
    assert check.max_abs_rel_err == pytest.approx(0.1 / np.abs(ref).max())
    assert "max elementwise" in check.failure()


def test_fp16_rounding_within_tolerance():
    ref = np.random.default_rng(2).standard_normal((64, 64))
    check = compare(ref.astype(np.float16), ref, 0, "y", FP16)
    assert check.failure() is None
    assert compare(ref.astype(np.float16), ref, 0, "y", FP32).failure() is not None


def test_fp16_output_below_its_normal_range_is_judged_against_that_range():
    ref = np.array([[-2.6e-6]])  # a GELU of about -5: a float16 subnormal, stored with 6e-8 steps
    check = compare(ref.astype(np.float16), ref, 0, "y", FP16)
    assert check.failure() is None
    wrong = np.array([[-2.0e-5]], dtype=np.float16)  # off by more than the format's resolution
    assert compare(wrong, ref, 0, "y", FP16).failure() is not None
    # float32 keeps relative precision there: no floor.
    assert compare(np.array([[-2.7e-6]], dtype=np.float32), ref, 0, "y", FP32).failure() is not None


def test_tolerance_grows_with_summed_terms_and_layers_only_where_it_must():
    assert Tolerance.of("float32", 4096).atol_rms > Tolerance.of("float32", 64).atol_rms
    assert Tolerance.of("float16", 1, layers=4).atol_rms == pytest.approx(2 * Tolerance.of("float16").atol_rms, 1e-3)
    assert Tolerance.of("float16", cancels=False).atol_rms == 0.0
    assert get_op("softmax").tolerance((4, 1000), "float16").atol_rms == 0.0
    assert get_op("matmul").tolerance((8, 8, 4096), "float32") == Tolerance.of("float32", 4096)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ops_rounding_nothing_inside_are_allowed_one_roundoff_of_the_rms_not_eight(dtype):
    u, summed = UNIT_ROUNDOFF[dtype], 8 * UNIT_ROUNDOFF["float32"] * math.sqrt(4096)
    assert get_op("matmul").tolerance((8, 8, 4096), dtype).atol_rms == pytest.approx(u + summed)
    fused = get_op("fused_mlp")
    fused_summed = 8 * UNIT_ROUNDOFF["float32"] * math.sqrt(fused.summed_terms((8, 4096, 64, 4096)))
    assert fused.tolerance((8, 4096, 64, 4096), dtype).atol_rms == pytest.approx(8 * u + fused_summed)
    # TF32 rounds every product's inputs: 8 there too, for an op that rounds nothing itself.
    tf32 = get_op("matmul").tolerance((8, 8, 4096), "tf32").atol_rms
    assert tf32 == pytest.approx(8 * UNIT_ROUNDOFF["tf32"] + summed)
    intermediates = {name: op.intermediates for name, op in OPS.items()}
    assert sorted(name for name, rounds in intermediates.items() if rounds) == [
        "attention",
        "fused_mlp",
        "mlp_stack",
        "sdpa",
    ]


# -- The tolerance against simulated kernels: float32 accumulation, the storage type's rounding where kernels
# round (outputs, a hidden layer, attention's probabilities). Correct ones must keep a margin; the faults the
# norm check let through must fail.


def _round(x, dtype):
    return x.astype(np.float32).astype(STORAGE[dtype]).astype(np.float64)


def _used(out, ref, tolerance, dtype="float16"):
    check = compare(out.astype(np.float32).astype(STORAGE.get(dtype, np.float32)), ref, 0, "y", tolerance)
    return check.allowance_used, check.failure()


def _gemm(dtype, m=64, k=4096, n=256, seed=0):
    rng = np.random.default_rng(seed)
    a, b = (_round(rng.uniform(-1, 1, size), dtype) for size in ((m, k), (k, n)))
    return a, b, a @ b


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_correct_16bit_gemm_and_its_faults(dtype):
    a, b, ref = _gemm(dtype)
    tol = get_op("matmul").tolerance((64, 256, 4096), dtype)
    used, why = _used(ref, ref, tol, dtype)
    assert why is None and used < 0.34
    # A term of the sum dropped (the last k): within 1e-2 in norm, far outside per element.
    used, why = _used(a[:, :-1] @ b[:-1], ref, tol, dtype)
    assert why is not None and used > 1
    # Accumulated in the storage type, 16 products at a time (tensor cores with 16-bit accumulators).
    acc = np.zeros_like(ref)
    for k0 in range(0, a.shape[1], 16):
        acc = _round(acc + a[:, k0 : k0 + 16] @ b[k0 : k0 + 16], dtype)
    used, why = _used(acc, ref, tol, dtype)
    if dtype == "float16":  # what the norm check alone let through
        assert np.linalg.norm(acc - ref) / np.linalg.norm(ref) < tol.norm
    assert why is not None and used > 2


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_correct_mlp_stack_rounding_each_layer_passes(dtype):
    batch, d_model, d_hidden, layers = 32, 512, 1408, 4
    rng = np.random.default_rng(3)
    x = _round(rng.uniform(-1, 1, (batch, d_model)), dtype)
    ref, out = x, x
    for _ in range(layers):
        w1 = _round(rng.uniform(-1, 1, (d_model, d_hidden)) * math.sqrt(3 / d_model), dtype)
        w2 = _round(rng.uniform(-1, 1, (d_hidden, d_model)) * math.sqrt(3 / d_hidden), dtype)
        b1, b2 = _round(rng.uniform(-0.5, 0.5, d_hidden), dtype), _round(rng.uniform(-0.5, 0.5, d_model), dtype)
        ref = _gelu(ref @ w1 + b1) @ w2 + b2
        out = _round(_round(_gelu(out @ w1 + b1), dtype) @ w2 + b2, dtype)
    used, why = _used(out, ref, get_op("mlp_stack").tolerance((batch, d_model, d_hidden, layers), dtype), dtype)
    assert why is None and used < 0.34


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_correct_attention_rounding_probabilities_passes(dtype):
    b, h, s, d = 2, 2, 256, 64
    rng = np.random.default_rng(4)
    q, k, v = (_round(rng.uniform(-2, 2, (b, h, s, d)), dtype) for _ in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ v
    out = (_round(p, dtype) @ v) / p.sum(-1, keepdims=True)  # flash attention: P in the storage type
    used, why = _used(out, ref, get_op("sdpa").tolerance((b, h, s, d), dtype), dtype)
    assert why is None and used < 0.34


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softmax_flushing_small_probabilities_fails(dtype):
    rng = np.random.default_rng(5)
    x = _round(rng.uniform(-8, 8, (256, 2048)), dtype)
    e = np.exp(x - x.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    tol = get_op("softmax").tolerance((256, 2048), dtype)
    used, why = _used(ref, ref, tol, dtype)
    assert why is None and used < 0.51  # float16's subnormals: rounding takes half the floor of one step
    flushed = np.where(e < 1e-3, 0.0, e)
    fake = flushed / flushed.sum(-1, keepdims=True)
    assert np.linalg.norm(fake - ref) / np.linalg.norm(ref) < tol.norm  # what the norm check alone let through
    used, why = _used(fake, ref, tol, dtype)
    assert why is not None and used > 4


@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_correct_tf32_gemm_passes_in_either_rounding(rounding):
    rng = np.random.default_rng(6)
    a, b = (rng.uniform(-1, 1, size).astype(np.float32) for size in ((64, 4096), (4096, 256)))
    ref = a.astype(np.float64) @ b

    def tf32(x):
        bits = x.view(np.uint32) + (np.uint32(1 << 12) if rounding == "nearest" else np.uint32(0))
        return (bits & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)

    used, why = _used(tf32(a) @ tf32(b), ref, get_op("matmul").tolerance((64, 256, 4096), "tf32"), "float32")
    assert why is None and used < 0.34


@pytest.mark.parametrize("k", [64, 4096])
def test_correct_float32_sequential_sum_passes(k):
    rng = np.random.default_rng(7)
    a, b = (rng.uniform(-1, 1, size).astype(np.float32) for size in ((32, k), (k, 64)))
    acc = np.zeros((32, 64), np.float32)
    for i in range(k):  # one FMA chain a thread, the worst order for rounding
        acc += np.outer(a[:, i], b[i])
    used, why = _used(acc, a.astype(np.float64) @ b, get_op("matmul").tolerance((32, 64, k), "float32"), "float32")
    assert why is None and used < 0.34


def test_a_correct_float32_sum_of_a_quarter_million_terms_passes_the_norm_checks():
    """The relative-norm tolerance stayed at 1e-5 however many terms were summed: a correct sequential float32 sum
    at K = 262144 was off by 1.8e-5 of max|ref|, and failed; a dropped term still fails."""
    k, rng = 262144, np.random.default_rng(7)
    a, b = rng.uniform(-1, 1, (16, k)).astype(np.float32), rng.uniform(-1, 1, (k, 16)).astype(np.float32)
    acc = np.zeros((16, 16), np.float32)
    for s in range(0, k, 4096):  # one rounding a term, in order (cumsum is sequential), chunk after chunk
        products = a[:, s : s + 4096].T[:, :, None] * b[s : s + 4096][:, None, :]
        acc = np.cumsum(np.concatenate([acc[None], products]), axis=0, dtype=np.float32)[-1]
    ref = a.astype(np.float64) @ b
    tolerance = get_op("matmul").tolerance((16, 16, k), "float32")
    check = compare(acc, ref, 0, "C", tolerance)
    assert check.max_abs_rel_err > 1e-5 and check.failure() is None  # over the old bound, within the new
    dropped = acc - np.outer(a[:, 1000], b[1000])  # one term of the quarter million missing
    assert compare(dropped, ref, 0, "C", tolerance).failure() is not None
    assert (
        Tolerance.of("float32", 4096).norm == 1e-5
        and Tolerance.of("float16", 262144).norm == Tolerance.of("float16").norm
    )


def test_unit_roundoff_is_half_an_ulp_of_each_format():
    assert UNIT_ROUNDOFF["float16"] == np.finfo(np.float16).eps / 2
    assert UNIT_ROUNDOFF["float32"] == np.finfo(np.float32).eps / 2
    assert UNIT_ROUNDOFF["bfloat16"] == float(ml_dtypes.finfo(bfloat16).eps) / 2


@pytest.mark.parametrize("nan_seed_first", [True, False])
def test_a_seed_with_nan_outputs_has_no_error_figure_and_makes_the_largest_nan(nan_seed_first):
    """An all-NaN seed was said to have a relative error of 0.0 (the bench table's "max rel err", the trial's
    max_rel_err_per_seed), and max_rel_err was NaN or the other seed's error by the order of the seeds."""
    from kernelmill.kernels.verify import VerifyResult

    ref = np.ones((4, 5))
    off = compare((ref * (1 + 1e-3)).astype(np.float32), ref, 1, "y", FP32)
    err = pytest.approx(1e-3, rel=1e-3)
    nan = compare(np.full((4, 5), np.nan, np.float32), ref, 2, "y", FP32)
    result = VerifyResult(False, "wrong_result", "float32", 1e-5, (4, 5))
    result.checks = [nan, off] if nan_seed_first else [off, nan]
    assert result.per_seed() == {1: err}
    assert math.isnan(result.max_rel_err)
    result.checks = [off]
    assert result.max_rel_err == err and result.per_seed() == {1: err}


def test_fresh_seeds_differ():
    assert fresh_seeds(4) != fresh_seeds(4)


def test_fresh_seeds_give_each_input_kind_one():
    assert sorted(s % 3 for s in fresh_seeds(3, kinds=3)) == [0, 1, 2]
    assert len(fresh_seeds(1, kinds=3)) == 3  # at least one a kind, whatever was asked
    assert all(0 <= s < 2**31 for s in fresh_seeds(50, kinds=3))


def test_timing_from_samples():
    t = Timing.from_samples([1.0, 2.0, 3.0, 4.0, 100.0])
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.n == 5
    assert t.spread > 0
    with pytest.raises(ValueError, match="^no timing samples$"):  # an IndexError before
        Timing.from_samples([])


def test_the_reference_cache_keys_inputs_by_seed_and_attributes_and_keeps_to_its_size():
    """Every evaluate() goes through it: a key without the seed would have verified every seed on the first
    seed's inputs (and never drawn layernorm's other kind of rows)."""
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.verify import ReferenceCache

    cache = ReferenceCache()
    softmax = get_op("softmax")
    first, ref = cache.get(softmax, (8, 64), "float32", {}, 1)
    again, ref_again = cache.get(softmax, (8, 64), "float32", {}, 1)
    assert again is first and ref_again is ref  # shared by the trials of a search
    other, other_ref = cache.get(softmax, (8, 64), "float32", {}, 2)
    assert not np.array_equal(other["x"], first["x"]) and not np.array_equal(other_ref["y"], ref["y"])
    np.testing.assert_array_equal(first["x"], softmax.make_inputs((8, 64), "float32", 1)["x"])
    linear = get_op("linear")
    plain, plain_ref = cache.get(linear, (4, 16, 8), "float32", {"act": "none"}, 3)
    relu, relu_ref = cache.get(linear, (4, 16, 8), "float32", {"act": "relu"}, 3)
    assert not np.array_equal(plain_ref["Y"], relu_ref["Y"]) and (relu_ref["Y"] >= 0).all()

    small = ReferenceCache(max_bytes=2 * 8 * 64 * (4 + 8))  # two seeds: float32 inputs, float64 references
    for seed in range(3):
        small.get(softmax, (8, 64), "float32", {}, seed)
    assert [key[-1] for key in small._entries] == [1, 2]  # the least recently used went
