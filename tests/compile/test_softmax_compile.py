"""softmax's long-row variants (issue 8) compile for sm_90 without spills and fit an SM (needs nvcc; runs in CI)."""

import pytest

from kernelmill.kernels.compile import Compiler
from kernelmill.kernels.ops.softmax import SOFTMAX
from kernelmill.kernels.variant import Variant

pytestmark = pytest.mark.nvcc

#: Shapes whose launches must fit: odd column counts, one element, long and odd rows, the issue-8 cases.
SHAPES = [(3, 17), (1, 1), (5, 33333), (2, 32000), (1, 32000), (4096, 32000), (8192, 8192), (32768, 1024)]
#: Dynamic plus static shared memory one block may have on sm_90.
SM90_SMEM_OPTIN = 227 * 1024


def long_row_points(dtype: str) -> list[tuple[str, dict]]:
    """The points meant for 4096x32000 and 1x32000 (registers, shared memory, clusters of 2 to 8)."""
    vec = 4 if dtype == "float32" else 8
    fast = {"fast_exp": dtype != "float32"}
    return [
        ("smem_row", {"vec": vec, "unroll": 16 // vec, "threads": 512, "cluster": 1, **fast}),
        ("smem_row", {"vec": vec, "unroll": 16 // vec, "threads": 256, "cluster": 2, **fast}),
        ("smem_row", {"vec": vec, "unroll": max(1, 8 // vec), "threads": 1024, "cluster": 1, **fast}),
        ("smem_row", {"vec": vec, "unroll": 32 // vec, "threads": 128, "cluster": 8, **fast}),
        ("smem_row", {"vec": 1, "unroll": 16, "threads": 256, "cluster": 4, **fast}),
        ("cluster_row", {"vec": vec, "unroll": 32 // vec, "threads": 256, "cluster": 4, **fast}),
        ("cluster_row", {"vec": vec, "unroll": 32 // vec, "threads": 512, "cluster": 2, **fast}),
        ("cluster_row", {"vec": vec, "unroll": 32 // vec, "threads": 128, "cluster": 8, **fast}),
        ("cluster_row", {"vec": vec, "unroll": 64 // vec, "threads": 128, "cluster": 4, **fast}),
        ("cluster_row", {"vec": 1, "unroll": 8, "threads": 256, "cluster": 8, **fast}),
        ("block_row", {"vec": vec, "unroll": 32 // vec, "threads": 1024, **fast}),
    ]


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return Compiler(cache_dir=tmp_path_factory.mktemp("softmax-cubins"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # bf16: the generic compile test samples it
def test_long_row_variants_compile_without_spills_and_fit(compiler, dtype):
    for family, params in long_row_points(dtype):
        fam = SOFTMAX.family(family)
        assert fam.check(params, dtype) is None, (family, params)
        compiled = Variant.create("softmax", family, dtype, params).compile(compiler, "sm_90")
        assert not compiled.spills, (family, params, compiled.report())
        for shape in SHAPES:
            if fam.check_shape(shape, params, dtype):
                assert family == "smem_row" and params["cluster"] == 1, (family, params, shape)
                continue
            for launch in fam.launches(shape, params, dtype):
                res = compiled.resources[launch.entry]
                assert res.registers * launch.threads <= 65536, (family, params)
                assert res.stack_bytes == 0, (family, params, res)
                assert launch.smem_bytes + res.smem_bytes <= SM90_SMEM_OPTIN, (family, params, shape)
                if fam.cluster(params) > 1:
                    assert launch.grid[0] % fam.cluster(params) == 0  # whole clusters


def test_cluster_and_cp_async_code_is_there():
    """Clusters read their partners' stats through distributed shared memory; smem_row's loads are cp.async."""
    import re

    for family, params in long_row_points("float16"):
        source = Variant.create("softmax", family, "float16", params).source
        if family == "smem_row":
            assert "cp.async.cg.shared.global" in source and "cp.async.wait_group" in source
        if SOFTMAX.family(family).cluster(params) > 1:
            assert re.search(r"__cluster_dims__\(KM_CS, 1, 1\)", source) and "map_shared_rank" in source
