from types import SimpleNamespace

import pytest

from kernelmill.cli import _bench_report
from kernelmill.kernels.bench import Timing, allow_tf32
from kernelmill.kernels.ops import get_op


def test_allow_tf32_sets_pytorchs_matmul_precision_for_the_block_only():
    torch = pytest.importorskip("torch")
    before = torch.get_float32_matmul_precision()
    with allow_tf32(torch, True):
        assert torch.get_float32_matmul_precision() == "high"  # TF32 allowed
    with allow_tf32(torch, False):
        assert torch.get_float32_matmul_precision() == "highest"  # IEEE float32
    assert torch.get_float32_matmul_precision() == before


def _row(family, precision, ms):
    variant = SimpleNamespace(describe=lambda: family, family=SimpleNamespace(name=family), params={},
                              precision=precision)  # fmt: skip
    verification = SimpleNamespace(precision=precision, per_seed=lambda: {1: 1e-4})
    return SimpleNamespace(variant=variant, status="ok", reason=None, verification=verification,
                           timing=Timing.from_samples([ms] * 3))  # fmt: skip


def test_bench_compares_each_variant_with_pytorch_in_its_own_precision():
    spec = get_op("matmul")
    ceil = SimpleNamespace(copy_gbps=3000.0, matrix_tflops={"float32": 50.0})
    rows = [_row("simt", "float32", 2.0), _row("tensorcore", "tf32", 1.0)]
    torch = {"float32": Timing.from_samples([3.0] * 3), "tf32": Timing.from_samples([0.5] * 3)}
    report = _bench_report(spec, (512, 512, 512), "float32", "GPU", ceil, 0.1, rows, torch)
    speedups = {v["family"]: v["speedup_vs_torch"] for v in report["variants"]}
    assert speedups == {"simt": pytest.approx(1.5), "tensorcore": pytest.approx(0.5)}  # not 3.0 against IEEE
    assert report["torch"]["median_ms"] == 3.0 and set(report["torch_by_precision"]) == {"float32", "tf32"}
