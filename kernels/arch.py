"""What GPU is here, without holding a context: the default compile target and a readable reason when none."""

from __future__ import annotations

from kernelmill.kernels.compile import DEFAULT_ARCH


def local_arch(ordinal: int = 0) -> tuple[str | None, str]:
    """(``"sm_90"``, device name) for the local GPU, or (None, why there is none)."""
    try:
        import pycuda.driver as cuda
    except ImportError:
        return None, "pycuda is not installed (pip install 'kernelmill[gpu]')"
    try:
        cuda.init()
        if cuda.Device.count() <= ordinal:
            return None, "no CUDA device is visible"
        dev = cuda.Device(ordinal)
        major, minor = dev.compute_capability()
        return f"sm_{major}{minor}", dev.name()
    except cuda.Error as exc:
        return None, f"CUDA driver unavailable: {exc}"


def default_arch() -> str:
    """The local GPU's arch, else sm_90."""
    arch, _ = local_arch()
    return arch or DEFAULT_ARCH
