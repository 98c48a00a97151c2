"""The persistent mlp_stack kernel on the GPU: verified at the benchmark's shape, deterministic, and its done
flags start afresh on every launch (marker gpu)."""

from __future__ import annotations

import numpy as np
import pytest

from kernelmill.kernels.compile import Compiler
from kernelmill.kernels.defaults import default_params
from kernelmill.kernels.ops.mlp_stack import MLP_STACK
from kernelmill.kernels.variant import BoundVariant, Variant
from kernelmill.kernels.verify import verify

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def device():
    from kernelmill.kernels.device import get_device

    return get_device()


@pytest.mark.parametrize(("shape", "dtype"), [((1, 4096, 11008, 2), "float16"), ((4, 1024, 2816, 3), "bfloat16")])
def test_stack_verifies_and_repeats_bit_for_bit(device, tmp_path, shape, dtype):
    fam = MLP_STACK.family("persistent")
    variant = Variant.create(MLP_STACK, "persistent", dtype, default_params(MLP_STACK, fam, shape, dtype))
    bound = BoundVariant(device, variant, variant.compile(Compiler(cache_dir=tmp_path), "sm_90"), shape)
    check = verify(device, bound, 2)
    assert check.ok, check.reason
    bound.set_inputs(MLP_STACK.make_inputs(shape, dtype, seed=11))
    outs = []
    for _ in range(3):  # the same inputs, launched again and again: the done flags are zeroed each time
        bound.poison()
        bound.run()
        device.synchronize()
        outs.append(bound.outputs()["Y"])
    assert np.isfinite(outs[0].astype(np.float32)).all()
    for out in outs[1:]:
        assert out.tobytes() == outs[0].tobytes()  # fixed-order sums: no atomics, no run-to-run noise
