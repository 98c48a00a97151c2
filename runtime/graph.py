"""CUDA graph capture and replay of a forward pass (cuda-python's driver API on pycuda's stream).

pycuda owns the context and the stream; ``cuda.bindings.driver`` (the ``cuda-bindings`` package of the
gpu extra) captures what the runtime enqueues on that stream: cuStreamBeginCapture (relaxed mode, so
the pooled allocator may still allocate), the forward's launches, cuStreamEndCapture, cuGraphInstantiate;
each replay is one cuGraphLaunch. Every buffer allocated during the capture comes from the graph's own
arena (``Backend.capture_arena``), so memory the graph writes is never handed to anyone else; inside the
capture a buffer the forward has dropped is handed to its later allocations, which is safe in capture order
(see PDL below: no kernel touches a buffer before the one before it is done).

Programmatic dependent launch (PDL, sm_90): with ``pdl=True`` the edge from a kernel node to the next
kernel of a PDL family (``Family.pdl``: its kernels call ``griddepcontrol.wait`` before touching any
buffer) is made programmatic while it is captured (``make_programmatic``). The driver then launches the
next kernel as soon as every block of the one before has passed its own wait and called
``griddepcontrol.launch_dependents``; its blocks take SMs as they free up, set up (the wgmma GEMM also
prefetches its first B stages into L2) and wait for the previous grid to complete, so the launch and the
set-up overlap the previous kernel's tail.

No copies around a replay: the capture logs every launch with its kernel node (``Backend.logging_work``).
``plan_rebinding`` finds the kernel arguments that point into the static inputs and the output; a replay
then points those nodes at the caller's input tensors and at a fresh output tensor
(``cuGraphExecKernelNodeSetParams``, parameters packed again, tensor maps encoded again), only when an
address changed. An input that a copy or fill of the capture touches, or that is not 16-byte aligned,
is still copied into its static buffer; an output that is not a whole buffer of its own is still cloned.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kernelmill.kernels.device import Buffer
from kernelmill.runtime.backend import AllocRecord, LaunchRecord, MemRecord
from kernelmill.runtime.tensor import ALIGNMENT, Tensor

log = logging.getLogger(__name__)


class GraphUnavailable(RuntimeError):
    """The forward could not be captured (no cuda-bindings, or the driver refused); plain launches run."""


_driver_module = None


def _driver():
    global _driver_module
    if _driver_module is None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise GraphUnavailable(f"cuda-bindings is not installed ({exc}); pip install 'kernelmill[gpu]'") from None
        try:
            (err,) = driver.cuInit(0)
        except Exception as exc:  # noqa: BLE001 - the bindings raise when the driver library is missing
            raise GraphUnavailable(f"cuda-bindings cannot load the driver: {exc}") from None
        if err != driver.CUresult.CUDA_SUCCESS:
            raise GraphUnavailable(f"cuInit failed: {err}")
        _driver_module = driver
    return _driver_module


def _check(result: tuple, what: str) -> Any:
    driver = _driver()
    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GraphUnavailable(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _kernel_dependency(stream) -> Any | None:
    """While ``stream`` is being captured: the one node its next work would depend on, when that is a
    kernel node; None otherwise, and with bindings older than CUDA 12.3 (no edge data)."""
    driver = _driver()
    get_info = getattr(driver, "cuStreamGetCaptureInfo_v3", None) or driver.cuStreamGetCaptureInfo
    info = get_info(stream)
    if len(info) != 7:  # (err, status, id, graph, nodes, edge data, count) from 12.3 on
        return None
    err, status, _id, _graph, nodes, _edges, count = info
    active = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    if err != driver.CUresult.CUDA_SUCCESS or status != active or count != 1:
        return None
    node = nodes[0]
    kind = _check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
    return node if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL else None


def captured_kernel_node(stream_handle: int) -> Any | None:
    """Right after a launch on ``stream_handle`` while it is being captured: that launch's kernel node."""
    return _kernel_dependency(_driver().CUstream(stream_handle))


def make_programmatic(stream_handle: int) -> bool:
    """While ``stream_handle`` is being captured, before a PDL kernel's launch: when the next node would
    depend on exactly one node and that is a kernel, the dependency becomes a programmatic edge (the next
    kernel may start once every block of that kernel has called launch_dependents, and waits for it in
    griddepcontrol.wait). Returns whether it did; bindings older than CUDA 12.3 (no edge data) never do."""
    driver = _driver()
    stream = driver.CUstream(stream_handle)
    update = getattr(driver, "cuStreamUpdateCaptureDependencies_v2", None) or driver.cuStreamUpdateCaptureDependencies
    node = _kernel_dependency(stream)
    if node is None:
        return False
    edge = driver.CUgraphEdgeData()
    edge.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    edge.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    flags = driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
    _check(update(stream, [node], [edge], 1, flags), "cuStreamUpdateCaptureDependencies")
    return True


# -- pointing a captured graph at other buffers ----------------------------------------------------------


@dataclass(frozen=True)
class Rebinding:
    """Which buffers of a captured forward a replay may move (one slot per static input, then the output)
    and, per logged launch that touches a movable one, its buffer arguments there: (argument index, slot,
    byte offset into the slot)."""

    movable: tuple[bool, ...]
    nodes: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]


