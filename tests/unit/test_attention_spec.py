"""attention / sdpa families: which one a default takes, the mma family's shape defaults, constraints, launches
and its rendered layouts. No GPU, no nvcc."""

from __future__ import annotations

import numpy as np
import pytest

from kernelmill.kernels.ops import OPS
from kernelmill.kernels.ops.attention import MMA_MAX_STATE, mma_smem_bytes
from kernelmill.kernels.ops.base import MAX_SMEM_BYTES
from kernelmill.kernels.render import render
from kernelmill.runtime.registry import KernelRegistry


def _default(op, shape, dtype, tmp_path, arch="sm_90"):
    """The family and params the runtime's registry picks without a tuned kernel."""
    registry = KernelRegistry(arch=arch, cache_dir=tmp_path, use_service=False)
    fam, params = registry.default_choice(OPS[op], shape, dtype, {})
    return fam.name, params


@pytest.mark.parametrize("op", ["attention", "sdpa"])
@pytest.mark.parametrize(
    ("shape", "dtype", "family"),
    [
        ((8, 12, 128, 64), "float16", "wgmma"),  # head_dim 64 or 128 on sm_90
        ((1, 16, 1024, 64), "bfloat16", "wgmma"),
        ((4, 16, 512, 128), "float16", "wgmma"),
        ((2, 3, 17, 16), "float16", "mma"),  # other multiples of 16
        ((2, 3, 17, 96), "float16", "mma"),
        ((8, 12, 128, 64), "float32", "fused"),  # tensor cores take 16-bit inputs
        ((2, 3, 17, 100), "float16", "fused"),  # head_dim not a multiple of 16
        ((2, 3, 17, 8), "float16", "fused"),
        ((1, 2, 64, 256), "float16", "fused"),  # past the mma family's largest head_dim
    ],
)
def test_sixteen_bit_defaults_take_tensor_cores_where_head_dim_allows(op, shape, dtype, family, tmp_path):
    name, params = _default(op, shape, dtype, tmp_path)
    assert name == family
    fam = OPS[op].family(name)
    assert fam.check(params, dtype) is None


def test_wgmma_only_on_sm_90(tmp_path):
    # sm_90a instructions: on other GPUs the mma family serves head_dim 64 and 128.
    assert _default("sdpa", (8, 12, 128, 64), "float16", tmp_path, arch="sm_80")[0] == "mma"


def test_wgmma_shape_defaults_launch_and_limits():
    fam = OPS["sdpa"].family("wgmma")
    assert fam.shape_defaults((8, 12, 128, 64), "float16") == {
        "warpgroups": 1,
        "block_kv": 128,
        "stages": 2,
        "max_head_dim": 64,
        "overlap": False,
    }
    # 3 blocks of 64 queries an SM or more: one slot, 64-key tiles at head_dim 128; fewer: the defaults.
    assert fam.shape_defaults((4, 16, 512, 128), "float16") == {
        "warpgroups": 1,
        "block_kv": 64,
        "stages": 1,
        "max_head_dim": 128,
        "overlap": False,
    }
    assert fam.shape_defaults((1, 16, 512, 128), "float16")["stages"] == 2
    assert fam.shape_defaults((2, 8, 2048, 64), "float16") == {
        "warpgroups": 1,
        "block_kv": 128,
        "stages": 1,
        "max_head_dim": 64,
        "overlap": False,
    }
    # The count goes by the GPU's SMs: 512 blocks are 3 an SM on 132 SMs, not on 200.
    assert fam.shape_defaults((2, 8, 2048, 64), "float16", sm_count=200)["stages"] == 2
    params = {"warpgroups": 2, "block_kv": 64, "stages": 3, "max_head_dim": 128, "overlap": False}
    assert fam.check(params, "float16") is None
    assert "head_dim == max_head_dim" in fam.check_shape((1, 2, 100, 64), params, "float16")
    assert fam.check_shape((1, 2, 100, 128), params, "float16") is None
    (launch,) = fam.launches((3, 5, 300, 128), params, "float16")
    assert launch.entry == "attention_wgmma" and launch.grid == (3, 5, 3) and launch.block == (256, 1, 1)
    # The alignment slack, Q (128 queries), 3 slots of K and V (64 x 128), 3 mask tiles.
    assert launch.smem_bytes == 1024 + 128 * 128 * 2 + 3 * (2 * 64 * 128 * 2 + 4 * 64)
    # One slot: one K and one V tile, still two mask tiles (the next one is staged during this one).
    one = {**params, "warpgroups": 1, "stages": 1}
    assert (
        fam.launches((3, 5, 300, 128), one, "float16")[0].smem_bytes
        == 1024 + 64 * 128 * 2 + 2 * 64 * 128 * 2 + 2 * 4 * 64
    )
    # Every point fits: the largest (2 warpgroups, 128-key tiles, 3 slots at head_dim 128) by 512 bytes.
    # The overlap holds the last tile's P as well, and takes two slots.
    assert "stages 2" in fam.check({**params, "overlap": True}, "float16")
    assert fam.check({**params, "stages": 2, "overlap": True}, "float16") is None
    assert len(list(fam.space("float16"))) == 24 + 8
    src = render(OPS["attention"].family("wgmma"), params, "bfloat16", {})
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in src  # S = Q K^T, 64-key tiles
    assert "m64n128k16.f32.bf16.bf16" in src and "fence.proxy.async.shared::cta" in src  # P V, head_dim 128


