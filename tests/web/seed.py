"""A store filled with finished jobs whose trials cover every status, served kernels and a measured device.

Real template families give the parameters, launch entries and CUDA source; the
times, failures, ptxas numbers and profiles are synthetic but deterministic.
Only finished jobs are written, so the service's runner leaves them alone.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

from kernelmill.agents.loop import served_fields
from kernelmill.agents.space import Candidate
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import format_shape
from kernelmill.service.db.models import utcnow
from kernelmill.service.db.store import Store

DEVICE = "FakeGPU 0"
WORKER = "fake-gpu0"

REASONS = {
    "wrong_result": "max rel err 3.1e-01 over the float16 tolerance 1e-02 (seed 2, first bad element at [17, 3])",
    "compile_error": (
        "nvcc exited with status 2\n"
        'kernel.cu(88): error: identifier "__shfl_xor_sync_bad" is undefined\n'
        "kernel.cu(91): error: expression must have integral type\n"
        '2 errors detected in the compilation of "kernel.cu".'
    ),
    "fault": (
        "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered (context poisoned, worker restarted)"
    ),
    "timeout": "the kernel did not finish within 10 s (hang; worker restarted)",
    "unsupported": "this variant cannot run the shape: rows_per_block x vec exceeds the row length",
}


def _candidates(op: str, dtype: str, n: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` valid (family, params) pairs, alternating between the op's families."""
    spec = get_op(op)
    iters = [(name, fam.space(dtype)) for name, fam in spec.families.items()]
    out: list[tuple[str, dict[str, Any]]] = []
    while len(out) < n and iters:
        for name, it in list(iters):
            params = next(it, None)
            if params is None:
                iters.remove((name, it))
                continue
            out.append((name, params))
            if len(out) == n:
                break
    return out


def _status(rng: random.Random, i: int) -> str:
    if i < 2:
        return "ok"
    r = rng.random()
    for status, cut in (
        ("wrong_result", 0.08),
        ("compile_error", 0.14),
        ("fault", 0.18),
        ("timeout", 0.21),
        ("unsupported", 0.24),
    ):
        if r < cut:
            return status
    return "ok"


