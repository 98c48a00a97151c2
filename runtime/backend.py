"""The runtime's GPU: the kernels layer's Device (pycuda, primary context, pooled memory) and one stream.

Every kernel launch and every device-side copy of the runtime goes to ``Backend.stream``, so a forward
pass is one ordered sequence that a CUDA graph can capture. Allocations come from the Device's memory
pool (no cudaMalloc per op once the pool is warm); while a graph is being captured they come from the
graph's own arena (``capture_arena``), which hands a buffer freed during the capture to later allocations
of the same capture and holds all of it for the graph. Every launch, copy, fill and arena allocation is
logged (``logging_work``) so that the graph can later point its kernels at other input and output buffers.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from kernelmill.kernels.device import Buffer, Device, get_device

log = logging.getLogger(__name__)


@dataclass
class LaunchRecord:
    """One kernel launch queued while a graph was captured: its graph node and everything that packs its
    parameters again (``Kernel.param_buffer(args)``)."""

    node: Any  # the captured kernel node (a cuda-bindings CUgraphNode), None where it could not be told
    kernel: Any  # kernels.device.Kernel
    args: list


@dataclass
class MemRecord:
    """A copy or fill queued while a graph was captured: the device bytes it writes (and reads)."""

    dst: int
    nbytes: int
    src: int | None = None


@dataclass
class AllocRecord:
    """An arena allocation made while a graph was captured: from here on these bytes are this buffer's."""

    ptr: int
    nbytes: int


