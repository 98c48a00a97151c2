"""Request and response models of the REST API (apart from the tables)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trials: int = Field(64, ge=1, description="trials over all shapes")
    seconds: float = Field(3600.0, gt=0, description="wall-clock limit")


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: str = Field(examples=["softmax"])
    shapes: list[list[int] | str] = Field(min_length=1, examples=[[[8192, 8192]]])
    dtype: str = Field("float16", examples=["float16"])
    arch: str = Field("auto", description="'auto' = the worker's GPU", pattern=r"^(auto|sm_\d+a?)$")
    strategy: str = Field("random", examples=["random", "exhaustive", "evolutionary"])
    attrs: dict[str, str] = Field(default_factory=dict, description="op attributes, e.g. {'act': 'relu'}")
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
    strategy: str
    budget: Budget
    state: str
    error: str | None
    worker: str | None
    device_name: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
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
    created_at: datetime


class KernelSummary(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    op: str
    shape: list[int]
    dtype: str
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
    updated_at: datetime


class KernelOut(KernelSummary):
    source: str
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
