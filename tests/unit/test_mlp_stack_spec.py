import numpy as np
import pytest

from kernelmill.kernels.defaults import default_params
from kernelmill.kernels.ops import OPS
from kernelmill.kernels.ops.base import SpecError, TensorMapArg
from kernelmill.kernels.ops.elementwise import ACT_FUNCTIONS
from kernelmill.kernels.ops.mlp_stack import GRID_BLOCKS, MAX_SMEM_BYTES, MLP_STACK

PERSISTENT = MLP_STACK.family("persistent")


def test_registered_with_shapes_of_stacked_weights():
    assert OPS["mlp_stack"] is MLP_STACK
    shapes = MLP_STACK.tensor_shapes((2, 16, 40, 3))
    assert shapes == {
        "X": (2, 16),
        "W1": (3, 16, 40),
        "b1": (3, 40),
        "W2": (3, 40, 16),
        "b2": (3, 16),
        "Y": (2, 16),
    }


@pytest.mark.parametrize("act", ["gelu_erf", "gelu_tanh", "relu", "silu", "none"])
def test_reference_is_the_blocks_one_after_another(act):
    shape = (3, 12, 20, 4)
    ins = MLP_STACK.make_inputs(shape, "float32", seed=3)
    y = MLP_STACK.reference(ins, {"act": act})["Y"]
    x = ins["X"].astype(np.float64)
    for layer in range(4):
        w1, b1 = ins["W1"][layer].astype(np.float64), ins["b1"][layer].astype(np.float64)
        w2, b2 = ins["W2"][layer].astype(np.float64), ins["b2"][layer].astype(np.float64)
        x = ACT_FUNCTIONS[act](x @ w1 + b1) @ w2 + b2
    assert y.dtype == np.float64 and y.shape == (3, 12)
    np.testing.assert_allclose(y, x, rtol=1e-12, atol=1e-12)


def test_inputs_keep_every_block_order_one():
    ins = MLP_STACK.make_inputs((4, 512, 1376, 4), "float32", seed=1)
    y = MLP_STACK.reference(ins, {"act": "gelu_erf"})["Y"]
    assert 0.1 < y.std() < 10.0


def test_attributes_default_to_erf_gelu_and_reject_unknown():
    assert MLP_STACK.resolve_attrs({}) == {"act": "gelu_erf"}
    assert MLP_STACK.resolve_attrs({"act": "SILU"}) == {"act": "silu"}
    with pytest.raises(SpecError, match="act"):
        MLP_STACK.resolve_attrs({"act": "tanh"})


def test_flops_and_bytes_count_every_layer():
    shape = (1, 4096, 11008, 4)
    assert MLP_STACK.flops(shape) == 4.0 * 4096 * 11008 * 4
    weights = 2 * 4 * 4096 * 11008 * 2
    assert weights < MLP_STACK.min_bytes(shape, "float16") < weights * 1.001


def test_launches_zero_the_flags_then_one_block_per_sm_with_maps_of_the_stacked_weights():
    shape = (1, 4096, 11008, 4)
    params = default_params(MLP_STACK, PERSISTENT, shape, "float16")
    assert PERSISTENT.check(params, "float16") is None
    assert PERSISTENT.check_shape(shape, params, "float16") is None
    zero, main = PERSISTENT.launches(shape, params, "float16")
    flags = 2 * 4 * GRID_BLOCKS  # a flag per task (at most one per block) and phase
    assert zero.entry == "mlp_stack_zero" and zero.args == ("flags", flags)
    assert main.grid == (GRID_BLOCKS, 1, 1) and main.block == (params["threads"] + 32, 1, 1)
    assert main.smem_bytes == PERSISTENT.smem_bytes(shape, params, "float16") <= MAX_SMEM_BYTES
    map_w1, map_w2 = main.args[:2]
    assert isinstance(map_w1, TensorMapArg) and isinstance(map_w2, TensorMapArg)
    assert main.args[map_w1.of] == "W1" and main.args[map_w2.of] == "W2"
    assert map_w1.dims == (11008, 4096, 4) and map_w2.dims == (4096, 11008, 4)
    assert map_w1.box == (256, params["rows"], 1) and map_w1.swizzle == 0
    assert main.args[-6:] == ("P", "flags", 1, 4096, 11008, 4)
    ws = PERSISTENT.workspace(shape, params, "float16")
    # 11008 columns are 43 strips of 256 in 3 K slices; 4096 are 16 strips in 8: per phase 3 x 11008 floats.
    assert ws == {"P": 8 * 3 * 11008 * 4, "flags": flags * 4}


def test_partial_sums_fit_when_strips_outnumber_blocks():
    shape = (2, 64, 256 * 200, 1)  # 200 strips > 132 blocks: one slice, tasks looped over the blocks
    params = {**PERSISTENT.defaults("float32"), "max_m": 2}
    ws = PERSISTENT.workspace(shape, params, "float32")
    assert ws["P"] >= 2 * 2 * 256 * 200 * 4
    assert ws["flags"] == 2 * 1 * 400 * 4  # fp32 strips are 128 columns: 400 of them


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((1, 4096, 11008, 4), "float16"), ((3, 136, 264, 3), "bfloat16"), ((8, 768, 3072, 12), "float16")],
)
def test_shape_defaults_fit_the_batch_and_shared_memory(shape, dtype):
    params = default_params(MLP_STACK, PERSISTENT, shape, dtype)
    assert params["max_m"] >= shape[0]
    assert PERSISTENT.check(params, dtype) is None
    assert PERSISTENT.check_shape(shape, params, dtype) is None


def test_check_shape_explains_what_does_not_fit():
    params = PERSISTENT.resolve({}, "float16")
    assert "max_m" in PERSISTENT.check_shape((2, 64, 64, 1), params, "float16")
    assert "multiple of 8" in PERSISTENT.check_shape((1, 60, 64, 1), params, "float16")
    assert "shared memory" in PERSISTENT.check_shape((1, 64, 200_000, 1), params, "float16")
    assert PERSISTENT.check_shape((1, 60, 64, 1), PERSISTENT.resolve({}, "float32"), "float32") is None


def test_check_rejects_rings_and_blocks_that_do_not_fit():
    base = PERSISTENT.defaults("float16")
    assert "registers" in PERSISTENT.check({**base, "threads": 768, "max_m": 8}, "float16")
    assert "without a row" in PERSISTENT.check({**base, "threads": 768, "rows": 16}, "float16")
    assert "ring" in PERSISTENT.check({**base, "rows": 128, "stages": 16}, "float16")
    assert sum(1 for _ in PERSISTENT.space("float16")) > 10
