"""Every family renders and compiles for sm_90 at several parameter points (needs nvcc; runs in CI)."""

import random

import pytest

from kernelmill.kernels.compile import CompileError, Compiler
from kernelmill.kernels.ops import OPS
from kernelmill.kernels.variant import Variant

pytestmark = pytest.mark.nvcc

CASES = [(op.name, fam.name, dtype) for op in OPS.values() for fam in op.families.values() for dtype in fam.dtypes]


def sample_points(fam, dtype, n_random=2):
    """Defaults, the first and last valid points, and a few seeded random ones."""
    space = list(fam.space(dtype))
    rng = random.Random(f"{fam.name}-{dtype}")
    picks = [fam.defaults(dtype), space[0], space[-1], *rng.sample(space, min(n_random, len(space)))]
    unique = []
    for p in picks:
        if p not in unique:
            unique.append(p)
    return unique


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return Compiler(cache_dir=tmp_path_factory.mktemp("cubins"))


@pytest.mark.parametrize(("op", "family", "dtype"), CASES)
def test_family_compiles_at_several_points(compiler, op, family, dtype):
    fam = OPS[op].family(family)
    for i, params in enumerate(sample_points(fam, dtype)):
        variant = Variant.create(op, family, dtype, params)
        compiled = variant.compile(compiler, "sm_90" + fam.arch_suffix)
        launches = fam.launches(tuple(257 for _ in OPS[op].dims), variant.params, dtype)
        for launch in launches:
            assert launch.entry in compiled.resources, f"{launch.entry} missing from the cubin"
            res = compiled.resources[launch.entry]
            assert res.registers * launch.threads <= 65536, f"{launch.entry}: registers exceed the SM"
        if i == 0:  # the defaults are what users get first: they must not spill
            assert not compiled.spills, compiled.report()


def test_planted_syntax_error_gives_compile_error_with_log(compiler):
    source = Variant.create("softmax", "warp_row", "float16").source
    broken = source.replace("const int warp = threadIdx.x >> 5", "const int warp = threadIdx.x >> 5 +", 1)
    assert broken != source
    with pytest.raises(CompileError) as info:
        compiler.compile(broken, "sm_90")
    assert "error" in info.value.log and "kernel.cu" in info.value.log


