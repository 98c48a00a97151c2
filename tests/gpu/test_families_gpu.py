"""Every family of every op verified on the GPU for all dtypes, odd shapes included (marker gpu)."""

from __future__ import annotations

import random

import pytest

from kernelmill.kernels.compile import Compiler
from kernelmill.kernels.evaluate import evaluate
from kernelmill.kernels.ops import OPS
from kernelmill.kernels.variant import BoundVariant, Variant
from kernelmill.kernels.verify import compare, verify

pytestmark = pytest.mark.gpu

#: Odd sizes (not multiples of any tile, vector width or warp) next to round ones.
SHAPES = {
    "softmax": [(1, 1), (3, 17), (37, 1000), (5, 4099), (64, 1024), (16, 32000), (2, 32000), (5, 33333), (2, 100003)],
    "matmul": [
        *[(1, 1, 1), (17, 33, 7), (255, 129, 100), (128, 128, 128), (1, 4096, 512), (300, 200, 513)],
        *[(16, 100, 300), (5, 4100, 257), (3, 64, 1000), (300, 200, 512)],
    ],
    "fused_mlp": [(1, 100, 257, 33), (3, 64, 128, 64), (17, 256, 300, 130), (16, 512, 1024, 512)],
    "linear": [
        *[(1, 1, 1), (17, 33, 7), (255, 129, 100), (128, 128, 128), (300, 200, 513)],
        *[(16, 100, 300), (5, 4100, 257), (3, 64, 1000), (64, 256, 128), (300, 200, 512)],
    ],
    # W is (N, K): only K need be a multiple of 8 (TMA row strides, gemv's 16-byte chunks); N is free.
    "linear_t": [
        *[(1, 8, 8), (17, 33, 8), (255, 136, 104), (300, 200, 512), (129, 264, 72), (256, 1000, 4104), (64, 61, 8)],
        *[(3, 1000, 72), (8, 37, 4104), (5, 300, 520), (1, 4096, 11008)],
    ],
    "bias_act": [(1, 1), (3, 17), (37, 1000), (64, 3072)],
    "add": [(1,), (17,), (1000,), (4099,), (1 << 20,)],
    "layernorm": [(1, 1), (3, 17), (37, 768), (5, 4099), (64, 1024)],
    "add_layernorm": [(1, 1), (3, 17), (37, 768), (5, 4099), (64, 1024)],
    "embedding": [(1, 1, 1, 1, 1), (2, 7, 33, 50, 2), (3, 17, 768, 1000, 2), (1, 128, 100, 30522, 3)],
    # head_dim 16 / 64 / 128 for the mma family (multiples of 16), sequences across several key tiles with a tail.
    "attention": [
        *[(1, 1, 1, 1), (2, 3, 17, 8), (1, 2, 100, 64), (2, 12, 128, 64), (1, 1, 33, 128), (1, 2, 70, 100)],
        *[(2, 3, 17, 16), (1, 4, 300, 64), (1, 2, 257, 128)],
    ],
    "sdpa": [(1, 1, 1, 1), (2, 3, 17, 8), (2, 12, 128, 64), (1, 2, 70, 100), (2, 3, 17, 16), (1, 4, 300, 128)],
    "mlp_stack": [(1, 64, 136, 1), (1, 136, 264, 3), (2, 64, 520, 2), (3, 768, 3072, 2), (1, 4096, 11008, 1)],
}

CASES = [(op.name, fam.name, dt) for op in OPS.values() for fam in op.families.values() for dt in fam.dtypes]


@pytest.fixture(scope="module")
def device():
    from kernelmill.kernels.device import get_device

    return get_device()


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return Compiler(cache_dir=tmp_path_factory.mktemp("gpu-cubins"))


def _points(fam, dtype):
    space = list(fam.space(dtype))
    rng = random.Random(f"gpu-{fam.name}-{dtype}")
    return [fam.defaults(dtype), *rng.sample(space, min(2, len(space)))]