def add_job(
    store: Store,
    op: str,
    shapes: list[list[int]],
    dtype: str,
    attrs: dict[str, Any] | None = None,
    trials_per_shape: int = 40,
    baseline_ms: float = 1.0,
    state: str = "done",
    error: str | None = None,
    seed: int = 0,
    publish: bool = True,
    slowdown: float = 1.0,
    device: str = DEVICE,
) -> int:
    """A finished job with trials, baselines and (unless ``publish`` is off) its served kernels; returns its id."""
    spec = get_op(op)
    attrs = spec.resolve_attrs(attrs or {})
    now = utcnow()
    job = store.create_job(
        op=op,
        shapes=shapes,
        dtype=dtype,
        attrs=attrs,
        strategy="evolutionary",
        budget_trials=trials_per_shape * len(shapes),
        budget_seconds=1800.0,
        state=state,
        error=error,
        worker=WORKER,
        device_name=device,
        created_at=now - timedelta(minutes=20 + seed),
        started_at=now - timedelta(minutes=19 + seed),
        finished_at=now - timedelta(minutes=2 + seed),
    )
    rng = random.Random(seed)
    for shape in shapes:
        key = format_shape(tuple(shape))
        base = baseline_ms * (1 + 0.1 * rng.random())
        store.record_baseline(job.id, key, base, device)
        rows = []
        cands = _candidates(op, dtype, trials_per_shape)
        for i, (family, params) in enumerate(cands):
            status = _status(rng, i)
            entries = [launch.entry for launch in spec.family(family).launches(tuple(shape), params, dtype)]
            row: dict[str, Any] = {
                "family": family,
                "params": params,
                "params_key": Candidate.of(family, params).params_json,
                "status": status,
                "arch": "sm_90",
                "note": "seed",
            }
            if status != "compile_error" and status != "unsupported":
                row["ptxas"] = {
                    e: {
                        "registers": rng.choice([32, 40, 64, 96, 128, 168, 255]),
                        "smem_bytes": rng.choice([0, 4096, 16384, 49152]),
                        "stack_bytes": 0,
                        "spill_stores_bytes": rng.choice([0, 0, 0, 0, 0, 24]),
                        "spill_loads_bytes": 0,
                        "barriers": 1,
                    }
                    for e in entries
                }
            if status == "ok":
                trend = 1.0 - 0.45 * min(1.0, i / max(1, trials_per_shape * 0.6))
                ms = (base * (0.55 + 0.9 * rng.random()) * trend + base * 0.2) * slowdown
                row.update(
                    median_ms=ms,
                    min_ms=ms * 0.97,
                    spread=0.01 + 0.03 * rng.random(),
                    reps=30,
                    max_rel_err=rng.choice([1.2e-4, 3.4e-4, 9.8e-4]),
                    cubin=b"seed-cubin",
                    verify={"precision": dtype, "tolerance": 1e-2, "max_rel_err_per_seed": {"1": 1e-4}},
                    profile={
                        "dram_throughput_pct": round(40 + 55 * rng.random(), 1),
                        "sm_throughput_pct": round(20 + 60 * rng.random(), 1),
                        "achieved_occupancy": round(0.3 + 0.6 * rng.random(), 2),
                        "l2": {"hit_rate_pct": round(10 + 50 * rng.random(), 1)},
                    },
                )
            else:
                row["reason"] = REASONS[status]
            rows.append(row)
        store.record_trials(job.id, key, rows)
        best = store.best_trial(job.id, key)
        if publish and best is not None:
            fields = served_fields(op, tuple(shape), dtype, attrs)(best.family, best.params)
            fields.update(cubin=b"seed-cubin", baseline_ms=base)
            store.publish(store.get_job(job.id), best, fields)
    return job.id


def seed_demo(store: Store) -> dict[str, int]:
    """Three finished jobs over the three ops, a failed and a cancelled one, and measured ceilings."""
    store.upsert_device(
        WORKER,
        name=DEVICE,
        arch="sm_90",
        sm_count=132,
        copy_gbps=3000.0,
        matrix_tflops={"float16": 700.0, "bfloat16": 700.0, "float32": 380.0},
    )
    ids = {
        "softmax": add_job(store, "softmax", [[4096, 4096], [8192, 1024]], "float16", trials_per_shape=48, seed=1),
        "fused_mlp": add_job(
            store,
            "fused_mlp",
            [[32, 1024, 4096, 1024]],
            "bfloat16",
            {"act": "gelu_tanh"},
            trials_per_shape=36,
            baseline_ms=0.08,
            seed=2,
        ),
        "matmul": add_job(
            store, "matmul", [[1024, 1024, 1024]], "float32", trials_per_shape=30, baseline_ms=0.4, seed=3
        ),
        "matmul_slow": add_job(
            store, "matmul", [[4096, 4096, 4096]], "float16", trials_per_shape=20, baseline_ms=0.9, slowdown=3.0, seed=6
        ),
        "failed": add_job(
            store,
            "softmax",
            [[1024, 1024]],
            "float32",
            trials_per_shape=6,
            state="failed",
            error="RuntimeError: the worker died three times in a row",
            seed=4,
            publish=False,
        ),
        "cancelled": add_job(
            store,
            "matmul",
            [[512, 512, 512]],
            "bfloat16",
            trials_per_shape=10,
            state="cancelled",
            seed=5,
            publish=False,
        ),
    }
    kernels, _ = store.list_kernels(limit=100)
    ids["kernel"] = next(k.id for k in kernels if k.op == "softmax")
    ids["mlp_kernel"] = next(k.id for k in kernels if k.op == "fused_mlp")
    return ids
