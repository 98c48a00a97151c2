import pytest

from kernelmill.kernels.compile import (
    CompileError,
    arch_flags,
    base_arch,
    normalize_arch,
    parse_ptxas,
    too_old,
    unknown_gpu,
)

LOG = (
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'gemm_main' for 'sm_90a'\n"
    "ptxas info    : Function properties for gemm_main\n"
    "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem\n"
    "ptxas info    : Compiling entry function 'reduce' for 'sm_90a'\n"
    "ptxas info    : Function properties for reduce\n"
    "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 20 registers, used 0 barriers\n"
)


def test_parse_ptxas_per_entry():
    report = parse_ptxas(LOG)
    assert set(report) == {"gemm_main", "reduce"}
    main = report["gemm_main"]
    assert (main.registers, main.smem_bytes, main.barriers) == (168, 1024, 1)
    assert (main.stack_bytes, main.spill_stores_bytes, main.spill_loads_bytes) == (16, 8, 12)
    assert report["reduce"].registers == 20 and report["reduce"].smem_bytes == 0


@pytest.mark.parametrize(
    ("given", "want"),
    [
        *[(None, "sm_90"), ("90", "sm_90"), ("sm_90a", "sm_90a"), ("9.0", "sm_90"), ("compute_80", "sm_80")],
        *[("sm_090", "sm_90"), ("0090a", "sm_90a"), ("09.0", "sm_90"), ("sm_0", "sm_0")],  # no worker had sm_090
    ],
)
def test_normalize_arch(given, want):
    assert normalize_arch(given) == want


@pytest.mark.parametrize(("given", "want"), [("sm_90a", "sm_90"), ("sm_100f", "sm_100"), ("sm_80", "sm_80")])
def test_base_arch_drops_the_target_suffix(given, want):
    assert base_arch(given) == want


def test_too_old_judges_the_base_arch():
    assert too_old("sm_90a") is None and too_old("sm_80") is None
    assert "sm_80 or newer, not sm_75" in too_old("sm_75")
    assert unknown_gpu("sm_100f") is None and unknown_gpu("sm_121") is None and unknown_gpu("sm_90a") is None
    assert "sm_999 is not a GPU nvcc targets" in unknown_gpu("sm_999") and too_old("sm_999") is None


def test_an_arch_of_thousands_of_digits_is_no_gpu_and_named_short():
    """int() raised on over 4300 digits: the API answered 500, the CLI printed Python's limit message."""
    arch = "sm_" + "1" * 5000
    assert too_old(arch) is None
    assert unknown_gpu(arch).startswith("sm_1111111111111... (5003 characters) is not a GPU nvcc targets; known:")
    assert unknown_gpu("sm_" + "0" * 5000 + "90") is None  # leading zeros are no size


def test_normalize_arch_rejects_garbage():
    with pytest.raises(ValueError, match="malformed arch"):
        normalize_arch("hopper")


def test_arch_specific_targets_use_gencode():
    assert arch_flags("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]


def test_compile_error_carries_log():
    err = CompileError("nvcc failed (exit 1)", "kernel.cu(3): error: expected a ';'")
    assert err.log.startswith("kernel.cu(3)")
    assert "expected a ';'" in str(err)
