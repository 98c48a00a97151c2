"""One variant at one shape: compile, verify, time. Every outcome is data (STYLE.md rule 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernelmill.kernels.bench import L2Flusher, Timing, time_it
from kernelmill.kernels.compile import CompiledKernel, CompileError, Compiler, NvccMissing
from kernelmill.kernels.device import Device, DeviceFault
from kernelmill.kernels.ops.base import SpecError
from kernelmill.kernels.render import RenderError
from kernelmill.kernels.variant import BoundVariant, Variant
from kernelmill.kernels.verify import ReferenceCache, VerifyResult, verify

#: Trial statuses; the loop and the dashboard colour by these.
OK, COMPILE_ERROR, UNSUPPORTED, WRONG_RESULT, FAULT, TIMEOUT = (
    "ok",
    "compile_error",
    "unsupported",
    "wrong_result",
    "fault",
    "timeout",
)
TRIAL_STATUSES = (OK, COMPILE_ERROR, UNSUPPORTED, WRONG_RESULT, FAULT, TIMEOUT)


@dataclass
class Evaluation:
    variant: Variant
    shape: tuple[int, ...]
    status: str
    reason: str | None = None
    compiled: CompiledKernel | None = None
    verification: VerifyResult | None = None
    timing: Timing | None = None
    poisoned: bool = False  # the CUDA context is unusable after this evaluation
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK


def evaluate(
    variant: Variant,
    shape: tuple[int, ...],
    device: Device,
    compiler: Compiler | None = None,
    *,
    seeds: int | list[int] = 3,
    timed: bool = True,
    warmup: int = 5,
    reps: int = 50,
    flusher: L2Flusher | None = None,
    timeout_s: float = 10.0,
    arch: str | None = None,
    cache: ReferenceCache | None = None,
) -> Evaluation:
    """Compile, verify on fresh inputs, then (if verified and ``timed``) time with CUDA events."""
    reason = variant.check_shape(shape)
    if reason:
        return Evaluation(variant, shape, UNSUPPORTED, reason)
    try:
        compiled = variant.compile(compiler, arch)
    except NvccMissing:  # the machine, not the variant: every trial here would be "compile_error"
        raise
    except (CompileError, RenderError) as exc:  # a template that cannot render this point fails it alone
        return Evaluation(variant, shape, COMPILE_ERROR, str(exc))
    except SpecError as exc:  # no target on this GPU (wgmma off sm_90)
        return Evaluation(variant, shape, UNSUPPORTED, str(exc))
    result = Evaluation(variant, shape, OK, compiled=compiled)
    try:
        bound = BoundVariant(device, variant, compiled, shape)
    except SpecError as exc:
        result.status, result.reason = UNSUPPORTED, str(exc)
        return result
    except DeviceFault as exc:
        result.status, result.reason, result.poisoned = FAULT, exc.reason, exc.poisoned
        return result
    cache = cache if cache is not None else ReferenceCache()  # the check after timing reuses the references
    check = verify(device, bound, seeds, timeout_s=timeout_s, cache=cache)
    result.verification = check
    if not check.ok:
        result.status = check.status
        result.reason, result.poisoned = check.reason, check.poisoned
        return result
    if timed:
        try:
            # Timed on the inputs PyTorch is timed on (make_inputs' seed 0, its first kind), not on the last
            # verification seed's kind: attention's padding masks let a kernel skip whole key tiles.
            bound.set_inputs(variant.op.make_inputs(shape, variant.dtype, seed=0))
            result.timing = time_it(device, bound.run, warmup, reps, flusher, timeout_s)
            # The timed launches ran unwatched: one that wrote out of bounds there (a race, say) is as wrong as
            # one that did while verified.
            if why := bound.out_of_bounds():
                result.status, result.reason = WRONG_RESULT, f"{why} while timed"
                return result
        except DeviceFault as exc:
            status = TIMEOUT if exc.timed_out else FAULT
            result.status, result.reason, result.poisoned = status, f"{exc.reason} while timed", exc.poisoned
            return result
        # And once more after them, outputs poisoned: a kernel that stops working once launched enough (split-k
        # arrival counts left non-zero, so no block reduces) wrote nothing while timed, and was timed faster.
        again = verify(device, bound, [check.checks[-1].seed], timeout_s=timeout_s, cache=cache)
        if not again.ok:
            result.status, result.poisoned = again.status, again.poisoned
            result.reason = f"after {warmup + reps} timed launches: {again.reason}"
    return result
