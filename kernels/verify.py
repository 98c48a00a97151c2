"""Verification against float64 references (DESIGN.md, measurement rules).

Fresh random inputs for several seeds (at least one for each kind of input the
op draws), outputs poisoned with NaN before each launch, a tolerance set by the
variant's arithmetic precision and the op's shape (a relative norm, and a bound
on each element: ops.base.Tolerance). NaN never passes, and neither does a launch that wrote outside its
outputs (a guard byte around any buffer, or an input, changed). The result is data:
per-seed errors and, on failure, why.
"""

from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kernelmill.kernels.device import Device, DeviceFault
from kernelmill.kernels.ops.base import Tolerance, format_shape
from kernelmill.kernels.variant import BoundVariant


@dataclass
class SeedCheck:
    """One seed's comparison of one output tensor with its reference, under a tolerance."""

    tolerance: Tolerance
    seed: int
    output: str
    rel_err: float  # ||out - ref|| / ||ref||
    max_abs_rel_err: float  # max |out - ref| / max |ref|
    nan_count: int
    first_bad_index: tuple[int, ...] | None = None
    #: max over elements of |out - ref| / (what the tolerance allows that element): above 1 fails
    allowance_used: float = 0.0
    worst_element: tuple[int, ...] | None = None  # where allowance_used is reached
    worst_values: tuple[float, float] | None = None  # (out, ref) there

    def failure(self) -> str | None:
        """Why this output fails its tolerance, or None."""
        tolerance = self.tolerance
        norm = tolerance.norm
        if self.nan_count:
            return (
                f"{self.output}: {self.nan_count} non-finite elements (unwritten or overflow), first at "
                f"{self.first_bad_index} (seed {self.seed})"
            )
        if not self.rel_err <= norm:
            return f"{self.output}: relative error {self.rel_err:.3g} > tolerance {norm:g} (seed {self.seed})"
        if not self.max_abs_rel_err <= norm:
            return (
                f"{self.output}: max elementwise error {self.max_abs_rel_err:.3g} of max|ref| > tolerance "
                f"{norm:g}, worst at {self.first_bad_index} (seed {self.seed})"
            )
        if not self.allowance_used <= 1.0:
            got, want = self.worst_values or (float("nan"), float("nan"))
            return (
                f"{self.output}: element {self.worst_element} is {got:.6g} where {want:.6g} is right, "
                f"{self.allowance_used:.3g}x the error allowed there ({tolerance.rtol:.2g} of itself + "
                f"{tolerance.atol_rms:.2g} of the output's rms) (seed {self.seed})"
            )
        return None


@dataclass
class VerifyResult:
    ok: bool
    status: str  # "ok", "wrong_result", "fault" or "timeout" (evaluate's trial statuses)
    precision: str
    tolerance: float  # relative norm
    shape: tuple[int, ...]
    checks: list[SeedCheck] = field(default_factory=list)
    reason: str | None = None
    poisoned: bool = False  # a fault left the CUDA context unusable
    rtol: float = 0.0  # per element: the share of its own size and of the output's rms allowed (Tolerance)
    atol_rms: float = 0.0

    @property
    def allowance_used(self) -> float | None:
        """The largest share of its per-element allowance any finite element used (above 1 fails)."""
        return max((c.allowance_used for c in self.checks if math.isfinite(c.allowance_used)), default=None)

    @property
    def max_rel_err(self) -> float:
        """The largest relative error, NaN where an output had non-finite elements (max() over a NaN gave the
        other seeds' error or NaN, by which came first)."""
        errors = [c.rel_err for c in self.checks]
        return float("nan") if not errors or any(math.isnan(e) for e in errors) else max(errors)

    def per_seed(self) -> dict[int, float]:
        """Max relative error per seed (over outputs), for the seeds whose outputs were finite: one with NaN has
        no error to give (it was said to be 0.0), its check's nan_count tells."""
        nonfinite = {c.seed for c in self.checks if math.isnan(c.rel_err)}
        out: dict[int, float] = {}
        for c in self.checks:
            if c.seed not in nonfinite:
                out[c.seed] = max(out.get(c.seed, 0.0), c.rel_err)
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "max_rel_err": self.max_rel_err}


#: Elements a chunk of the per-element check holds: its float64 temporaries stay at 128 MiB.
_CHUNK = 1 << 24


