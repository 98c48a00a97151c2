"""NVTX ranges around the runtime's GPU ops, for Nsight Systems (``kernelmill profile-forward``).

Off unless asked for (``KERNELMILL_NVTX=1``, or ``enable()``): then ``active()`` is one global read
and ops pay nothing else. When on, each op call pushes one range named after its problem, e.g.
``linear 16x11008x4096 float16 act=gelu_erf``, around the launches it enqueues. Ranges go through

1. the ``nvtx`` package (``pip install 'kernelmill[profile]'``), in the ``kernelmill`` domain;
2. else ``libnvToolsExt`` through ctypes, where one is found (CUDA 11 and older ship it);
3. else nowhere: one log line says why.

Under CUDA-graph replay no Python runs per op, so per-op ranges exist only in the plain-launch path
(warm-up and capture); ``profile-forward`` therefore runs plain launches unless told ``--graphs``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol

from kernelmill.kernels.ops.base import format_shape

log = logging.getLogger(__name__)

DOMAIN = "kernelmill"


class RangeMarker(Protocol):
    """Where ranges go: one NVTX implementation."""

    name: str

    def push(self, message: str) -> None:
        """Open a range named ``message`` on this thread."""

    def pop(self) -> None:
        """Close the innermost range of this thread."""


class NvtxPackage:
    """The ``nvtx`` PyPI package (NVTX 3 compiled in; nsys injects itself through the environment)."""

    name = "nvtx"

    def __init__(self, module: Any) -> None:
        self._domain = module.get_domain(DOMAIN)
        self._attributes: dict[str, Any] = {}

    def push(self, message: str) -> None:
        attributes = self._attributes.get(message)
        if attributes is None:  # built once per name: the per-call cost stays a C call
            attributes = self._attributes[message] = self._domain.get_event_attributes(message=message)
        self._domain.push_range(attributes)

    def pop(self) -> None:
        self._domain.pop_range()


class LibNvToolsExt:
    """``nvtxRangePushA`` / ``nvtxRangePop`` of a libnvToolsExt shared library (no domain)."""

    name = "libnvToolsExt"

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        lib.nvtxRangePushA.argtypes = [ctypes.c_char_p]
        lib.nvtxRangePushA.restype = ctypes.c_int
        lib.nvtxRangePop.restype = ctypes.c_int
        self._lib, self.path = lib, path

    def push(self, message: str) -> None:
        self._lib.nvtxRangePushA(message.encode())

    def pop(self) -> None:
        self._lib.nvtxRangePop()


def find_libnvtoolsext() -> str | None:
    """A loadable libnvToolsExt, or None (CUDA 12 and later ship NVTX as headers only)."""
    candidates = [ctypes.util.find_library("nvToolsExt")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates += [os.path.join(root, sub, "libnvToolsExt.so.1") for sub in ("lib64", "lib")]
    for path in candidates:
        if not path:
            continue
        try:
            ctypes.CDLL(path)
        except OSError:
            continue
        return path
    return None


def make_marker() -> RangeMarker | None:
    """The best available marker, or None with one log line saying why."""
    try:
        import nvtx
    except ImportError:
        nvtx = None
    if nvtx is not None:
        return NvtxPackage(nvtx)
    path = find_libnvtoolsext()
    if path is not None:
        return LibNvToolsExt(path)
    log.warning(
        "runtime: NVTX ranges were asked for but neither the nvtx package nor libnvToolsExt is here "
        "(pip install 'kernelmill[profile]'); profiling without per-op ranges"
    )
    return None


_UNRESOLVED: Any = object()
_marker: RangeMarker | None = _UNRESOLVED


def active() -> RangeMarker | None:
    """The marker ops push their ranges to, or None when ranges are off (the default)."""
    global _marker
    if _marker is _UNRESOLVED:
        from kernelmill.settings import get_settings

        _marker = make_marker() if get_settings().nvtx else None
    return _marker


def enable(on: bool = True) -> RangeMarker | None:
    """Turn ranges on (or off) in this process regardless of the settings; returns the marker."""
    global _marker
    _marker = make_marker() if on else None
    return _marker


def reset() -> None:
    """Forget the decision: the next ``active()`` reads the settings again."""
    global _marker
    _marker = _UNRESOLVED


@contextlib.contextmanager
def nvtx_range(message: str) -> Iterator[None]:
    """One range around the block where ranges are on; nothing otherwise."""
    marker = active()
    if marker is None:
        yield
        return
    marker.push(message)
    try:
        yield
    finally:
        marker.pop()


def op_range_name(op: str, shape: tuple[int, ...], dtype: str, attrs: dict[str, Any]) -> str:
    """``linear 16x11008x4096 float16 act=gelu_erf``: the op's problem, as the tuner names it."""
    extra = "".join(f" {k}={v}" for k, v in sorted(attrs.items()))
    return f"{op} {format_shape(shape)} {dtype}{extra}"
