"""nvcc builds one source to the same bytes wherever the compile cache is (needs nvcc; runs in CI): the runtime's
first-use records are keyed by the cubin, and a rebuilt or pruned cache entry used to come back as other bytes
because -lineinfo wrote nvcc's random temp folder into it."""

import pytest

from kernelmill.kernels.compile import Compiler
from kernelmill.kernels.variant import Variant

pytestmark = pytest.mark.nvcc


def test_a_source_builds_to_the_same_bytes_in_two_caches(tmp_path):
    source = Variant.create("softmax", "warp_row", "float16").source
    first = Compiler(cache_dir=tmp_path / "one").compile(source, "sm_90")
    second = Compiler(cache_dir=tmp_path / "two").compile(source, "sm_90")
    assert not first.cached and not second.cached
    assert first.cubin == second.cubin
    assert b"kernelmill-nvcc-" + first.key[:32].encode() in first.cubin  # the folder it names: the key's
