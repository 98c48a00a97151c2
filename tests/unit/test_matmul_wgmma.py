"""The wgmma (Hopper, sm_90a) matmul family: space, constraints, launch geometry, tensor-map arguments and the
parameter-buffer layout they need. No GPU; the test marked nvcc compiles one variant."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kernelmill.kernels.device import Buffer, DeviceFault, kernel_param_layouts, param_format, tensor_map_strides
from kernelmill.kernels.ops.base import SpecError, TensorMapArg, cdiv
from kernelmill.kernels.ops.matmul import MATMUL, WGMMA
from kernelmill.kernels.render import render

DTYPES = ("float16", "bfloat16")
#: Shapes TMA can address (K, N multiples of 8; M anything) and ones it cannot.
SHAPES = [(1, 8, 8), (255, 136, 104), (300, 200, 512), (4096, 4096, 4096), (2048, 11008, 4096), (8192, 8192, 8192)]
REJECTED = [(1, 1, 1), (255, 129, 100), (300, 200, 513), (64, 4100, 4096)]


def test_registered_for_sm_90a_half_types_only():
    assert MATMUL.family("wgmma") is WGMMA
    assert WGMMA.arch_suffix == "a" and WGMMA.template == "matmul/wgmma.cu.j2"
    assert WGMMA.dtypes == DTYPES
    assert [WGMMA.precision(d) for d in DTYPES] == list(DTYPES)
    with pytest.raises(SpecError, match="does not support float32"):
        WGMMA.resolve({}, "float32")


def test_its_target_is_sm_90a_and_no_other_gpu_has_one():
    assert WGMMA.target("sm_90") == WGMMA.target("sm_90a") == "sm_90a"
    for arch in ("sm_80", "sm_89", "sm_100"):
        with pytest.raises(SpecError, match=f"wgmma uses sm_90a instructions: it runs on sm_90 only, not {arch}"):
            WGMMA.target(arch)
    assert MATMUL.family("tensorcore").target("sm_80") == "sm_80"  # a family with no suffix: the GPU's own arch


def test_parameters_that_need_sm_90_have_no_older_target():
    gemv = MATMUL.family("gemv")
    split = gemv.resolve({"k_splits": 4}, "float16")
    with pytest.raises(SpecError, match="gemv with k_splits=4 shares a column strip .* not sm_80"):
        gemv.target("sm_80", split)
    assert gemv.target("sm_90", split) == "sm_90"
    assert gemv.target("sm_80", gemv.resolve({"k_splits": 1}, "float16")) == "sm_80"
    assert gemv.target("sm_80") == "sm_80"  # without parameters: only what the whole family needs


@pytest.mark.parametrize("dtype", DTYPES)
def test_space_is_valid_and_moderate(dtype):
    space = list(WGMMA.space(dtype))
    # 852: narrow swapped tiles (BN 16 / 32) and rings of 8-16 stages came in on 2026-11-25 (was <= 700);
    # 990 with TMA stores (tma_store: whole tiles of BN a multiple of 64, no split, swap or stream-K).
    # 1190 with stream-K tails (sk_tail: persistent grids only).
    assert 50 <= len(space) <= 1300
    assert WGMMA.defaults(dtype) in space
    for params in space:
        assert WGMMA.check(params, dtype) is None
        ring = params["stages"] * (params["BM"] + WGMMA.bn_loaded(params)) * 64 * 2
        rs = WGMMA.staged_row_floats(params)
        if params["swap_ab"]:  # a block per tile, C stored from the tile staged transposed, [BN][RS]
            assert params["ctas"] == 0 and not params["stream_k"]
            assert WGMMA.bn_loaded(params) == params["BN"]  # A's rows: one K-major box of BN rows
            assert rs >= params["BM"] and rs % 32 == 4 and params["BN"] * rs * 4 <= ring
        elif params["k_splits"] > 1:  # a cluster per tile, its fp32 partial sums staged in the ring
            assert params["ctas"] == 0 and not params["stream_k"]
            assert rs >= params["BN"] and rs % 32 == 8 and params["BM"] * rs * 4 <= ring
        rows = params["BM"] // params["consumers"]
        assert rows in (64, 128)
        assert WGMMA.acc_regs(params) <= 128
        assert WGMMA.threads(params) in (256, 384)
        assert WGMMA.smem_bytes(params, dtype) <= 227 * 1024


def test_defaults():
    for dtype in DTYPES:
        params = WGMMA.defaults(dtype)
        tile = {"BM": 128, "BN": 256, "consumers": 2, "stages": 4}
        knobs = {"ctas": 132, "stream_k": False, "k_splits": 1, "swap_ab": False, "tma_store": False, "sk_tail": False}
        assert params == {**tile, **knobs}
        assert WGMMA.threads(params) == 384  # producer + 2 consumer warpgroups
        assert WGMMA.acc_regs(params) == 128  # 64 x 256 fp32 per consumer over 128 threads
        # 4 stages of A (128 x 64) and B (64 x 256) halves, 8 mbarriers, 1 KiB alignment slack.
        assert WGMMA.smem_bytes(params, dtype) == 4 * (128 + 256) * 64 * 2 + 4 * 16 + 1024


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"BM": 64, "consumers": 2}, "64 or 128 rows"),  # 32 rows per consumer
        ({"BM": 256, "consumers": 1, "BN": 64}, "64 or 128 rows"),  # 256 rows per consumer
        ({"BM": 128, "consumers": 1, "BN": 256}, "accumulators"),  # 128 x 256 in one warpgroup
        ({"BM": 256, "BN": 256}, "accumulators"),
        ({"stages": 5}, "shared memory"),  # 5 x 48 KiB
        ({"k_splits": 2}, "ctas=0"),  # a cluster per tile, not a persistent grid
        ({"k_splits": 2, "stream_k": True}, "no stream_k"),
        ({"BN": 168, "stages": 6}, "shared memory"),  # 168 columns load three 64-column boxes: 6 x 40 KiB
    ],
)
def test_check_rejects(override, reason):
    params = {**WGMMA.defaults("float16"), **override}
    message = WGMMA.check(params, "float16")
    assert message is not None and reason in message
    with pytest.raises(SpecError, match="invalid parameters"):
        WGMMA.resolve(override, "float16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_check_shape_needs_16_byte_row_strides(dtype):
    params = WGMMA.defaults(dtype)
    for shape in SHAPES:
        assert WGMMA.check_shape(shape, params, dtype) is None, shape
    for shape in REJECTED:
        message = WGMMA.check_shape(shape, params, dtype)
        assert message is not None and "multiple of 8" in message and "tensorcore" in message


def test_split_k_partial_sums_must_fit_the_ring():
    params = {**WGMMA.defaults("float16"), "stages": 2, "ctas": 0, "k_splits": 2}  # 2 x 48 KiB < 128 KiB
    assert "exceeds" in WGMMA.check(params, "float16")


def test_split_k_needs_a_k_tile_per_block_and_launches_a_cluster_per_tile():
    params = {**WGMMA.defaults("float16"), "BM": 64, "BN": 64, "consumers": 1, "stages": 6, "ctas": 0, "k_splits": 4}
    assert "fewer than k_splits=4" in WGMMA.check_shape((128, 768, 192), params, "float16")  # 3 k tiles
    assert WGMMA.check_shape((128, 768, 256), params, "float16") is None
    (launch,) = WGMMA.launches((128, 768, 3072), params, "float16")
    assert launch.grid == (2 * 12 * 4, 1, 1)  # 24 tiles, 4 blocks (one cluster) each
    assert WGMMA.workspace((128, 768, 3072), params, "float16") == {}  # partial sums stay in shared memory


def test_swapped_operands_tile_c_transposed_and_stage_it():
    params = {**WGMMA.defaults("float16"), "ctas": 0, "k_splits": 4, "swap_ab": True}  # 128 x 256 tiles of C^T
    assert WGMMA.check(params, "float16") is None
    assert WGMMA.bn_loaded(params) == 256  # A's rows, one K-major box: no 64-column rounding
    assert WGMMA.tiles((256, 4096, 11008), params) == 32  # 4096 / 128 along N, one tile along M
    (launch,) = WGMMA.launches((256, 4096, 11008), params, "float16")
    assert launch.grid == (32 * 4, 1, 1)
    # C^T's 128 x 256 tile staged as [256][132] floats (132 = 4 mod 32): 135 KiB of the 192 KiB ring.
    assert WGMMA.staged_row_floats(params) == 132 and WGMMA.staged_bytes(params) == 256 * 132 * 4
    persistent = {"ctas": 132, "k_splits": 1}
    for override, reason in ((persistent, "ctas=0"), ({**persistent, "stream_k": True}, "no stream_k")):
        assert reason in WGMMA.check({**params, **override}, "float16")
    assert "exceeds" in WGMMA.check({**params, "stages": 2}, "float16")  # 135 KiB staged > 2 x 48 KiB


def test_tma_store_keeps_a_c_tile_beside_the_ring():
    params = {**WGMMA.defaults("float16"), "stages": 3, "ctas": 128, "tma_store": True}
    # 3 stages of 128 x 256 leave room for the whole 128 x 256 C tile (16-bit)...
    assert WGMMA.c_cols(params, "float16") == 256
    assert WGMMA.smem_bytes(params, "float16") == 3 * (128 + 256) * 64 * 2 + 128 * 256 * 2 + 3 * 16 + 1024
    # ... 4 stages for half of it (two rounds of stores a tile), 5 stages of 128 x 192 for a third.
    assert WGMMA.c_cols({**params, "stages": 4}, "float16") == 128
    assert WGMMA.c_cols({**params, "BN": 192, "stages": 5}, "float16") == 64
    for override in ({"k_splits": 2, "ctas": 0}, {"swap_ab": True, "ctas": 0}, {"stream_k": True}):
        assert "tma_store stores whole tiles" in WGMMA.check({**params, **override}, "float16")
    assert "multiple of 64" in WGMMA.check({**params, "BN": 168}, "float16")
    # C's rows must be whole 16-byte units for TMA: linear_t's (N, K) weights allow any N otherwise.
    from kernelmill.kernels.ops import OPS

    linear_t = OPS["linear_t"].family("wgmma")
    assert linear_t.check_shape((64, 1000, 64), {**params, "tma_store": False}, "float16") is None
    assert "TMA stores" in linear_t.check_shape((64, 1001, 64), params, "float16")


def test_bn_that_is_not_whole_boxes_loads_whole_boxes():
    params = {**WGMMA.defaults("float16"), "BN": 168, "ctas": 0}
    assert WGMMA.bn_loaded(params) == 192 and WGMMA.acc_regs(params) == 84
    assert WGMMA.smem_bytes(params, "float16") == 4 * (128 + 192) * 64 * 2 + 4 * 16 + 1024
    assert WGMMA.tiles((256, 11008, 4096), params) == 132  # one block per SM of an H100
    (launch,) = WGMMA.launches((256, 11008, 4096), params, "float16")
    assert launch.args[1].box == (64, 64)  # B still comes in 64-column boxes


def _points(dtype):
    space = list(WGMMA.space(dtype))
    return [WGMMA.defaults(dtype), *space[::7]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_launch_geometry(dtype, shape):
    M, N, K = shape  # noqa: N806
    for params in _points(dtype):
        if WGMMA.check_shape(shape, params, dtype):
            continue  # e.g. fewer k tiles than k_splits
        launches = WGMMA.launches(shape, params, dtype)
        launch = launches[-1]
        swap = params["swap_ab"]  # the tiles of C^T: BM along N, BN along M
        tiles = cdiv(N, params["BM"]) * cdiv(M, params["BN"]) if swap else cdiv(M, params["BM"]) * cdiv(N, params["BN"])
        grid = launch.grid[0]
        assert launch.grid[1:] == (1, 1)
        extra = []
        if params["stream_k"] or params["sk_tail"]:
            # One launch (the kernel leaves its arrival counts zero); every block of the persistent grid
            # may take a share.
            assert len(launches) == 1 and grid == params["ctas"]
            extra = ["sk_ws", "sk_flags"]
            assert WGMMA.workspace(shape, params, dtype)["sk_flags"] == tiles * params["consumers"] * 4
        elif params["k_splits"] > 1:
            # A cluster of k_splits consecutive blocks per tile.
            assert len(launches) == 1 and grid == tiles * params["k_splits"]
        else:
            # Every tile is owned by exactly one block (block b: tiles b, b + grid, ...), and no block is idle.
            assert len(launches) == 1 and 1 <= grid <= tiles
            assert grid == (min(tiles, params["ctas"]) if params["ctas"] else tiles)
        assert launch.block == (WGMMA.threads(params), 1, 1)
        assert launch.smem_bytes == WGMMA.smem_bytes(params, dtype)
        maps = 3 if params["tma_store"] else 2
        (a_map, b_map, *c_map), rest = launch.args[:maps], list(launch.args[maps:])
        assert rest == ["A", "B", "C", *extra, M, N, K]
        # The maps describe the buffers after them: A (M x K) and B (K x N), innermost dim first; swapped, B's
        # map feeds wgmma's A (64 x 64 boxes, BM / 64 of them a stage) and A's its B (BN rows). With tma_store
        # a third map takes C (M x N) in 64-column boxes of one consumer's rows.
        assert isinstance(a_map, TensorMapArg) and isinstance(b_map, TensorMapArg)
        if params["tma_store"]:
            ((c_map),) = c_map
            assert launch.args[c_map.of] == "C" and c_map.dims == (N, M)
            assert c_map.box == (64, params["BM"] // params["consumers"]) and c_map.swizzle == 128
        if swap:
            a_map, b_map = b_map, a_map
            assert b_map.box == (64, 64) and a_map.box == (64, params["BN"])
        else:
            assert a_map.box == (64, params["BM"]) and b_map.box == (64, 64)
        assert launch.args[a_map.of] == "A" and launch.args[b_map.of] == "B"
        assert a_map.dims == (K, M) and b_map.dims == (N, K)
        assert a_map.dtype == b_map.dtype == dtype and a_map.swizzle == b_map.swizzle == 128
        assert a_map.kind == b_map.kind == "tensor_map"
        assert set(WGMMA.workspace(shape, params, dtype)) == set(extra)


def test_launch_args_are_json_serialisable():
    """The service stores served launches as JSON (agents.loop.served_fields)."""
    (launch,) = WGMMA.launches((300, 200, 512), WGMMA.defaults("float16"), "float16")
    decoded = json.loads(json.dumps(list(launch.args)))
    assert decoded[0] == ["tensor_map", 2, [512, 300], [64, 128], "float16", 128]
    assert decoded[2:] == ["A", "B", "C", 300, 200, 512]


def _tile_order(tile: int, tiles_m: int, tiles_n: int, group_m: int = 8) -> tuple[int, int]:
    """km_wgmma_tile of the template, line for line."""
    per_group = group_m * tiles_n
    group = tile // per_group
    first_m = group * group_m
    rows = min(tiles_m - first_m, group_m)
    in_group = tile - group * per_group
    return first_m + in_group % rows, in_group // rows


@pytest.mark.parametrize(("tiles_m", "tiles_n"), [(1, 1), (3, 5), (8, 16), (9, 7), (17, 43), (64, 32)])
def test_tile_order_is_a_bijection(tiles_m, tiles_n):
    seen = {_tile_order(t, tiles_m, tiles_n) for t in range(tiles_m * tiles_n)}
    assert seen == {(m, n) for m in range(tiles_m) for n in range(tiles_n)}


# -- templates (rendered only) --------------------------------------------------------------------

_KERNEL_RE = re.compile(
    r'extern "C" __global__ void __launch_bounds__\((\d+, \d+)\)(?: __cluster_dims__\((\d+), 1, 1\))?\n(\w+)\(([^)]*)\)'
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rendered_kernel_matches_launch(dtype):
    for params in _points(dtype):
        source = render(WGMMA, params, dtype)
        ((bounds, cluster, entry, arglist),) = _KERNEL_RE.findall(source)
        assert int(cluster or 1) == params["k_splits"]
        names = [a.split()[-1] for a in arglist.split(",")]
        assert entry == "matmul_wgmma"
        extra = ["ws", "flags"] if params["stream_k"] or params["sk_tail"] else []
        maps = ["tma_a", "tma_b", "tma_c"] if params["tma_store"] else ["tma_a", "tma_b"]
        assert names == [*maps, "A", "B", "C", *extra, "M", "N", "K"]
        assert "const __grid_constant__ KmTensorMap tma_a" in arglist
        assert bounds == f"{WGMMA.threads(params)}, 1"
        assert f"== {WGMMA.smem_bytes(params, dtype)}, " in source  # static_assert against the C++ size
        assert f"== {WGMMA.staged_row_floats(params)},\n" in source  # and against the C++ staged row stride
        kind = "f16" if dtype == "float16" else "bf16"
        assert f"wgmma.mma_async.sync.aligned.m64n{params['BN']}k16.f32.{kind}.{kind}" in source
        # B is N-major in shared memory (row-major K x N): imm-trans-b = 1, A K-major: imm-trans-a = 0;
        # swapped, B is wgmma's A, M-major (imm-trans-a = 1), and A its B, K-major (imm-trans-b = 0).
        assert ("p, 1, 1, 1, 0;" if params["swap_ab"] else "p, 1, 1, 0, 1;") in source
        assert len(WGMMA.launches((17, 32, 64), params, dtype)[-1].args) == len(names)


# -- the parameter buffer of launches with tensor maps ------------------------------------------------

#: What ptxas 13.0 gives matmul_wgmma (cuobjdump -elf, EIATTR_KPARAM_INFO): the parameter block starts at
#: c[0x0][0x210], so the first 64-byte aligned map lands at offset 0x30.
PTXAS_LAYOUT = ([(48, 128), (176, 128), (304, 8), (312, 8), (320, 8), (328, 4), (332, 4), (336, 4)], 340)


def _device_args(launch):
    return [Buffer(None, 1) if isinstance(a, str) else a for a in launch.args]


def test_param_format_follows_the_ptxas_layout():
    (launch,) = WGMMA.launches((300, 200, 512), WGMMA.defaults("float16"), "float16")
    assert param_format(_device_args(launch), PTXAS_LAYOUT) == "48x128s128sPPPiii"


def test_param_format_of_plain_launches_is_unchanged():
    assert param_format([Buffer(None, 1), Buffer(None, 1), Buffer(None, 1), 3, 4, 5]) == "PPPiii"
    assert param_format([Buffer(None, 1), 7], PTXAS_LAYOUT) == "Pi"  # no map: the layout is not consulted


def test_param_format_refuses_what_it_cannot_lay_out():
    (launch,) = WGMMA.launches((300, 200, 512), WGMMA.defaults("float16"), "float16")
    args = _device_args(launch)
    with pytest.raises(DeviceFault, match="no parameter layout"):
        param_format(args, None)
    with pytest.raises(DeviceFault, match="does not fit"):
        param_format(args, ([(0, 128), (128, 128), (256, 8), (264, 8), (272, 8), (280, 4), (284, 8), (292, 4)], 296))
    with pytest.raises(DeviceFault, match="no parameter layout"):
        param_format(args[:-1], PTXAS_LAYOUT)


def test_tensor_map_strides_are_row_bytes():
    (launch,) = WGMMA.launches((300, 200, 512), WGMMA.defaults("bfloat16"), "bfloat16")
    a_map, b_map = launch.args[:2]
    assert tensor_map_strides(a_map) == [512 * 2]  # a row of A: K halves
    assert tensor_map_strides(b_map) == [200 * 2]  # a row of B: N halves


def test_kernel_param_layouts_tolerates_garbage():
    assert kernel_param_layouts(b"not an elf file") == {}


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_layout_needs_the_padding(tmp_path, dtype):
    """The real cubin: ptxas places the maps at 0x30 and 0xb0, which param_format reproduces."""
    from kernelmill.kernels.compile import Compiler

    params = WGMMA.defaults(dtype)
    compiled = Compiler(cache_dir=tmp_path).compile(render(WGMMA, params, dtype), "sm_90a")
    resources = compiled.resources["matmul_wgmma"]
    assert not compiled.spills and resources.registers * WGMMA.threads(params) <= 65536
    assert "C751" not in compiled.log  # no "wgmma serialized" warnings
    layout = kernel_param_layouts(compiled.cubin)["matmul_wgmma"]
    assert layout == PTXAS_LAYOUT
    (launch,) = WGMMA.launches((4096, 4096, 4096), params, dtype)
    assert param_format(_device_args(launch), layout) == "48x128s128sPPPiii"


# -- a model of the kernel's shared-memory address math ----------------------------------------------
# The kernel's offsets re-typed in NumPy, run under the documented hardware semantics: TMA writes a 2-D box
# with SWIZZLE_128B (address bits 4-6 XOR bits 7-9, zero fill out of bounds); wgmma reads A K-major and B
# N-major through descriptors (CUTLASS's canonical SW128 layouts: K-major ((8,m),(8 el,2)):((128 B,SBO),
# (2 B,16 B)); MN-major ((64 el,n),(8,k)):((2 B,LBO),(128 B,SBO))); the accumulators follow CUTLASS's
# CLayout_64xN. Keep in step with templates/common/gemm_wgmma.cuh.j2: a wrong stride, LBO/SBO or k step
# here or there shows as a mismatch.


def _swizzle(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def _tma_load(smem, tensor, box, c0, c1, dst):
    rows, inner = tensor.shape
    r, e = np.meshgrid(np.arange(box[1]), np.arange(box[0]), indexing="ij")
    y, x = c1 + r, c0 + e
    inside = (x < inner) & (y < rows)
    values = np.where(inside, tensor[np.minimum(y, rows - 1), np.minimum(x, inner - 1)], 0.0)
    smem[_swizzle(dst + r * box[0] * 2 + e * 2) // 2] = values


def _desc(addr, lead, stride):
    return ((addr & 0x3FFFF) >> 4) | ((lead >> 4) << 16) | ((stride >> 4) << 32) | (1 << 62)


def _wgmma(smem, acc, desc_a, desc_b, n, accumulate):
    start_a, stride_a = (desc_a & 0x3FFF) << 4, ((desc_a >> 32) & 0x3FFF) << 4
    start_b, lead_b, stride_b = (desc_b & 0x3FFF) << 4, ((desc_b >> 16) & 0x3FFF) << 4, ((desc_b >> 32) & 0x3FFF) << 4
    m, k = np.meshgrid(np.arange(64), np.arange(16), indexing="ij")
    a = smem[_swizzle(start_a + (m % 8) * 128 + (m // 8) * stride_a + k * 2) // 2]
    k, c = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
    b = smem[_swizzle(start_b + (c % 64) * 2 + (c // 64) * lead_b + (k % 8) * 128 + (k // 8) * stride_b) // 2]
    return a @ b + (acc if accumulate else 0.0)


def _fragment(t, i):
    """CUTLASS CLayout_64xN: thread t, register i -> (row, column) of the 64 x N accumulator tile."""
    return t // 4 % 8 + 16 * (t // 32) + 8 * (i // 2 % 2), 2 * (t % 4) + i % 2 + 8 * (i // 4)


def _model_matmul(M, N, K, BM, BN, consumers, stages, ctas):  # noqa: N803
    rng = np.random.default_rng(0)
    a, b = rng.integers(-3, 4, (M, K)).astype(float), rng.integers(-3, 4, (K, N)).astype(float)
    c = np.full((M, N), np.nan)
    wg_m, row = BM // consumers, 128
    a_bytes, b_block, b_bytes = BM * row, 64 * row, BN // 64 * 64 * row
    a_smem = 0x400  # where ptxas puts dynamic shared memory on sm_90 (1 KiB reserved): already 1024-aligned
    b_smem = a_smem + stages * a_bytes
    smem = np.full((b_smem + stages * b_bytes) // 2, np.nan)  # NaN: a read of anything TMA did not write shows
    tiles_m, tiles_n = cdiv(M, BM), cdiv(N, BN)
    grid = min(tiles_m * tiles_n, ctas) if ctas else tiles_m * tiles_n
    t = np.arange(128)[:, None]
    for block in range(grid):
        stage = 0
        for tile in range(block, tiles_m * tiles_n, grid):
            tm, tn = _tile_order(tile, tiles_m, tiles_n)
            m0, n0 = tm * BM, tn * BN
            acc = {(w, ms): np.full((64, BN), np.nan) for w in range(consumers) for ms in range(wg_m // 64)}
            for kt in range(cdiv(K, 64)):
                _tma_load(smem, a, (64, BM), kt * 64, m0, a_smem + stage * a_bytes)
                for j in range(BN // 64):
                    _tma_load(smem, b, (64, 64), n0 + 64 * j, kt * 64, b_smem + stage * b_bytes + j * b_block)
                for w, ms in acc:
                    desc_a0, desc_b0 = _desc(a_smem + w * wg_m * row, 16, 1024), _desc(b_smem, b_block, 1024)
                    for kk in range(4):
                        desc_b = desc_b0 + ((stage * b_bytes + kk * 16 * row) >> 4)
                        desc_a = desc_a0 + ((stage * a_bytes + ms * 64 * row + kk * 32) >> 4)
                        acc[w, ms] = _wgmma(smem, acc[w, ms], desc_a, desc_b, BN, kt > 0 or kk > 0)
                stage = (stage + 1) % stages
            for (w, ms), tile_acc in acc.items():
                regs = tile_acc[_fragment(t, np.arange(BN // 2)[None, :])]  # [thread][register]
                warp, lane = t // 32, t % 32
                r0 = m0 + w * wg_m + ms * 64 + warp * 16 + lane // 4
                for j in range(BN // 8):
                    n = n0 + 8 * j + 2 * (lane % 4)
                    for rows, v0, v1 in (
                        (r0, regs[:, [4 * j]], regs[:, [4 * j + 1]]),
                        (r0 + 8, regs[:, [4 * j + 2]], regs[:, [4 * j + 3]]),
                    ):
                        ok = rows < M
                        c[rows[ok & (n < N)], n[ok & (n < N)]] = v0[ok & (n < N)]
                        c[rows[ok & (n + 1 < N)], n[ok & (n + 1 < N)] + 1] = v1[ok & (n + 1 < N)]
    return c, a @ b


@pytest.mark.parametrize(
    "case",
    [
        (130, 200, 136, 128, 192, 2, 3, 2),  # ragged M, N and K; two tiles per persistent block
        (300, 136, 72, 256, 128, 2, 3, 0),  # two m64 rows per consumer
        (70, 72, 8, 64, 64, 1, 4, 3),  # K below one 64-deep stage
        (129, 264, 200, 128, 256, 2, 4, 1),  # one block, four tiles: the ring wraps across tiles
        (1, 8, 8, 128, 256, 2, 4, 132),  # boxes almost entirely out of bounds
    ],
)
def test_model_of_the_address_math_reproduces_a_times_b(case):
    c, reference = _model_matmul(*case)
    assert np.array_equal(c, reference)


def test_kernel_launch_packs_maps_where_ptxas_put_them(monkeypatch):
    """Kernel.launch with a stand-in for pycuda's function: the signature, the values and one encoding per map."""
    import types

    from kernelmill.kernels import device as device_module

    encoded = []

    def fake_encode(ptr, spec):
        encoded.append((ptr, spec))
        return bytes([len(encoded)]) * 128

    class FakeFunction:
        def prepare(self, signature):
            self.signature = signature

        def set_attribute(self, attribute, value):
            self.smem = value

        def prepared_async_call(self, grid, block, stream, *values, shared_size):
            self.call = (grid, block, values, shared_size)

    class FakeModule:
        def param_layout(self, entry):
            assert entry == "matmul_wgmma"
            return PTXAS_LAYOUT

    cuda = types.SimpleNamespace(
        Error=RuntimeError, function_attribute=types.SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=8)
    )
    monkeypatch.setattr(device_module, "encode_tensor_map", fake_encode)
    fn = FakeFunction()
    kernel = device_module.Kernel(types.SimpleNamespace(cuda=cuda), fn, "matmul_wgmma", FakeModule())
    (launch,) = WGMMA.launches((300, 200, 512), WGMMA.defaults("float16"), "float16")
    buffers = {"A": Buffer(0x1000, 0), "B": Buffer(0x2000, 0), "C": Buffer(0x3000, 0)}
    args = [buffers[a] if isinstance(a, str) else a for a in launch.args]
    for _ in range(2):
        kernel.launch(launch.grid, launch.block, launch.smem_bytes, args)
    assert fn.signature == "48x128s128sPPPiii" and fn.smem == launch.smem_bytes
    grid, block, values, shared = fn.call
    assert values == (b"\x01" * 128, b"\x02" * 128, 0x1000, 0x2000, 0x3000, 300, 200, 512)
    assert [ptr for ptr, _ in encoded] == [0x1000, 0x2000]  # encoded once, reused by the second launch
    assert grid == launch.grid and block == launch.block and shared == launch.smem_bytes


