"""Evaluators turn candidates into trial results on a GPU (or, for tests of the loop's logic, a fake).

Results are plain data so they can cross a Dask boundary. A candidate whose
evaluation poisoned the CUDA context ends the batch: the rest come back as
``skipped`` (never recorded, so they are proposed again on a fresh context).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kernelmill.agents.space import Candidate

log = logging.getLogger(__name__)

SKIPPED = "skipped"


@dataclass
class TrialResult:
    family: str
    params: dict[str, Any]
    status: str
    reason: str | None = None
    arch: str | None = None
    variant_key: str | None = None
    #: ``kernels.render.code_digest`` of the source its cubin was built from (None: not built, or a fake's)
    code_sha256: str | None = None
    ptxas: dict[str, Any] | None = None
    max_rel_err: float | None = None
    verify: dict[str, Any] | None = None
    median_ms: float | None = None
    min_ms: float | None = None
    spread: float | None = None
    reps: int | None = None
    roofline_pct: float | None = None  # roofline floor / median time, against this GPU's measured ceilings
    cubin: bytes | None = None
    poisoned: bool = False
    note: str | None = None

    @property
    def candidate(self) -> Candidate:
        return Candidate.of(self.family, self.params)

    def row(self) -> dict[str, Any]:
        """Columns for the store's trial table."""
        data = asdict(self)
        data.pop("poisoned")
        data["params_key"] = self.candidate.params_json
        return data


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    arch: str
    extra: dict[str, Any] = field(default_factory=dict)


class Evaluator(Protocol):
    def facts(self) -> DeviceFacts:
        """The GPU this evaluator runs on."""
        ...

    def baseline_ms(
        self, op: str, shape: Sequence[int], dtype: str, attrs: Mapping[str, Any], precision: str | None = None
    ) -> float | None:
        """PyTorch's median time for the problem on this GPU, computing in ``precision`` (the search's: "tf32"
        lets PyTorch's float32 matmuls use TF32 too), or None where torch is absent."""
        ...

    def evaluate(
        self, op: str, shape: Sequence[int], dtype: str, attrs: Mapping[str, Any], candidates: Sequence[Candidate]
    ) -> list[TrialResult]:
        """One result per candidate, in order: compiled in parallel, then verified and timed."""
        ...

    def profile(
        self, op: str, shape: Sequence[int], dtype: str, attrs: Mapping[str, Any], candidate: Candidate
    ) -> dict[str, Any]:
        """Profiler metrics of one candidate (ncu), or {"error": why, "unavailable": bool} where it cannot be
        profiled: ``unavailable`` False where only this candidate failed (it hung or crashed under ncu), True (or
        absent) where the profiler cannot run here at all."""
        ...


class LocalEvaluator:
    """Runs on this process's GPU (a Dask worker's, or the CLI's when embedded)."""

    def __init__(self, ordinal: int = 0, seeds: int = 3, reps: int = 30, timeout_s: float = 10.0) -> None:
        from kernelmill.kernels.bench import L2Flusher
        from kernelmill.kernels.compile import Compiler
        from kernelmill.kernels.device import get_device

        self.device = get_device(ordinal)
        self.compiler = Compiler()
        self.flusher = L2Flusher(self.device)
        from kernelmill.kernels.verify import ReferenceCache

        self.seeds, self.reps, self.timeout_s = seeds, reps, timeout_s
        # Fresh seeds per problem, drawn once per worker process: every trial of a search is
        # checked on the same random inputs, whose float64 reference is computed once.
        self._problem_seeds: dict[tuple, list[int]] = {}
        self.references = ReferenceCache()

    def ceilings(self):
        """This GPU's measured copy bandwidth and matrix rates (once per process)."""
        from kernelmill.kernels.bench import ceilings

        return ceilings(self.device, ("float32", "tf32", "float16", "bfloat16"))

    def facts(self) -> DeviceFacts:
        info = self.device.info
        ceil = self.ceilings()
        extra = {**info.to_dict(), "copy_gbps": ceil.copy_gbps, "matrix_tflops": ceil.matrix_tflops}
        return DeviceFacts(info.name, info.arch, extra)

    def profile(self, op, shape, dtype, attrs, candidate):
        from kernelmill.kernels.profile import ProfileFailed, ProfileUnavailable, profile

        try:
            arch = self.device.info.arch + self.op_family(op, candidate.family).arch_suffix
            return profile(op, candidate.family, dtype, candidate.params, tuple(shape), dict(attrs), arch).to_dict()
        except ProfileFailed as exc:
            return {"error": str(exc), "unavailable": isinstance(exc, ProfileUnavailable)}

    @staticmethod
    def op_family(op: str, family: str):
        from kernelmill.kernels.ops import get_op

        return get_op(op).family(family)

    def _usable(self) -> None:
        """GpuUnavailable where a kernel left this process's CUDA context unusable: every later launch would
        fail there, and be recorded as the fault of the variant that ran it. (A service's worker is replaced
        after such a batch, and the job resumes on the new one; a process of its own must end.)"""
        from kernelmill.kernels.device import GpuUnavailable

        if self.device.poisoned:
            raise GpuUnavailable("a kernel faulted and left this process's CUDA context unusable")

    def baseline_ms(self, op, shape, dtype, attrs, precision=None):
        from kernelmill.kernels.bench import time_torch
        from kernelmill.kernels.ops import get_op

        self._usable()
        spec = get_op(op)
        inputs = spec.make_inputs(tuple(shape), dtype, seed=0)
        timing = time_torch(
            self.device, spec, inputs, spec.resolve_attrs(attrs), self.flusher, reps=self.reps, precision=precision
        )
        return timing.median_ms if timing else None

    def evaluate(self, op, shape, dtype, attrs, candidates):
        from kernelmill.kernels.compile import CompileError, NvccMissing
        from kernelmill.kernels.evaluate import evaluate
        from kernelmill.kernels.ops import get_op
        from kernelmill.kernels.ops.base import SpecError
        from kernelmill.kernels.render import RenderError
        from kernelmill.kernels.variant import Variant
        from kernelmill.kernels.verify import fresh_seeds

        shape = tuple(shape)
        problem = (op, shape, dtype, tuple(sorted(attrs.items())))
        seeds = self._problem_seeds.setdefault(problem, fresh_seeds(self.seeds, len(get_op(op).input_kinds)))
        variants = []
        for cand in candidates:
            try:
                variants.append(Variant.create(op, cand.family, dtype, cand.params, attrs))
            except SpecError as exc:
                variants.append(exc)
        self._usable()
        arch = self.device.info.arch
        # Compile the whole batch in parallel first (per nvcc target); evaluate() then finds each in the cache,
        # or its failure in the compiler's memory. A variant with no target here, evaluate() records unsupported.
        targets: dict[str, list[str]] = {}
        for v in variants:
            if isinstance(v, Variant):
                with contextlib.suppress(SpecError, RenderError):  # evaluate() records a RenderError as the trial's
                    target, source = v.family.target(arch, v.params), v.source
                    targets.setdefault(target, []).append(source)
        for target, sources in targets.items():
            self.compiler.compile_many(sources, target)
        results: list[TrialResult] = []
        poisoned = False
        for cand, variant in zip(candidates, variants, strict=True):
            if poisoned:
                results.append(TrialResult(cand.family, cand.params, SKIPPED, "context poisoned earlier in the batch"))
                continue
            if isinstance(variant, SpecError):
                results.append(TrialResult(cand.family, cand.params, "unsupported", str(variant)))
                continue
            try:
                ev = evaluate(
                    variant,
                    shape,
                    self.device,
                    self.compiler,
                    seeds=seeds,
                    reps=self.reps,
                    flusher=self.flusher,
                    timeout_s=self.timeout_s,
                    arch=arch + variant.family.arch_suffix,
                    cache=self.references,
                )
            except NvccMissing:  # no nvcc on this worker: the machine's failure, not the candidate's
                raise
            except CompileError as exc:  # pragma: no cover - evaluate() already turns these into data
                results.append(TrialResult(cand.family, cand.params, "compile_error", str(exc)))
                continue
            res = _result(cand, ev, variant)
            if res.median_ms:
                floor_ms = self.ceilings().floor_ms(variant.op, shape, dtype, variant.precision)
                res.roofline_pct = 100.0 * floor_ms / res.median_ms
            results.append(res)
            poisoned = ev.poisoned
        return results