def plan_rebinding(
    work: Sequence[LaunchRecord | MemRecord | AllocRecord], slots: Sequence[tuple[int, int] | None]
) -> Rebinding:
    """``slots``: (address, bytes) of each static input and then of the output, None where it may not move.
    A slot's bytes are its own from the last logged allocation that overlaps them (from the start where there
    is none); before that they belonged to other buffers of the capture, whose work is left as it is. A slot
    stays put where it overlaps another, where a logged copy or fill reads or writes it (that node's
    addresses are not rewritten), or where a launch that points into it has no known node."""
    movable = [s is not None and s[1] > 0 for s in slots]

    def overlaps(slot, start, nbytes):
        base, size = slot
        return start < base + size and base < start + nbytes

    owned_from = [0] * len(slots)
    for index, rec in enumerate(work):
        if isinstance(rec, AllocRecord):
            for i, s in enumerate(slots):
                if s is not None and overlaps(s, rec.ptr, rec.nbytes):
                    owned_from[i] = index

    def slot_of(ptr, index):
        return next(
            (i for i, s in enumerate(slots) if s is not None and s[0] <= ptr < s[0] + s[1] and index >= owned_from[i]),
            None,
        )

    for i, si in enumerate(slots):
        for j, sj in enumerate(slots[:i]):
            if si is not None and sj is not None and overlaps(si, *sj):
                movable[i] = movable[j] = False
    refs_of = []
    for index, rec in enumerate(work):
        if isinstance(rec, AllocRecord):
            refs_of.append(())
            continue
        if isinstance(rec, MemRecord):
            touched = [(rec.dst, rec.nbytes)] + ([(rec.src, rec.nbytes)] if rec.src is not None else [])
            for i, s in enumerate(slots):
                if s is not None and index >= owned_from[i] and any(overlaps(s, start, n) for start, n in touched):
                    movable[i] = False
            refs_of.append(())
            continue
        refs = tuple(
            (k, slot, a.ptr - slots[slot][0])
            for k, a in enumerate(rec.args)
            if isinstance(a, Buffer) and (slot := slot_of(a.ptr, index)) is not None
        )
        if rec.node is None:
            for _k, slot, _off in refs:
                movable[slot] = False
        refs_of.append(refs)
    nodes = []
    for index, refs in enumerate(refs_of):
        kept = tuple(ref for ref in refs if movable[ref[1]])
        if kept:
            nodes.append((index, kept))
    return Rebinding(tuple(movable), tuple(nodes))


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 of cuda.h."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        *[(f"{kind}Dim{axis}", ctypes.c_uint) for kind in ("grid", "block") for axis in "XYZ"],
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


#: cuda.h's CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE.
_PARAM_END, _PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE = 0, 1, 2


def _set_kernel_params(graph_exec: Any, node: Any, params: bytes) -> None:
    """Gives the instantiated graph's copy of kernel ``node`` the parameter buffer ``params`` (its function,
    grid, block and shared memory stay); later launches of the graph use it."""
    from kernelmill.kernels.device import _libcuda

    lib = _libcuda()
    current = _KernelNodeParams()
    node_handle = ctypes.c_void_p(int(node))
    status = lib.cuGraphKernelNodeGetParams_v2(node_handle, ctypes.byref(current))
    if status != 0:
        raise GraphUnavailable(f"cuGraphKernelNodeGetParams failed: CUresult {status}")
    buffer = ctypes.create_string_buffer(params, len(params))
    size = ctypes.c_size_t(len(params))
    extra = (ctypes.c_void_p * 5)(
        _PARAM_BUFFER_POINTER, ctypes.addressof(buffer), _PARAM_BUFFER_SIZE, ctypes.addressof(size), _PARAM_END
    )
    current.kernelParams = None
    current.extra = ctypes.addressof(extra)
    status = lib.cuGraphExecKernelNodeSetParams_v2(ctypes.c_void_p(int(graph_exec)), node_handle, ctypes.byref(current))
    if status != 0:
        raise GraphUnavailable(f"cuGraphExecKernelNodeSetParams failed: CUresult {status}")


