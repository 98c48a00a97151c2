import math

import numpy as np
import pytest

from kernelmill.kernels.ops.base import DTYPES, SpecError, cdiv, itemsize
from kernelmill.kernels.ops.fused_mlp import (
    ACC_ROW_ALIGN_FLOATS,
    ACTIVATIONS,
    FUSED_MLP,
    MAX_SMEM_BYTES,
    SmallBatchLayout,
    acc_row_floats,
)
from kernelmill.kernels.ops.matmul import CORES, gemm_workspace

SMALL = FUSED_MLP.family("small_batch")
EPILOGUE = FUSED_MLP.family("epilogue")
ODD_SHAPES = [(1, 100, 257, 33), (3, 100, 257, 33), (17, 100, 257, 33), (16, 4096, 11008, 4096)]


def _direct(x, w1, b1, w2, b2, act):
    h = x @ w1 + b1
    if act == "relu":
        h = np.where(h > 0, h, 0.0)
    elif act == "gelu_erf":
        h = np.array([[0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in row] for row in h])
    else:
        h = 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))
    return h @ w2 + b2


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_reference_matches_direct_formula(act):
    shape = (3, 20, 37, 11)
    ins = FUSED_MLP.make_inputs(shape, "float32", seed=5)
    y = FUSED_MLP.reference(ins, {"act": act})["Y"]
    assert y.shape == (3, 11) and y.dtype == np.float64
    direct = _direct(*(ins[n].astype(np.float64) for n in FUSED_MLP.inputs), act)
    np.testing.assert_allclose(y, direct, rtol=1e-12, atol=1e-12)


def test_inputs_keep_the_hidden_layer_order_one():
    shape = (64, 4096, 1024, 512)
    ins = FUSED_MLP.make_inputs(shape, "float32", seed=1)
    pre = ins["X"].astype(np.float64) @ ins["W1"] + ins["b1"]
    assert 0.5 < pre.std() < 2.0
    y = FUSED_MLP.reference(ins, {"act": "gelu_tanh"})["Y"]
    assert 0.1 < y.std() < 3.0


def test_attributes_default_and_coerce():
    assert FUSED_MLP.resolve_attrs({}) == {"act": "gelu_tanh"}
    assert FUSED_MLP.resolve_attrs({"act": "RELU"}) == {"act": "relu"}
    with pytest.raises(SpecError):
        FUSED_MLP.resolve_attrs({"act": "silu"})


def test_flops_and_min_bytes():
    shape = (16, 4096, 11008, 4096)
    assert FUSED_MLP.flops(shape) == 2.0 * 16 * (4096 * 11008 + 11008 * 4096)
    weights = 4096 * 11008 * 2
    assert FUSED_MLP.min_bytes(shape, "float16") == 2 * (16 * 4096 + weights + 11008 + 4096 + 16 * 4096)
    assert FUSED_MLP.tensor_shapes(shape)["W2"] == (11008, 4096)


