"""benchmarks/attention_sweep.py without a GPU: its shapes parse, bad ones are refused, and it says it needs a GPU."""

import pytest

from kernelmill.kernels.ops.base import SpecError
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("attention_sweep")


def test_default_shapes_parse_and_each_op_has_the_mma_family(sweep):
    from kernelmill.kernels.ops import get_op

    shapes = sweep.parse_shapes(sweep.SHAPES)
    assert shapes[0] == (8, 12, 128, 64) and len(shapes) == 5
    for op in ("sdpa", "attention"):
        assert "mma" in get_op(op).families and "fused" in get_op(op).families


def test_malformed_shape_is_refused(sweep):
    with pytest.raises(SpecError):
        sweep.parse_shapes("8x12x128")


def test_without_a_gpu_it_stops_before_timing(sweep, monkeypatch):
    from kernelmill.kernels import device

    def no_gpu(ordinal=0):
        raise device.GpuUnavailable("no CUDA device is visible")

    monkeypatch.setattr(device, "get_device", no_gpu)
    assert sweep.main(["--shapes", "1x2x64x64"]) == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_timing_masks(sweep, dtype):
    import numpy as np

    from kernelmill.kernels.ops import get_op

    spec, shape = get_op("sdpa"), (2, 3, 40, 16)
    random = sweep.timing_inputs(spec, shape, dtype, "random")["mask"].astype(np.float32)
    assert (random != 0).all()  # make_inputs: every key masked by something
    assert (sweep.timing_inputs(spec, shape, dtype, "zero")["mask"].astype(np.float32) == 0).all()
    padding = sweep.timing_inputs(spec, shape, dtype, "padding")["mask"].astype(np.float32)
    assert (padding[:, :30] == 0).all() and (padding[:, 30:] < -20000).all()
