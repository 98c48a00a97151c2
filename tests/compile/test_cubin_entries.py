"""kernels.compile.cubin_entries reads a cubin's kernel entries from its ELF symbol table (needs nvcc; runs in CI),
and the runtime's registry refuses a served or cached cubin that lacks an entry its family now launches."""

import json
import logging

import pytest

from kernelmill.kernels.compile import Compiler, cubin_entries
from kernelmill.kernels.ops import OPS
from kernelmill.kernels.variant import Variant
from kernelmill.runtime.registry import DEFAULT, KernelRegistry, _file_stem

pytestmark = pytest.mark.nvcc

PROBLEM = ("sdpa", (2, 4, 256, 64), "float16")  # head_dim == max_head_dim: the attention_mma_full entry


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return Compiler(cache_dir=tmp_path_factory.mktemp("cubins"))


def _cubin(compiler, rename: str | None = None) -> bytes:
    """The sdpa mma default's cubin; with `rename`, its full entry renamed as a kernel built before that
    entry existed would lack it."""
    variant = Variant.create("sdpa", "mma", "float16")
    source = variant.source
    if rename:
        assert "attention_mma_full(" in source
        source = source.replace("attention_mma_full(", f"{rename}(")
    return compiler.compile(source, "sm_90").cubin


def test_entries_match_what_ptxas_reports(compiler):
    for op in ("sdpa", "softmax", "linear"):
        spec = OPS[op]
        for fam in spec.families.values():
            dtype = "float16" if "float16" in fam.dtypes else fam.dtypes[0]
            compiled = Variant.create(op, fam.name, dtype).compile(compiler, "sm_90" + fam.arch_suffix)
            assert cubin_entries(compiled.cubin) == frozenset(compiled.resources), (op, fam.name)
    assert cubin_entries(_cubin(compiler)) == {"attention_mma", "attention_mma_full"}


def test_what_is_not_an_elf_or_does_not_parse():
    assert cubin_entries(b"served-cubin") is None
    assert cubin_entries(b"\x7fELF\x02\x01" + bytes(10)) == frozenset()


def _served(cubin_id: int, exact: bool) -> dict:
    params = OPS["sdpa"].family("mma").defaults("float16")
    return {
        "id": cubin_id,
        "op": "sdpa",
        "shape": list(PROBLEM[1]) if exact else [2, 4, 512, 64],
        "dtype": "float16",
        "arch": "sm_90",
        "attrs": {},
        "family": "mma",
        "params": params,
        "launches": [],
        "workspace": {},
        "median_ms": 0.01,
        "speedup": 2.0,
        "exact": exact,
    }


@pytest.mark.parametrize("exact", [True, False])
def test_a_served_cubin_without_the_entry_is_not_used(compiler, tmp_path, caplog, exact):
    import httpx

    old = _cubin(compiler, rename="attention_mma_old")
    kernel = _served(11, exact)

    def handler(request):
        if request.url.path != "/api/kernels/best":
            return httpx.Response(200, content=old)
        if request.url.params.get("arch") != "sm_90":
            return httpx.Response(404, json={"detail": "none"})
        return httpx.Response(200, json=kernel)

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=compiler)
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.registry"):
        entry = reg.get(*PROBLEM)
    # The default instead: on sm_90 at head_dim 64 the wgmma family's.
    assert entry.source == DEFAULT and "attention_wgmma" in cubin_entries(entry.cubin)
    assert "served kernel #11 not used: its cubin has no attention_mma_full" in entry.note
    assert "built before this version's launches of mma" in caplog.text


def test_a_cached_cubin_without_the_entry_is_not_used(compiler, tmp_path):
    # A local cache entry written by an earlier version (offline: no service to replace it).
    folder = tmp_path / "served" / "sdpa"
    folder.mkdir(parents=True)
    stem = _file_stem(PROBLEM[1], "float16", "sm_90", {})
    meta = {"family": "mma", "params": OPS["sdpa"].family("mma").defaults("float16"), "source": "tuned"}
    meta.update(served_shape=list(PROBLEM[1]), arch="sm_90", attrs={}, kernel_id=5, speedup=2.0, median_ms=0.01)
    (folder / f"{stem}.json").write_text(json.dumps(meta))
    (folder / f"{stem}.cubin").write_bytes(_cubin(compiler, rename="attention_mma_old"))
    reg = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=compiler)
    entry = reg.get(*PROBLEM)
    assert entry.source == DEFAULT
    assert "local cache entry unusable: its cubin has no attention_mma_full" in entry.note
    # The same entry with a cubin that has it is used.
    (folder / f"{stem}.cubin").write_bytes(_cubin(compiler))
    fresh = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=compiler)
    assert fresh.get(*PROBLEM).source == "tuned"