class CapturedForward:
    """One static-shape forward captured as a CUDA graph: static inputs, the output, the graph.

    ``programmatic_edges`` counts the kernel-to-kernel edges captured as programmatic (``pdl=True``);
    ``rebinding`` says which inputs (and the output) a replay reads (writes) in place."""

    def __init__(
        self,
        backend,
        fn: Callable[..., Tensor],
        inputs: tuple[Tensor | None, ...],
        pdl: bool = False,
        plain: frozenset[int] = frozenset(),
        constants: frozenset[int] = frozenset(),
    ) -> None:
        driver = _driver()
        self.backend = backend
        self._graph = self._exec = None
        self.programmatic_edges = 0
        # Static inputs live outside the capture (they are copied into before each replay).
        self.inputs = tuple(None if t is None else t.clone() for t in inputs)
        backend.synchronize()
        stream = driver.CUstream(backend.stream_handle)
        self._stream = stream
        with (
            backend.capture_arena() as arena,
            backend.capturing(make_programmatic if pdl else None, plain, constants) as (edges, pdl_entries),
            backend.logging_work(captured_kernel_node) as work,
        ):
            mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
            _check(driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
            try:
                output = fn(*self.inputs)
            except BaseException:
                graph = driver.cuStreamEndCapture(stream)  # leave the stream usable
                if graph[0] == driver.CUresult.CUDA_SUCCESS and graph[1] is not None:
                    driver.cuGraphDestroy(graph[1])
                raise
            self._graph = _check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        self._arena = arena
        self.programmatic_edges = edges[0]
        #: The kernel entries whose launches got a programmatic edge; ``plain``: ids of those kept plain;
        #: ``constants``: the addresses the capture vouched for (re-captures reuse them).
        self.pdl_entries, self.plain, self.constants = list(pdl_entries), plain, constants
        self.pdl = pdl
        self.output = output
        try:
            self._exec = _check(driver.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        except TypeError:  # bindings where flags go through cuGraphInstantiateWithFlags
            self._exec = _check(driver.cuGraphInstantiateWithFlags(self._graph, 0), "cuGraphInstantiateWithFlags")
        _nodes, count = _check(driver.cuGraphGetNodes(self._graph, 0), "cuGraphGetNodes")
        self.nodes = int(count)  # kernel launches + copies captured
        self._work = list(work)
        slots = [None if t is None else (t.ptr, t.nbytes) for t in self.inputs]
        # The output may move only where it is a whole buffer that the forward allocated (not a view).
        whole = output.device == "cuda" and arena.owns(output.buffer) and output.nbytes == output.buffer.nbytes
        slots.append((output.ptr, output.nbytes) if whole else None)
        self.rebinding = plan_rebinding(work, slots)
        self._static = [0 if s is None else s[0] for s in slots]
        self._bound = list(self._static)  # the addresses the instantiated graph's nodes use now

    @property
    def nbytes(self) -> int:
        """Device bytes the graph holds: its arena (the forward's buffers, reused once dropped)."""
        return self._arena.nbytes

    def _bind(self, addresses: list[int]) -> None:
        """Points the nodes that touch a movable slot at ``addresses`` (one per slot) where they changed."""
        changed = {i for i, (a, b) in enumerate(zip(addresses, self._bound, strict=True)) if a != b}
        if not changed:
            return
        self._bound = [None] * len(self._bound)  # unknown until every node is done
        for index, refs in self.rebinding.nodes:
            if not any(slot in changed for _k, slot, _off in refs):
                continue
            rec = self._work[index]
            args = list(rec.args)
            for k, slot, offset in refs:
                args[k] = Buffer(addresses[slot] + offset, 0)
            try:
                _set_kernel_params(self._exec, rec.node, rec.kernel.param_buffer(args))
            except GraphUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - a tensor map the driver refuses, bindings without int()
                raise GraphUnavailable(f"re-pointing {rec.kernel.name}: {exc}") from None
        self._bound = list(addresses)

    def replay(self, inputs: tuple[Tensor | None, ...], copy_output: bool = True) -> Tensor:
        """Launches the graph on ``inputs``: read in place where the rebinding allows (else copied into the
        static inputs first). Returns the output: a fresh tensor by default (written in place where the
        rebinding allows, else a copy), the graph's own with ``copy_output=False`` (overwritten by the next
        replay)."""
        movable = self.rebinding.movable
        addresses = list(self._static)
        copies = []
        for i, (static, new) in enumerate(zip(self.inputs, inputs, strict=True)):
            if static is None or new is static:
                continue
            if movable[i] and new.device == "cuda" and new.ptr % ALIGNMENT == 0:
                addresses[i] = new.ptr
            else:
                copies.append((static, new))
        out = None
        if copy_output and movable[-1]:
            out = Tensor.empty(self.output.shape, self.output.dtype, "cuda")
            addresses[-1] = out.ptr
        try:
            self._bind(addresses)
        except GraphUnavailable as exc:
            log.warning("runtime: the graph cannot point its kernels at new buffers (%s); it copies instead", exc)
            self._bound = [None] * len(self._bound)
            self._bind(self._static)  # raises again where the driver refuses even that: no graph then
            self.rebinding = Rebinding(tuple(False for _ in movable), ())
            return self.replay(inputs, copy_output)
        for static, new in copies:
            static.copy_(new)
        # The inputs need not be held: pooled memory is handed out again only to work queued behind this
        # launch on the same stream (uploads queue on it as well).
        _check(_driver().cuGraphLaunch(self._exec, self._stream), "cuGraphLaunch")
        if out is not None:
            return out
        return self.output.clone() if copy_output else self.output

    def close(self) -> None:
        driver = _driver_module
        if driver is None:
            return
        if self._exec is not None:
            driver.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            driver.cuGraphDestroy(self._graph)
            self._graph = None
        if getattr(self, "_arena", None) is not None:
            self._arena.close()  # back to the pool: a replay in flight finishes first (stream order)

    def __del__(self) -> None:  # pragma: no cover - GPU
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
