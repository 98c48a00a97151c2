"""Jobs: validation of a submission, and the runner that hands queued jobs to idle GPU workers.

The database is the truth: each running job is leased to the runner (service process) running it, which
renews the lease while it lives. A job whose lease lapsed (its service died) is queued again, by this
runner at start-up or by any live runner on the same database, and resumes from its recorded trials; a
job another live runner holds is left alone, and so is its GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.exc import OperationalError

from kernelmill.agents.evaluator import TrialResult
from kernelmill.agents.loop import JobPlan, NothingVerified, Progress, run_job
from kernelmill.agents.space import Candidate, Observation, Space, default_families, search_precision
from kernelmill.agents.strategies import strategy_class
from kernelmill.kernels.compile import NvccMissing, base_arch, normalize_arch, too_old, unknown_gpu
from kernelmill.kernels.device import GpuUnavailable
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError, format_shape
from kernelmill.kernels.render import RenderError, code_digest
from kernelmill.service.db.models import Job
from kernelmill.service.db.store import Store
from kernelmill.service.executor import Executor
from kernelmill.settings import Settings

log = logging.getLogger(__name__)


#: The least time budget a job may have: a batch of trials compiles and times its kernels, seconds in all, and a
#: job with less ended "done" without a trial.
MIN_BUDGET_SECONDS = 10.0


class JobError(ValueError):
    """A submission that cannot be accepted; the message says why (422)."""


def _within(low: float, high: float | None) -> str:
    def shown(limit: float) -> str:  # a trial count in full: 2147483647, not 2.14748e+09
        return str(limit) if isinstance(limit, int) else f"{limit:g}"

    return f"in {shown(low)}..{shown(high)}" if high is not None else f"at least {shown(low)}"


def validate_submission(
    settings: Settings,
    op: str,
    shapes: Sequence[Sequence[int] | str],
    dtype: str,
    strategy: str,
    budget_trials: int,
    budget_seconds: float,
    attrs: dict[str, Any] | None = None,
    arch: str = "auto",
    families: Sequence[str] | None = None,
    bounded: bool = True,
) -> dict[str, Any]:
    """Normalized job fields, or JobError saying what is wrong. ``bounded=False`` leaves out the limits of
    ``settings`` (shapes a job, trials, seconds): a client checking what it sends to a server, whose own hold."""
    job_arch = _job_arch(arch)
    max_shapes, max_trials, max_seconds = (
        (settings.max_shapes, settings.max_budget_trials, settings.max_budget_seconds) if bounded else (None,) * 3
    )
    try:
        spec = get_op(op)
        spec.check_dtype(dtype)
        if not shapes:
            raise JobError("shapes: give at least one shape")
        if max_shapes is not None and len(shapes) > max_shapes:
            raise JobError(f"shapes: at most {max_shapes} per job, got {len(shapes)}")
        parsed = [list(spec.parse_shape(s)) for s in shapes]
        twice = next((shape for i, shape in enumerate(parsed) if shape in parsed[:i]), None)
        if twice is not None:
            raise JobError(f"shapes: {format_shape(tuple(twice))} is given twice")
        resolved_attrs = spec.resolve_attrs(attrs or {})
        families = _families(spec, dtype, families)
        if families and job_arch != "auto":  # a family that cannot run on the job's GPU (wgmma off sm_90)
            for name in families:
                spec.family(name).target(job_arch)
    except SpecError as exc:
        raise JobError(str(exc)) from None
    try:
        strategy_class(strategy)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    if not 1 <= budget_trials <= (max_trials or budget_trials):
        raise JobError(f"budget.trials must be {_within(1, max_trials)}, got {budget_trials}")
    if budget_trials < len(parsed):  # the budget is split over the shapes, each needs a trial at least
        raise JobError(f"budget.trials: {budget_trials} cannot try {len(parsed)} shapes (one trial each at least)")
    if not math.isfinite(budget_seconds):  # unbounded (a client's check), inf passed the range below
        raise JobError(f"budget.seconds must be a finite number, got {budget_seconds:g}")
    if not MIN_BUDGET_SECONDS <= budget_seconds <= (max_seconds or budget_seconds):
        limits = _within(MIN_BUDGET_SECONDS, max_seconds)
        raise JobError(f"budget.seconds must be {limits} (a batch of trials takes seconds), got {budget_seconds:g}")
    if not families and not default_families(spec, dtype):
        raise JobError(f"no {op} family supports {dtype}")
    for shape in parsed:  # a shape no variant accepts would finish "done" with no trial
        reason = Space.refuses(spec, dtype, tuple(shape), families)
        if reason is not None:
            shown = format_shape(tuple(shape))
            raise JobError(f"shapes: no {op} variant accepts {shown} in {dtype} ({reason})")
    return {
        "op": op,
        "arch": job_arch,
        "shapes": parsed,
        "dtype": dtype,
        "attrs": resolved_attrs,
        "families": families,
        "strategy": strategy,
        "budget_trials": budget_trials,
        "budget_seconds": budget_seconds,
    }


def _families(spec, dtype: str, families: Sequence[str] | None) -> list[str] | None:
    """The families a job names, checked (each known, supporting ``dtype``, named once, all computing in one
    precision: a TF32 family is searched apart from the IEEE ones); None for the defaults. SpecError."""
    if not families:
        return None
    names = list(families)
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise SpecError(f"families: {twice} is given twice")
    for name in names:
        if dtype not in spec.family(name).dtypes:
            raise SpecError(f"families: {spec.name} family {name} does not support {dtype}")
    search_precision(spec, dtype, names)
    return names


def _job_arch(arch: str) -> str:
    """A job's GPU arch: "auto" (any worker's) or a base arch such as "sm_90" ("sm_90a" and "90" say the same)."""
    if arch == "auto":
        return arch
    try:
        base = base_arch(normalize_arch(arch))
    except ValueError as exc:
        raise JobError(f"arch: {exc}, or auto (the worker's GPU)") from None
    if reason := too_old(base) or unknown_gpu(base):
        raise JobError(f"arch: {reason}")
    return base


def runs_on(job_arch: str | None, worker_arch: str | None) -> bool:
    """Whether a job for ``job_arch`` may run on a worker whose GPU is ``worker_arch`` (None: not known yet)."""
    if job_arch in (None, "auto"):
        return True
    return worker_arch is not None and base_arch(worker_arch) == base_arch(job_arch)


def fits(job: Job | dict[str, Any], worker_arch: str | None) -> bool:
    """Whether a job may run on a worker whose GPU is ``worker_arch``: ``runs_on``, and some variant of its
    families runs at each of its shapes there (wgmma runs on sm_90 alone: a job naming it alone, for any arch,
    failed on the sm_80 it was given while an sm_90 stood idle). A GPU not known yet (the executor asks each worker
    in the background) may run a job of the default families, not one that names its own."""
    arch, op, dtype, families, shapes = (_field(job, name) for name in ("arch", "op", "dtype", "families", "shapes"))
    if not runs_on(arch, worker_arch):
        return False
    if worker_arch is None:
        return not families
    return _variants_run(op, dtype, tuple(families or ()), tuple(tuple(s) for s in shapes), worker_arch)


def _field(job: Job | dict[str, Any], name: str) -> Any:
    return job.get(name) if isinstance(job, dict) else getattr(job, name)


@functools.lru_cache(maxsize=512)  # a Space of a whole op takes up to a quarter of a second; the poll asks often
def _variants_run(
    op: str, dtype: str, families: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], arch: str
) -> bool:
    try:
        space = Space(get_op(op), dtype, families or None).for_arch(arch)
    except (KeyError, SpecError):  # a family or op this version lacks: the job's start says so
        return True
    return all(len(space.for_shape(shape)) for shape in shapes)


def no_worker_for(job: Job | dict[str, Any], worker_archs: Sequence[str | None]) -> str | None:
    """Why a job waits although GPU workers are attached: none of them has its GPU ("no GPU worker has sm_80; the
    workers have sm_90"), or none has a GPU its families run on ("no GPU worker runs matmul float16 (wgmma) at
    256x256x256; the workers have sm_80"); None where one may run it, none is attached, or a worker's GPU is not
    known yet."""
    if not worker_archs or any(a is None for a in worker_archs) or any(fits(job, a) for a in worker_archs):
        return None
    archs = ", ".join(sorted({base_arch(a) for a in worker_archs if a}))
    job_arch = _field(job, "arch")
    if not any(runs_on(job_arch, a) for a in worker_archs):
        return f"no GPU worker has {job_arch}; the workers have {archs}"
    families = _field(job, "families")
    named = f" ({', '.join(families)})" if families else ""
    shapes = ", ".join(format_shape(s) for s in _field(job, "shapes"))
    return f"no GPU worker runs {_field(job, 'op')} {_field(job, 'dtype')}{named} at {shapes}; the workers have {archs}"


class StoreRecorder:
    """The loop's Recorder backed by the store."""

    def __init__(
        self, store: Store, job_id: int, stopping: threading.Event | None = None, runner: str | None = None
    ) -> None:
        self.store, self.job_id, self.stopping = store, job_id, stopping
        #: The runner holding the job's lease: trials and time are recorded only while it still holds the job.
        self.runner = runner
        #: Set once the job was found no longer held (its lease lapsed and another runner may run it): the loop
        #: stops at its next check, recording nothing more.
        self.lost = False
        self._since = time.monotonic()
        job = store.get_job(job_id)
        #: The GPU model this start runs on (start_job set it): trials are recorded with it, and a baseline or a
        #: trial timed on another model (a start before, on another GPU) is neither compared nor served here.
        self.device = job.device_name if job is not None else None

    def checkpoint(self) -> None:
        """Count the time since the last checkpoint against the job's budget (after each batch, and when the
        run ends), so that a crash loses at most one batch's time."""
        now = time.monotonic()
        if not self.store.add_job_seconds(self.job_id, now - self._since, self.runner):
            self.lost = self.runner is not None
        self._since = now

    def observations(self, shape: str) -> list[Observation]:
        return [
            Observation(Candidate.of(t.family, t.params), t.status, t.median_ms, {**_facts(t), "profile": t.profile})
            for t in self.store.trials(self.job_id, shape)
        ]

    def record(self, shape: str, results: Sequence[TrialResult]) -> None:
        rows = [{**r.row(), "device_name": self.device} for r in results]
        if self.store.record_trials(self.job_id, shape, rows, self.runner) is None:
            self.lost = True
            log.warning("job %s: %d trials of %s not recorded: this runner no longer holds the job", self.job_id,
                        len(rows), shape)  # fmt: skip
        self.checkpoint()

    def baseline(self, shape: str) -> tuple[bool, float | None]:
        if not self.store.has_baseline(self.job_id, shape):
            return False, None
        timed_on = self.store.baseline_device(self.job_id, shape)
        if self.device and timed_on and timed_on != self.device:  # resumed on another GPU model: its own PyTorch
            log.info("job %s %s: baseline timed on %s, this start runs on %s: timed again", self.job_id, shape,
                     timed_on, self.device)  # fmt: skip
            return False, None
        return True, self.store.baseline(self.job_id, shape)

    def record_baseline(self, shape: str, median_ms: float | None, device_name: str) -> None:
        self.store.record_baseline(self.job_id, shape, median_ms, device_name)

    def cancelled(self) -> bool:
        """Cancelled by a user, the service is stopping (the runner then queues the job again), or the job is
        no longer this runner's (``lost``)."""
        if self.stopping is not None and self.stopping.is_set() or self.store.cancel_requested(self.job_id):
            return True
        if self.runner is not None and not self.lost and not self.store.holds(self.job_id, self.runner):
            self.lost = True
        return self.lost

    def warm_start(self, shape: str, limit: int = 8) -> list[Candidate]:
        """Best parameters of other jobs of this op, nearest problem first: same dtype and a close shape
        count most, then other dtypes, then other GPUs of the same arch."""
        job = self.store.get_job(self.job_id)
        want = [int(v) for v in shape.split("x")]
        arch = base_arch(job.arch or "auto")

        def distance(trial, other) -> float:
            dims = [int(v) for v in trial.shape_key.split("x")]
            d = sum(abs(math.log(a / b)) for a, b in zip(dims, want, strict=False))
            d += 0.0 if other.dtype == job.dtype else 2.0
            d += 0.0 if other.device_name == job.device_name else 0.5
            return d

        found = [
            (distance(t, o), t, o)
            for t, o in self.store.best_trials_elsewhere(job)
            if arch == "auto" or base_arch(t.arch or "") == arch
        ]
        out, seen = [], set()
        for _, trial, other in sorted(found, key=lambda f: f[0]):
            cand = Candidate.of(trial.family, trial.params)
            if cand.key in seen:
                continue
            seen.add(cand.key)
            where = f"{other.op} {trial.shape_key} {other.dtype} on {other.device_name or '?'} (job {other.id})"
            out.append(cand.because(f"warm start: best of {where}"))
            if len(out) == limit:
                break
        return out

    def record_profile(self, shape: str, candidate: Candidate, profile: dict[str, Any]) -> None:
        self.store.set_trial_profile(self.job_id, shape, candidate.family, candidate.params_json, profile)

    def publish_best(self, shape: str, served_fields: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
        """Serve the fastest verified trial whose parameters this version's family still builds, into the code its
        cubin was built from. One recorded before an upgrade is passed over, not the job's end, where the upgrade
        changed its knobs (a value dropped, a family renamed: building what to serve raised KeyError, and the
        job failed at its last step) or its template (its cubin would be served beside source it was not built
        from, whose launches it may not match; a trial recorded without its code's digest is served as before)."""
        passed_over: list[int] = []
        while (best := self.store.best_trial(self.job_id, shape, self.device, passed_over)) is not None:
            try:
                fields = served_fields(best.family, best.params)
            except (KeyError, SpecError, RenderError) as exc:
                log.warning("job %s %s: trial %s (%s %s) not served: this version cannot build it (%s: %s)",
                            self.job_id, shape, best.id, best.family, best.params, type(exc).__name__, exc)  # fmt: skip
                passed_over.append(best.id)
                continue
            if best.code_sha256 is None or code_digest(fields["source"]) == best.code_sha256:
                break
            log.warning("job %s %s: trial %s (%s %s) not served: its cubin was built from code this version's "
                        "template no longer renders", self.job_id, shape, best.id, best.family,
                        best.params)  # fmt: skip
            passed_over.append(best.id)
        if best is None:
            log.info("job %s %s: no verified trial to serve", self.job_id, shape)
            return
        fields.update(
            cubin=best.cubin, code_sha256=best.code_sha256, baseline_ms=self.store.baseline(self.job_id, shape)
        )
        self.store.publish(self.store.get_job(self.job_id), best, fields)


def _facts(trial) -> dict[str, Any]:
    ptxas = trial.ptxas or {}
    return {
        "roofline_pct": trial.roofline_pct,
        "registers": max((k.get("registers", 0) for k in ptxas.values()), default=0),
        "spill_bytes": sum(k.get("spill_stores_bytes", 0) + k.get("spill_loads_bytes", 0) for k in ptxas.values()),
    }


class JobRunner:
    """Polls the store for queued jobs and runs each on an idle GPU worker, one thread per job."""

    #: Seconds a worker gets no job after its GPU was unavailable (its job went back to the queue).
    bench_s = 30.0
    #: Seconds a running job's lease holds unless renewed (it is renewed every third of that): how long a job
    #: whose service died waits before another runner, or the restarted service, resumes it.
    lease_s = 30.0

    def __init__(self, store: Store, executor: Executor, settings: Settings, poll_s: float = 0.5) -> None:
        self.store, self.executor, self.settings, self.poll_s = store, executor, settings, poll_s
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # this runner, in jobs.runner
        self._benched: dict[str, float] = {}  # worker -> when it may take a job again
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []  # the poll and the lease threads
        self._running: dict[int, threading.Thread] = {}
        self._said_waiting: set[int] = set()
        self.progress: dict[int, Progress] = {}

    def start(self) -> None:
        self._stop.clear()  # started again after stop(): its poll thread ended at once, and no job ran
        self._recover()
        # Leases are renewed on a thread of their own: a poll held up (a Dask scheduler slow to answer
        # executor.workers()) must not let the leases of the jobs running here lapse.
        self._threads = [
            threading.Thread(target=self._poll, name="kernelmill-jobs", daemon=True),
            threading.Thread(target=self._keep_leases, name="kernelmill-leases", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _recover(self) -> None:
        """Jobs whose runner died: cancelled where a cancel was asked (the job never reached it), else queued
        again to resume. Jobs a live runner holds are not touched, nor this runner's own: their threads run, and
        a lease of theirs found lapsed (this poll stalled past it) was just renewed, or lost to another runner."""
        for job in self.store.lapsed_jobs():
            if job.id in self._running:
                continue
            state = self.store.recover_lapsed(job.id)
            if state == "cancelled":
                log.info("job %s was being cancelled when its service stopped: cancelled", job.id)
            elif state == "queued":
                log.info("job %s was running when its service stopped: queued again to resume", job.id)

    def _keep_leases(self) -> None:
        """Every third of a lease: the leases of the jobs running here renewed, lapsed ones recovered."""
        while not self._stop.is_set():
            try:
                self.store.renew_leases(self.name, list(self._running), self.lease_s)
                self._recover()
            except Exception:  # noqa: BLE001 - tried again at the next turn; a job that lost its lease stops
                log.exception("job runner: renewing leases failed")
            self._stop.wait(self.lease_s / 3)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling and ask running jobs to stop at their next batch (they are queued again, to resume on
        the next start); wait for the poll thread and every job thread, ``timeout_s`` in all."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        jobs = list(self._running.values())  # read after the poll thread ended: it starts no job after this
        for thread in jobs:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in [*self._threads, *jobs] if t.is_alive()]
        if alive:  # a batch still evaluating: its thread is a daemon and goes with the process
            log.warning("job runner: %s still running %.1f s after stop", ", ".join(alive), timeout_s)

    def _poll(self) -> None:
        unavailable = False  # said once an outage: a poll every half second logged a traceback each
        while not self._stop.is_set():
            try:
                self._assign()
                if unavailable:
                    log.info("job runner: the database answers again")
                unavailable = False
            except OperationalError as exc:  # its server gone or restarting: polled again until it answers
                if not unavailable:
                    log.warning("job runner: the database is unavailable (%s); polling on", exc.orig or exc)
                unavailable = True
            except Exception:  # noqa: BLE001 - the runner must outlive any one bad poll
                log.exception("job runner poll failed")
            self._stop.wait(self.poll_s)

    def _assign(self) -> None:
        queued = [j for j in self.store.jobs_in_state("queued") if j.id not in self._running]
        if not queued:
            return
        workers = self.executor.workers()
        held = self.store.workers_held(self.name)  # by another service on this database
        for worker in workers:
            if not queued:
                return
            if worker.busy or worker.name in held or self._benched.get(worker.name, 0.0) > time.monotonic():
                continue
            job = next((j for j in queued if fits(j, worker.arch)), None)
            if job is None or not self.executor.claim(worker.name, job.id):
                continue
            queued.remove(job)
            thread = threading.Thread(target=self._run, args=(job, worker.name), name=f"job-{job.id}", daemon=True)
            self._running[job.id] = thread
            thread.start()
        archs = [w.arch for w in workers]
        for job in queued:  # said once a job; the job page and `kernelmill tune` say it too
            if job.id not in self._said_waiting and (why := no_worker_for(job, archs)):
                self._said_waiting.add(job.id)
                log.warning("job %s waits: %s", job.id, why)

    def _run(self, job: Job, worker: str) -> None:
        started = False
        try:
            try:
                evaluator = self.executor.evaluator(worker)
                facts = evaluator.facts()
            except Exception as exc:  # noqa: BLE001 - the worker, not the job, is at fault: another may run it
                self._bench(worker, job, exc)
                return
            self.store.upsert_device(
                worker, name=facts.name, arch=facts.arch, sm_count=facts.extra.get("sm_count"),
                copy_gbps=facts.extra.get("copy_gbps"), matrix_tflops=facts.extra.get("matrix_tflops") or {},
            )  # fmt: skip
            if self.store.start_job(job.id, worker, facts.name, self.name, self.lease_s) is None:
                log.info("job %s was cancelled, or started by another service, before it started on %s", job.id, worker)
                return
            started = True
            plan = JobPlan(
                job.id,
                job.op,
                [tuple(s) for s in job.shapes],
                job.dtype,
                dict(job.attrs or {}),
                job.strategy,
                job.budget_trials,
                max(0.0, job.budget_seconds - (job.seconds_used or 0.0)),  # what earlier starts left
                batch_size=self.settings.batch_size,
                families=list(job.families) if job.families else None,
            )
            recorder = StoreRecorder(self.store, job.id, self._stop, self.name)
            error = None
            try:
                state = run_job(plan, evaluator, recorder, self._on_progress)
            except NothingVerified as exc:  # the search ran and none of its trials verified: nothing served
                log.warning("job %s failed: %s", job.id, exc)
                state, error = "failed", str(exc)
            except (GpuUnavailable, NvccMissing) as exc:  # the machine failed (its GPU went, it has no nvcc), not the
                # job: what was recorded stays, and the job resumes on a worker that can run it
                self.store.requeue_job(job.id, self.name)
                if self._stop.is_set():  # the service stopping closed the executor under the batch: no fault
                    log.info("job %s interrupted by the service stopping: queued again to resume", job.id)
                else:
                    self._bench(worker, job, exc)
                return
            except OperationalError as exc:  # the database failed, not the job (SQLite busy past its timeout, a
                # server gone a while): queued again to resume from what was recorded, or, where the database
                # cannot take that either, left to its lease to lapse, as if this service had died
                log.warning("job %s: the database failed it (%s): queued again to resume", job.id, exc.orig or exc)
                with contextlib.suppress(OperationalError):
                    self.store.requeue_job(job.id, self.name)
                return
            finally:
                with contextlib.suppress(OperationalError):  # the time of a batch recorded, or of none
                    recorder.checkpoint()
            # Only while this runner still holds the job: one whose lease lapsed (a stop that outlived its wait)
            # must not queue again, or end, a job another runner has taken over.
            if recorder.lost:
                log.warning(
                    "job %s stopped here: its lease lapsed (this service did not renew it in %.0f s) and it was "
                    "queued again, to resume from its recorded trials on another service or here", job.id, self.lease_s,
                )  # fmt: skip
            elif state == "cancelled" and self._stop.is_set() and not self.store.cancel_requested(job.id):
                if self.store.requeue_job(job.id, self.name):
                    log.info("job %s interrupted by the service stopping: queued again to resume", job.id)
            elif not self.store.finish_job(job.id, state, error, runner=self.name):
                log.warning(
                    "job %s ended here (%s) after another service took it over: left to that one", job.id, state
                )
        except Exception as exc:  # noqa: BLE001 - a failed job is recorded, the service stays up
            log.exception("job %s failed", job.id)
            if started:  # only a job this runner started (a device-row race before it is no reason to fail it)
                self.store.finish_job(job.id, "failed", f"{type(exc).__name__}: {exc}", runner=self.name)
        finally:
            self.executor.release(worker)
            self._running.pop(job.id, None)
            self.progress.pop(job.id, None)

    def _bench(self, worker: str, job: Job, exc: Exception) -> None:
        """``job`` goes back to the queue (or stays there) and ``worker`` gets no job for ``bench_s``."""
        self._benched[worker] = time.monotonic() + self.bench_s
        log.warning(
            "worker %s cannot run job %s (%s: %s): the job is queued again; the worker gets no job for %.0f s",
            worker, job.id, type(exc).__name__, exc, self.bench_s,
        )  # fmt: skip

    def _on_progress(self, progress: Progress) -> None:
        self.progress[progress.job_id] = progress
