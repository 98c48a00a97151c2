"""The GPU through pycuda: context, pooled memory, cubin loading, prepared launches, events.

pycuda is imported lazily (an optional extra), so everything else imports on a
machine without CUDA. Driver errors are wrapped once here: code above sees
``GpuUnavailable`` or ``DeviceFault`` (with ``poisoned`` telling whether the
CUDA context is now unusable, as after an illegal address).
"""

from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_INSTALL_HINT = "install the gpu extra: pip install 'kernelmill[gpu]' (needs the CUDA driver)"

#: Driver errors after which the context is unusable (every later call fails).
_STICKY_ERRORS = (
    "illegal memory access",
    "illegal address",
    "misaligned address",
    "illegal instruction",
    "unspecified launch failure",
    "launch failed",
    "hardware stack error",
    "launch timed out",
    "invalid program counter",
    "exception on sm",
    "an illegal",
)


class GpuUnavailable(RuntimeError):
    """No usable GPU here: pycuda missing, no driver or no device."""


class DeviceFault(RuntimeError):
    """A launch or a copy failed on the device; ``poisoned``: the context must be thrown away."""

    def __init__(self, reason: str, poisoned: bool, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.poisoned = poisoned
        self.timed_out = timed_out


def _pycuda():
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        raise GpuUnavailable(f"pycuda is not installed ({exc}); {_INSTALL_HINT}") from None
    return cuda


def _fault(exc: Exception, what: str) -> DeviceFault:
    text = str(exc)
    poisoned = any(s in text.lower() for s in _STICKY_ERRORS)
    return DeviceFault(f"{what}: {text}", poisoned)


@dataclass(frozen=True)
class DeviceInfo:
    """deviceQuery-like facts about one GPU."""

    ordinal: int
    name: str
    arch: str  # "sm_90"
    sm_count: int
    l2_bytes: int
    smem_per_block_optin_bytes: int
    total_mem_bytes: int
    clock_khz: int
    mem_clock_khz: int
    mem_bus_bits: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Buffer:
    """Device memory from the pool; ``ptr`` is the raw device address."""

    allocation: Any
    nbytes: int

    @property
    def ptr(self) -> int:
        return int(self.allocation)


class Kernel:
    """One entry function of a loaded module, prepared per argument signature."""

    def __init__(self, device: Device, function: Any, name: str) -> None:
        self._device = device
        self._function = function
        self.name = name
        self._signature: str | None = None
        self._smem_limit = 48 * 1024

    def launch(self, grid, block, smem_bytes: int, args: list[int | Buffer], stream: Any = None) -> None:
        """Enqueue one launch; ints are int32 scalars, Buffers are pointers."""
        cuda = self._device.cuda
        signature = "".join("P" if isinstance(a, Buffer) else "i" for a in args)
        try:
            if signature != self._signature:
                self._function.prepare(signature)
                self._signature = signature
            if smem_bytes > self._smem_limit:
                self._function.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes)
                self._smem_limit = smem_bytes
            values = [a.ptr if isinstance(a, Buffer) else int(a) for a in args]
            self._function.prepared_async_call(tuple(grid), tuple(block), stream, *values, shared_size=smem_bytes)
        except cuda.Error as exc:
            where = f"launch of {self.name} grid={tuple(grid)} block={tuple(block)} smem={smem_bytes}"
            raise self._device._raise(exc, where) from None


class Module:
    def __init__(self, device: Device, module: Any) -> None:
        self._device = device
        self._module = module
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, entry: str) -> Kernel:
        if entry not in self._kernels:
            try:
                fn = self._module.get_function(entry)
            except self._device.cuda.Error as exc:
                raise _fault(exc, f"no entry {entry!r} in the module") from None
            self._kernels[entry] = Kernel(self._device, fn, entry)
        return self._kernels[entry]


