"""benchmarks/kernels.py: the issue's cases and how a row is judged against its target."""

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kernels")


def test_every_case_is_a_valid_problem_with_a_target(bench):
    from kernelmill.kernels.ops import get_op

    cases = bench._cases()
    assert len({c.name for c in cases}) == len(cases) == 24
    for case in cases:
        spec = get_op(case.op)
        spec.tensor_shapes(case.shape)  # raises on a malformed shape
        for fam in case.families or ():
            assert case.dtype in spec.family(fam).dtypes, case.name


def test_targets_judge_rows(bench):
    copy80 = bench.Target("floor_pct", 80, "")
    assert copy80.met({"pct_floor": 81.0}) is True
    assert copy80.met({"pct_floor": 79.9}) is False
    assert copy80.met({}) is None
    skinny = bench.Target("speedup", 1.2, "", (bench.Target("floor_pct", 85, ""),))
    assert skinny.met({"speedup": 1.3, "pct_floor": 90}) is True
    assert skinny.met({"speedup": 1.3, "pct_floor": 80}) is False
    assert skinny.met({"speedup": 1.1, "pct_floor": 90}) is False
    assert bench.Target("max_us", 50, "").met({"ours_us": 49.9}) is True
    assert bench.Target("max_us", 50, "").met({"ours_us": 50.1}) is False