def _verify_where_it_runs(variant, shapes, device, compiler) -> int:
    """Verifies ``variant`` on 2 seeds at each of ``shapes`` it takes; returns how many it took."""
    ran = 0
    for shape in shapes:
        if variant.check_shape(shape):
            continue
        ev = evaluate(variant, shape, device, compiler, seeds=2, timed=False)
        assert ev.ok, f"{variant.describe()} {variant.attrs} at {shape}: {ev.status}: {ev.reason}"
        ran += 1
    return ran


@pytest.mark.parametrize(("op", "family", "dtype"), CASES)
def test_family_verifies_on_odd_shapes(device, compiler, op, family, dtype):
    spec = OPS[op]
    fam = spec.family(family)
    attrs_list = [{a.name: v} for a in spec.attributes for v in a.values] or [{}]
    ran = 0
    for i, params in enumerate(_points(fam, dtype)):
        for attrs in attrs_list if i == 0 else attrs_list[:1]:
            variant = Variant.create(op, family, dtype, params, attrs)
            # Shapes a variant does not take (a small-batch family at a large batch) are not its job.
            ran += _verify_where_it_runs(variant, SHAPES[op], device, compiler)
    assert ran > 0, "no shape was in range for this family"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("act", ["relu", "gelu_erf", "gelu_tanh", "silu"])
def test_activation_forms_hold_over_a_wide_range(device, compiler, act, dtype):
    # The activation forms of prelude.cuh.j2 (float32: erfcf; 16-bit: an A&S erfc; sigmoids from the MUFU's
    # 2^x and 1/x) against float64 over [-16, 16], which random GEMM outputs rarely reach: tails included.
    import numpy as np

    spec = OPS["bias_act"]
    variant = Variant.create("bias_act", "vec", dtype, spec.family("vec").defaults(dtype), {"act": act})
    shape = (64, 4096)
    x = np.linspace(-16.0, 16.0, shape[0] * shape[1]).reshape(shape).astype(dtype)
    bound = BoundVariant(device, variant, variant.compile(compiler), shape)
    bound.poison()
    bound.set_inputs({"X": x, "b": np.zeros(shape[1], dtype)})
    bound.run()
    device.synchronize()
    got = bound.outputs()["Y"].astype(np.float64)
    want = spec.reference({"X": x, "b": np.zeros(shape[1], dtype)}, {"act": act})["Y"]
    assert np.isfinite(got).all()
    if dtype == "float32":
        err = np.abs(got - want) / np.maximum(1.0, np.abs(x))
        assert err.max() <= 2e-6, f"{act}: error {err.max():.3g} at x = {x.flat[int(err.argmax())]:.4f}"
        # Relative precision in the negative tail too (the textbook forms cancel there), to within the tail's
        # own conditioning: e^(-x^2 / 2) turns float32 rounding of its argument into ~x^2 eps relative.
        normal = np.abs(want) >= 1e-30
        rel = np.abs(got - want)[normal] / np.abs(want)[normal]
        limit = 1e-5 * (1.0 + x[normal].astype(np.float64) ** 2 / 4)
        worst = int(np.argmax(rel / limit))
        assert rel[worst] <= limit[worst], f"{act}: relative error {rel[worst]:.3g} at x = {x[normal][worst]:.4f}"
    else:
        # Within a rounding of the float16 result (half an ulp is 2^-11 relative; subnormals step 6e-8).
        err = np.abs(got - want) / (np.abs(want) * 2.0**-10 + 6e-8)
        assert err.max() <= 1.0, f"{act}: error {err.max():.3g} roundings at x = {x.flat[int(err.argmax())]:.4f}"


