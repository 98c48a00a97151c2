"""Every point of the attention / sdpa tensor-core families (mma, and wgmma on Hopper) at a few shapes, against
the fused family and PyTorch, in one process on one GPU: where their shape defaults come from (docs/PERFORMANCE.md,
"Attention on tensor cores" and on).

Each point is verified (one fresh seed a shape, its float64 reference shared by the points) then timed (CUDA
events, read flush, median of 30); PyTorch (`F.scaled_dot_product_attention` with the mask; for the attention op
with its permutes) is timed in the same process. Prints, per op and shape, PyTorch, each family's shape defaults
(the fused family's only), the five fastest points and the fastest point of each family.

The timed mask is `--mask`: "random" (make_inputs: every key gets a nonzero mask, the mma family's masked path),
"zero" (no key masked, as in a batch without padding) or "padding" (zero but for the last quarter of each
sequence, at -30000: a padding mask like BERT's). Verification always runs on random masks.

    python3 benchmarks/attention_sweep.py [--dtype float16] [--ops sdpa,attention] [--mask random]
        [--families mma,wgmma] [--shapes 8x12x128x64,1x12x128x64,1x16x1024x64,4x16x512x128,2x8x2048x64]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

PADDED = -30000.0  # the "padding" mask of padded keys
SHAPES = "8x12x128x64,1x12x128x64,1x16x1024x64,4x16x512x128,2x8x2048x64"


OPS = ("sdpa", "attention")


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    from kernelmill.kernels.ops import get_op

    return [get_op("sdpa").parse_shape(s) for s in text.split(",") if s]


def _shapes(text: str) -> list[tuple[int, ...]]:
    """--shapes as an argparse type: a malformed shape is a one-line usage error."""
    from kernelmill.kernels.ops.base import SpecError

    try:
        shapes = parse_shapes(text)
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not shapes:
        raise argparse.ArgumentTypeError("expected comma-separated shapes, e.g. 8x12x128x64")
    return shapes


def _names(known: tuple[str, ...], what: str):
    """An argparse type: comma-separated names, each one of ``known``."""

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {what} of {', '.join(known)}")
        return names

    return parse


def timing_inputs(spec, shape, dtype: str, mask: str) -> dict:
    """make_inputs (seed 0) with the mask of kind `mask` (see the module docstring)."""
    import numpy as np

    inputs = spec.make_inputs(shape, dtype, seed=0)
    if mask != "random":
        values = np.zeros(inputs["mask"].shape, np.float32)
        if mask == "padding":
            seq = shape[2]
            values[:, seq - seq // 4 :] = PADDED
        inputs["mask"] = values.astype(inputs["mask"].dtype)
    return inputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--ops", default="sdpa,attention", type=_names(OPS, "ops"))
    parser.add_argument("--shapes", default=SHAPES, type=_shapes, help="comma-separated batch x heads x seq x head_dim")
    parser.add_argument("--mask", default="random", choices=("random", "zero", "padding"), help="the timed mask")
    parser.add_argument(
        "--families", default="mma,wgmma", type=_names(("mma", "wgmma"), "families"),
        help="the families whose whole spaces are swept",
    )  # fmt: skip
    args = parser.parse_args(argv)
    shapes = args.shapes

    from kernelmill.kernels.bench import L2Flusher, time_it, time_torch
    from kernelmill.kernels.compile import Compiler
    from kernelmill.kernels.defaults import default_params
    from kernelmill.kernels.device import GpuUnavailable, get_device
    from kernelmill.kernels.evaluate import evaluate
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.variant import BoundVariant, Variant
    from kernelmill.kernels.verify import ReferenceCache, fresh_seeds

    dtype = args.dtype
    try:
        device = get_device()
    except GpuUnavailable as exc:
        print(f"attention_sweep.py needs a CUDA GPU: {exc}", file=sys.stderr)
        return 3
    command = shlex.join(["python3", "benchmarks/attention_sweep.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"{device.info.name}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {command}", flush=True)
    compiler = Compiler()
    flusher = L2Flusher(device)
    cache = ReferenceCache()
    for opname in args.ops:
        spec = get_op(opname)
        variants = [
            Variant.create(opname, name, dtype, p) for name in args.families for p in spec.family(name).space(dtype)
        ]
        fused = Variant.create(opname, "fused", dtype, spec.family("fused").defaults(dtype))  # its defaults
        start = time.time()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda v: v.compile(compiler), [*variants, fused]))
        print(f"{opname}: compiled {len(variants) + 1} variants in {time.time() - start:.0f} s", flush=True)
        for shape in shapes:
            inputs = timing_inputs(spec, shape, dtype, args.mask)
            torch_us = time_torch(device, spec, inputs, {}, flusher, reps=50).median_ms * 1e3
            seeds = fresh_seeds(1)
            rows = []
            for v in [fused, *variants]:
                if v.check_shape(shape):
                    continue
                ev = evaluate(v, shape, device, compiler, seeds=seeds, reps=30, flusher=flusher, cache=cache)
                if not ev.ok:
                    print(f"  FAILED {v.describe()} {shape}: {ev.status} {ev.reason}", flush=True)
                    if ev.poisoned:  # the CUDA context is gone: nothing after this would run
                        return 1
                    continue
                timing = ev.timing
                if args.mask != "random":  # verified on random masks; timed on this one
                    bound = BoundVariant(device, v, ev.compiled, shape)
                    bound.set_inputs(inputs)
                    timing = time_it(device, bound.run, 5, 30, flusher)
                rows.append((timing.median_ms * 1e3, v))
            rows.sort(key=lambda r: r[0])
            head = f"{opname} {shape} {dtype} {args.mask} mask: torch {torch_us:.1f} us"
            for name in ("fused", *args.families):  # each family's shape defaults, where they ran
                chosen = default_params(spec, spec.family(name), shape, dtype, device.info.sm_count)
                us = next((us for us, v in rows if v.family.name == name and v.params == chosen), None)
                head += f", {name} defaults " + ("-" if us is None else f"{us:.1f} us")
            print(head, flush=True)
            best = {}
            for us, v in rows:
                best.setdefault(v.family.name, (us, v))
            shown = rows[:5] + [b for b in best.values() if b not in rows[:5]]
            for us, v in shown:
                print(f"    {us:8.1f} us  {torch_us / us:5.2f}x torch  {v.describe()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