def _sk_owner(x: int, total: int, blocks: int) -> int:
    """templates/common/gemm_wgmma.cuh.j2's km_sk_owner: the block whose share holds iteration x."""
    return ((x + 1) * blocks + total - 1) // total - 1


@pytest.mark.parametrize(
    ("tiles_m", "tiles_n", "k_tiles", "blocks"),
    [(2, 58, 64, 132), (2, 32, 172, 132), (1, 1, 1, 132), (4, 1, 3, 128), (8, 17, 2, 132), (1, 7, 173, 5)],
)
def test_stream_k_shares_cover_every_iteration_once_and_partial_slots_never_collide(tiles_m, tiles_n, k_tiles, blocks):
    """The kernel's stream-K bookkeeping, in Python: groups of tiles_m blocks (one per row tile) share the
    column tiles' k iterations, [g*total/G, (g+1)*total/G), split at tile boundaries; a part of a tile goes
    to slot (block, group == the tile's first group); the count of parts is what the last block waits for."""
    total = tiles_n * k_tiles
    groups = min(blocks // tiles_m, total)  # shares go to the first min(grid / tiles_m, total) groups
    covered = [[0] * total for _ in range(tiles_m)]
    slots: dict[tuple[int, int], tuple[int, int]] = {}
    parts_seen: dict[tuple[int, int], int] = {}
    for b in range(blocks):
        g, tm = divmod(b, tiles_m)
        if g >= groups:
            continue
        it, end = total * g // groups, total * (g + 1) // groups
        for x in range(it, end):
            covered[tm][x] += 1
            assert _sk_owner(x, total, groups) == g
        while it < end:
            tn, kt0 = divmod(it, k_tiles)
            kt1 = min(k_tiles, kt0 + end - it)
            it += kt1 - kt0
            if kt0 > 0 or kt1 < k_tiles:
                first = _sk_owner(tn * k_tiles, total, groups)
                slot = (b, int(g == first))
                assert slot not in slots, f"slot {slot} taken by tile {slots.get(slot)} and {(tm, tn)}"
                slots[slot] = (tm, tn)
                parts_seen[(tm, tn)] = parts_seen.get((tm, tn), 0) + 1
    assert covered == [[1] * total for _ in range(tiles_m)]
    for (_tm, tn), seen in parts_seen.items():
        first = _sk_owner(tn * k_tiles, total, groups)
        assert _sk_owner(tn * k_tiles + k_tiles - 1, total, groups) - first + 1 == seen


def test_stream_k_needs_a_persistent_grid_and_sizes_its_workspace():
    from kernelmill.kernels.ops import get_op

    fam = get_op("linear").family("wgmma")
    params = {**fam.defaults("float16"), "BM": 128, "BN": 192, "stream_k": True}
    assert "set ctas" in fam.check({**params, "ctas": 0}, "float16")
    shape = (256, 11008, 4096)
    (launch,) = fam.launches(shape, params, "float16")  # no zeroing launch: sk_flags is a counter workspace
    assert "sk_flags" in fam.counter_workspaces and launch.args[-5:-3] == ("sk_ws", "sk_flags")
    assert launch.grid == (132, 1, 1)  # every block takes a share though there are only 116 tiles
    ws = fam.workspace(shape, params, "float16")
    assert ws == {"sk_ws": 2 * 132 * 128 * 192 * 4, "sk_flags": 116 * 2 * 4}
    assert "row tiles" in fam.check_shape((2048, 11008, 4096), params, "float16")  # 16 row tiles


def _sk_tail_work(tiles: int, k_tiles: int, blocks: int) -> dict[int, list[tuple[int, int, int]]]:
    """The kernel's sk_tail walk, in Python (it_begin, next_it and tile_end of gemm_wgmma.cuh.j2): for each
    block, its (tile, kt0, kt1) work units in order."""
    dp_tiles = tiles - tiles % blocks
    tail = tiles - dp_tiles
    parts = max(1, min(blocks // tail, 4, k_tiles)) if tail else 1
    dp_end = dp_tiles * k_tiles
    work = {}
    for b in range(blocks):
        u, j = divmod(b, parts)
        sk_begin = dp_end + (u * k_tiles + k_tiles * j // parts if u < tail else 0)
        sk_end = dp_end + (u * k_tiles + k_tiles * (j + 1) // parts if u < tail else 0)
        it, units = (b * k_tiles if b < dp_tiles else sk_begin), []
        while it < sk_end:
            unit, kt0 = divmod(it, k_tiles)
            kt1 = min(k_tiles, kt0 + sk_end - it)
            units.append((unit, kt0, kt1))
            if it < dp_end:
                it = it + blocks * k_tiles if it + blocks * k_tiles < dp_end else sk_begin
            else:
                it += kt1 - kt0
        work[b] = units
    return work


@pytest.mark.parametrize(
    ("tiles", "k_tiles", "blocks"),
    [
        (344, 64, 132),
        (688, 64, 132),
        (172, 64, 132),
        (64, 172, 132),
        (136, 16, 132),
        (153, 3, 132),
        (2, 1, 132),
        (264, 64, 132),
        (129, 5, 128),
        (40, 32, 132),
    ],
)
def test_sk_tail_covers_every_iteration_once_and_cuts_only_the_last_round(tiles, k_tiles, blocks):
    """sk_tail: whole tiles b, b + G, ... over the grid's full rounds, then P even k parts of each tile left,
    one block each (block u * P + j: part j of tail tile u), so every block holds at most one part and its
    slot is its own; the family's sk_tail_split and workspace agree with the kernel's cut."""
    work = _sk_tail_work(tiles, k_tiles, blocks)
    covered = [[0] * k_tiles for _ in range(tiles)]
    parts_of: dict[int, list[int]] = {}
    for b, units in work.items():
        assert sum(1 for _t, kt0, kt1 in units if kt1 - kt0 < k_tiles) <= 1  # one slot a block
        for tile, kt0, kt1 in units:
            assert kt0 < kt1
            for kt in range(kt0, kt1):
                covered[tile][kt] += 1
            if kt1 - kt0 < k_tiles:
                parts_of.setdefault(tile, []).append(b)
    assert covered == [[1] * k_tiles for _ in range(tiles)]
    dp_tiles = tiles - tiles % blocks
    assert all(tile >= dp_tiles for tile in parts_of)  # full rounds stay whole
    shape = (128 * tiles, 256, 64 * k_tiles)  # BM x BN = 128 x 256: one column of tiles
    params = {**WGMMA.defaults("float16"), "ctas": blocks, "sk_tail": True}
    tail, parts = WGMMA.sk_tail_split(shape, params)
    assert tail == tiles - dp_tiles
    for tile, owners in parts_of.items():
        assert owners == list(range((tile - dp_tiles) * parts, (tile - dp_tiles + 1) * parts))  # first, parts
    slots = sum(len(owners) for owners in parts_of.values())
    assert WGMMA.workspace(shape, params, "float16")["sk_ws"] == max(slots * 128 * 256 * 4, 4)


def test_sk_tail_needs_a_persistent_grid_of_whole_tiles():
    params = {**WGMMA.defaults("float16"), "sk_tail": True}
    assert WGMMA.check(params, "float16") is None
    assert WGMMA.check({**params, "tma_store": True}, "float16") is None  # the last part stores the tile
    assert "set ctas" in WGMMA.check({**params, "ctas": 0}, "float16")
    assert "choose one" in WGMMA.check({**params, "stream_k": True}, "float16")
    assert "ctas=0" in WGMMA.check({**params, "k_splits": 2}, "float16")
