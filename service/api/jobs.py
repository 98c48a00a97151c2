"""/api/jobs: submit, list, inspect, cancel, and the trials of a job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Query, status

from kernelmill.agents.space import search_precision
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError
from kernelmill.service.api.deps import get_settings_dep, get_store, json_body, op_filter, require_writer, state_filter
from kernelmill.service.api.schemas import (
    Budget,
    JobCreate,
    JobId,
    JobOut,
    Offset,
    Page,
    ShapeProgress,
    TrialOut,
    TrialStatus,
    problems,
)
from kernelmill.service.db.models import ACTIVE_STATES, ENDED_STATES, Job, utcnow
from kernelmill.service.db.store import ShapeSummary, Store
from kernelmill.service.jobs import JobError, validate_submission
from kernelmill.settings import Settings

router = APIRouter(prefix="/api/jobs", tags=["jobs"])

#: The most jobs one page of GET /api/jobs holds (`kernelmill jobs --limit` takes the same bound).
MAX_JOBS_PAGE = 500


def _precision(job: Job) -> str:
    """What the job's families compute its dtype in (the dtype where the op is unknown here: a plugin)."""
    try:
        return search_precision(get_op(job.op), job.dtype, job.families)
    except SpecError:
        return job.dtype


def jobs_out(store: Store, jobs: Sequence[Job]) -> list[JobOut]:
    """``job_out`` of each job, their summaries read together (``Store.summaries``)."""
    summaries = store.summaries(jobs)
    return [job_out(store, job, summaries[job.id]) for job in jobs]


def job_out(store: Store, job: Job, summary: Sequence[ShapeSummary] | None = None) -> JobOut:
    summary = store.summary(job) if summary is None else summary
    per_shape = [ShapeProgress(**s.__dict__, speedup=s.speedup) for s in summary]
    done = sum(s.trials for s in per_shape)
    eta = None
    if job.state == "running" and job.started_at and done:
        # Running time over all its starts (counted after each batch), else the time since its first start.
        used = job.seconds_used or (utcnow() - job.started_at).total_seconds()
        remaining = max(0, job.budget_trials - done)
        eta = min(used / done * remaining, max(0.0, job.budget_seconds - used))
    return JobOut(
        id=job.id,
        op=job.op,
        shapes=job.shapes,
        dtype=job.dtype,
        arch=job.arch,
        attrs=job.attrs or {},
        families=job.families,
        precision=_precision(job),
        strategy=job.strategy,
        budget=Budget(trials=job.budget_trials, seconds=job.budget_seconds),
        state=job.state,
        cancel_requested=bool(job.cancel_requested) and job.state in ACTIVE_STATES,
        error=job.error,
        worker=job.worker,
        device_name=job.device_name,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        seconds_used=job.seconds_used or 0.0,
        trials_done=done,
        trials_failed=sum(s.failed for s in per_shape),
        per_shape=per_shape,
        eta_seconds=eta,
    )


def _job_or_404(store: Store, job_id: int) -> Job:
    job = store.get_job(job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no job with id {job_id}")
    return job


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(require_writer), Depends(json_body)],
    responses=problems(400, 401, 403, 413, 415, 422),
)
def create_job(
    body: JobCreate, store: Store = Depends(get_store), settings: Settings = Depends(get_settings_dep)
) -> JobOut:
    try:
        fields = validate_submission(
            settings,
            body.op,
            body.shapes,
            body.dtype,
            body.strategy,
            body.budget.trials,
            body.budget.seconds,
            body.attrs,
            body.arch,
            body.families,
        )
    except JobError as exc:
        raise HTTPException(422, detail=str(exc)) from None
    return job_out(store, store.create_job(**fields))


@router.get("", responses=problems(422))
def list_jobs(
    store: Store = Depends(get_store),
    state: str | None = Depends(state_filter),
    op: str | None = Depends(op_filter),
    limit: int = Query(50, ge=1, le=MAX_JOBS_PAGE),
    offset: Offset = 0,
) -> Page[JobOut]:
    jobs, total = store.list_jobs(state, op, limit, offset)
    return Page[JobOut](items=jobs_out(store, jobs), total=total, limit=limit, offset=offset)


@router.get("/{job_id}", responses=problems(404, 422))
def get_job(job_id: JobId, store: Store = Depends(get_store)) -> JobOut:
    return job_out(store, _job_or_404(store, job_id))


@router.post(
    "/{job_id}/cancel", dependencies=[Depends(require_writer)], responses=problems(401, 403, 404, 409, 413, 422)
)
def cancel_job(job_id: JobId, store: Store = Depends(get_store)) -> JobOut:
    job = _job_or_404(store, job_id)
    if job.state in ENDED_STATES:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"job {job_id} is already {job.state}")
    return job_out(store, store.request_cancel(job_id))


@router.get("/{job_id}/trials", responses=problems(404, 422))
def list_trials(
    job_id: JobId,
    store: Store = Depends(get_store),
    sort: Literal["seq", "median_ms", "status", "family"] = "seq",
    order: Literal["asc", "desc"] = "asc",
    status_filter: TrialStatus | None = Query(None, alias="status"),
    limit: int = Query(100, ge=1, le=1000),
    offset: Offset = 0,
) -> Page[TrialOut]:
    _job_or_404(store, job_id)
    trials, total = store.list_trials(job_id, sort, order == "desc", status_filter, limit, offset)
    return Page[TrialOut](items=[TrialOut.model_validate(t) for t in trials], total=total, limit=limit, offset=offset)
