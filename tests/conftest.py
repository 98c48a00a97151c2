"""Markers say what a test needs; a machine without it skips with the reason.

CI sets KERNELMILL_REQUIRE_NVCC=1 so that compile tests fail rather than skip
when nvcc is missing there; a GPU run (benchmarks/device_check.sh) sets
KERNELMILL_REQUIRE_GPU=1, so that a host whose pycuda or driver is broken fails
instead of reporting every GPU test skipped. KERNELMILL_REQUIRE_MODULES (comma-separated; CI names torch,
transformers and schemathesis, a GPU run cuda.bindings and torch too) fails the session where one of them
does not import, so the tests that ``pytest.importorskip`` it cannot all skip unseen.
"""

from __future__ import annotations

import os
import shutil

import pytest


def _gpu_reason() -> str | None:
    from kernelmill.kernels.device import gpu_available

    ok, why = gpu_available()
    return None if ok else why


def pytest_sessionstart(session):
    import importlib

    for name in filter(None, os.environ.get("KERNELMILL_REQUIRE_MODULES", "").split(",")):
        try:
            importlib.import_module(name.strip())
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install's own error
            raise pytest.UsageError(
                f"KERNELMILL_REQUIRE_MODULES names {name.strip()}, which does not import here: {exc}"
            ) from None


def pytest_collection_modifyitems(config, items):
    need_gpu = any("gpu" in item.keywords for item in items)
    gpu_reason = _gpu_reason() if need_gpu else None
    if gpu_reason and os.environ.get("KERNELMILL_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"KERNELMILL_REQUIRE_GPU=1 but the GPU tests cannot run here: {gpu_reason}")
    nvcc_missing = shutil.which(os.environ.get("KERNELMILL_NVCC", "nvcc")) is None
    if nvcc_missing and os.environ.get("KERNELMILL_REQUIRE_NVCC") == "1":
        raise pytest.UsageError("KERNELMILL_REQUIRE_NVCC=1 but nvcc is not on PATH: compile tests cannot run")
    for item in items:
        if "gpu" in item.keywords and gpu_reason:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {gpu_reason}"))
        if ("nvcc" in item.keywords or "gpu" in item.keywords) and nvcc_missing:
            item.add_marker(pytest.mark.skip(reason="needs nvcc on PATH"))


@pytest.fixture(autouse=True)
def _isolated_settings(tmp_path_factory, monkeypatch):
    """Each test session compiles into its own cache unless a test overrides it."""
    from kernelmill import settings

    cache = tmp_path_factory.getbasetemp() / "kernel-cache"
    monkeypatch.setenv("KERNELMILL_CACHE_DIR", str(cache))
    settings.reset_settings()
    yield
    settings.reset_settings()
