"""Tuned kernels against PyTorch eager and torch.compile, in one process on one GPU.

    python3 benchmarks/kernels.py --db sqlite:////tmp/kernels.db --budget 32 --json kernels.json
    python3 benchmarks/kernels.py --only softmax --reuse        # time what the store already holds

For each case: a tuning job (guided strategy, warm starts from the store) unless
--reuse finds one, then the best verified kernel, torch eager and torch.compile
(max-autotune) are timed the same way (CUDA events, L2 flushed between
repetitions, median). Prints case, our time, PyTorch's, speedup, GB/s or
TFLOP/s and % of the roofline floor (measured copy bandwidth and matrix rate);
writes the table as JSON. Every reported kernel passed verification at that
shape and dtype inside its tuning job and is verified again here.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import format_shape


@dataclass(frozen=True)
class Target:
    """What a case must reach: ``kind`` is "floor_pct" (% of the roofline floor: copy bandwidth or matrix
    rate), "speedup" (x PyTorch eager) or "max_us" (our time); all of ``also`` must hold as well."""

    kind: str
    value: float
    text: str
    also: tuple[Target, ...] = ()

    def met(self, row: dict) -> bool | None:
        key = {"floor_pct": "pct_floor", "speedup": "speedup", "max_us": "ours_us"}[self.kind]
        got = row.get(key)
        if got is None:
            return None
        ok = got <= self.value if self.kind == "max_us" else got >= self.value
        return ok and all(t.met(row) for t in self.also)


@dataclass(frozen=True)
class Case:
    op: str
    shape: tuple[int, ...]
    dtype: str
    target: Target
    attrs: dict = field(default_factory=dict, hash=False)
    #: Families the tuning job searches (None: every family of the op for the dtype).
    families: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.op} {format_shape(self.shape)} {self.dtype}"


def _cases() -> list[Case]:
    copy80 = Target("floor_pct", 80, ">= 80% of copy bandwidth")
    cases = []
    for dtype in ("float16", "float32"):
        for shape in ((8192, 8192), (32768, 1024), (4096, 32000)):
            cases.append(Case("softmax", shape, dtype, copy80))
        cases.append(Case("softmax", (1, 32000), dtype, Target("speedup", 2.0, ">= 2x torch.softmax")))
    big = Target("speedup", 0.9, ">= 0.9x cuBLAS")
    skinny = Target(
        "speedup", 1.2, ">= 1.2x cuBLAS, >= 85% of copy bandwidth", (Target("floor_pct", 85, "85% of copy"),)
    )
    for dtype in ("float16", "bfloat16"):
        for shape in ((4096, 4096, 4096), (8192, 8192, 8192), (2048, 11008, 4096)):
            cases.append(Case("matmul", shape, dtype, big, families=("wgmma",)))
        for shape in ((1, 4096, 4096), (16, 4096, 4096), (1, 4096, 11008)):
            cases.append(Case("matmul", shape, dtype, skinny, families=("gemv",)))
    fp32 = Target("speedup", 0.9, ">= 0.9x cuBLAS fp32 (no TF32)")
    cases.append(Case("matmul", (4096, 4096, 4096), "float32", fp32, families=("simt",)))
    for batch, us in ((1, 50.0), (16, 55.0), (4096, 1100.0)):
        families = ("wgmma", "epilogue") if batch > 32 else ("small_batch", "epilogue")
        text = f"<= {us:.0f} us" if us < 1000 else f"<= {us / 1000:.2f} ms"
        cases.append(
            Case(
                "fused_mlp", (batch, 4096, 11008, 4096), "float16", Target("max_us", us, text), {"act": "gelu_tanh"},
                families=families,
            )
        )  # fmt: skip
    return cases


def tune(store, evaluator, case: Case, budget: int, strategy: str, profile_top_k: int = 1, seconds: int = 1800):
    from kernelmill.agents.loop import JobPlan, run_job
    from kernelmill.service.jobs import StoreRecorder

    facts = evaluator.facts()
    job = store.create_job(
        op=case.op, shapes=[list(case.shape)], dtype=case.dtype, attrs=case.attrs, strategy=strategy,
        budget_trials=budget, budget_seconds=seconds, arch=facts.arch,
    )  # fmt: skip
    store.start_job(job.id, "benchmark", facts.name)
    plan = JobPlan(
        job.id, case.op, [case.shape], case.dtype, case.attrs, strategy, budget, seconds, batch_size=16,
        profile_top_k=profile_top_k, families=list(case.families) if case.families else None,
    )  # fmt: skip
    state = run_job(plan, evaluator, StoreRecorder(store, job.id))
    store.finish_job(job.id, state)
    return job.id


def latest_job(store, case: Case) -> int | None:
    jobs, _ = store.list_jobs(op=case.op, limit=500)
    for job in jobs:
        if job.dtype == case.dtype and [list(case.shape)] == job.shapes and job.state == "done":
            return job.id
    return None


def measure(case: Case, store, evaluator, job_id: int, reps: int, compiled_torch: bool) -> dict:
    from kernelmill.kernels.bench import time_it, time_torch
    from kernelmill.kernels.compile import CompiledKernel
    from kernelmill.kernels.variant import BoundVariant, Variant
    from kernelmill.kernels.verify import verify

    spec = get_op(case.op)
    key = format_shape(case.shape)
    row = {"case": case.name, "target": case.target.text, "job": job_id}
    best = store.best_trial(job_id, key)
    if best is not None and best.profile:
        row["ncu"] = best.profile  # the job's ncu profile of this kernel (profile_top_k)
    device, flusher = evaluator.device, evaluator.flusher
    attrs = spec.resolve_attrs(case.attrs)
    inputs = spec.make_inputs(case.shape, case.dtype, seed=0)
    torch_eager = time_torch(device, spec, inputs, attrs, flusher, reps=reps)
    row["torch_us"] = torch_eager.median_ms * 1e3 if torch_eager else None
    if compiled_torch and torch_eager is not None:
        row["torch_compile_us"] = _torch_compile_us(device, spec, inputs, attrs, flusher, reps)
    ceil = evaluator.ceilings()
    floor_ms = ceil.floor_ms(spec, case.shape, case.dtype)
    row["floor_us"] = floor_ms * 1e3
    if best is None:
        row["status"] = "no verified kernel"
        return row
    variant = Variant.create(case.op, best.family, case.dtype, best.params, case.attrs)
    bound = BoundVariant(device, variant, CompiledKernel(best.cubin, best.arch, f"trial-{best.id}"), case.shape)
    check = verify(device, bound, seeds=2, cache=evaluator.references)
    if not check.ok:
        row["status"] = f"failed re-verification: {check.reason}"
        return row
    timing = time_it(device, bound.run, 5, reps, flusher)
    ms = timing.median_ms
    row.update(
        status="ok", family=best.family, params=best.params, ours_us=ms * 1e3, spread=timing.spread,
        max_rel_err=check.max_rel_err, gbps=spec.min_bytes(case.shape, case.dtype) / (ms * 1e-3) / 1e9,
        tflops=spec.flops(case.shape) / (ms * 1e-3) / 1e12, pct_floor=100.0 * floor_ms / ms,
        speedup=(row["torch_us"] / (ms * 1e3)) if row["torch_us"] else None,
    )  # fmt: skip
    row["met"] = case.target.met(row)
    return row


def _torch_compile_us(device, spec, inputs, attrs, flusher, reps) -> float | None:
    import torch

    from kernelmill.kernels.bench import time_it, to_torch

    tensors = {name: to_torch(arr) for name, arr in inputs.items()}
    eager = spec.torch_reference(tensors, attrs)
    try:
        compiled = torch.compile(eager, mode="max-autotune")
        compiled()
    except Exception as exc:  # noqa: BLE001 - report, don't abort the table
        logging.warning("torch.compile failed for %s: %s", spec.name, exc)
        return None
    return time_it(device, compiled, 5, reps, flusher).median_ms * 1e3


def print_table(rows: list[dict], device: str, ceil) -> None:
    print(f"\n{device}: copy {ceil.copy_gbps:.0f} GB/s, matrix " + ", ".join(
        f"{k} {v:.0f} TFLOP/s" for k, v in ceil.matrix_tflops.items()))  # fmt: skip
    head = f"{'case':34} {'ours us':>9} {'torch us':>9} {'compile us':>10} {'speedup':>8} {'GB/s':>7} {'TFLOP/s':>8}"
    print(head + f" {'% floor':>8}  met  target")
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['case']:34} {r.get('status')}")
            continue
        comp = f"{r['torch_compile_us']:.1f}" if r.get("torch_compile_us") else "-"
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        print(
            f"{r['case']:34} {r['ours_us']:9.1f} {r['torch_us'] or 0:9.1f} {comp:>10} {speed:>8} {r['gbps']:7.0f} "
            f"{r['tflops']:8.1f} {r['pct_floor']:7.0f}%  {_met(r.get('met')):3}  {r['target']}"
        )


def _met(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "no")


def _count(least: int):
    """An argparse type: an integer of at least ``least``, with a one-line reason otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: at least {least}")
        return value

    return parse


