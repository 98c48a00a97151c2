"""Timing with CUDA events (DESIGN.md, measurement rules) and the roofline ceilings.

Warm-up first; L2 flushed between repetitions so every repetition reads from
DRAM; median and spread reported. A PyTorch baseline is timed the same way,
on the same stream of the same context, in the same process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kernelmill.kernels.device import Buffer, Device
from kernelmill.kernels.ops.base import OpSpec

log = logging.getLogger(__name__)


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    p10_ms: float
    p90_ms: float
    n: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how much to trust a difference between two timings."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else float("nan")

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "spread": self.spread}

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> Timing:
        if not samples_ms:
            raise ValueError("no timing samples")
        ordered = sorted(samples_ms)
        # Inclusive: p10 and p90 lie between the samples ("exclusive" extrapolates past them for fewer than 9, as
        # bench_reps allows: 5 samples of 1.0-5.0 ms gave a p90 of 6.5, 2 gave a p10 below 0).
        q = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) >= 2 else [ordered[0]] * 9
        return cls(statistics.median(ordered), ordered[0], q[0], q[-1], len(ordered))


#: The flush kernel: reads every 16 bytes of the buffer and keeps the loads alive with a store that a
#: never-matching key guards.
_READ_FLUSH_SOURCE = r"""
extern "C" __global__ void km_l2_read_flush(const uint4* __restrict__ p, int n, unsigned key, unsigned* out) {
  unsigned acc = 0u;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == key) out[0] = acc;
}
"""


class L2Flusher:
    """Reads a buffer twice the L2's size so the next kernel starts with a cold cache.

    Reads, not writes: a memset flush leaves the L2 full of dirty lines, and their write-back to DRAM
    then runs during the timed kernel and takes bandwidth from it (on an H100 it added ~9 us to a 32 MB
    GEMV, for PyTorch's kernels and ours alike). ``mode="write"`` keeps the memset flush (and is the
    fallback when the read kernel cannot be compiled here).
    """

    def __init__(self, device: Device, mode: str = "read", compiler: Any = None) -> None:
        if mode not in ("read", "write"):
            raise ValueError(f"flush mode {mode!r}: use 'read' or 'write'")
        self.device = device
        self.buffer: Buffer = device.alloc(max(2 * device.info.l2_bytes, 64 << 20) // 16 * 16)
        self.device.fill(self.buffer, 0)
        self._byte = 0
        self._kernel = None
        self._out = device.alloc(16)
        self.mode = mode
        if mode == "read":
            try:
                from kernelmill.kernels.compile import Compiler

                compiled = (compiler or Compiler()).compile(_READ_FLUSH_SOURCE, device.info.arch)
                self._kernel = device.load(compiled.cubin, compiled.key).kernel("km_l2_read_flush")
            except Exception as exc:  # noqa: BLE001 - any failure leaves the memset flush, said once
                log.warning("L2 flush: the read kernel is unavailable (%s); flushing with memset", exc)
                self.mode = "write"
        self._grid = (4 * device.info.sm_count, 1, 1)

    def flush(self) -> None:
        if self._kernel is None:
            self._byte = (self._byte + 1) & 0x7F
            self.device.fill(self.buffer, self._byte)
            return
        self._kernel.launch(self._grid, (512, 1, 1), 0, [self.buffer, self.buffer.nbytes // 16, -1, self._out])


def time_it(
    device: Device,
    enqueue: Callable[[], Any],
    warmup: int = 5,
    reps: int = 50,
    flusher: L2Flusher | None = None,
    timeout_s: float | None = None,
) -> Timing:
    """Median of ``reps`` event-timed runs of ``enqueue`` on the default stream.

    With ``timeout_s`` a run that hangs is a DeviceFault (timed out, poisoned) instead of a wait for ever: the
    first warm-up run gets ``timeout_s``, the rest together ``timeout_s`` plus three times that run's wall
    time for each of them (a kernel that only hangs when run again, say on counters it left set)."""
    started = time.perf_counter()
    if warmup:
        enqueue()
        device.synchronize(timeout_s)
    once = time.perf_counter() - started
    for _ in range(warmup - 1):
        enqueue()
    events = [(device.event(), device.event()) for _ in range(reps)]
    for start, end in events:
        if flusher is not None:
            flusher.flush()
        start.record()
        enqueue()
        end.record()
    device.synchronize(None if timeout_s is None else timeout_s + 3 * once * (warmup + reps))
    return Timing.from_samples([end.time_since(start) for start, end in events])


# -- ceilings -------------------------------------------------------------------


@dataclass
class Ceilings:
    """Measured limits of one device: copy bandwidth and matrix rate per precision ("tf32" as well as dtypes)."""

    device_name: str
    copy_gbps: float
    matrix_tflops: dict[str, float]

    def floor_ms(self, op: OpSpec, shape: tuple[int, ...], dtype: str, precision: str | None = None) -> float:
        """Roofline floor: the larger of bytes / copy bandwidth and flops / the matrix rate of ``precision``
        (the dtype's where not given; a TF32 kernel against the TF32 rate)."""
        memory_ms = op.min_bytes(shape, dtype) / (self.copy_gbps * 1e9) * 1e3
        compute_ms = 0.0
        rate = self.matrix_tflops.get(precision or dtype)
        if op.matrix_bound and rate:
            compute_ms = op.flops(shape) / (rate * 1e12) * 1e3
        return max(memory_ms, compute_ms)


def measure_copy_gbps(device: Device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src, dst = device.alloc(nbytes), device.alloc(nbytes)
    device.fill(src, 0x3C)
    timing = time_it(device, lambda: device.copy(dst, src, nbytes), warmup=3, reps=reps)
    return 2 * nbytes / (timing.median_ms * 1e-3) / 1e9


def measure_matrix_tflops(device: Device, precision: str, n: int = 8192, reps: int = 10) -> float | None:
    """Dense matrix rate through PyTorch (cuBLAS) on random data, in a dtype or "tf32" (float32 data, TF32
    arithmetic; float32 itself is IEEE); None without torch."""
    torch = _torch()
    if torch is None:
        return None
    tdtype = torch.float32 if precision == "tf32" else getattr(torch, precision)
    a = torch.randn(n, n, device="cuda", dtype=tdtype)
    b = torch.randn(n, n, device="cuda", dtype=tdtype)
    with allow_tf32(torch, precision == "tf32"):
        timing = time_it(device, lambda: torch.matmul(a, b), warmup=3, reps=reps)
    return 2 * n**3 / (timing.median_ms * 1e-3) / 1e12


_ceilings: dict[tuple[int, tuple[str, ...]], Ceilings] = {}


def ceilings(device: Device, dtypes: tuple[str, ...] = ()) -> Ceilings:
    """Measured once per process and device (and per set of matrix precisions: dtypes, "tf32")."""
    key = (device.ordinal, tuple(sorted(dtypes)))
    if key not in _ceilings:
        rates = {}
        for dtype in dtypes:
            rate = measure_matrix_tflops(device, dtype)
            if rate is not None:
                rates[dtype] = rate
        _ceilings[key] = Ceilings(device.info.name, measure_copy_gbps(device), rates)
    return _ceilings[key]


# -- PyTorch baseline --------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError:
        _say_no_baseline("PyTorch is not installed here")
        return None
    if not torch.cuda.is_available():
        _say_no_baseline(f"this PyTorch ({torch.__version__}) has no CUDA")
        return None
    return torch


@functools.cache
def _say_no_baseline(why: str) -> None:
    """Once a process: without PyTorch on the GPU a job runs and serves kernels with no baseline to compare."""
    log.warning("no PyTorch baseline: %s; kernels are tuned and served without a speedup (install torch)", why)


def to_torch(array: np.ndarray):
    """Host array (float32/float16/bfloat16) -> CUDA tensor of the same dtype."""
    torch = _torch()
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(array)).cuda()


def time_torch(
    device: Device,
    op: OpSpec,
    inputs: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
    flusher: L2Flusher | None,
    warmup: int = 5,
    reps: int = 50,
    precision: str | None = None,
) -> Timing | None:
    """PyTorch's time for the same op and inputs, or None when torch (with CUDA) is absent, or when a kernel
    faulted in this context (nothing launches there any more). With ``precision`` "tf32", PyTorch may compute
    float32 matmuls in TF32 as well (``torch.set_float32_matmul_precision("high")``), so that a TF32 kernel is
    compared with PyTorch in the same precision."""
    if device.poisoned:
        log.warning("no PyTorch baseline: a kernel faulted and left this process's CUDA context unusable")
        return None
    torch = _torch()
    if torch is None:
        return None
    tensors = {name: to_torch(arr) for name, arr in inputs.items()}
    thunk = op.torch_reference(tensors, attrs)
    if thunk is None:
        return None
    with allow_tf32(torch, precision == "tf32"):
        return time_it(device, thunk, warmup, reps, flusher)


@contextlib.contextmanager
def allow_tf32(torch, allowed: bool) -> Iterator[None]:
    """PyTorch's float32 matmuls in TF32 (``allowed``) or IEEE float32 for the block, then as they were."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if allowed else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
