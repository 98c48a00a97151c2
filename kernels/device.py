"""The GPU through pycuda: context, pooled memory, cubin loading, prepared launches, events.

pycuda is imported lazily (an optional extra), so everything else imports on a
machine without CUDA. Driver errors are wrapped once here: code above sees
``GpuUnavailable`` or ``DeviceFault`` (with ``poisoned`` telling whether the
CUDA context is now unusable, as after an illegal address).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import struct
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import numpy as np

from kernelmill.kernels.compile import elf_sections
from kernelmill.kernels.ops.base import TensorMapArg

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


class ContextPoisoned(DeviceFault, GpuUnavailable):
    """``get_device`` on a device an earlier fault poisoned: a fault (as before) that is also no usable GPU, so a
    caller that says "no GPU here" in one line (the runtime's load, ``gpu_available``) says this too."""


def _pycuda():
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        raise GpuUnavailable(f"pycuda is not installed ({exc}); {_INSTALL_HINT}") from None
    return cuda


def _fault(exc: Exception, what: str) -> DeviceFault:
    text = str(exc)
    poisoned = any(s in text.lower() for s in _STICKY_ERRORS)
    # The driver's watchdog killed the kernel (a GPU driving a display): a hang, as one past timeout_s is.
    return DeviceFault(f"{what}: {text}", poisoned, timed_out="launch timed out" in text.lower())


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


@dataclass(eq=False)  # hashed by identity: the device keeps its live buffers in a WeakSet
class Buffer:
    """Device memory from the pool; ``ptr`` is the raw device address."""

    allocation: Any
    nbytes: int

    @property
    def ptr(self) -> int:
        return int(self.allocation)


#: Loaded modules a device keeps by key, most recently used last. A long-lived worker loads a module for every
#: variant it tries; past this many the least recently used is dropped, and unloaded once nothing else holds it
#: (a runtime's bound kernels and graphs hold theirs).
MODULE_CACHE_SIZE = 256


# -- TMA tensor maps (CUtensorMap by value) -------------------------------------------

#: CUtensorMap: 128 opaque bytes (by value in the kernel's parameters).
TENSOR_MAP_BYTES = 128
#: CUtensorMapDataType, CUtensorMapSwizzle (by bytes) and the other enums of cuda.h used here.
_TMAP_DTYPES = {"float16": 6, "float32": 7, "bfloat16": 9}
_TMAP_ITEMSIZE = {"float16": 2, "float32": 4, "bfloat16": 2}
_TMAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
_TMAP_INTERLEAVE_NONE = 0
_TMAP_L2_PROMOTION_256B = 3
_TMAP_OOB_FILL_ZEROS = 0
#: .nv.info attributes (cuobjdump -elf names them): one parameter's offset and size; the parameter block size.
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_CBANK_PARAM_SIZE = 0x19
_EIFMT_SVAL = 4

#: Per entry: (offset, size) of each parameter by ordinal, and the size of the parameter block.
ParamLayout = tuple[list[tuple[int, int]], int]


def kernel_param_layouts(cubin: bytes) -> dict[str, ParamLayout]:
    """Parameter offsets of every entry of a cubin, from its ``.nv.info.<entry>`` ELF sections.

    pycuda passes parameters as one packed buffer, which the driver copies to the parameter bank as it is.
    ptxas aligns a 64-byte aligned parameter (a CUtensorMap) to the bank's absolute address, whose
    parameter block starts 16-byte aligned (c[0x0][0x210] on sm_90), so such a parameter lands at an
    offset a natural struct layout does not predict (0x30 for the first one): the buffer must follow ptxas.
    """
    try:
        layouts: dict[str, ParamLayout] = {}
        for section in elf_sections(cubin):
            if not section.name.startswith(".nv.info."):
                continue
            params: dict[int, tuple[int, int]] = {}
            total, pos, end = 0, section.offset, section.offset + section.size
            while pos + 4 <= end:
                fmt, attr, value = struct.unpack_from("<BBH", cubin, pos)
                pos += 4
                if fmt == _EIFMT_SVAL:
                    if attr == _EIATTR_KPARAM_INFO:
                        _, ordinal, param_offset, flags = struct.unpack_from("<IHHI", cubin, pos)
                        params[ordinal] = (param_offset, (flags >> 18) & 0x3FFF)
                    pos += value
                elif attr == _EIATTR_CBANK_PARAM_SIZE:
                    total = value
            if params:
                layouts[section.name.removeprefix(".nv.info.")] = ([params[i] for i in sorted(params)], total)
        return layouts
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as exc:
        log.warning("could not read the parameter layout of a cubin: %s", exc)
        return {}


def param_format(args: list, layout: ParamLayout | None = None) -> str:
    """pycuda's struct format of a launch's parameter buffer: P for pointers, i for int32 scalars, and for
    launches with tensor maps (128s each) the offsets of ``layout`` reproduced with pad bytes (x)."""
    if not any(isinstance(a, TensorMapArg) for a in args):
        return "".join("P" if isinstance(a, Buffer) else "i" for a in args)
    if layout is None or len(layout[0]) != len(args):
        raise DeviceFault(f"no parameter layout for a launch with tensor maps ({len(args)} arguments)", poisoned=False)
    parts, at = [], 0
    for a, (offset, size) in zip(args, layout[0], strict=True):
        code, want, align = (
            (f"{TENSOR_MAP_BYTES}s", TENSOR_MAP_BYTES, 1)
            if isinstance(a, TensorMapArg)
            else ("P", 8, 8)
            if isinstance(a, Buffer)
            else ("i", 4, 4)
        )
        # pycuda packs in native mode: an item must already sit at its natural alignment, or pack would pad.
        if size != want or offset < at or offset % align:
            raise DeviceFault(f"parameter layout {layout} does not fit the arguments {args}", poisoned=False)
        parts.append(f"{offset - at}x{code}" if offset > at else code)
        at = offset + size
    if layout[1] > at:
        parts.append(f"{layout[1] - at}x")
    return "".join(parts)


def tensor_map_strides(spec: TensorMapArg) -> list[int]:
    """Byte strides of dims 1.. of a dense row-major tensor (cuTensorMapEncodeTiled's globalStrides)."""
    item = _TMAP_ITEMSIZE[spec.dtype]
    return [math.prod(spec.dims[: i + 1]) * item for i in range(len(spec.dims) - 1)]


@cache
def _libcuda() -> Any:
    """The driver library pycuda runs on; its C ABI for cuTensorMapEncodeTiled is fixed by cuda.h."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p]
    fn.argtypes += [ctypes.c_int] * 4
    lib.cuGetErrorName.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def encode_tensor_map(ptr: int, spec: TensorMapArg) -> bytes:
    """The 128 bytes of a CUtensorMap over the dense tensor at device address ``ptr`` (zero fill out of bounds)."""
    try:
        lib = _libcuda()
    except (OSError, AttributeError) as exc:
        raise DeviceFault(f"cannot load the CUDA driver's cuTensorMapEncodeTiled: {exc}", poisoned=False) from None
    rank = len(spec.dims)
    if spec.dtype not in _TMAP_DTYPES or spec.swizzle not in _TMAP_SWIZZLE or len(spec.box) != rank:
        raise DeviceFault(f"unsupported tensor map {spec}", poisoned=False)
    storage = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 128)
    addr = -(-ctypes.addressof(storage) // 128) * 128  # cuda.h aligns CUtensorMap to 128 bytes
    dims = (ctypes.c_uint64 * rank)(*spec.dims)
    strides = (ctypes.c_uint64 * max(rank - 1, 1))(*tensor_map_strides(spec))
    box = (ctypes.c_uint32 * rank)(*spec.box)
    element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
    status = lib.cuTensorMapEncodeTiled(
        addr,
        _TMAP_DTYPES[spec.dtype],
        rank,
        ptr,
        dims,
        strides,
        box,
        element_strides,
        _TMAP_INTERLEAVE_NONE,
        _TMAP_SWIZZLE[spec.swizzle],
        _TMAP_L2_PROMOTION_256B,
        _TMAP_OOB_FILL_ZEROS,
    )
    if status != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        why = name.value.decode() if name.value else f"CUresult {status}"
        raise DeviceFault(f"cuTensorMapEncodeTiled failed ({why}) for {spec} at 0x{ptr:x}", poisoned=False)
    return ctypes.string_at(addr, TENSOR_MAP_BYTES)


class Kernel:
    """One entry function of a loaded module, prepared per argument signature."""

    def __init__(self, device: Device, function: Any, name: str, module: Module | None = None) -> None:
        self._device = device
        self._function = function
        self.name = name
        self._module = module
        self._signature: str | None = None
        self._smem_limit = 48 * 1024
        self._tensor_maps: dict[tuple[int, TensorMapArg], bytes] = {}

    def _tensor_map(self, spec: TensorMapArg, args: list) -> bytes:
        """Encoded once per (buffer address, spec): a launch must not pay for the driver call each time."""
        source = args[spec.of]
        if not isinstance(source, Buffer):
            raise DeviceFault(f"tensor map argument {spec} does not point at a buffer argument", poisoned=False)
        key = (source.ptr, spec)
        if key not in self._tensor_maps:
            if len(self._tensor_maps) >= 64:
                self._tensor_maps.clear()
            self._tensor_maps[key] = encode_tensor_map(source.ptr, spec)
        return self._tensor_maps[key]

    def _signature_of(self, args: list) -> str:
        with_maps = any(isinstance(a, TensorMapArg) for a in args)
        layout = self._module.param_layout(self.name) if with_maps and self._module is not None else None
        return param_format(args, layout)

    def _values(self, args: list) -> list:
        return [
            a.ptr if isinstance(a, Buffer) else self._tensor_map(a, args) if isinstance(a, TensorMapArg) else int(a)
            for a in args
        ]

    def param_buffer(self, args: list[int | Buffer | TensorMapArg]) -> bytes:
        """The parameter buffer a launch with ``args`` passes (what pycuda packs: the same struct format)."""
        return struct.pack(self._signature_of(args), *self._values(args))

    def launch(self, grid, block, smem_bytes: int, args: list[int | Buffer | TensorMapArg], stream: Any = None) -> None:
        """Enqueue one launch; ints are int32 scalars, Buffers are pointers, TensorMapArgs 128-byte maps."""
        cuda = self._device.cuda
        signature = self._signature_of(args)
        try:
            if signature != self._signature:
                self._function.prepare(signature)
                self._signature = signature
            if smem_bytes > self._smem_limit:
                self._function.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes)
                self._smem_limit = smem_bytes
            values = self._values(args)
            self._function.prepared_async_call(tuple(grid), tuple(block), stream, *values, shared_size=smem_bytes)
        except cuda.Error as exc:
            where = f"launch of {self.name} grid={tuple(grid)} block={tuple(block)} smem={smem_bytes}"
            raise self._device._raise(exc, where) from None


class Module:
    def __init__(self, device: Device, module: Any, cubin: bytes = b"") -> None:
        self._device = device
        self._module = module
        self._cubin = cubin
        self._layouts: dict[str, ParamLayout] | None = None
        self._kernels: dict[str, Kernel] = {}

    def param_layout(self, entry: str) -> ParamLayout | None:
        """The entry's parameter offsets (read from the cubin once, only for launches that need them)."""
        if self._layouts is None:
            self._layouts = kernel_param_layouts(self._cubin) if self._cubin else {}
        return self._layouts.get(entry)

    def kernel(self, entry: str) -> Kernel:
        if entry not in self._kernels:
            try:
                fn = self._module.get_function(entry)
            except self._device.cuda.Error as exc:
                raise self._device._raise(exc, f"no entry {entry!r} in the module") from None
            self._kernels[entry] = Kernel(self._device, fn, entry, self)
        return self._kernels[entry]


class Event:
    """A pycuda event whose driver errors go through the device as a launch's do. After a kernel faults, every
    call in the context fails, recording an event as well: that is a poisoning DeviceFault too, never a raw
    pycuda error (which got past the evaluator and left the device unmarked, so the next batch launched on)."""

    def __init__(self, device: Device, event: Any) -> None:
        self._device = device
        self._event = event

    def record(self, stream: Any = None) -> Event:
        try:
            self._event.record(stream)
        except self._device.cuda.Error as exc:
            raise self._device._raise(exc, "recording an event") from None
        return self

    def query(self) -> bool:
        try:
            return self._event.query()
        except self._device.cuda.Error as exc:
            raise self._device._raise(exc, "querying an event") from None

    def synchronize(self) -> None:
        """Wait for the event, without a bound (Device.synchronize bounds its wait)."""
        try:
            self._event.synchronize()
        except self._device.cuda.Error as exc:
            raise self._device._raise(exc, "waiting for an event") from None

    def time_since(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event (both recorded and done)."""
        try:
            return self._event.time_since(start._event)
        except self._device.cuda.Error as exc:
            raise self._device._raise(exc, "reading an event's time") from None


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
        # The context stays pushed on this thread's stack; other threads push it around their work (activated).
        self._owner: int | None = threading.get_ident()
        self._local = threading.local()
        if threading.current_thread() is not threading.main_thread():
            self._local.pop_at_end = _PopAtThreadEnd(self)
        from pycuda.tools import DeviceMemoryPool

        self._pool = DeviceMemoryPool()
        self._modules: OrderedDict[str, Module] = OrderedDict()
        self._modules_lock = threading.Lock()
        self._close_hooks: list = []
        # Every live buffer: at exit they go back to the pool while the context is still current (one
        # freed after the context is popped makes pycuda abort the process in a C++ destructor).
        self._live: weakref.WeakSet[Buffer] = weakref.WeakSet()
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
            buf = Buffer(self._pool.allocate(max(int(nbytes), 1)), int(nbytes))
        except self.cuda.Error as exc:
            raise self._raise(exc, f"allocating {nbytes} bytes") from None
        self._live.add(buf)
        return buf

    def free_held(self) -> int:
        """Returns the pool's unused blocks to the driver; how many there were."""
        held = self._pool.held_blocks
        self._pool.free_held()
        return held

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
        """Load a cubin, cached by ``key`` (the ``MODULE_CACHE_SIZE`` most recently used). Called with the
        context current, as every call here is, so a module dropped from the cache unloads in a live context."""
        if key is not None:
            with self._modules_lock:
                if key in self._modules:
                    self._modules.move_to_end(key)
                    return self._modules[key]
        try:
            module = Module(self, self.cuda.module_from_buffer(cubin), cubin)
        except self.cuda.Error as exc:
            raise self._raise(exc, "loading the cubin") from None
        if key is not None:
            with self._modules_lock:
                self._modules[key] = module
                dropped = [self._modules.popitem(last=False)[1] for _ in range(len(self._modules) - MODULE_CACHE_SIZE)]
            del dropped  # unloaded here, in this thread's current context, unless something still holds them
        return module

    # -- sync and time -------------------------------------------------------------

    def event(self) -> Event:
        """A timing event whose driver errors are DeviceFaults, as a launch's are."""
        try:
            return Event(self, self.cuda.Event())
        except self.cuda.Error as exc:
            raise self._raise(exc, "creating an event") from None

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
        # The message names the known sticky errors; the context itself says whether it still works (a driver
        # whose wording differs, an error this list lacks): an event that can no longer be recorded or queried.
        if not fault.poisoned and not self._context_usable():
            fault.poisoned = True
        if fault.poisoned:
            self.poisoned = True
        return fault

    def _context_usable(self) -> bool:
        """Whether the context still takes work, without waiting for any (a hung kernel may still run)."""
        try:
            probe = self.cuda.Event()
            probe.record()
            probe.query()
        except self.cuda.Error:
            return False
        return True

    @contextlib.contextmanager
    def activated(self):
        """The device's context current in the calling thread for the block. The thread that created the
        device has it already; another thread (a web server's pool, a Dask worker's) pushes it for the block
        and pops it after: pycuda finds contexts on a per-thread stack, and aborts the process if a thread ends
        with one still there. Nested blocks push once."""
        if threading.get_ident() == self._owner or getattr(self._local, "depth", 0):
            yield
            return
        self._ctx.push()
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            self.cuda.Context.pop()

    def on_close(self, hook) -> None:
        """Call ``hook()`` before the context goes at exit: layers above drop their device objects there."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        # pycuda aborts at exit if a context is still pushed, so pop it; first run the close hooks, drop what we
        # hold and collect garbage, so that buffers, modules and events are freed while their context is current.
        try:
            import gc

            if threading.get_ident() != self._owner:  # made on another thread, or that thread has ended
                self._ctx.push()
                # Objects still held at exit that pycuda made on that thread (a model's stream and modules) cannot
                # be cleaned up from this one; it says so for each, and the process frees them as it ends.
                warnings.filterwarnings("ignore", message=".*in out-of-thread context could not be cleaned up")
            for hook in reversed(self._close_hooks):
                try:
                    hook()
                except Exception as exc:  # noqa: BLE001 - best effort at exit
                    log.debug("close hook %s: %s", hook, exc)
            self._modules.clear()
            gc.collect()
            if not self.poisoned:
                for buf in list(self._live):
                    buf.allocation.free()  # the buffer's own finalizer then has nothing left to free
                self._pool.free_held()
            self._ctx.pop()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.debug("closing the device context: %s", exc)
        self._ctx = None


class _PopAtThreadEnd:
    """Kept in the thread-local storage of a thread other than the main one that created a Device: when that
    thread ends (its thread-locals are cleared there), pops the context the Device pushed on its stack, since
    pycuda aborts the process when a thread ends with one still there, and leaves the device to the threads
    that use it (``Device.activated``)."""

    def __init__(self, device: Device) -> None:
        self._device = weakref.ref(device)

    def __del__(self) -> None:
        device = self._device()
        if device is None or getattr(device, "_ctx", None) is None or device._owner != threading.get_ident():
            return
        device._owner = None
        with contextlib.suppress(Exception):
            device.cuda.Context.pop()


_devices: dict[int, Device] = {}


def get_device(ordinal: int = 0) -> Device:
    """The process's Device for ``ordinal`` (created on first use)."""
    if ordinal not in _devices:
        _devices[ordinal] = Device(ordinal)
    device = _devices[ordinal]
    if device.poisoned:
        # A faulted primary context cannot be recovered in-process; the worker must be replaced.
        raise ContextPoisoned("the CUDA context is poisoned by an earlier fault; restart the process", poisoned=True)
    return device


def gpu_available() -> tuple[bool, str]:
    """(True, name) when a GPU can be used here, else (False, why)."""
    try:
        dev = get_device()
    except GpuUnavailable as exc:
        return False, str(exc)
    return True, dev.info.name