class CaptureArena:
    """The device memory of one captured graph.

    A buffer the capture allocated and then dropped (its last tensor gone) is handed to a later allocation of
    the same capture, never to anything outside it: the graph's kernels run in capture order, and a kernel
    launched early (PDL) touches no buffer before the one before it is done (``km_pdl_start``), so the new
    owner's first access comes after the old owner's last. The arena keeps every block until ``close``; a
    buffer still in use then (the graph's output) keeps its own block alive."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._blocks: list[Buffer] = []  # the pool's allocations
        self._free: list[Buffer] = []  # those no buffer handed out uses now
        self._handed: weakref.WeakSet[Buffer] = weakref.WeakSet()
        self._closed = False

    def alloc(self, nbytes: int) -> Buffer:
        fits = [b for b in self._free if b.nbytes >= nbytes]
        if fits:
            block = min(fits, key=lambda b: b.nbytes)
            self._free.remove(block)
        else:
            block = self.device.alloc(nbytes)
            self._blocks.append(block)
        buf = Buffer(block.allocation, nbytes)
        weakref.finalize(buf, self._release, block).atexit = False
        self._handed.add(buf)
        return buf

    def _release(self, block: Buffer) -> None:
        if not self._closed:
            self._free.append(block)

    def owns(self, buf: Buffer) -> bool:
        """Whether ``buf`` is a whole buffer this arena handed out."""
        return buf in self._handed

    @property
    def nbytes(self) -> int:
        """Device bytes held (every block, in use or free)."""
        return 0 if self._closed else sum(b.nbytes for b in self._blocks)

    def close(self) -> None:
        """Drops the blocks: those no buffer uses go back to the pool."""
        self._closed = True
        self._blocks, self._free = [], []


class Staging:
    """Page-locked host buffers that small uploads pass through, so that they queue on the stream
    (cuMemcpyHtoDAsync) instead of waiting for its work: the host goes on preparing the next forward while
    the GPU runs this one. A buffer is taken again once the event recorded after its copy has passed; at most
    ``limit`` bytes are held (past that, an upload waits for the oldest copy)."""

    def __init__(self, cuda: Any, limit: int) -> None:
        self.cuda, self.limit = cuda, limit
        self._free: dict[int, list[tuple[Any, Any]]] = {}  # size -> (pinned array, event)
        self._busy: collections.deque[tuple[int, Any, Any]] = collections.deque()  # in copy order
        self.held = 0

    def upload(self, ptr: int, host: Any, stream: Any) -> None:
        data = host.reshape(-1).view("uint8")
        size = max(4096, 1 << (data.nbytes - 1).bit_length())
        array, event = self._take(size)
        array[: data.nbytes] = data
        self.cuda.memcpy_htod_async(ptr, array[: data.nbytes], stream)
        event.record(stream)
        self._busy.append((size, array, event))

    def _take(self, size: int) -> tuple[Any, Any]:
        self._reap(wait=False)
        if self._free.get(size):
            return self._free[size].pop()
        if self.held + size > self.limit:
            self._reap(wait=True)  # every copy so far done: all buffers free
            if self._free.get(size):
                return self._free[size].pop()
            self._free.clear()  # buffers of other sizes make room
            self.held = 0
        self.held += size
        return self.cuda.pagelocked_empty(size, "uint8"), self.cuda.Event(self.cuda.event_flags.DISABLE_TIMING)

    def _reap(self, wait: bool) -> None:
        while self._busy and (wait or self._busy[0][2].query()):
            size, array, event = self._busy.popleft()
            if wait:
                event.synchronize()
            self._free.setdefault(size, []).append((array, event))

    def close(self) -> None:
        """Waits for the copies under way and drops the buffers (before the context goes)."""
        self._reap(wait=True)
        self._free.clear()
        self.held = 0


class Backend:
    #: Uploads up to this size go through page-locked staging and queue on the stream (``Staging``); larger
    #: ones (weights) are synchronous copies.
    STAGED_BYTES = 8 << 20

    def __init__(self, device: Device) -> None:
        self.device = device
        self.cuda = device.cuda
        self.stream = device.cuda.Stream()
        self.staging = Staging(device.cuda, 4 * self.STAGED_BYTES)
        #: Held by every runtime call that touches the device (``on_device``): one stream, one capture at a time.
        self.lock = threading.RLock()
        self._arena: CaptureArena | None = None
        self._programmatic = None  # graph.make_programmatic while a PDL graph is being captured
        self._edges: list[int] = [0]
        self._plain: frozenset[int] = frozenset()  # ids of kernel entries whose launches keep plain edges
        self._pdl_entries: list[Any] = []  # the entries that got a programmatic edge, in first-launch order
        self._constants: frozenset[int] = frozenset()  # addresses the capture under way vouches are read-only
        self._work: list[LaunchRecord | MemRecord] | None = None  # the capture's log (logging_work)
        self._node_of = None  # graph.captured_kernel_node while a graph is being captured

    @property
    def arch(self) -> str:
        return self.device.info.arch

    def alloc(self, nbytes: int, persistent: bool = False) -> Buffer:
        """Device memory: from the pool, or inside a capture from its arena. ``persistent``: from the pool even
        then (a kernel's workspace, which outlives the graph and must never be another buffer's)."""
        if self._arena is None or persistent:
            return self.device.alloc(nbytes)
        buf = self._arena.alloc(nbytes)
        if self._work is not None:
            self._work.append(AllocRecord(buf.ptr, nbytes))
        return buf

    @property
    def capturing_graph(self) -> bool:
        """Whether a CUDA graph is being captured (nothing may synchronize the device meanwhile)."""
        return self._arena is not None

    @contextlib.contextmanager
    def capture_arena(self):
        """Inside the block allocations come from a new CaptureArena (yielded), which the graph keeps."""
        previous, self._arena = self._arena, CaptureArena(self.device)
        try:
            yield self._arena
        finally:
            self._arena = previous

    @contextlib.contextmanager
    def capturing(self, programmatic, plain: frozenset[int] = frozenset(), constants: frozenset[int] = frozenset()):
        """While a graph is captured: ``programmatic(stream_handle)`` (or None) runs before each launch of a
        PDL kernel (``before_launch``) but those of the kernel entries whose ids are in ``plain``; yields a
        one-element list that ends up holding how many edges it made programmatic, and the list of entries
        that got one. ``constants``: addresses of tensors no kernel of the capture writes (the model's
        parameters), which kernels may read before their PDL wait (``is_constant``)."""
        previous = self._programmatic, self._edges, self._plain, self._pdl_entries, self._constants
        self._programmatic, self._edges, self._plain, self._pdl_entries = programmatic, [0], plain, []
        self._constants = constants
        try:
            yield self._edges, self._pdl_entries
        finally:
            self._programmatic, self._edges, self._plain, self._pdl_entries, self._constants = previous

    def is_constant(self, ptr: int) -> bool:
        """Whether the capture under way vouches that no kernel writes the tensor at ``ptr``."""
        return ptr in self._constants

    @contextlib.contextmanager
    def logging_work(self, node_of):
        """While a graph is captured: yields the list that collects every launch (with its kernel node,
        ``node_of(stream_handle)`` right after it is queued), copy and fill, in order."""
        previous = self._work, self._node_of
        self._work, self._node_of = [], node_of
        try:
            yield self._work
        finally:
            self._work, self._node_of = previous

    def before_launch(self, pdl: bool, entry: Any = None) -> None:
        """Called before every kernel launch of the runtime; ``pdl``: the kernel waits for the one before;
        ``entry``: the registry's KernelEntry that launches it."""
        if not pdl or self._programmatic is None or id(entry) in self._plain:
            return
        if self._programmatic(self.stream_handle):
            self._edges[0] += 1
            if entry is not None and all(e is not entry for e in self._pdl_entries):
                self._pdl_entries.append(entry)

    def after_launch(self, kernel: Any, args: list) -> None:
        """Called after every kernel launch of the runtime, with what ``kernel.launch`` was given."""
        if self._work is not None:
            self._work.append(LaunchRecord(self._node_of(self.stream_handle), kernel, list(args)))

    def upload(self, ptr: int, host: Any) -> None:
        """Host -> device, after the stream's queued work (never during a capture): up to ``STAGED_BYTES``
        queued on the stream from a page-locked copy of ``host`` (the caller may change ``host`` at once),
        larger uploads as a synchronous copy once the stream's work is done."""
        if self._arena is not None:
            raise RuntimeError("an upload from the host cannot be captured in a CUDA graph")
        try:
            if 0 < host.nbytes <= self.STAGED_BYTES:
                self.staging.upload(ptr, host, self.stream)
                return
            self.stream.synchronize()
            self.cuda.memcpy_htod(ptr, host.reshape(-1).view("uint8"))
        except self.cuda.Error as exc:
            raise self.device._raise(exc, "copy to device") from None

    def download(self, ptr: int, out: Any) -> None:
        """Device -> host once the stream's queued work is done."""
        self.stream.synchronize()
        try:
            self.cuda.memcpy_dtoh(out.reshape(-1).view("uint8"), ptr)
        except self.cuda.Error as exc:
            raise self.device._raise(exc, "copy from device (a kernel before it may have faulted)") from None

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            if self._work is not None:
                self._work.append(MemRecord(dst, nbytes, src))
            self.cuda.memcpy_dtod_async(dst, src, nbytes, self.stream)

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
        """``height`` rows of ``width`` bytes, ``src_pitch`` bytes apart at ``src``, ``dst_pitch`` apart at
        ``dst``: one strided copy (a copy per row where the driver refuses the pitches)."""
        if not (width and height):
            return
        if self._work is not None:
            span = max(dst_pitch, src_pitch) * (height - 1) + width
            self._work.append(MemRecord(dst, span, src))
        copy = self.cuda.Memcpy2D()
        copy.set_src_device(src)
        copy.set_dst_device(dst)
        copy.src_pitch, copy.dst_pitch, copy.width_in_bytes, copy.height = src_pitch, dst_pitch, width, height
        try:
            copy(self.stream)
        except self.cuda.Error as exc:
            log.debug("cuMemcpy2DAsync refused pitches %d / %d (%s): a copy per row", src_pitch, dst_pitch, exc)
            for row in range(height):
                self.cuda.memcpy_dtod_async(dst + row * dst_pitch, src + row * src_pitch, width, self.stream)

    def fill(self, ptr: int, byte: int, nbytes: int) -> None:
        if nbytes:
            if self._work is not None:
                self._work.append(MemRecord(ptr, nbytes))
            self.cuda.memset_d8_async(ptr, byte, nbytes, self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    @property
    def stream_handle(self) -> int:
        return int(self.stream.handle)


_backends: dict[int, Backend] = {}


def on_device(fn=None, *, cuda_args_only: bool = False):
    """Runs ``fn`` holding the runtime backend's lock, with its CUDA context current in the calling thread
    (``Device.activated``), once a backend exists: so that models and tensors made in one thread work from
    any other, one at a time (they share one stream, and a forward being captured must see no other work).
    ``cuda_args_only``: only calls that name the GPU (a CUDA Tensor or a "cuda" device among the arguments)
    do so; CPU tensor work does not wait behind another thread's forward."""
    if fn is None:
        return functools.partial(on_device, cuda_args_only=cuda_args_only)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        backend = _backends.get(0)
        if backend is None or (cuda_args_only and not _names_cuda(args, kwargs)):
            return fn(*args, **kwargs)
        with backend.lock, backend.device.activated():
            return fn(*args, **kwargs)

    return wrapper


def _names_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether a call's arguments hold a CUDA tensor or name the "cuda" device."""
    for a in (*args, *kwargs.values()):
        if getattr(a, "device", None) == "cuda" or (isinstance(a, str) and a.startswith("cuda")):
            return True
    return False


@on_device
def empty_cache() -> int:
    """Hands the memory pool's unused blocks back to the driver, where other libraries (PyTorch) can allocate
    them; returns how many blocks went. Buffers in use, and the graphs' arenas, stay."""
    backend = _backends.get(0)
    if backend is None:
        return 0
    backend.synchronize()  # blocks freed behind queued work are free once it is done
    return backend.device.free_held()


def get_backend(ordinal: int = 0) -> Backend:
    """The process's Backend for GPU ``ordinal``; GpuUnavailable where there is none."""
    if ordinal not in _backends:
        device = get_device(ordinal)
        _backends[ordinal] = Backend(device)
        device.on_close(_release_all)
    return _backends[ordinal]


def _release_all() -> None:
    """At exit, before the context goes: drop every cached device object the runtime holds."""
    from kernelmill.runtime import dlpack, ops

    ops._default_registry = None
    dlpack._alive.clear()
    for backend in _backends.values():
        backend.staging.close()
    _backends.clear()