def _result(cand: Candidate, ev, variant) -> TrialResult:
    from kernelmill.kernels.render import code_digest

    res = TrialResult(cand.family, cand.params, ev.status, ev.reason, poisoned=ev.poisoned)
    if ev.compiled is not None:
        res.arch, res.variant_key = ev.compiled.arch, ev.compiled.key
        res.code_sha256 = code_digest(variant.source)  # what was compiled: it rendered
        res.ptxas = ev.compiled.report()["kernels"]
    if ev.verification is not None:
        res.max_rel_err = ev.verification.max_rel_err if ev.verification.checks else None
        res.verify = {
            "precision": ev.verification.precision,
            "tolerance": ev.verification.tolerance,
            "rtol": ev.verification.rtol,
            "atol_rms": ev.verification.atol_rms,
            "allowance_used": ev.verification.allowance_used,
            "max_rel_err_per_seed": {str(k): v for k, v in ev.verification.per_seed().items()},
        }
    if ev.timing is not None:
        t = ev.timing
        res.median_ms, res.min_ms, res.spread, res.reps = t.median_ms, t.min_ms, t.spread, t.n
        res.cubin = ev.compiled.cubin
    return res


class FakeEvaluator:
    """Deterministic synthetic timings, for testing the loop's logic only (never kernel correctness).

    Time is a smooth function of the parameters so searches have something to find;
    a few candidates "fail" by a hash rule so failure handling is exercised.
    """

    def __init__(self, name: str = "FakeGPU", arch: str = "sm_90", fail_every: int = 7, delay_s: float = 0.0):
        self.name, self.arch, self.fail_every, self.delay_s = name, arch, fail_every, delay_s

    def facts(self) -> DeviceFacts:
        return DeviceFacts(self.name, self.arch, {"fake": True})

    def baseline_ms(self, op, shape, dtype, attrs, precision=None):
        return 1.0

    def profile(self, op, shape, dtype, attrs, candidate):
        digest = int(hashlib.sha256(candidate.key.encode()).hexdigest(), 16)
        return {"kernel": "fake", "fake": True, "dram_pct": float(digest % 100), "sm_pct": float(digest % 37)}

    def evaluate(self, op, shape, dtype, attrs, candidates):
        import time

        out = []
        for cand in candidates:
            if self.delay_s:
                time.sleep(self.delay_s)
            digest = int(hashlib.sha256(cand.key.encode()).hexdigest(), 16)
            if self.fail_every and digest % self.fail_every == 0:
                out.append(TrialResult(cand.family, cand.params, "wrong_result", "fake: planted failure", self.arch))
                continue
            rng = random.Random(digest)
            ms = 0.5 + rng.random()
            out.append(
                TrialResult(
                    cand.family,
                    cand.params,
                    "ok",
                    None,
                    self.arch,
                    f"fake-{digest % 10**12}",
                    max_rel_err=1e-6,
                    median_ms=ms,
                    min_ms=ms * 0.98,
                    spread=0.01,
                    reps=10,
                    cubin=b"fake-cubin",
                )
            )
        return out