#: gemv's mma engine with A's fragments as vector loads (a_vec): one or two steps per load (odd and even
#: unroll), M in one or two 8-row halves, one or two groups in flight, split K; the shapes have partial
#: groups at the end of a K slice, K not a multiple of 4 or 8 (the element-wise fallback) and M below max_m.
A_VEC_POINTS = [
    {"max_m": 8, "unroll": 1, "pipeline": 1, "k_splits": 4, "threads": 128},
    {"max_m": 8, "unroll": 2, "pipeline": 2, "k_splits": 8, "threads": 128},
    {"max_m": 16, "unroll": 1, "pipeline": 1, "k_splits": 4, "threads": 128},
    {"max_m": 16, "unroll": 2, "pipeline": 1, "k_splits": 2, "threads": 256},
    {"max_m": 16, "unroll": 4, "pipeline": 1, "k_splits": 1, "threads": 128},
]
A_VEC_SHAPES = [(1, 64, 16), (1, 4096, 512), (5, 4100, 257), (8, 200, 1000), (13, 136, 1002), (16, 520, 4100)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_gemv_vector_loads_of_a_keep_the_k_order(device, compiler, op, dtype):
    fam = OPS[op].family("gemv")
    ran = 0
    for point in A_VEC_POINTS:
        params = {**fam.defaults(dtype), "block_cols": 64, **point, "a_vec": True}
        variant = Variant.create(op, "gemv", dtype, params, {"act": "gelu_erf"} if op == "linear" else {})
        ran += _verify_where_it_runs(variant, A_VEC_SHAPES, device, compiler)
    assert ran == sum(shape[0] <= point["max_m"] for point in A_VEC_POINTS for shape in A_VEC_SHAPES)


#: linear_t's gemv (row dot products) off its defaults: block sizes, chunks a thread, rows in flight, grid strides.
GEMV_T_POINTS = [
    {"max_m": 1, "threads": 256, "k_chunks": 6, "rows": 8, "blocks": 132},
    {"max_m": 2, "threads": 1024, "k_chunks": 1, "rows": 1, "blocks": 528},
    {"max_m": 2, "threads": 512, "k_chunks": 2, "rows": 4, "blocks": 396},
    {"max_m": 2, "threads": 256, "k_chunks": 3, "rows": 2, "blocks": 264},
]
GEMV_T_SHAPES = [(1, 1, 8), (1, 4096, 4096), (2, 300, 3072), (2, 1000, 72), (1, 37, 4104), (2, 133, 520), (3, 1, 16)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_linear_t_gemv_points(device, compiler, dtype):
    ran = 0
    for point in GEMV_T_POINTS:
        variant = Variant.create("linear_t", "gemv", dtype, point, {"act": "silu"})
        ran += _verify_where_it_runs(variant, GEMV_T_SHAPES, device, compiler)
    assert ran >= 12


class PlantedVariant(Variant):
    """A real variant whose source a test edits: the verifier must catch the damage."""

    def plant(self, old: str, new: str, count: int = 1) -> PlantedVariant:
        """``old`` replaced by ``new``: its first ``count`` occurrences (-1: all)."""
        source = self.source
        assert old in source, f"plant point {old!r} not in the source"
        object.__setattr__(self, "_planted", source.replace(old, new, count))
        return self

    @property
    def source(self) -> str:  # type: ignore[override]
        return getattr(self, "_planted", None) or super().source


def _planted(old: str, new: str) -> PlantedVariant:
    base = Variant.create("softmax", "warp_row", "float32")
    return PlantedVariant(base.op, base.family, base.params, base.dtype, base.attrs).plant(old, new)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_linear_t_gemv_element_loads_match(device, compiler, dtype):
    # The path for rows that are not 16-byte aligned (views): forced on, it must compute the same thing.
    base = Variant.create("linear_t", "gemv", dtype, {"max_m": 2, "threads": 512, "k_chunks": 2}, {"act": "relu"})
    variant = PlantedVariant(base.op, base.family, base.params, base.dtype, base.attrs)
    variant.plant("const bool w_vec = (reinterpret_cast<uintptr_t>(W) & 15) == 0;", "const bool w_vec = false;")
    variant.plant("const bool x_vec = (reinterpret_cast<uintptr_t>(X) & 15) == 0;", "const bool x_vec = false;")
    assert _verify_where_it_runs(variant, [(2, 1000, 72), (1, 37, 4104)], device, compiler) == 2


def _mask_kind(mask, kind: str):
    """The (batch, seq) additive mask of one kind; the random one (make_inputs) masks every tile."""
    import numpy as np

    mask = mask.astype(np.float32)
    if kind == "minus_inf":  # the first 150 keys of batch 0 (whole key tiles: the running max stays -inf)
        mask[0, :150] = -np.inf
        mask[1, -40:] = -np.inf
    elif kind == "all_minus_inf":  # every key of batch 0 (its output is 0, as torch's sdpa gives), some of batch 1
        mask[0] = -np.inf
        mask[1, -40:] = -np.inf
    elif kind == "zero":  # no key masked: the mma family's tiles take the path without the mask
        mask[:] = 0.0
    elif kind == "padding":  # BERT's: 0, and the dtype's lowest value on batch 1's last keys
        mask[:] = 0.0
        mask[1, -70:] = np.finfo(np.float16).min
    return mask.astype(np.float16)


def _check_attention(device, compiler, variant, shape, kind: str) -> None:
    """variant at shape against the float64 reference on two fresh seeds, its output poisoned first, with the
    mask of `kind` ("random": make_inputs' own; else _mask_kind's): finite, within the op's tolerance, and
    nothing written outside the output (the guard bytes, the inputs), as verify() checks."""
    import numpy as np

    spec = variant.op
    kinds = len(spec.input_kinds)
    for seed in (random.randrange(1 << 20) * kinds for _ in range(2)):  # seeds of make_inputs' "random" kind
        inputs = spec.make_inputs(shape, variant.dtype, seed)
        if kind != "random":
            inputs["mask"] = _mask_kind(inputs["mask"], kind)
        bound = BoundVariant(device, variant, variant.compile(compiler), shape)
        bound.poison()
        bound.set_inputs(inputs)
        bound.run()
        device.synchronize()
        stray = bound.stray_write(inputs)
        assert stray is None, f"{variant.describe()} {kind} (seed {seed}): {stray}"
        want = spec.reference(inputs, {})["out"]
        assert np.isfinite(want).all()
        check = compare(bound.outputs()["out"], want, seed, "out", spec.tolerance(shape, variant.precision))
        assert check.failure() is None, f"{variant.describe()} {kind}: {check.failure()}"


MMA_MASK_POINTS = [
    {},  # the defaults: 128-key tiles
    {"m_tiles": 2, "block_kv": 64, "stages": 3},
    {"warps": 2, "block_kv": 32, "stages": 1},
    {"m_tiles": 2, "block_kv": 64, "q_regs": False},  # Q re-read from shared memory
    {"m_tiles": 2, "block_kv": 32, "q_regs": False, "max_head_dim": 128},
    # Two key groups: at 300 keys the last 128-key tile leaves group 1 no key at all, so its merge takes an
    # empty state (m = -inf, l = 0).
    {"kv_groups": 2, "block_kv": 64},
    {"kv_groups": 2, "warps": 2, "block_kv": 32, "stages": 1},
    {"kv_groups": 2, "m_tiles": 2, "block_kv": 32, "q_regs": False, "max_head_dim": 128},
    {"kv_groups": 4, "warps": 2, "block_kv": 32, "q_regs": False},
]


@pytest.mark.parametrize("op", ["attention", "sdpa"])
@pytest.mark.parametrize(
    ("family", "params"), [("fused", {})] + [("mma", p) for p in MMA_MASK_POINTS], ids=lambda v: str(v)
)
@pytest.mark.parametrize("kind", ["minus_inf", "all_minus_inf", "zero", "padding"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_attention_masks(device, compiler, op, family, params, kind, head_dim):
    # Exponents of -inf - -inf would be NaN; all-zero tiles take the mma family's softmax without the mask;
    # head_dim 48 runs its generic entry, 64 its unrolled one where max_head_dim is 64. 300 keys: whole tiles and
    # a partial one.
    spec = OPS[op]
    variant = Variant.create(op, family, "float16", {**spec.family(family).defaults("float16"), **params})
    _check_attention(device, compiler, variant, (2, 3, 300, head_dim), kind)


WGMMA_POINTS = [
    {},  # the defaults: 1 warpgroup, 128-key tiles
    {"warpgroups": 1, "block_kv": 64, "stages": 3},
    {"warpgroups": 2, "block_kv": 64, "stages": 2},
    # One K and one V slot, loads staggered: 300 keys end on a partial 64-key tile.
    {"warpgroups": 1, "block_kv": 64, "stages": 1},
    {"warpgroups": 2, "block_kv": 128, "stages": 1},
    # A tile's softmax while the last tile's P V runs: the first and last tiles take the loop's ends.
    {"warpgroups": 1, "block_kv": 64, "stages": 2, "overlap": True},
    {"warpgroups": 2, "block_kv": 128, "stages": 2, "overlap": True},
]


@pytest.mark.parametrize("op", ["attention", "sdpa"])
@pytest.mark.parametrize("params", WGMMA_POINTS, ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["random", "minus_inf", "all_minus_inf", "zero", "padding"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_wgmma(device, compiler, op, params, kind, head_dim, dtype):
    # The wgmma family (sm_90a) against float64, output poisoned: 300 keys and queries give whole key tiles, a
    # partial one and a partial query block; the mask kinds as in test_attention_masks.
    if device.info.arch != "sm_90":
        pytest.skip(f"the wgmma family needs a Hopper GPU (sm_90a); this is {device.info.name} ({device.info.arch})")
    spec = OPS[op]
    shape = (2, 3, 300, head_dim)
    fam = spec.family("wgmma")
    variant = Variant.create(op, "wgmma", dtype, {**fam.defaults(dtype), "max_head_dim": head_dim, **params})
    assert variant.check_shape(shape) is None
    _check_attention(device, compiler, variant, shape, kind)


@pytest.mark.parametrize("op", ["attention", "sdpa"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "shape",
    # The last two make 3 blocks of 64 queries an SM or more: the wgmma defaults' one-slot ring, partial tiles.
    [
        (2, 12, 128, 64),
        (1, 16, 600, 64),
        (2, 3, 140, 128),
        (1, 2, 64, 256),
        (2, 2, 30, 40),
        (4, 16, 700, 64),
        (8, 16, 300, 128),
    ],
)
def test_attention_defaults_verify(device, compiler, tmp_path, op, dtype, shape):
    # What the runtime runs untuned: the family and shape defaults its registry picks.
    from kernelmill.runtime.registry import KernelRegistry

    registry = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=compiler)
    fam, params = registry.default_choice(OPS[op], shape, dtype, {})
    variant = Variant.create(op, fam.name, dtype, params)
    ev = evaluate(variant, shape, device, compiler, seeds=2, timed=False)
    assert ev.ok, f"{variant.describe()} at {shape}: {ev.status}: {ev.reason}"


def test_planted_wrong_kernel_is_rejected(device, compiler):
    # 0.1% off on every element, in the store every path uses: far over fp32's 1e-5.
    variant = _planted("pack.v[k] = from_f32<T>(v[u][k]);", "pack.v[k] = from_f32<T>(v[u][k] * 1.001f);")
    bound = BoundVariant(device, variant, variant.compile(compiler), (64, 1000))
    result = verify(device, bound, seeds=2)
    assert not result.ok and result.status == "wrong_result"
    assert "relative error" in result.reason


@pytest.mark.parametrize(("write", "where"), [("y[(long long)rows * cols + 3]", "after y"), ("y[-1]", "before y")])
def test_a_write_just_out_of_bounds_is_rejected(device, compiler, write, where):
    # Within the allocation pool's memory, so no fault: only the guard bytes around each buffer see it.
    variant = _planted(
        "if (row >= rows) return;", f"if (row >= rows) return;\n  if (row == 0 && lane == 0) {write} = 1.0f;"
    )
    bound = BoundVariant(device, variant, variant.compile(compiler), (64, 1000))
    result = verify(device, bound, seeds=2)
    assert not result.ok and result.status == "wrong_result", result.reason
    assert f"guard bytes {where} changed" in result.reason, result.reason


def test_a_kernel_writing_to_its_input_is_rejected(device, compiler):
    # Its output is softmax of what it found in x, and it found x changed: the input check names the write.
    variant = _planted(
        "if (row >= rows) return;",
        "if (row >= rows) return;\n  if (row == 1 && lane == 0) const_cast<T*>(x)[row * cols] = from_f32<T>(7.0f);",
    )
    result = verify(device, BoundVariant(device, variant, variant.compile(compiler), (64, 1000)), seeds=2)
    assert not result.ok and result.status == "wrong_result", result.reason
    assert "wrote to its input x: 1 of its 64000 elements changed, the first at (1, 0)" in result.reason


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(37, 768), (5, 4099)])  # rows held in registers, and rows read three times
def test_a_one_pass_layernorm_variance_fails_on_offset_rows(device, compiler, dtype, shape):
    # var = E[x^2] - mean^2: right on the uniform kind of input, wrong where rows sit far from zero (the offset kind).
    base = Variant.create("layernorm", "row", dtype)
    clean = verify(device, BoundVariant(device, base, base.compile(compiler), shape), seeds=4)
    assert clean.ok and clean.allowance_used < 0.5, (clean.reason, clean.allowance_used)
    planted = PlantedVariant(base.op, base.family, base.params, base.dtype, base.attrs)
    planted.plant("? v[u][k] - mean : 0.0f;", "? v[u][k] : 0.0f;").plant("? v[k] - mean : 0.0f;", "? v[k] : 0.0f;")
    planted.plant("* inv_cols + ", "* inv_cols - mean * mean + ", count=-1)
    bound = BoundVariant(device, planted, planted.compile(compiler), shape)
    seed = random.randrange(1 << 20) * 2
    assert verify(device, bound, [seed]).ok  # the uniform kind: one pass is enough there
    offset = verify(device, bound, [seed + 1])
    assert not offset.ok and offset.status == "wrong_result", offset.reason


def test_kernel_leaving_output_unwritten_is_rejected(device, compiler):
    variant = _planted("if (row >= rows) return;", "if (row >= rows || row % 13 == 5) return;")
    bound = BoundVariant(device, variant, variant.compile(compiler), (64, 1000))
    result = verify(device, bound, seeds=2)
    assert not result.ok and result.status == "wrong_result"
    assert "non-finite" in result.reason


# Faults a 16-bit kernel can have that stay inside 1e-2 in relative norm: in float16 only the per-element
# bound (ops.base.Tolerance) catches them. (fault: op, family, shape, or shapes by dtype, plant point, planted.)
SUBTLE_FAULTS = {
    # Probabilities under 1e-5 written as 0 (a "fast" softmax skipping small exps).
    "flushed_softmax": (
        "softmax", "warp_row", (64, 1000),
        "pack.v[k] = from_f32<T>(v[u][k]);", "pack.v[k] = from_f32<T>(v[u][k] < 1e-5f ? 0.0f : v[u][k]);",
    ),
    # Products summed in the storage type instead of float32.
    "16bit_accumulation": (
        "matmul", "simt", (64, 256, 512),
        "acc[i][j] = fmaf(a[i], b[j], acc[i][j]);",
        "acc[i][j] = to_f32(from_f32<T>(fmaf(a[i], b[j], acc[i][j])));",
    ),
    # The last term of every dot product left out: one of 16384 (in bfloat16 that took 0.72 of an allowance
    # of 8 roundoffs of the rms, seen on an H200; matmul rounds nothing inside, so it is allowed 1 now).
    "dropped_last_k": (
        "matmul", "simt", (64, 256, 16384),
        "return {begin, min(K, begin + per_slice)};", "return {begin, min(K - 1, begin + per_slice)};",
    ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fault", sorted(SUBTLE_FAULTS))
def test_subtle_16bit_faults_fail_per_element(device, compiler, fault, dtype):
    op, family, shape, old, new = SUBTLE_FAULTS[fault]
    shape = shape[dtype] if isinstance(shape, dict) else shape
    base = Variant.create(op, family, dtype)
    clean = verify(device, BoundVariant(device, base, base.compile(compiler), shape), seeds=2)
    assert clean.ok, f"the unplanted {base.describe()} at {shape}: {clean.reason}"
    assert clean.allowance_used < 0.6, clean.allowance_used  # float16 subnormals take 0.5: half a step
    planted = PlantedVariant(base.op, base.family, base.params, base.dtype, base.attrs).plant(old, new)
    result = verify(device, BoundVariant(device, planted, planted.compile(compiler), shape), seeds=2)
    assert not result.ok and result.status == "wrong_result", result
    if dtype == "float16":  # bfloat16's coarser rounding can push these past the norm as well
        assert all(c.rel_err <= c.tolerance.norm for c in result.checks), result.checks
        assert "the error allowed there" in result.reason, result.reason
