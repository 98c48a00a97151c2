import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernelmill.kernels.ops import OPS, SpecError, get_op
from kernelmill.kernels.ops.attention import MASK_MIN
from kernelmill.kernels.ops.base import DTYPES, Param, numpy_dtype


def test_get_op_unknown_lists_known():
    with pytest.raises(SpecError, match="known ops: softmax, matmul, fused_mlp"):
        get_op("conv")


@given(st.lists(st.integers(min_value=1, max_value=1 << 20), min_size=2, max_size=2))
def test_parse_shape_roundtrip(dims):
    op = get_op("softmax")
    assert op.parse_shape("x".join(map(str, dims))) == tuple(dims)
    assert op.parse_shape(dims) == tuple(dims)


def test_each_ops_example_shape_is_one_a_job_of_each_of_its_dtypes_takes():
    """The example a malformed shape's error (and the dashboard's form) gives: 1024 a dim was attention's
    head_dim of 1024, which no attention variant takes."""
    from kernelmill.service.jobs import validate_submission
    from kernelmill.settings import Settings

    for spec in OPS.values():
        for dtype in [dt for dt in DTYPES if any(dt in family.dtypes for family in spec.families.values())]:
            validate_submission(Settings(), spec.name, [spec.example()], dtype, "random", 64, 600.0)
    with pytest.raises(SpecError, match=r"malformed shape '8x12xqx64' for attention: .*e\.g\. 8x12x128x64$"):
        get_op("attention").parse_shape("8x12xqx64")


@pytest.mark.parametrize(
    "text", ["8192", "8x8x8", "axb", "8x-1", "0x5", "", "1x2147483648", "4096x1024x", "x4096x1024", "4096xx1024"]
)
def test_parse_shape_rejects(text):
    with pytest.raises(SpecError):
        get_op("softmax").parse_shape(text)


@pytest.mark.parametrize("text", ["4096x1024", " 4096 X 1024 ", "4096,1024", "4096 1024", "4096 x\t1024"])
def test_parse_shape_takes_one_separator_between_dims(text):
    assert get_op("softmax").parse_shape(text) == (4096, 1024)


def test_a_dim_past_a_32_bit_int_less_a_loops_step_is_refused_with_the_reason():
    """At 2^31 - 1 a row loop's step wrapped negative (softmax, layernorm read before the row; GEMMs wrote 0)."""
    assert get_op("softmax").parse_shape("1x2130706432") == (1, 2130706432)
    for cols in (2147483647, 2130706433, 99999999999):
        with pytest.raises(SpecError, match=r"dim cols must be at most 2130706432 \(kernels index in 32 bits\)"):
            get_op("softmax").parse_shape([1, cols])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{'1' * 5000}x4", "dim rows must be at most 2130706432 (kernels index in 32 bits), got a number of 5000"),
        (f"4x-{'1' * 5000}", "dim cols must be > 0, got a number of 5000 digits"),
        (f"4x{'0' * 5000}8", None),
        (f"4x4x{'1' * 5000}", "softmax takes a shape of 2 dims (rowsxcols), got 3"),
    ],
)
def test_a_dim_of_thousands_of_digits_is_refused_without_int_raising(text, message):
    """int() raises its own ValueError ("Exceeds the limit (4300 digits)") on such a number: a 500 in the API."""
    if message is None:  # leading zeros are no size
        assert get_op("softmax").parse_shape(text) == (4, 8)
        return
    with pytest.raises(SpecError) as err:
        get_op("softmax").parse_shape(text)
    assert message in str(err.value) and len(str(err.value)) < 200


def test_param_coerce():
    p = Param("vec", (1, 2, 4))
    assert p.coerce("4") == 4
    flag = Param("fast", (False, True))
    assert flag.coerce("true") is True
    with pytest.raises(SpecError, match="choose one of 1, 2, 4"):
        p.coerce("3")


def test_dtypes_map_to_numpy():
    assert [numpy_dtype(d).itemsize for d in DTYPES] == [4, 2, 2]
    with pytest.raises(SpecError):
        numpy_dtype("float64")