def test_a_source_nvcc_refused_is_not_compiled_again_by_that_compiler(tmp_path, monkeypatch):
    """The evaluator compiles a batch in parallel, then each variant: a failing one ran nvcc twice (a timeout
    took its 120 s twice)."""
    import subprocess

    compiler = Compiler(cache_dir=tmp_path)
    broken = Variant.create("softmax", "warp_row", "float16").source + "\nthis is not C++;\n"
    runs = []
    real_popen = subprocess.Popen

    def counting(cmd, *args, **kwargs):
        if "-cubin" in cmd:
            runs.append(cmd)
        return real_popen(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", counting)
    (first,) = compiler.compile_many([broken], "sm_90")
    assert isinstance(first, CompileError)
    with pytest.raises(CompileError) as again:
        compiler.compile(broken, "sm_90")
    assert again.value is first and len(runs) == 1
    assert len(Compiler(cache_dir=tmp_path).compile_many([broken], "sm_90")) == 1 and len(runs) == 2  # per compiler


def test_a_variant_with_no_target_on_the_gpu_is_evaluated_unsupported(compiler):
    from kernelmill.kernels.evaluate import UNSUPPORTED, evaluate

    variant = Variant.create("matmul", "wgmma", "float16")
    ev = evaluate(variant, (256, 256, 256), device=None, compiler=compiler, arch="sm_80")
    assert ev.status == UNSUPPORTED and "runs on sm_90 only, not sm_80" in ev.reason


@pytest.mark.parametrize("swap_ab", [False, True])
def test_wgmma_staged_row_stride_is_tied_to_the_python_formula(compiler, swap_ab):
    # WgmmaFamily.staged_row_floats sizes the staged fp32 tile that check() fits into the ring; the kernel has
    # its own constexpr. A template told a different stride must not compile.
    params = {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 0, "k_splits": 2, "swap_ab": swap_ab}
    source = Variant.create("linear", "wgmma", "float16", params).source
    stride = OPS["linear"].family("wgmma").staged_row_floats(params)
    assert f"== {stride},\n" in source
    compiler.compile(source, "sm_90a")
    with pytest.raises(CompileError) as info:
        compiler.compile(source.replace(f"== {stride},\n", f"== {stride + 4},\n", 1), "sm_90a")
    assert "staged-tile row stride differs" in info.value.log


@pytest.mark.parametrize(
    ("op", "params"),
    [
        ("matmul", {"BM": 128, "BN": 256, "stages": 4, "ctas": 128}),  # two rounds of 128 columns a tile
        ("linear", {"BM": 128, "BN": 192, "stages": 4, "ctas": 132}),  # the whole C tile at once
        ("linear_t", {"BM": 256, "BN": 128, "stages": 3, "ctas": 128}),  # two m64 rows a consumer, K-major B
        ("fused_mlp", {"BM": 64, "BN": 64, "consumers": 1, "stages": 6, "ctas": 0}),  # one consumer, a block per tile
    ],
)
def test_wgmma_tma_store_compiles_to_bulk_tensor_stores(compiler, op, params):
    # tma_store: C leaves through a shared tile by TMA stores. The kernel must size that tile as the Python side
    # does (the static_assert on the shared-memory size) and must not spill.
    params = {"consumers": 2, **params, "tma_store": True}
    variant = Variant.create(op, "wgmma", "float16", params, {"act": "gelu_erf"} if op != "matmul" else {})
    assert "const __grid_constant__ KmTensorMap tma_c" in variant.source
    compiled = variant.compile(compiler, "sm_90a")
    assert not compiled.spills, compiled.report()
    assert all(res.registers <= 168 for res in compiled.resources.values())
    fam = OPS[op].family("wgmma")
    assert f"== {fam.smem_bytes(variant.params, 'float16')}, " in variant.source


@pytest.mark.parametrize(
    ("op", "params"),
    [
        ("linear", {"BM": 128, "BN": 256, "stages": 4, "tma_store": True}),  # the last part stores by TMA
        ("matmul", {"BM": 128, "BN": 128, "stages": 5}),  # ... or from registers
        ("fused_mlp", {"BM": 64, "BN": 64, "consumers": 1, "stages": 6, "tma_store": True}),  # one consumer
    ],
)
def test_wgmma_sk_tail_compiles_without_spills(compiler, op, params):
    # sk_tail: the fp32 parts of a cut tile go through the workspace and the last block to arrive adds them; the
    # kernel takes ws and flags after C (and the bias) and needs no zeroing launch.
    params = {"consumers": 2, "ctas": 132, **params, "sk_tail": True}
    variant = Variant.create(op, "wgmma", "float16", params, {"act": "gelu_erf"} if op != "matmul" else {})
    assert "float* __restrict__ ws, int* __restrict__ flags" in variant.source and "_zero(" not in variant.source
    compiled = variant.compile(compiler, "sm_90a")
    assert not compiled.spills, compiled.report()
    assert all(res.registers <= 168 for res in compiled.resources.values())


def test_second_compile_hits_the_cache(tmp_path):
    compiler = Compiler(cache_dir=tmp_path)
    source = Variant.create("softmax", "block_row", "float32", {"threads": 128}).source
    first = compiler.compile(source, "sm_90")
    second = compiler.compile(source, "sm_90")
    assert not first.cached and second.cached
    assert first.cubin == second.cubin and first.key == second.key
    assert second.resources == first.resources
    other_arch = compiler.compile(source, "sm_80")
    assert other_arch.key != first.key and not other_arch.cached


def test_compile_many_returns_failures_as_values(tmp_path):
    compiler = Compiler(cache_dir=tmp_path)
    good = Variant.create("softmax", "warp_row", "float32").source
    results = compiler.compile_many([good, good + "\n#error planted\n"], "sm_90", workers=2)
    assert not isinstance(results[0], CompileError)
    assert isinstance(results[1], CompileError) and "planted" in results[1].log