@pytest.mark.parametrize(
    ("shape", "want"),
    [
        # BERT at batch 8: 192 blocks of 64 queries, a short walk: the plain defaults.
        ((8, 12, 128, 64), {"warps": 4, "m_tiles": 1, "block_kv": 128, "stages": 2, "kv_groups": 1}),
        # BERT at batch 1: 24 blocks; two key groups of 2 warps, 64 keys each.
        ((1, 12, 128, 64), {"warps": 2, "m_tiles": 1, "block_kv": 64, "kv_groups": 2}),
        ((1, 12, 256, 64), {"warps": 2, "m_tiles": 1, "block_kv": 128, "kv_groups": 2}),
        # 256 blocks, a long walk: two key groups of 4 warps of two m tiles.
        ((1, 16, 1024, 64), {"warps": 4, "m_tiles": 2, "block_kv": 64, "kv_groups": 2}),
        # 3 blocks an SM or more: two m tiles, one group.
        ((2, 8, 2048, 64), {"warps": 4, "m_tiles": 2, "block_kv": 64, "q_regs": True, "kv_groups": 1}),
        ((4, 16, 1024, 64), {"warps": 4, "m_tiles": 2, "block_kv": 64, "kv_groups": 1}),
        ((2, 3, 40, 48), {"warps": 4, "m_tiles": 1, "block_kv": 64, "max_head_dim": 64}),
        ((4, 16, 512, 128), {"m_tiles": 2, "block_kv": 32, "max_head_dim": 128, "stages": 2, "q_regs": False}),
        # head_dim 128 with fewer blocks: one m tile, 128-key tiles, Q in registers.
        ((1, 16, 512, 128), {"m_tiles": 1, "block_kv": 128, "max_head_dim": 128, "q_regs": True}),
        ((1, 1, 4096, 80), {"m_tiles": 1, "block_kv": 128, "max_head_dim": 128, "q_regs": True}),
    ],
)
def test_mma_shape_defaults(shape, want):
    fam = OPS["sdpa"].family("mma")
    params = fam.shape_defaults(shape, "float16")
    assert {k: params[k] for k in want} == want
    assert fam.check(params, "float16") is None and fam.check_shape(shape, params, "float16") is None