@pytest.mark.parametrize("family", [SMALL, EPILOGUE], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_space_point_is_valid(family, dtype):
    points = list(family.space(dtype))
    assert 100 <= len(points) <= 5000
    assert len({tuple(sorted(p.items())) for p in points}) == len(points)  # no duplicates
    for params in points:
        assert family.check(params, dtype) is None
    assert family.resolve({}, dtype) == family.defaults(dtype)
    assert family.defaults(dtype) in points


@pytest.mark.parametrize(
    ("dtype", "overrides", "fragment"),
    [
        ("float32", {"core": "mma"}, "float16 or bfloat16"),
        ("float16", {"core": "mma", "vec": 4}, "16 bytes"),
        ("float16", {"core": "mma", "max_batch": 8}, "max_batch"),
        ("float16", {"core": "mma", "hidden_per_block": 32}, "multiple of 64"),
        ("float32", {"vec": 8}, "16-byte"),
        ("float32", {"hidden_per_block": 256, "vec": 2}, "column lanes"),
        ("float32", {"max_batch": 32, "vec": 4}, "accumulators"),
        ("float32", {"max_batch": 16, "vec": 2, "unroll": 8, "threads": 512}, "registers"),
    ],
)
def test_small_batch_rejects_invalid_points(dtype, overrides, fragment):
    with pytest.raises(SpecError, match=fragment):
        SMALL.resolve(overrides, dtype)


def test_epilogue_rejects_invalid_points():
    with pytest.raises(SpecError, match="runs on simt"):
        EPILOGUE.resolve({"core": "tensorcore"}, "float32")
    with pytest.raises(SpecError, match="not a simt knob"):
        EPILOGUE.resolve({"stages": 3}, "float32")
    with pytest.raises(SpecError, match="not a tensorcore value"):
        EPILOGUE.resolve({"BK": 8}, "float16")
    with pytest.raises(SpecError, match="not allowed"):
        EPILOGUE.resolve({"core": "wmma"}, "float16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_batch_check_shape(dtype):
    params = SMALL.resolve({"max_batch": 16} if dtype == "float32" else {}, dtype)
    assert SMALL.check_shape((16, 4096, 11008, 4096), params, dtype) is None
    assert "max_batch" in SMALL.check_shape((17, 100, 257, 33), params, dtype)
    assert SMALL.check_shape((1, 100, 257, 33), params, dtype) is None


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_batch_launches_cover_the_problem(shape, dtype):
    batch, d_in, d_hidden, d_out = shape
    params = SMALL.resolve({"max_batch": 32, "vec": 2} if dtype == "float32" else {"max_batch": 32}, dtype)
    layout = SmallBatchLayout.of(params, dtype)
    zero, main, final = SMALL.launches(shape, params, dtype)
    stride = acc_row_floats(d_out)
    assert stride % ACC_ROW_ALIGN_FLOATS == 0 and d_out <= stride < d_out + ACC_ROW_ALIGN_FLOATS
    # the zeroing launch clears every float4 of the accumulator, the finalize launch reads every Y element
    assert zero.args == ("y_acc", batch * stride // 4)
    assert zero.grid[0] * zero.threads * 4 >= batch * stride
    assert final.args == ("y_acc", "b2", "Y", batch, d_out, stride)
    assert final.grid[0] * final.threads >= batch * d_out
    # one block per hidden slice, shared memory as laid out
    assert main.grid == (cdiv(d_hidden, layout.hidden_per_block), 1, 1)
    assert main.threads == params["threads"]
    assert main.smem_bytes == layout.smem_bytes <= MAX_SMEM_BYTES
    assert main.args == ("X", "W1", "b1", "W2", "y_acc", batch, d_in, d_hidden, d_out, stride)
    assert SMALL.workspace(shape, params, dtype) == {"y_acc": batch * stride * 4}


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_batch_smem_layout(dtype):
    for params in SMALL.space(dtype):
        layout = SmallBatchLayout.of(params, dtype)
        ctx = SMALL.context(params, dtype, {"act": "relu"})
        assert ctx["partial_floats"] * 4 == layout.partial_bytes
        assert layout.partial_bytes % 16 == 0  # the hidden tile after it stays 16-byte aligned
        if params["core"] == "mma":
            assert layout.hidden_row_elems % 8 == 0 and ctx["mma_type"] in ("f16", "bf16")
            assert layout.partial_slots * layout.col_warps == layout.warps
        else:
            assert 32 % layout.col_lanes == 0 and layout.partial_slots == layout.warps


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_launches_and_workspace(shape, split_k, dtype):
    batch, d_in, d_hidden, d_out = shape
    params = EPILOGUE.resolve({"split_k": split_k}, dtype)
    core = CORES[params["core"]]
    bm, bn = core.tile(params)
    launches = EPILOGUE.launches(shape, params, dtype)
    gemms = [launch for launch in launches if not launch.entry.endswith("_reduce")]
    assert [g.entry for g in gemms] == ["fused_mlp_up", "fused_mlp_down"]
    up, down = gemms
    assert up.grid == (cdiv(d_hidden, bn), cdiv(batch, bm), split_k)
    assert down.grid == (cdiv(d_out, bn), cdiv(batch, bm), split_k)
    assert up.threads == down.threads == core.threads(params)
    workspace = EPILOGUE.workspace(shape, params, dtype)
    assert workspace["H"] == batch * d_hidden * itemsize(dtype)
    if split_k == 1:
        assert len(launches) == 2 and "ws" not in workspace
        assert up.args == ("X", "W1", "H", "b1", batch, d_hidden, d_in)
        assert down.args == ("H", "W2", "Y", "b2", batch, d_out, d_hidden)
    else:
        assert [launch.entry for launch in launches] == [
            "fused_mlp_up",
            "fused_mlp_up_reduce",
            "fused_mlp_down",
            "fused_mlp_down_reduce",
        ]
        assert launches[1].args[:3] == ("ws", "H", "b1") and launches[3].args[:3] == ("ws", "Y", "b2")
        assert workspace["ws"] == split_k * batch * max(d_hidden, d_out) * 4
        assert workspace["ws"] == max(
            gemm_workspace(core.name, batch, d_hidden, d_in, params),
            gemm_workspace(core.name, batch, d_out, d_hidden, params),
        )


def test_epilogue_precision_is_the_dtype():
    for dtype in DTYPES:
        assert EPILOGUE.precision(dtype) == dtype == SMALL.precision(dtype)
        assert all(p["core"] == EPILOGUE.core_for(dtype) for p in EPILOGUE.space(dtype))


# -- models of the templates' index math (no GPU here) ---------------------------------


def _visited(start, stride, unroll, n, fast, group_fits):
    """The rows a thread/warp visits: the unguarded loop while a whole group fits, then the
    guarded one (small_batch_simt/mma phase 1); asserts unguarded groups stay in range."""
    seen = []
    k = start
    if fast:
        while group_fits(k):
            group = [k + u * stride for u in range(unroll)]
            assert max(group) < n
            seen += group
            k += stride * unroll
    while k < n:
        seen += [k + u * stride for u in range(unroll) if k + u * stride < n]
        k += stride * unroll
    return seen


@pytest.mark.parametrize("n", [1, 7, 16, 37, 100, 4096])
@pytest.mark.parametrize("unroll", [1, 2, 4, 8])
@pytest.mark.parametrize("stride", [1, 3, 8, 32])
def test_k_loops_visit_every_row_once(n, unroll, stride):
    for start in range(min(stride, 5)):
        # simt: rows k; the unguarded loop runs while k + (unroll - 1) * stride < n
        seen = _visited(start, stride, unroll, n, True, lambda k: k + (unroll - 1) * stride < n)
        assert seen == list(range(start, n, stride))
        # mma: k steps of 16 rows; the unguarded loop runs while the group's last step is whole
        steps = cdiv(n, 16)
        seen = _visited(start, stride, unroll, steps, True, lambda s: (s + (unroll - 1) * stride) * 16 + 16 <= n)
        assert seen == list(range(start, steps, stride))


def test_mma_fragments_give_each_lane_sixteen_contiguous_columns():
    """small_batch_mma: lane (g, t) loads 8 columns base + 8g .. +7 of rows 2t, 2t+1, 2t+8, 2t+9;
    byte permutes make column i of those the B operand (k x n = 16 x 8) of n-tile i; the D
    fragment (rows g, g+8; MMA columns 2t, 2t+1) then is real columns 16t + i and 16t + 8 + i."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16))  # batch rows x 16 k
    w = rng.standard_normal((16, 64))  # 16 k rows x the warp's 64 columns
    d = np.zeros((8, 32, 4))  # n-tile, lane, D register
    for i in range(8):
        b = np.zeros((16, 8))
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for row in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9):
                b[row, g] = w[row, 8 * g + i]
        tile = a @ b
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            d[i, lane] = tile[g, 2 * t], tile[g, 2 * t + 1], tile[g + 8, 2 * t], tile[g + 8, 2 * t + 1]
    full = a @ w
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for half in range(2):
            got = np.concatenate([d[:, lane, 2 * half], d[:, lane, 2 * half + 1]])
            np.testing.assert_allclose(got, full[g + 8 * half, 16 * t : 16 * t + 16], rtol=1e-12)
