"""The agent loop: propose -> evaluate -> record, per shape, until budget, plateau or cancel.

The loop owns no storage: a ``Recorder`` (the service's store, or anything with
the same methods) keeps the history, so a job resumed after a crash continues
from its recorded trials and never re-runs them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kernelmill.agents.evaluator import SKIPPED, DeviceFacts, Evaluator, TrialResult
from kernelmill.agents.space import Candidate, Observation, Space
from kernelmill.agents.strategies import get_strategy
from kernelmill.kernels.defaults import DEFAULT_SM_COUNT, default_alternatives, default_params
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError, format_shape
from kernelmill.kernels.render import render

log = logging.getLogger(__name__)


@dataclass
class JobPlan:
    job_id: int
    op: str
    shapes: list[tuple[int, ...]]
    dtype: str
    attrs: dict[str, Any]
    strategy: str
    budget_trials: int
    budget_seconds: float
    batch_size: int = 8
    #: Stop a shape when this many trials in a row bring no gain over 1%.
    plateau: int = 48
    #: Profile this many of each shape's fastest verified trials with ncu after the search.
    profile_top_k: int = 3
    #: Start from the best parameters found for nearby problems in the store.
    warm_start: bool = True
    #: Search only these template families (None: every family that supports the dtype).
    families: list[str] | None = None


@dataclass
class Progress:
    job_id: int
    shape: str
    trials: int  # over all shapes
    failed: int
    budget: int
    best_ms: float | None
    baseline_ms: float | None
    last: list[TrialResult] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        return self.baseline_ms / self.best_ms if self.best_ms and self.baseline_ms else None


class Recorder(Protocol):
    def observations(self, shape: str) -> list[Observation]:
        """Trials already recorded for this job and shape."""
        ...

    def record(self, shape: str, results: Sequence[TrialResult]) -> None: ...

    def baseline(self, shape: str) -> tuple[bool, float | None]:
        """(measured already?, PyTorch's median ms or None where it could not be timed)."""
        ...

    def record_baseline(self, shape: str, median_ms: float | None, device_name: str) -> None: ...

    def cancelled(self) -> bool: ...

    def warm_start(self, shape: str) -> list[Candidate]:
        """Best candidates of the nearest recorded problems (other shapes, dtypes, GPUs of the arch), best first."""
        ...

    def record_profile(self, shape: str, candidate: Candidate, profile: dict[str, Any]) -> None: ...

    def publish_best(self, shape: str, served_fields: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
        """Serve the fastest verified trial of ``shape``; ``served_fields(family, params)`` adds source and launches."""
        ...


def served_fields(op: str, shape: tuple[int, ...], dtype: str, attrs: dict[str, Any]):
    """Builds what the runtime needs to launch a served kernel, beyond the trial itself."""
    spec = get_op(op)

    def build(family: str, params: dict[str, Any]) -> dict[str, Any]:
        fam = spec.family(family)
        launches = [
            {
                "entry": launch.entry,
                "grid": list(launch.grid),
                "block": list(launch.block),
                "smem_bytes": launch.smem_bytes,
                "args": list(launch.args),
            }
            for launch in fam.launches(shape, params, dtype)
        ]
        return {
            "source": render(fam, params, dtype, spec.resolve_attrs(attrs)),
            "launches": launches,
            "workspace": fam.workspace(shape, params, dtype),
        }

    return build


def _sm_count(facts: DeviceFacts) -> int:
    return int((facts.extra or {}).get("sm_count") or DEFAULT_SM_COUNT)


def shape_defaults(space: Space, shape: tuple[int, ...], facts: DeviceFacts) -> list[Candidate]:
    """Each family's parameters for this shape as the runtime would compile them untuned
    (kernels/defaults.py), so that the search starts there and never serves a kernel slower than them."""
    out = []
    for fam in space.families.values():
        cand = space.valid(fam.name, default_params(space.op, fam, shape, space.dtype, _sm_count(facts)))
        if cand is not None:
            out.append(cand.because("default for this shape"))
    return out


def default_runners_up(space: Space, shape: tuple[int, ...], facts: DeviceFacts) -> list[Candidate]:
    """The shape defaults' runners-up: the wgmma tiles the cost model ranks next once split, and their swapped
    forms (kernels/defaults.py)."""
    out = []
    for fam in space.families.values():
        for params in default_alternatives(space.op, fam, shape, space.dtype, _sm_count(facts)):
            cand = space.valid(fam.name, params)
            if cand is not None:
                out.append(cand.because("a split or swapped tile for this shape"))
    return out


def _after(best: float | None, since_gain: int, median_ms: float | None) -> tuple[float | None, int]:
    """(best time, trials since the last gain of 1% or more) once a trial taking ``median_ms`` (None: it
    failed) is counted."""
    if median_ms is None:
        return best, since_gain + 1
    if best is None or median_ms < best * 0.99:
        return median_ms, 0
    return min(best, median_ms), since_gain + 1


#: The most of a shape's time so far that profiling its leaders between batches may take (a strategy that reads
#: profiles while it searches: guided).
MID_SEARCH_PROFILE_SHARE = 0.25


def run_job(
    plan: JobPlan,
    evaluator: Evaluator,
    recorder: Recorder,
    on_progress: Callable[[Progress], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Run the search; returns the final state: "done" or "cancelled". NothingVerified where trials ran and none
    verified."""
    spec = get_op(plan.op)
    facts = evaluator.facts()
    deadline = clock() + plan.budget_seconds
    # The trial budget split over the shapes, the first ones taking the remainder: never more in all. (A job
    # has at least as many trials as shapes: service.jobs.validate_submission.)
    n_shapes = max(1, len(plan.shapes))
    shares = [max(1, plan.budget_trials // n_shapes + (i < plan.budget_trials % n_shapes)) for i in range(n_shapes)]
    space = Space(spec, plan.dtype, plan.families).for_arch(facts.arch)
    # Every shape's candidates on this GPU, before any is searched: the submission's check (Space.refuses) cannot
    # know the GPU of a job for any arch, and one whose families run on none of it (wgmma off sm_90) timed PyTorch
    # and ended "done" without a trial or a word.
    shape_spaces = {format_shape(s): space.for_shape(tuple(s)) for s in plan.shapes}
    for shape in plan.shapes:
        key = format_shape(shape)
        if not len(shape_spaces[key]):
            refused = Space.refuses(spec, plan.dtype, tuple(shape), list(space.families))
            raise SpecError(
                f"{key}: no variant of {plan.op} {plan.dtype} ({', '.join(space.families)}) runs at this shape on "
                f"{facts.arch}" + (f": {refused}" if refused else "")
            )
    total = failed = 0
    histories = {format_shape(s): recorder.observations(format_shape(s)) for s in plan.shapes}
    for history in histories.values():
        total += len(history)
        failed += sum(1 for o in history if not o.ok)

    # The shapes are walked in order, each published before the next starts: one followed by a shape with recorded
    # trials was finished by an earlier start (its trials, its plateau or its share of the time), and a resumed
    # job leaves it so. It was searched again, with the time of the shapes after it.
    keys = [format_shape(s) for s in plan.shapes]
    finished = {key for i, key in enumerate(keys) if any(histories[later] for later in keys[i + 1 :])}

    profiler_works = True  # until ncu says it cannot run here
    for index, (shape, per_shape) in enumerate(zip(plan.shapes, shares, strict=False)):
        key = format_shape(shape)
        history = histories[key]
        if key in finished:
            log.info("job %s %s: finished before this start, with %d trials", plan.job_id, key, len(history))
            continue
        # The time left shared by the shapes left (what one leaves unused passes on): the first shape of a job
        # took the whole time budget, and the others not even a baseline.
        shape_start = clock()
        shape_deadline = shape_start + max(0.0, deadline - shape_start) / (n_shapes - index)
        profiling_s = 0.0  # spent profiling leaders during the search (ncu takes seconds a kernel)
        measured, baseline = recorder.baseline(key)
        if not measured:
            baseline = evaluator.baseline_ms(plan.op, shape, plan.dtype, plan.attrs, space.precision)
            recorder.record_baseline(key, baseline, facts.name)
        strategy = get_strategy(plan.strategy, seed=plan.job_id)
        shape_space = shape_spaces[key]
        # Trials since the last gain of 1%, counted over the recorded ones too: a resumed job whose shape had
        # reached its plateau moved on at once, not after another plateau's worth of trials.
        best, since_gain = None, 0
        for o in history:
            best, since_gain = _after(best, since_gain, o.median_ms if o.ok else None)
        warm = [c for c in recorder.warm_start(key) if c in shape_space] if plan.warm_start else []
        # The shape defaults first (what the runtime would run untuned: a small share must not be spent before
        # them), then the warm starts, then the defaults' runners-up. Each candidate once, first mention first:
        # a warm start may also be a shape default, and a batch that held it twice ran it twice and counted a
        # trial the store does not keep.
        defaults = shape_defaults(shape_space, tuple(shape), facts)
        runners_up = default_runners_up(shape_space, tuple(shape), facts)
        warm = _first_of_each([*defaults, *warm, *runners_up])
        while len(history) < per_shape:
            if recorder.cancelled():
                return "cancelled"
            if clock() > shape_deadline:
                log.info("job %s %s: its share of the time budget spent", plan.job_id, key)
                break
            if since_gain >= plan.plateau:
                if best is not None:  # none verified: said below, with what they failed with
                    log.info("job %s %s: plateau after %d trials", plan.job_id, key, len(history))
                break
            n = min(plan.batch_size, per_shape - len(history))
            seen = {o.candidate.key for o in history}
            warm = [c for c in warm if c.key not in seen]
            batch, warm = warm[:n], warm[n:]
            if len(batch) < n:
                picked = {c.key for c in batch}
                # Ask for n: a strategy may propose what the seeds already hold (a family's default).
                proposed = [c for c in strategy.propose(shape_space, history, n) if c.key not in picked]
                batch += proposed[: n - len(batch)]
            if not batch:
                break
            results = evaluator.evaluate(plan.op, shape, plan.dtype, plan.attrs, batch)
            if len(results) != len(batch):  # results pair with candidates by position: none can be trusted
                raise RuntimeError(f"the evaluator answered {len(results)} results for {len(batch)} candidates")
            for cand, r in zip(batch, results, strict=True):
                r.note = r.note or cand.note or None
            kept = [r for r in results if r.status != SKIPPED]
            if not kept:  # nothing ran: asking again would loop for ever
                raise RuntimeError(f"the evaluator skipped every candidate of a batch of {len(batch)}")
            # Candidates a poisoned context skipped run first in the next batch (on a fresh worker): a warm start
            # or shape default among them would otherwise never run, as strategies propose them only by chance.
            warm = [c for c, r in zip(batch, results, strict=True) if r.status == SKIPPED] + warm
            recorder.record(key, kept)
            for r in kept:
                history.append(Observation(r.candidate, r.status, r.median_ms, trial_facts(r)))
                total += 1
                ok_ms = r.median_ms if r.status == "ok" else None
                if ok_ms is None:
                    failed += 1
                best, since_gain = _after(best, since_gain, ok_ms)
            if on_progress:
                on_progress(Progress(plan.job_id, key, total, failed, sum(shares), best, baseline, kept))
            # A strategy that reads ncu's word on the leaders (guided) gets it before it proposes again.
            # At most a share of the shape's time so far goes to it, so the search still runs its trials.
            leaders = getattr(strategy, "profiles_best", 0)
            affordable = profiling_s < 1.0 or profiling_s <= MID_SEARCH_PROFILE_SHARE * (clock() - shape_start)
            if leaders and profiler_works and affordable and len(history) < per_shape and clock() <= shape_deadline:
                started = clock()
                profiler_works = _profile_best(
                    plan, evaluator, recorder, shape, history, shape_deadline, clock, leaders
                )
                profiling_s += clock() - started
        # A cancel asked during the last batch: cancelled, as at any other batch (it ended "done" and published).
        if recorder.cancelled():
            return "cancelled"
        if best is None and history:
            log.warning("job %s %s: no trial verified (%s): nothing served", plan.job_id, key, _statuses(history))
        if profiler_works and clock() <= shape_deadline:  # profiling takes seconds a shape: not past its time
            profiler_works = _profile_best(plan, evaluator, recorder, shape, history, shape_deadline, clock)
        if recorder.cancelled():
            return "cancelled"
        recorder.publish_best(key, served_fields(plan.op, shape, plan.dtype, plan.attrs))
        if clock() > deadline:
            break
    tried = [key for key in keys if histories[key]]
    if tried and not any(o.ok for key in tried for o in histories[key]):
        raise NothingVerified(
            "no trial verified, so nothing is served: "
            + "; ".join(f"{key}: {_statuses(histories[key])}" for key in tried)
            + f" (each one's reason: the dashboard's /jobs/{plan.job_id}, or GET /api/jobs/{plan.job_id}/trials)"
        )
    return "done"


class NothingVerified(Exception):
    """A search that ran trials of which none verified: the job failed, nothing is served (it ended "done")."""


def _statuses(history: Sequence[Observation]) -> str:
    """``history``'s trials counted by status, most first: "48 trials: 40 compile_error, 8 wrong_result"."""
    counts = Counter(o.status for o in history).most_common()
    return f"{len(history)} trials: " + ", ".join(f"{count} {status}" for status, count in counts)


def _first_of_each(candidates: list[Candidate]) -> list[Candidate]:
    """``candidates`` without repeats (by key), in order of first mention."""
    firsts: dict[str, Candidate] = {}
    for c in candidates:
        firsts.setdefault(c.key, c)
    return list(firsts.values())


def trial_facts(result: TrialResult) -> dict[str, Any]:
    """What a strategy may read of a trial besides its time."""
    facts: dict[str, Any] = {"roofline_pct": result.roofline_pct}
    if result.ptxas:
        facts["registers"] = max((k.get("registers", 0) for k in result.ptxas.values()), default=0)
        facts["spill_bytes"] = sum(
            k.get("spill_stores_bytes", 0) + k.get("spill_loads_bytes", 0) for k in result.ptxas.values()
        )
    return facts


def _profile_best(
    plan: JobPlan,
    evaluator: Evaluator,
    recorder: Recorder,
    shape,
    history,
    deadline: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
    top_k: int | None = None,
) -> bool:
    """ncu on the ``top_k`` (default ``plan.profile_top_k``) fastest verified trials of a shape that have no
    profile yet (each profile stored with its trial; one that failed stores why), while the time budget lasts and
    no cancel is asked. Whether the profiler works (False once it said it cannot run here: asking again would say
    it again; one variant that hung or crashed under it does not stop the next)."""
    top_k = plan.profile_top_k if top_k is None else min(top_k, plan.profile_top_k)
    if top_k <= 0:
        return True
    leaders = sorted((o for o in history if o.ok), key=lambda o: o.median_ms)[:top_k]
    for obs in (o for o in leaders if not o.facts.get("profile")):
        if clock() > deadline or recorder.cancelled():
            break
        metrics = evaluator.profile(plan.op, shape, plan.dtype, plan.attrs, obs.candidate)
        obs.facts["profile"] = metrics
        recorder.record_profile(format_shape(shape), obs.candidate, metrics)
        if "error" in metrics and metrics.get("unavailable", True):  # no ncu here: one message is enough
            log.info("job %s: no profile: %s", plan.job_id, metrics["error"])
            return False
        if "error" in metrics:  # this variant's failure (it hung or crashed under ncu): the next may profile
            log.info("job %s: %s not profiled: %s", plan.job_id, obs.candidate.key, metrics["error"])
    return True