def compare(out: np.ndarray, ref: np.ndarray, seed: int, name: str, tolerance: Tolerance) -> SeedCheck:
    """Errors of ``out`` against the float64 ``ref`` (in place and BLAS-backed: outputs can be 100 M elements),
    and the share of ``tolerance``'s per-element allowance the worst element uses."""
    diff = out.astype(np.float64).reshape(-1)  # float64 checks are faster than float16 ones in NumPy
    bad = ~np.isfinite(diff)
    nan_count = int(np.count_nonzero(bad))
    if nan_count:
        first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), out.shape))
        return SeedCheck(tolerance, seed, name, float("nan"), float("nan"), nan_count, first, float("nan"))
    if ref.size == 0:
        return SeedCheck(tolerance, seed, name, 0.0, 0.0, 0)
    flat_ref = ref.reshape(-1)
    np.subtract(diff, flat_ref, out=diff)
    np.abs(diff, out=diff)
    diff_norm = float(np.sqrt(np.dot(diff, diff)))
    ref_norm = float(np.sqrt(np.dot(flat_ref, flat_ref)))
    rms = ref_norm / math.sqrt(flat_ref.size)
    worst_flat = int(np.argmax(diff))
    worst_abs = float(diff[worst_flat])
    ref_max = float(max(flat_ref.max(), -flat_ref.min()))
    # float16 outputs cannot hold values below its smallest normal number to relative precision (an output
    # of one element of 1e-6 is a subnormal with 6% steps): errors are relative to at least that size.
    tiny = float(np.finfo(np.float16).tiny) if out.dtype == np.float16 else 0.0
    ref_norm, ref_max = max(ref_norm, tiny * np.sqrt(flat_ref.size)), max(ref_max, tiny)
    rel = diff_norm / ref_norm if ref_norm > 0 else diff_norm
    max_abs_rel = worst_abs / ref_max if ref_max > 0 else worst_abs
    worst = tuple(int(i) for i in np.unravel_index(worst_flat, ref.shape))
    # Per element: rtol of its own size, atol_rms of the output's rms, and the format's smallest step near zero
    # (float16's subnormal step; float32's smallest normal for the rest: kernels flush denormals).
    floor = 2.0**-24 if out.dtype == np.float16 else float(np.finfo(np.float32).tiny)
    atol = tolerance.atol_rms * rms + floor
    used, used_at = 0.0, 0
    for start in range(0, flat_ref.size, _CHUNK):
        part = slice(start, start + _CHUNK)
        allowed = np.abs(flat_ref[part])
        allowed *= tolerance.rtol
        allowed += atol
        np.divide(diff[part], allowed, out=allowed)
        at = int(np.argmax(allowed))
        if allowed[at] > used:
            used, used_at = float(allowed[at]), start + at
    check = SeedCheck(tolerance, seed, name, rel, max_abs_rel, 0, worst, used)
    check.worst_element = tuple(int(i) for i in np.unravel_index(used_at, ref.shape))
    check.worst_values = (float(out.reshape(-1)[used_at]), float(flat_ref[used_at]))
    return check


class ReferenceCache:
    """Inputs and float64 references by (problem, seed), so trials of one search share them.

    The seeds are still fresh random ones (drawn per search); only the host-side
    reference, which can take seconds at large shapes, is computed once.
    """

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, tuple[dict, dict, int]] = OrderedDict()
        self._bytes = 0

    def get(self, op, shape, dtype, attrs, seed) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        key = (op.name, tuple(shape), dtype, tuple(sorted(attrs.items())), seed)
        if key in self._entries:
            self._entries.move_to_end(key)
            inputs, reference, _ = self._entries[key]
            return inputs, reference
        inputs = op.make_inputs(shape, dtype, seed)
        reference = op.reference(inputs, attrs)
        size = sum(a.nbytes for a in (*inputs.values(), *reference.values()))
        self._entries[key] = (inputs, reference, size)
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped
        return inputs, reference


def fresh_seeds(n: int, kinds: int = 1) -> list[int]:
    """New random seeds every call, recorded in the result so a failure can be replayed: at least one for each
    of an op's ``kinds`` of input (OpSpec.input_kinds, drawn by seed % kinds), and ``n`` in all if more."""
    seeds = [secrets.randbits(31) for _ in range(max(n, kinds))]
    return [s - s % kinds + i % kinds for i, s in enumerate(seeds)]


def verify(
    device: Device,
    bound: BoundVariant,
    seeds: Sequence[int] | int = 3,
    timeout_s: float = 10.0,
    tolerance: Tolerance | None = None,
    cache: ReferenceCache | None = None,
) -> VerifyResult:
    """Run ``bound`` on fresh inputs per seed and compare every output with the float64 reference."""
    variant = bound.variant
    op, shape = variant.op, bound.shape
    precision = variant.precision
    tol = tolerance if tolerance is not None else op.tolerance(shape, precision)
    seed_list = fresh_seeds(seeds, len(op.input_kinds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:  # a verification that ran nothing must not pass
        raise ValueError("verify needs at least one seed")
    result = VerifyResult(
        ok=True, status="ok", precision=precision, tolerance=tol.norm, shape=shape, rtol=tol.rtol,
        atol_rms=tol.atol_rms,
    )  # fmt: skip
    for seed in seed_list:
        if cache is not None:
            inputs, reference = cache.get(op, shape, variant.dtype, variant.attrs, seed)
        else:
            inputs = op.make_inputs(shape, variant.dtype, seed)
            reference = op.reference(inputs, variant.attrs)
        try:
            bound.set_inputs(inputs)
            bound.poison()
            bound.run()
            device.synchronize(timeout_s)
            outputs = bound.outputs()
            stray = bound.stray_write(inputs)
        except DeviceFault as exc:
            result.ok = False
            result.status = "timeout" if exc.timed_out else "fault"
            result.reason = f"device fault at {format_shape(shape)}: {exc.reason}"
            result.poisoned = exc.poisoned
            return result
        if stray:
            result.ok, result.status = False, "wrong_result"
            result.reason = f"{stray} at {format_shape(shape)} (seed {seed})"
            return result
        for name in op.outputs:
            check = compare(outputs[name], reference[name], seed, name, tol)
            result.checks.append(check)
            why = check.failure()
            if why and result.ok:
                result.ok, result.status = False, "wrong_result"
                result.reason = f"wrong result at {format_shape(shape)}: {why}"
    return result