@pytest.mark.parametrize("op", list(OPS.values()), ids=lambda o: o.name)
def test_every_family_defaults_valid_and_space_consistent(op):
    for fam in op.families.values():
        for dtype in fam.dtypes:
            defaults = fam.defaults(dtype)
            assert fam.check(defaults, dtype) is None, (fam.name, dtype)
            assert set(defaults) == {p.name for p in fam.params}
            size = 0
            for params in fam.space(dtype):
                assert fam.check(params, dtype) is None
                size += 1
            assert size == fam.space_size(dtype) > 0


@pytest.mark.parametrize("op", list(OPS.values()), ids=lambda o: o.name)
def test_make_inputs_fresh_nonzero_and_seeded(op):
    shape = tuple(3 + i for i in range(len(op.dims)))
    kinds = len(op.input_kinds)  # seeds of the first kind: the others may zero a mask on purpose
    for dtype in DTYPES:
        a = op.make_inputs(shape, dtype, seed=kinds)
        b = op.make_inputs(shape, dtype, seed=kinds)
        c = op.make_inputs(shape, dtype, seed=2 * kinds)
        for name in op.inputs:
            assert a[name].dtype == numpy_dtype(dtype)
            assert a[name].shape == op.tensor_shapes(shape)[name]
            assert (a[name].astype("float64") != 0).mean() > 0.9
            assert (a[name] == b[name]).all()
            assert not (a[name] == c[name]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["attention", "sdpa"])
def test_attention_inputs_take_the_production_mask_paths_by_seed(op, dtype):
    spec = OPS[op]
    shape = (3, 2, 40, 16)
    masks = {spec.input_kind(seed): spec.make_inputs(shape, dtype, seed)["mask"].astype("float64") for seed in range(3)}
    assert set(masks) == {"random", "zero", "padding"}
    assert (masks["random"] != 0).mean() > 0.9
    assert (masks["zero"] == 0).all()
    # BERT's padding value, finite, and torch code's -inf, by turns over the batch
    padded = (masks["padding"] == MASK_MIN[dtype]) | np.isneginf(masks["padding"])
    assert padded.any() and (masks["padding"][~padded] == 0).all() and not padded[:2].all(axis=1).any()
    assert np.isneginf(masks["padding"][2]).all()  # from batch 3, a sequence whose every key is -inf
    assert padded[0].sum() == padded[1].sum() == 20  # batches 0 and 1 lose their second half, whatever the seed
    assert (masks["padding"][0, -1] == MASK_MIN[dtype]) == np.isneginf(masks["padding"][1, -1])  # one of each
    for seed in range(3):
        assert np.isfinite(spec.reference(spec.make_inputs(shape, dtype, seed), {})["out"]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_offset_inputs_overflow_exp_without_the_max(dtype):
    spec = OPS["softmax"]
    x = spec.make_inputs((64, 100), dtype, seed=1)["x"].astype("float64")
    assert spec.input_kind(1) == "offset"
    row_max = np.abs(x).max(axis=1)
    assert (row_max > 90).all()  # exp() of those is past float32's range (88.7), or 0 below -103
    assert (x.max(axis=1) > 90).any() and (x.max(axis=1) < -90).any()
    ref = spec.reference({"x": x}, {})["y"]
    assert np.isfinite(ref).all() and np.allclose(ref.sum(axis=1), 1.0)


@pytest.mark.parametrize("op", list(OPS.values()), ids=lambda o: o.name)
def test_reference_outputs_float64_of_declared_shapes(op):
    shape = tuple(5 + i for i in range(len(op.dims)))
    inputs = op.make_inputs(shape, "float32", seed=0)
    outs = op.reference(inputs, op.resolve_attrs({}))
    for name in op.outputs:
        assert outs[name].dtype == "float64"
        assert outs[name].shape == op.tensor_shapes(shape)[name]
    assert op.flops(shape) > 0
    assert op.min_bytes(shape, "float16") * 2 == op.min_bytes(shape, "float32")


def test_resolve_rejects_bad_params_and_dtype():
    fam = get_op("softmax").family("warp_row")
    with pytest.raises(SpecError, match="16-byte"):
        fam.resolve({"vec": 8}, "float32")
    with pytest.raises(SpecError, match="no parameter"):
        fam.resolve({"bogus": 1}, "float16")
    with pytest.raises(SpecError, match="no family"):
        get_op("softmax").family("nope")
