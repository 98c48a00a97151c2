"""CUDA graph capture and replay of a forward pass (cuda-python's driver API on pycuda's stream).

pycuda owns the context and the stream; ``cuda.bindings.driver`` (the ``cuda-bindings`` package of the
gpu extra) captures what the runtime enqueues on that stream: cuStreamBeginCapture (relaxed mode, so
the pooled allocator may still allocate), the forward's launches, cuStreamEndCapture, cuGraphInstantiate;
each replay is one cuGraphLaunch. Every buffer allocated during the capture is owned by the graph, so
memory the graph writes is never handed to anyone else.

Programmatic dependent launch (PDL, sm_90): with ``pdl=True`` the edge from a kernel node to the next
kernel of a PDL family (``Family.pdl``: its kernels call ``griddepcontrol.wait`` before touching any
buffer) is made programmatic while it is captured (``make_programmatic``). The driver then launches the
next kernel as soon as every block of the one before has passed its own wait and called
``griddepcontrol.launch_dependents``; its blocks take SMs as they free up, set up (the wgmma GEMM also
prefetches its first B stages into L2) and wait for the previous grid to complete, so the launch and the
set-up overlap the previous kernel's tail.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kernelmill.runtime.tensor import Tensor

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


def make_programmatic(stream_handle: int) -> bool:
    """While ``stream_handle`` is being captured, before a PDL kernel's launch: when the next node would
    depend on exactly one node and that is a kernel, the dependency becomes a programmatic edge (the next
    kernel may start once every block of that kernel has called launch_dependents, and waits for it in
    griddepcontrol.wait). Returns whether it did; bindings older than CUDA 12.3 (no edge data) never do."""
    driver = _driver()
    stream = driver.CUstream(stream_handle)
    get_info = getattr(driver, "cuStreamGetCaptureInfo_v3", None) or driver.cuStreamGetCaptureInfo
    update = getattr(driver, "cuStreamUpdateCaptureDependencies_v2", None) or driver.cuStreamUpdateCaptureDependencies
    info = get_info(stream)
    if len(info) != 7:  # (err, status, id, graph, nodes, edge data, count) from 12.3 on
        return False
    err, status, _id, _graph, nodes, _edges, count = info
    active = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    if err != driver.CUresult.CUDA_SUCCESS or status != active or count != 1:
        return False
    node = nodes[0]
    kind = _check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
    if kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
        return False
    edge = driver.CUgraphEdgeData()
    edge.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    edge.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    flags = driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
    _check(update(stream, [node], [edge], 1, flags), "cuStreamUpdateCaptureDependencies")
    return True


class CapturedForward:
    """One static-shape forward captured as a CUDA graph: static inputs, the output, the graph.

    ``programmatic_edges`` counts the kernel-to-kernel edges captured as programmatic (``pdl=True``)."""

    def __init__(
        self, backend, fn: Callable[..., Tensor], inputs: tuple[Tensor | None, ...], pdl: bool = False
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
        with backend.keep_allocations() as kept, backend.capturing(make_programmatic if pdl else None) as edges:
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
        self._kept = kept
        self.programmatic_edges = edges[0]
        self.output = output
        try:
            self._exec = _check(driver.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        except TypeError:  # bindings where flags go through cuGraphInstantiateWithFlags
            self._exec = _check(driver.cuGraphInstantiateWithFlags(self._graph, 0), "cuGraphInstantiateWithFlags")
        _nodes, count = _check(driver.cuGraphGetNodes(self._graph, 0), "cuGraphGetNodes")
        self.nodes = int(count)  # kernel launches + copies captured

    def replay(self, inputs: tuple[Tensor | None, ...], copy_output: bool = True) -> Tensor:
        """Copies ``inputs`` into the static inputs, launches the graph; the output (a copy by default:
        the graph's own output is overwritten by the next replay)."""
        for static, new in zip(self.inputs, inputs, strict=True):
            if static is not None and new is not static:
                static.copy_(new)
        _check(_driver().cuGraphLaunch(self._exec, self._stream), "cuGraphLaunch")
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

    def __del__(self) -> None:  # pragma: no cover - GPU
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