def test_mma_space_fits_shared_memory_and_rejects_what_does_not():
    fam = OPS["attention"].family("mma")
    space = list(fam.space("float16"))
    # One m tile: all but 8 warps, 128-key tiles, 3 stages at head_dim 128 (238 KB). Two: head_dim 64 with
    # 32- or 64-key tiles (the registers of S, O and Q a lane otherwise pass MMA_MAX_STATE); with Q re-read
    # from shared memory (q_regs off), also head_dim 128 with 32-key tiles.
    one = [p for p in space if p["kv_groups"] == 1]
    in_regs = [p for p in one if p["q_regs"]]
    assert len(in_regs) == (3 * 3 * 3 * 2 - 1) + 3 * 2 * 3
    assert len(one) - len(in_regs) == (3 * 3 * 3 * 2 - 1) + 3 * 3 * 3
    assert {p["max_head_dim"] for p in space if p["m_tiles"] == 2 and not p["q_regs"]} == {64, 128}
    # Key groups: at most 8 warps a block in all (2 groups of 2 or 4 warps, 4 groups of 2), and the ring of
    # kv_groups * block_kv keys fits.
    grouped = [p for p in space if p["kv_groups"] > 1]
    assert {(p["kv_groups"], p["warps"]) for p in grouped} == {(2, 2), (2, 4), (4, 2)}
    assert len(grouped) == len(space) - len(one) > 100
    for params in space:
        assert mma_smem_bytes(params) <= MAX_SMEM_BYTES
        q = params["max_head_dim"] // 4 if params["q_regs"] else 0
        assert params["m_tiles"] * (params["block_kv"] // 2 + params["max_head_dim"] // 2 + q) <= MMA_MAX_STATE
    biggest = {
        "warps": 8,
        "m_tiles": 1,
        "block_kv": 128,
        "stages": 3,
        "max_head_dim": 128,
        "q_regs": True,
        "kv_groups": 1,
    }
    assert mma_smem_bytes(biggest) == (128 + 2 * 3 * 128) * (128 + 8) * 2 + 4 * 3 * 128  # + the mask tiles
    assert "shared memory" in fam.check(biggest, "float16")
    assert "registers" in fam.check({**biggest, "m_tiles": 2, "stages": 1, "block_kv": 32}, "float16")
    assert "8 warps" in fam.check({**biggest, "block_kv": 32, "stages": 1, "kv_groups": 2}, "float16")
    # Groups 1.. hand group 0 their state through the ring: room for it where the ring is smaller.
    small = {"warps": 2, "m_tiles": 2, "block_kv": 32, "stages": 1, "max_head_dim": 128, "q_regs": False}
    state = 2 * (4 + 64) * 32 * 4  # m, l and O of 2 m tiles, 32 lanes, fp32
    assert mma_smem_bytes({**small, "kv_groups": 4}) == 64 * 136 * 2 + 3 * 2 * state
    assert mma_smem_bytes({**small, "kv_groups": 1}) == (64 + 2 * 32) * 136 * 2 + 4 * 32


@pytest.mark.parametrize(
    ("head_dim", "max_head_dim", "ok"),
    [
        (16, 64, True),
        (64, 64, True),
        (48, 64, True),
        (80, 64, False),
        (128, 128, True),
        (72, 128, False),
        (8, 64, False),
    ],
)
def test_mma_head_dim_must_be_a_multiple_of_16_within_the_variant(head_dim, max_head_dim, ok):
    fam = OPS["sdpa"].family("mma")
    params = {**fam.defaults("float16"), "max_head_dim": max_head_dim}
    why = fam.check_shape((2, 3, 50, head_dim), params, "float16")
    assert (why is None) == ok
    if not ok:
        assert "multiples of 16" in why


@pytest.mark.parametrize(("op", "tensors"), [("attention", ("qkv",)), ("sdpa", ("q", "k", "v"))])
def test_mma_launch_grid_and_arguments(op, tensors):
    fam = OPS[op].family("mma")
    params = {"warps": 8, "m_tiles": 1, "block_kv": 32, "stages": 3, "max_head_dim": 128, "kv_groups": 1}
    (launch,) = fam.launches((3, 5, 300, 96), params, "float16")
    assert launch.entry == "attention_mma"
    assert launch.grid == (3, 5, 3)  # 128 queries a block: cdiv(300, 128)
    (two,) = fam.launches((3, 5, 300, 64), {**params, "m_tiles": 2, "max_head_dim": 64}, "float16")
    assert two.grid == (2, 5, 3)  # 256 queries a block
    assert two.entry == "attention_mma_full"  # head_dim == max_head_dim: the unrolled entry
    assert launch.block == (256, 1, 1)
    assert launch.smem_bytes == mma_smem_bytes(params)
    assert launch.args == (*tensors, "mask", "out", 5, 300, 96)
    # Key groups: the same queries a block (the same grid), kv_groups times the warps.
    (grouped,) = fam.launches((3, 5, 300, 96), {**params, "warps": 2, "kv_groups": 4}, "float16")
    assert grouped.grid == (10, 5, 3) and grouped.block == (256, 1, 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_renders_each_layout_and_type(dtype):
    packed = render(OPS["attention"].family("mma"), OPS["attention"].family("mma").defaults(dtype), dtype, {})
    bhsd = render(OPS["sdpa"].family("mma"), OPS["sdpa"].family("mma").defaults(dtype), dtype, {})
    mma = "mma.sync.aligned.m16n8k16.row.col.f32." + ("bf16.bf16" if dtype == "bfloat16" else "f16.f16")
    for src in (packed, bhsd):
        assert "#define KM_STAGES 2" in src and "cp.async.cg.shared.global" in src
        assert mma in src.replace('" KM_MMA_AB "', "bf16.bf16" if dtype == "bfloat16" else "f16.f16")
    assert "const T* __restrict__ qkv" in packed and "q_in" not in packed
    assert "const T* __restrict__ q_in" in bhsd and "qkv" not in bhsd


def test_padding_masks_with_bert_s_lowest_value_and_with_minus_infinity():
    """Torch code masks with -inf; verification fed only the dtype's lowest value, so a kernel turning a key
    tile of -inf into NaN passed."""
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.ops.attention import MASK_MIN

    op = get_op("attention")
    seeds = [s for s in range(30) if op.input_kind(s) == "padding"][:2]
    shape = (4, 2, 200, 64)
    for seed in seeds:
        inputs = op.make_inputs(shape, "float16", seed)
        mask = inputs["mask"].astype(np.float32)
        values = {float(v) for v in np.unique(mask)}
        assert values == {0.0, MASK_MIN["float16"], -np.inf}
        assert (mask[[0, 1, 3], 0] == 0).all() and np.isneginf(mask[2]).all()  # sequence 2: every key -inf
        assert np.isneginf(mask[[0, 1, 3], -64:]).all(axis=1).any()  # a whole tile of -inf with a key kept
        assert np.isfinite(op.reference(inputs, {})["out"]).all()
    firsts = {float(op.make_inputs(shape, "float16", s)["mask"][0, -1]) for s in seeds}
    assert firsts == {MASK_MIN["float16"], -np.inf}  # the first sequence takes each by turns


def test_a_query_whose_every_key_is_minus_inf_gives_zero_in_the_reference_as_in_torch():
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.ops.attention import masked_softmax

    op = get_op("attention")
    seed = next(s for s in range(30) if op.input_kind(s) == "padding")
    inputs = op.make_inputs((3, 2, 40, 16), "float16", seed)
    assert np.isneginf(inputs["mask"][2]).all()  # from batch 3 the padding kind masks a whole sequence
    out = op.reference(inputs, {})["out"]
    assert (out[2] == 0).all() and np.isfinite(out).all() and np.abs(out[:2]).min(axis=(1, 2, 3)).all()
    rows = np.array([[-np.inf, -np.inf], [0.0, -np.inf], [np.nan, 0.0], [1.0, 1.0]])
    got = masked_softmax(rows)
    assert (got[0] == 0).all() and (got[1] == [1, 0]).all() and np.isnan(got[2]).all() and (got[3] == 0.5).all()
    assert masked_softmax(np.zeros((2, 0))).shape == (2, 0)
