"""Request and response models of the REST API (apart from the tables)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from fastapi import Path, Query
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, StrictFloat, StrictInt

# Ids past the id columns (INTEGER: 32 bits on PostgreSQL) and offsets past 64-bit integers cannot name a row:
# 422, not a driver overflow (500).
MAX_ID = 2**31 - 1
MAX_INT = 2**63 - 1
JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="a job's id")]
KernelId = Annotated[int, Path(ge=1, le=MAX_ID, description="a served kernel's id")]
ProfileId = Annotated[int, Path(ge=1, le=MAX_ID, description="a forward profile's id")]
Offset = Annotated[int, Query(ge=0, le=MAX_INT, description="rows to skip")]
#: A trial's status (kernels.evaluate.TRIAL_STATUSES; a test keeps the two the same).
TrialStatus = Literal["ok", "compile_error", "unsupported", "wrong_result", "fault", "timeout"]


def _with_utc_offset(when: datetime) -> datetime:
    return when if when.tzinfo else when.replace(tzinfo=UTC)


# The store keeps naive UTC datetimes; on the wire a date-time carries its offset (RFC 3339 "...Z"),
# as the OpenAPI format "date-time" requires. Python-side values stay naive.
UtcDatetime = Annotated[datetime, PlainSerializer(_with_utc_offset, return_type=datetime, when_used="json")]


class Problem(BaseModel):
    """Every error response: a sentence saying what is wrong (and, for malformed requests, each problem)."""

    detail: str
    errors: list[dict[str, Any]] | None = Field(None, description="422 on malformed requests: where and what")


_PROBLEMS = {
    400: "the body could not be read as JSON (e.g. not UTF-8)",
    401: "a write without the bearer token this server requires (KERNELMILL_API_TOKEN)",
    403: "a write a browser sent from another site's page (Sec-Fetch-Site)",
    404: "no such id, or no tuned kernel for the problem",
    409: "the job is already finished",
    413: "request body over KERNELMILL_MAX_BODY_BYTES",
    415: "the body is not sent as JSON (Content-Type: application/json)",
    422: "the request is malformed or names something unknown; `detail` says what",
}


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route's error status codes, all with the Problem body."""
    return {code: {"model": Problem, "description": _PROBLEMS[code]} for code in codes}


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Strict: JSON true is no number of trials (it was read as 1), nor "60" a number of seconds.
    trials: StrictInt = Field(64, ge=1, description="trials over all shapes (at least one a shape)")
    seconds: StrictFloat = Field(3600.0, gt=0, allow_inf_nan=False, description="wall-clock limit")


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: str = Field(examples=["softmax"])
    shapes: list[list[StrictInt] | str] = Field(min_length=1, examples=[[[8192, 8192]]])
    dtype: str = Field("float16", examples=["float16"])
    arch: str = Field(
        "auto",
        description="'auto' = any worker's GPU; an arch (sm_80 or newer) = wait for a worker with that GPU",
        pattern=r"^(auto|sm_[0-9]{2,4}a?)$",
    )
    strategy: str = Field("random", examples=["random", "exhaustive", "evolutionary"])
    attrs: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="op attributes, e.g. {'act': 'relu'} or {'eps': 1e-05}"
    )
    families: list[str] | None = Field(
        None,
        min_length=1,
        description="template families to search (`kernelmill ops --json` lists them); default: every family that "
        "computes in the dtype itself. Families computing in another precision (matmul's tensorcore family: "
        "float32 as tf32) are searched only when named, never beside IEEE ones, against PyTorch in that precision",
        examples=[["tensorcore"]],
    )
    budget: Budget = Field(default_factory=Budget)


class ShapeProgress(BaseModel):
    shape: str
    trials: int
    failed: int
    best_ms: float | None
    best_trial_id: int | None
    baseline_ms: float | None
    speedup: float | None


class JobOut(BaseModel):
    id: int
    op: str
    shapes: list[list[int]]
    dtype: str
    arch: str
    attrs: dict[str, Any]
    families: list[str] | None = Field(None, description="the families searched; None: the defaults")
    precision: str = Field(description="what the searched families compute the dtype in (tf32: float32 as TF32)")
    strategy: str
    budget: Budget
    state: str
    cancel_requested: bool = Field(
        False, description="a cancel was asked and the running job stops after its current batch of trials"
    )
    error: str | None
    worker: str | None
    device_name: str | None
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    seconds_used: float = Field(0.0, description="seconds the job has run over all its starts (budget.seconds caps)")
    trials_done: int = 0
    trials_failed: int = 0
    per_shape: list[ShapeProgress] = []
    eta_seconds: float | None = None


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class TrialOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    seq: int
    shape_key: str
    family: str
    params: dict[str, Any]
    status: str
    reason: str | None
    arch: str | None
    max_rel_err: float | None
    median_ms: float | None
    min_ms: float | None
    spread: float | None
    reps: int | None
    ptxas: dict[str, Any] | None
    verify: dict[str, Any] | None
    profile: dict[str, Any] | None
    note: str | None
    created_at: UtcDatetime


class KernelSummary(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    op: str
    shape: list[int]
    dtype: str
    precision: str = Field(description="what its family computes the dtype in: the dtype itself, or tf32 (float32)")
    arch: str
    attrs: dict[str, Any]
    family: str
    params: dict[str, Any]
    median_ms: float
    baseline_ms: float | None
    speedup: float | None
    device_name: str | None
    job_id: int | None
    trial_id: int | None
    updated_at: UtcDatetime


class KernelOut(KernelSummary):
    source: str
    code_sha256: str | None = Field(
        None,
        description="sha256 of the code the cubin was built from (the source without its first line, the knobs "
        "comment: kernels.render.code_digest); null for kernels published before it was recorded",
    )
    launches: list[dict[str, Any]]
    workspace: dict[str, int]
    ptxas: dict[str, Any] | None
    max_rel_err: float | None
    profile: dict[str, Any] | None = None


class BestKernelOut(KernelOut):
    exact: bool
    requested_shape: list[int]


class WorkerOut(BaseModel):
    name: str
    gpu: str | None
    arch: str | None
    busy: bool
    job_id: int | None


class WorkersOut(BaseModel):
    workers: list[WorkerOut]
    reason: str | None = Field(None, description="why there are no GPU workers, when there are none")


class Health(BaseModel):
    status: str
    version: str
    database: str
    workers: int


class ForwardProfileSummary(BaseModel):
    """One ``kernelmill profile-forward`` run as listings show it (times of all its forwards together)."""

    model_config = ConfigDict(from_attributes=True)
    id: int
    model: str = Field(description="a preset's name or the model's path")
    dtype: str
    batch: int
    seq: int | None = Field(description="sequence length (BERT); null for MLPs")
    iters: int = Field(description="forwards profiled")
    graphs: bool = Field(description="CUDA-graph replay (per-op ranges then only in the warm-up)")
    device_name: str | None
    nsys_version: str | None
    kernel_time_ms: float
    kernel_launches: int
    kernel_ms_per_forward: float
    gap_total_ms: float = Field(description="GPU idle time between consecutive activities")
    gap_median_us: float | None
    gap_max_us: float | None
    memcpy_time_ms: float
    memcpy_bytes: int
    created_at: UtcDatetime


class ForwardProfileOut(ForwardProfileSummary):
    summary: dict[str, Any] = Field(
        description="the whole summary: top_kernels, ranges (per NVTX range: calls, cpu_ns, gpu_ns), gaps, memcpy "
        "(by_operation), api, span_ns, notes; times in ns, sizes in bytes"
    )