def selected(cases: list[Case], only: str, names: str) -> list[Case]:
    """The cases of the ops in ``only`` whose names contain one of ``names`` (comma-separated; empty: all)."""
    ops = {o for o in only.split(",") if o}
    subs = [c for c in names.split(",") if c]
    return [c for c in cases if (not ops or c.op in ops) and (not subs or any(n in c.name for n in subs))]


def main(argv: list[str] | None = None) -> int:
    from kernelmill.agents.strategies import STRATEGIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default="sqlite:///kernels.db")
    parser.add_argument("--budget", type=_count(1), default=32, help="trials per tuning job")
    parser.add_argument("--strategy", default="guided", choices=sorted(STRATEGIES))
    parser.add_argument("--only", default="", help="comma-separated ops")
    parser.add_argument(
        "--cases", default="", help="comma-separated substrings of case names, e.g. '8192x8192 float16'"
    )
    parser.add_argument("--reuse", action="store_true", help="time the store's latest job per case, no tuning")
    parser.add_argument("--no-compile", default="", help="comma-separated ops for which torch.compile is skipped")
    parser.add_argument("--reps", type=_count(1), default=50)
    parser.add_argument("--tune-only", action="store_true", help="run the tuning jobs, time nothing")
    parser.add_argument("--profile-top-k", type=_count(0), default=1, help="ncu profiles of each job's fastest kernels")
    parser.add_argument("--job-seconds", type=_count(1), default=1800, help="time budget of each tuning job")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():  # found now, not after the run
        parser.error(f"argument --json: no folder {str(Path(args.json).parent)!r} to write {args.json!r} in")
    cases = selected(_cases(), args.only, args.cases)
    if not cases:
        ops = sorted({c.op for c in _cases()})
        parser.error(f"no case matches --only {args.only!r} --cases {args.cases!r} (ops: {', '.join(ops)})")
    command = shlex.join(["python", "benchmarks/kernels.py", *(sys.argv[1:] if argv is None else argv)])

    from kernelmill.agents.evaluator import LocalEvaluator
    from kernelmill.kernels.device import GpuUnavailable
    from kernelmill.service.db.store import DatabaseError, Store

    try:  # the GPU first: without one, no database file is left behind
        evaluator = LocalEvaluator(0, seeds=2, reps=30)
    except GpuUnavailable as exc:
        print(f"kernels.py needs a CUDA GPU: {exc}", file=sys.stderr)
        return 3
    try:
        store = Store(args.db)
    except DatabaseError as exc:
        print(f"kernels.py: {exc}", file=sys.stderr)
        return 3 if exc.unreachable else 2
    rows: list[dict] = []
    ceil = evaluator.ceilings()
    device = evaluator.device.info.name
    date = datetime.now(UTC).isoformat(timespec="seconds")
    for case in cases:
        start = time.monotonic()
        try:
            job_id = latest_job(store, case) if args.reuse else None
            if job_id is None:
                job_id = tune(store, evaluator, case, args.budget, args.strategy, args.profile_top_k, args.job_seconds)
            if args.tune_only:
                print(f"{case.name}: job {job_id} ({time.monotonic() - start:.0f} s)", flush=True)
                continue
            row = measure(case, store, evaluator, job_id, args.reps, case.op not in args.no_compile.split(","))
        except Exception as exc:  # noqa: BLE001 - one case's failure is a row of the table, not the end of it
            logging.exception("%s failed", case.name)
            row = {"case": case.name, "target": case.target.text, "status": f"error: {exc}"}
        row["seconds"] = round(time.monotonic() - start, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "params"}), flush=True)
        if args.json:  # after every case: a run cut short keeps what it measured
            with open(args.json, "w") as fh:
                json.dump({"device": device, "date": date, "command": command, "copy_gbps": ceil.copy_gbps,
                           "matrix_tflops": ceil.matrix_tflops, "rows": rows}, fh, indent=2)  # fmt: skip
    if not args.tune_only:
        print_table(rows, device, ceil)
    return 0


if __name__ == "__main__":
    sys.exit(main())
