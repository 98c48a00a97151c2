import numpy as np
import pytest

from kernelmill.kernels.bench import Timing
from kernelmill.kernels.ops.base import TOLERANCES
from kernelmill.kernels.verify import compare, fresh_seeds


def test_exact_output_passes():
    ref = np.random.default_rng(0).standard_normal((8, 9))
    check = compare(ref.astype(np.float32), ref, seed=1, name="y")
    assert check.failure(TOLERANCES["float32"]) is None
    assert check.rel_err < 1e-7


def test_nan_never_passes_and_is_located():
    ref = np.ones((4, 5))
    out = ref.astype(np.float16)
    out[2, 3] = np.nan
    check = compare(out, ref, seed=7, name="y")
    assert check.nan_count == 1 and check.first_bad_index == (2, 3)
    assert "non-finite" in check.failure(1.0)


def test_small_norm_error_but_one_wrong_element_fails():
    ref = np.random.default_rng(1).uniform(0.5, 1.0, size=(256, 256))
    out = ref.copy()
    out[100, 7] += 0.5  # one element 50% off: tiny in norm, gross elementwise
    check = compare(out, ref, seed=0, name="C")
    assert check.rel_err < 1e-2
    assert "max elementwise" in check.failure(1e-2)
    assert check.first_bad_index == (100, 7)


def test_fp16_rounding_within_tolerance():
    ref = np.random.default_rng(2).standard_normal((64, 64))
    check = compare(ref.astype(np.float16), ref, 0, "y")
    assert check.failure(TOLERANCES["float16"]) is None
    assert check.failure(TOLERANCES["float32"]) is not None


def test_fp16_output_below_its_normal_range_is_judged_against_that_range():
    ref = np.array([[-2.6e-6]])  # a GELU of about -5: a float16 subnormal, stored with 6e-8 steps
    check = compare(ref.astype(np.float16), ref, 0, "y")
    assert check.failure(TOLERANCES["float16"]) is None
    wrong = np.array([[-2.0e-5]], dtype=np.float16)  # off by more than the format's resolution
    assert compare(wrong, ref, 0, "y").failure(TOLERANCES["float16"]) is not None
    # float32 keeps relative precision there: no floor.
    assert compare(np.array([[-2.7e-6]], dtype=np.float32), ref, 0, "y").failure(TOLERANCES["float32"]) is not None


def test_fresh_seeds_differ():
    assert fresh_seeds(4) != fresh_seeds(4)


def test_timing_from_samples():
    t = Timing.from_samples([1.0, 2.0, 3.0, 4.0, 100.0])
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.n == 5
    assert t.spread > 0
    with pytest.raises(Exception):  # noqa: B017 - statistics raises on empty input
        Timing.from_samples([])
