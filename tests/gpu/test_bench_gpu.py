"""kernels/bench.py on the GPU (marker gpu): PyTorch baselines in the precision of the search."""

from __future__ import annotations

import pytest

from kernelmill.kernels.bench import allow_tf32, time_torch

pytestmark = pytest.mark.gpu


def test_allow_tf32_switches_pytorchs_float32_matmul_between_ieee_and_tf32():
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.rand(1024, 1024, device="cuda", generator=gen) - 0.5 for _ in range(2))
    want = a.double() @ b.double()

    def err(got):
        return float((got.double() - want).norm() / want.norm())

    with allow_tf32(torch, False):
        ieee = err(a @ b)
    with allow_tf32(torch, True):
        tf32 = err(a @ b)
    assert ieee < 1e-5 < tf32 < 2e-3, (ieee, tf32)  # TF32 keeps 10 mantissa bits: ~3e-4 here


def test_a_tf32_baseline_is_timed_with_tf32_and_leaves_the_setting_as_it_was():
    torch = pytest.importorskip("torch")
    from kernelmill.kernels.device import get_device
    from kernelmill.kernels.ops import get_op

    spec = get_op("matmul")
    inputs = spec.make_inputs((512, 512, 512), "float32", seed=0)
    before = torch.get_float32_matmul_precision()
    for precision in ("float32", "tf32"):
        timing = time_torch(get_device(), spec, inputs, {}, None, warmup=2, reps=5, precision=precision)
        assert timing is not None and timing.median_ms > 0
    assert torch.get_float32_matmul_precision() == before


def test_events_time_work_on_the_gpu_through_the_devices_wrapper():
    from kernelmill.kernels.bench import time_it
    from kernelmill.kernels.device import get_device

    device = get_device()
    buf = device.alloc(64 << 20)
    timing = time_it(device, lambda: device.fill(buf, 1), warmup=2, reps=5, timeout_s=10)
    assert timing.n == 5 and timing.min_ms > 0
    start = device.event().record()
    device.fill(buf, 2)
    end = device.event().record()
    end.synchronize()
    assert end.query() and end.time_since(start) > 0
