"""SQLAlchemy 2 tables. API schemas live apart (service/api/schemas.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, deferred, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


#: A job's states: those it can still leave, then those it ends in.
ACTIVE_STATES = ("queued", "running")
ENDED_STATES = ("done", "failed", "cancelled")
JOB_STATES = ACTIVE_STATES + ENDED_STATES


class DeviceRow(Base):
    """A GPU a worker serves, with its measured ceilings."""

    __tablename__ = "devices"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    arch: Mapped[str] = mapped_column(String(16))
    worker: Mapped[str] = mapped_column(String(128), unique=True)
    sm_count: Mapped[int | None] = mapped_column(Integer)
    copy_gbps: Mapped[float | None] = mapped_column(Float)
    matrix_tflops: Mapped[dict[str, Any]] = mapped_column(default=dict)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    op: Mapped[str] = mapped_column(String(32), index=True)
    shapes: Mapped[list[Any]] = mapped_column()
    dtype: Mapped[str] = mapped_column(String(16))
    attrs: Mapped[dict[str, Any]] = mapped_column(default=dict)
    arch: Mapped[str] = mapped_column(String(16), default="auto")
    #: The template families searched; None: the defaults (agents.space.default_families).
    families: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    strategy: Mapped[str] = mapped_column(String(32))
    budget_trials: Mapped[int] = mapped_column(Integer)
    budget_seconds: Mapped[float] = mapped_column(Float)
    #: Wall-clock seconds the job has run, summed over its starts (a resumed job has only the rest of its budget).
    seconds_used: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    state: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    error: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(String(128))
    device_name: Mapped[str | None] = mapped_column(String(128))
    #: The job runner (service process) running the job, and until when its claim holds unless renewed:
    #: another runner queues the job again only once the lease has lapsed (migration 0008).
    runner: Mapped[str | None] = mapped_column(String(96))
    lease_until: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()
    trials: Mapped[list[Trial]] = relationship(back_populates="job", cascade="all, delete-orphan", lazy="raise")


class Trial(Base):
    """One variant evaluated on one device for one shape; failures are rows with a reason."""

    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("job_id", "shape_key", "family", "params_key", name="uq_trial_candidate"),
        Index("ix_trials_job_shape", "job_id", "shape_key"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)  # order within the job
    shape_key: Mapped[str] = mapped_column(String(64))
    family: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any]] = mapped_column()
    params_key: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(24), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    arch: Mapped[str | None] = mapped_column(String(16))
    device_name: Mapped[str | None] = mapped_column(String(128))  # the GPU model it was timed on (migration 0009)
    variant_key: Mapped[str | None] = mapped_column(String(64))
    #: The digest of the code its cubin was built from (kernels.render.code_digest; migration 0010)
    code_sha256: Mapped[str | None] = mapped_column(String(64))
    ptxas: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    max_rel_err: Mapped[float | None] = mapped_column(Float)
    verify: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    median_ms: Mapped[float | None] = mapped_column(Float)
    min_ms: Mapped[float | None] = mapped_column(Float)
    spread: Mapped[float | None] = mapped_column(Float)
    reps: Mapped[int | None] = mapped_column(Integer)
    roofline_pct: Mapped[float | None] = mapped_column(Float)
    profile: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    note: Mapped[str | None] = mapped_column(Text)  # why the strategy proposed it
    cubin: Mapped[bytes | None] = deferred(mapped_column(LargeBinary))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    job: Mapped[Job] = relationship(back_populates="trials")


class Baseline(Base):
    """PyTorch's time for a job's shape, measured on the job's GPU in the same job."""

    __tablename__ = "baselines"
    __table_args__ = (UniqueConstraint("job_id", "shape_key", name="uq_baseline_job_shape"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    shape_key: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(32), default="torch")
    median_ms: Mapped[float | None] = mapped_column(Float)
    device_name: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Kernel(Base):
    """The best verified trial per (op, shape, dtype, arch, attrs, precision) and GPU model: what is served."""

    __tablename__ = "kernels"
    __table_args__ = (
        UniqueConstraint(
            "op", "shape_key", "dtype", "arch", "attrs_key", "precision", "device_key", name="uq_kernel_problem"
        ),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    op: Mapped[str] = mapped_column(String(32), index=True)
    shape: Mapped[list[Any]] = mapped_column()
    shape_key: Mapped[str] = mapped_column(String(64))
    dtype: Mapped[str] = mapped_column(String(16))
    #: The arithmetic its family computes the dtype in: the dtype itself, or tf32 for float32 on tensor cores.
    precision: Mapped[str] = mapped_column(String(16))
    arch: Mapped[str] = mapped_column(String(16))
    attrs: Mapped[dict[str, Any]] = mapped_column(default=dict)
    attrs_key: Mapped[str] = mapped_column(String(256), default="{}")
    family: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any]] = mapped_column()
    source: Mapped[str] = mapped_column(Text)
    #: ``code_digest(source)``, the code its cubin was built from, as its trial recorded it (None: not known, a
    #: kernel published before migration 0010 or from a trial that did not record it)
    code_sha256: Mapped[str | None] = mapped_column(String(64))
    cubin: Mapped[bytes] = deferred(mapped_column(LargeBinary))
    launches: Mapped[list[Any]] = mapped_column()
    workspace: Mapped[dict[str, Any]] = mapped_column(default=dict)
    ptxas: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    median_ms: Mapped[float] = mapped_column(Float)
    baseline_ms: Mapped[float | None] = mapped_column(Float)
    speedup: Mapped[float | None] = mapped_column(Float)
    max_rel_err: Mapped[float | None] = mapped_column(Float)
    device_name: Mapped[str | None] = mapped_column(String(128))
    #: The GPU model it is served for in the unique key: device_name, "" where that is not known (NULLs would
    #: never collide in a unique constraint).
    device_key: Mapped[str] = mapped_column(String(128), default="", server_default="")
    trial_id: Mapped[int | None] = mapped_column(ForeignKey("trials.id", ondelete="SET NULL"))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ForwardProfileRow(Base):
    """One ``kernelmill profile-forward`` run: nsys's summary of a model's forwards (``summary`` holds it
    whole; the columns are what listings show)."""

    __tablename__ = "forward_profiles"
    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(512))
    dtype: Mapped[str] = mapped_column(String(16))
    batch: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int | None] = mapped_column(Integer)
    iters: Mapped[int] = mapped_column(Integer)
    graphs: Mapped[bool] = mapped_column(default=False)
    device_name: Mapped[str | None] = mapped_column(String(128))
    nsys_version: Mapped[str | None] = mapped_column(String(32))
    kernel_time_ms: Mapped[float] = mapped_column(Float)
    kernel_launches: Mapped[int] = mapped_column(Integer)
    kernel_ms_per_forward: Mapped[float] = mapped_column(Float)
    gap_total_ms: Mapped[float] = mapped_column(Float)
    gap_median_us: Mapped[float | None] = mapped_column(Float)
    gap_max_us: Mapped[float | None] = mapped_column(Float)
    memcpy_time_ms: Mapped[float] = mapped_column(Float)
    memcpy_bytes: Mapped[int] = mapped_column(BigInteger)
    summary: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
