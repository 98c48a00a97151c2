"""How fast can the GPU read weights, by read pattern? Read-only kernels over one buffer (721 MB by default:
the 4-block 4096-11008-4096 fp16 MLP stack), 16-byte ld.global.nc loads, UNROLL in flight per thread.

* sweep:  the whole grid walks the buffer together (grid-stride), the best case;
* slice:  each block reads its own contiguous slice (1 / grid of the buffer);
* strip:  rows of `grid x width` bytes; block b reads bytes [b * width, (b + 1) * width) of every row
          (the column strips of a skinny GEMV on a row-major K x N weight).

Blocks of 1024 threads, one per SM. Informs templates/mlp_stack/persistent.cu.j2 (docs/PERFORMANCE.md).

    python3 benchmarks/read_patterns.py [--mb 721] [--reps 10]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import UTC, datetime

import numpy as np

SOURCE = r"""
#include <stdint.h>
__device__ __forceinline__ uint4 ld(const uint4* q) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(q));
  return v;
}
// A use of every loaded word that the compiler cannot drop (the store never happens).
#define KEEP(v) acc += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w)
#define ZERO make_uint4(0, 0, 0, 0)
extern "C" __global__ void sweep(const uint4* __restrict__ p, int n16, float* out) {
  float acc = 0.f;
  const long long stride = (long long)gridDim.x * blockDim.x * UNROLL;
  for (long long i = (long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x; i < n16; i += stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long j = i + (long long)u * blockDim.x;
      v[u] = j < n16 ? ld(p + j) : ZERO;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) KEEP(v[u]);
  }
  if (acc == 1.2345f) out[0] = acc;
}
extern "C" __global__ void slice(const uint4* __restrict__ p, int n16, float* out) {
  const long long per = n16 / gridDim.x, s0 = per * blockIdx.x;
  float acc = 0.f;
  for (long long i = s0 + threadIdx.x; i < s0 + per; i += (long long)blockDim.x * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long j = i + (long long)u * blockDim.x;
      v[u] = j < s0 + per ? ld(p + j) : ZERO;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) KEEP(v[u]);
  }
  if (acc == 1.2345f) out[0] = acc;
}
// Rows of row16 16-byte words; block b reads words [b * w16, (b + 1) * w16) of every row.
extern "C" __global__ void strip(const uint4* __restrict__ p, int rows, int row16, int w16, float* out) {
  const int c0 = w16 * blockIdx.x, lanes_per_row = blockDim.x / w16;
  const int cl = threadIdx.x % w16, r = threadIdx.x / w16;
  float acc = 0.f;
  if (r < lanes_per_row)
    for (int k = r; k < rows; k += lanes_per_row * UNROLL) {
      uint4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int kk = k + u * lanes_per_row;
        v[u] = kk < rows ? ld(p + (long long)kk * row16 + c0 + cl) : ZERO;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) KEEP(v[u]);
    }
  if (acc == 1.2345f) out[0] = acc;
}
"""


MAX_MB = 16_000  # the kernels index 16-byte words with an int: under 2**31 of them


def _mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size in MB, e.g. 721") from None
    if not 1 <= value <= MAX_MB:
        raise argparse.ArgumentTypeError(f"{text!r}: from 1 to {MAX_MB} MB")
    return value


def _reps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=_mb, default=4 * 2 * 4096 * 11008 * 2 / 1e6, help="buffer size, MB")
    parser.add_argument("--reps", type=_reps, default=10)
    args = parser.parse_args(argv)

    from kernelmill.kernels.compile import Compiler
    from kernelmill.kernels.device import GpuUnavailable, get_device

    try:
        device = get_device()
    except GpuUnavailable as exc:
        print(f"read_patterns.py needs a CUDA GPU: {exc}", file=sys.stderr)
        return 3
    sms = device.info.sm_count
    n16 = int(args.mb * 1e6) // 16 // (sms * 64) * (sms * 64)  # whole slices and 64-word strips
    buf, out = device.alloc(n16 * 16), device.alloc(4)
    device.copy_in(buf, np.random.default_rng(0).integers(0, 2**32, n16 * 4, dtype=np.uint32))  # like weights
    command = shlex.join(["python3", "benchmarks/read_patterns.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"{device.info.name}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {command}")
    print(f"{sms} SMs, {n16 * 16 / 1e6:.0f} MB, blocks of 1024 threads, one per SM")

    def time_us(kernel, args_) -> float:
        for _ in range(2):
            kernel.launch((sms, 1, 1), (1024, 1, 1), 0, args_)
        start, end = device.event(), device.event()
        start.record()
        for _ in range(args.reps):
            kernel.launch((sms, 1, 1), (1024, 1, 1), 0, args_)
        end.record()
        end.synchronize()
        return end.time_since(start) * 1e3 / args.reps

    cases = [("sweep", "sweep", [buf, n16, out], n16), ("slice", "slice", [buf, n16, out], n16)]
    for w16 in (11, 32, 64):  # 176-, 512- and 1024-byte strips
        rows = n16 // (sms * w16)
        cases.append((f"strip {w16 * 16} B", "strip", [buf, rows, sms * w16, w16, out], rows * sms * w16))
    print(f"{'pattern':34s} {'us':>8s} {'GB/s':>7s}")
    for unroll in (4, 8):
        compiled = Compiler().compile(SOURCE, device.info.arch, extra_flags=(f"-DUNROLL={unroll}",))
        module = device.load(compiled.cubin, compiled.key)
        for name, entry, kargs, words in cases:
            t = time_us(module.kernel(entry), kargs)
            print(f"{name + f' (unroll {unroll})':34s} {t:8.1f} {words * 16 / t / 1e3:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
