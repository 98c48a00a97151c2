"""attention / sdpa families: which one a default takes, the mma family's shape defaults, constraints, launches
and its rendered layouts. No GPU, no nvcc."""

from __future__ import annotations

import pytest

from kernelmill.kernels.ops import OPS
from kernelmill.kernels.ops.attention import MMA_MAX_STATE, mma_smem_bytes
from kernelmill.kernels.ops.base import MAX_SMEM_BYTES
from kernelmill.kernels.render import render
from kernelmill.runtime.registry import KernelRegistry


def _default(op, shape, dtype, tmp_path):
    """The family and params the runtime's registry picks without a tuned kernel."""
    registry = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False)
    fam, params = registry.default_choice(OPS[op], shape, dtype, {})
    return fam.name, params


@pytest.mark.parametrize("op", ["attention", "sdpa"])
@pytest.mark.parametrize(
    ("shape", "dtype", "family"),
    [
        ((8, 12, 128, 64), "float16", "mma"),
        ((1, 16, 1024, 64), "bfloat16", "mma"),
        ((4, 16, 512, 128), "float16", "mma"),
        ((2, 3, 17, 16), "float16", "mma"),
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


@pytest.mark.parametrize(
    ("shape", "want"),
    [
        ((8, 12, 128, 64), {"warps": 4, "m_tiles": 1, "block_kv": 128, "max_head_dim": 64, "stages": 2}),
        ((1, 16, 1024, 64), {"warps": 4, "m_tiles": 1, "block_kv": 128, "max_head_dim": 64, "stages": 2}),
        ((2, 8, 2048, 64), {"warps": 4, "m_tiles": 2, "block_kv": 64, "max_head_dim": 64, "q_regs": True}),
        ((2, 3, 40, 48), {"warps": 4, "m_tiles": 1, "block_kv": 64, "max_head_dim": 64}),
        ((4, 16, 512, 128), {"m_tiles": 2, "block_kv": 32, "max_head_dim": 128, "stages": 2, "q_regs": False}),
        ((1, 1, 4096, 80), {"m_tiles": 2, "block_kv": 32, "max_head_dim": 128, "q_regs": False}),
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
    in_regs = [p for p in space if p["q_regs"]]
    assert len(in_regs) == (3 * 3 * 3 * 2 - 1) + 3 * 2 * 3
    assert len(space) - len(in_regs) == (3 * 3 * 3 * 2 - 1) + 3 * 3 * 3
    assert {p["max_head_dim"] for p in space if p["m_tiles"] == 2 and not p["q_regs"]} == {64, 128}
    for params in space:
        assert mma_smem_bytes(params) <= MAX_SMEM_BYTES
        q = params["max_head_dim"] // 4 if params["q_regs"] else 0
        assert params["m_tiles"] * (params["block_kv"] // 2 + params["max_head_dim"] // 2 + q) <= MMA_MAX_STATE
    biggest = {"warps": 8, "m_tiles": 1, "block_kv": 128, "stages": 3, "max_head_dim": 128, "q_regs": True}
    assert mma_smem_bytes(biggest) == (128 + 2 * 3 * 128) * (128 + 8) * 2 + 4 * 3 * 128  # + the mask tiles
    assert "shared memory" in fam.check(biggest, "float16")
    assert "registers" in fam.check({**biggest, "m_tiles": 2, "stages": 1, "block_kv": 32}, "float16")


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
    params = {"warps": 8, "m_tiles": 1, "block_kv": 32, "stages": 3, "max_head_dim": 128}
    (launch,) = fam.launches((3, 5, 300, 96), params, "float16")
    assert launch.entry == "attention_mma"
    assert launch.grid == (3, 5, 3)  # 128 queries a block: cdiv(300, 128)
    (two,) = fam.launches((3, 5, 300, 64), {**params, "m_tiles": 2, "max_head_dim": 64}, "float16")
    assert two.grid == (2, 5, 3)  # 256 queries a block
    assert two.entry == "attention_mma_full"  # head_dim == max_head_dim: the unrolled entry
    assert launch.block == (256, 1, 1)
    assert launch.smem_bytes == mma_smem_bytes(params)
    assert launch.args == (*tensors, "mask", "out", 5, 300, 96)


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