class Device:
    """One GPU's primary context (shared with PyTorch in the same process)."""

    def __init__(self, ordinal: int = 0) -> None:
        cuda = _pycuda()
        try:
            cuda.init()
            count = cuda.Device.count()
        except cuda.Error as exc:
            raise GpuUnavailable(f"CUDA driver unavailable: {exc}") from None
        if count == 0:
            raise GpuUnavailable("no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)")
        if ordinal >= count:
            raise GpuUnavailable(f"device {ordinal} requested but only {count} visible")
        self.cuda = cuda
        self.ordinal = ordinal
        self._dev = cuda.Device(ordinal)
        # The primary context is the one PyTorch uses: baselines and our kernels share it.
        self._ctx = self._dev.retain_primary_context()
        self._ctx.push()
        from pycuda.tools import DeviceMemoryPool

        self._pool = DeviceMemoryPool()
        self._modules: dict[str, Module] = {}
        self.poisoned = False
        atexit.register(self.close)

    # -- facts -------------------------------------------------------------------

    @cached_property
    def info(self) -> DeviceInfo:
        attrs = self._dev.get_attributes()
        a = self.cuda.device_attribute
        major, minor = self._dev.compute_capability()
        return DeviceInfo(
            ordinal=self.ordinal,
            name=self._dev.name(),
            arch=f"sm_{major}{minor}",
            sm_count=attrs[a.MULTIPROCESSOR_COUNT],
            l2_bytes=attrs[a.L2_CACHE_SIZE],
            smem_per_block_optin_bytes=attrs[a.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN],
            total_mem_bytes=self._dev.total_memory(),
            clock_khz=attrs[a.CLOCK_RATE],
            mem_clock_khz=attrs[a.MEMORY_CLOCK_RATE],
            mem_bus_bits=attrs[a.GLOBAL_MEMORY_BUS_WIDTH],
        )

    # -- memory ------------------------------------------------------------------

    def alloc(self, nbytes: int) -> Buffer:
        try:
            return Buffer(self._pool.allocate(max(int(nbytes), 1)), int(nbytes))
        except self.cuda.Error as exc:
            raise self._raise(exc, f"allocating {nbytes} bytes") from None

    def upload(self, array: np.ndarray) -> Buffer:
        array = np.ascontiguousarray(array)
        buf = self.alloc(array.nbytes)
        self.copy_in(buf, array)
        return buf

    def copy_in(self, buf: Buffer, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        try:
            self.cuda.memcpy_htod(buf.ptr, array.view(np.uint8))
        except self.cuda.Error as exc:
            raise self._raise(exc, "copy to device") from None

    def download(self, buf: Buffer, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        try:
            self.cuda.memcpy_dtoh(out.view(np.uint8), buf.ptr)
        except self.cuda.Error as exc:
            raise self._raise(exc, "copy from device (a kernel before it may have faulted)") from None
        return out

    def fill(self, buf: Buffer, byte: int, stream: Any = None) -> None:
        """memset; 0xFF bytes are NaN in float32, float16 and bfloat16 alike."""
        try:
            self.cuda.memset_d8_async(buf.ptr, byte, buf.nbytes, stream)
        except self.cuda.Error as exc:
            raise self._raise(exc, "memset") from None

    def copy(self, dst: Buffer, src: Buffer, nbytes: int, stream: Any = None) -> None:
        try:
            self.cuda.memcpy_dtod_async(dst.ptr, src.ptr, nbytes, stream)
        except self.cuda.Error as exc:
            raise self._raise(exc, "device-to-device copy") from None

    # -- code --------------------------------------------------------------------

    def load(self, cubin: bytes, key: str | None = None) -> Module:
        """Load a cubin (cached by ``key`` for the life of the context)."""
        if key is not None and key in self._modules:
            return self._modules[key]
        try:
            module = Module(self, self.cuda.module_from_buffer(cubin))
        except self.cuda.Error as exc:
            raise self._raise(exc, "loading the cubin") from None
        if key is not None:
            self._modules[key] = module
        return module

    # -- sync and time -------------------------------------------------------------

    def event(self) -> Any:
        return self.cuda.Event()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait for all queued work; a kernel still running after ``timeout_s`` is a (poisoning) hang."""
        try:
            if timeout_s is None:
                self.cuda.Context.synchronize()
                return
            done = self.cuda.Event()
            done.record()
            deadline = time.monotonic() + timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    self.poisoned = True
                    why = f"kernel still running after {timeout_s:.1f} s (hang)"
                    raise DeviceFault(why, poisoned=True, timed_out=True)
                time.sleep(0.0005)
            done.synchronize()
        except self.cuda.Error as exc:
            raise self._raise(exc, "synchronize") from None

    def _raise(self, exc: Exception, what: str) -> DeviceFault:
        fault = _fault(exc, what)
        if fault.poisoned:
            self.poisoned = True
        return fault

    def close(self) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        try:
            self._modules.clear()
            if not self.poisoned:
                self._pool.free_held()
            self._ctx.pop()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.debug("closing the device context: %s", exc)
        self._ctx = None


_devices: dict[int, Device] = {}


def get_device(ordinal: int = 0) -> Device:
    """The process's Device for ``ordinal`` (created on first use)."""
    if ordinal not in _devices:
        _devices[ordinal] = Device(ordinal)
    device = _devices[ordinal]
    if device.poisoned:
        # A faulted primary context cannot be recovered in-process; the worker must be replaced.
        raise DeviceFault("the CUDA context is poisoned by an earlier fault; restart the process", poisoned=True)
    return device


def gpu_available() -> tuple[bool, str]:
    """(True, name) when a GPU can be used here, else (False, why)."""
    try:
        dev = get_device()
    except GpuUnavailable as exc:
        return False, str(exc)
    return True, dev.info.name
