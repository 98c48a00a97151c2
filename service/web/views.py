"""What each dashboard page shows, built from the store (and the executor for the GPUs).

No HTTP here: a route in ``pages.py`` validates its input, calls one of these
functions and renders the template with what it returns.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from markupsafe import Markup, escape

from kernelmill.kernels.ops import DTYPES, OPS
from kernelmill.service.api.jobs import job_out, jobs_out
from kernelmill.service.api.schemas import JobOut
from kernelmill.service.db.models import ACTIVE_STATES, JOB_STATES, DeviceRow, Job, Kernel, Trial, utcnow
from kernelmill.service.db.store import Store
from kernelmill.service.executor import Executor
from kernelmill.service.web import charts

#: Every trial status, in the order legends and filters list them.
STATUSES = ("ok", "wrong_result", "compile_error", "fault", "timeout", "unsupported")
PAGE_SIZE = 100
RECENT_JOBS = 12
KERNEL_LIMIT = 5000


# -- shared ---------------------------------------------------------------------------


def shape_label(shape: Sequence[int]) -> str:
    return "x".join(str(int(v)) for v in shape)


def attrs_label(attrs: Mapping[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted((attrs or {}).items()))


def params_label(params: Mapping[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (params or {}).items())


def run_s(job: Job) -> float | None:
    """The seconds counted against the job's time budget: its running time over all its starts (counted after
    each batch of trials), not the wall time since its first start, which also holds any time it spent queued
    again after a restart. Where nothing is counted yet (its first batch runs): the time since it started."""
    if job.started_at is None:
        return None
    if job.seconds_used:
        return job.seconds_used
    return max(0.0, ((job.finished_at or utcnow()) - job.started_at).total_seconds())


def speedups(job: JobOut) -> list[float]:
    return [s.speedup for s in job.per_shape if s.speedup]


# -- overview -------------------------------------------------------------------------


@dataclass
class WorkerView:
    name: str
    job_id: int | None
    gpu: str | None
    arch: str | None
    busy: bool
    job: JobOut | None
    device: DeviceRow | None


@dataclass
class OpBest:
    op: str
    kernels: int
    best: Kernel | None
    geomean: float | None


def overview(store: Store, executor: Executor) -> dict[str, Any]:
    """GPUs and what they run, recent jobs, the best speedup per op."""
    devices = {d.worker: d for d in store.devices()}
    workers = []
    for w in executor.workers():
        job = store.get_job(w.job_id) if w.job_id is not None else None
        workers.append(
            WorkerView(
                w.name, w.job_id, w.gpu, w.arch, w.busy, job_out(store, job) if job else None, devices.get(w.name)
            )
        )
    jobs, total_jobs = store.list_jobs(limit=RECENT_JOBS)
    kernels, n_kernels = store.list_kernels(limit=KERNEL_LIMIT)
    counts = {state: store.list_jobs(state, limit=1)[1] for state in ACTIVE_STATES}
    return {
        "workers": workers,
        "why_none": None if workers else executor.why_none(),
        "jobs": jobs_out(store, jobs),
        "total_jobs": total_jobs,
        "per_op": best_per_op(kernels),
        "n_kernels": n_kernels,
        "running": counts["running"],
        "queued": counts["queued"],
    }


def best_per_op(kernels: Sequence[Kernel]) -> list[OpBest]:
    by_op: dict[str, list[Kernel]] = defaultdict(list)
    for k in kernels:
        by_op[k.op].append(k)
    out = []
    for op in sorted(by_op, key=_op_order):
        rows = by_op[op]
        timed = [k for k in rows if k.speedup]
        best = max(timed, key=lambda k: k.speedup) if timed else None
        geo = math.exp(sum(math.log(k.speedup) for k in timed) / len(timed)) if timed else None
        out.append(OpBest(op, len(rows), best, geo))
    return out


def _op_order(op: str) -> tuple[int, str]:
    names = list(OPS)
    return (names.index(op) if op in names else len(names), op)


def jobs_list(store: Store, state: str | None, op: str | None, page: int) -> dict[str, Any]:
    jobs, total = store.list_jobs(state, op, PAGE_SIZE, (page - 1) * PAGE_SIZE)
    if not jobs and page > (last := Pager.last_page(PAGE_SIZE, total)):  # past the end: a stale link
        page = last
        jobs, total = store.list_jobs(state, op, PAGE_SIZE, (page - 1) * PAGE_SIZE)
    return {
        "jobs": jobs_out(store, jobs),
        "total": total,
        "state": state,
        "op": op,
        "states": JOB_STATES,
        "ops": list(OPS),
        "pager": Pager(page, PAGE_SIZE, total),
    }


# -- job --------------------------------------------------------------------------------


@dataclass
class Pager:
    page: int
    size: int
    total: int

    @staticmethod
    def last_page(size: int, total: int) -> int:
        return max(1, math.ceil(total / size))

    @property
    def pages(self) -> int:
        return self.last_page(self.size, self.total)

    @property
    def first(self) -> int:
        return min(self.total, (self.page - 1) * self.size + 1)

    @property
    def last(self) -> int:
        return min(self.total, self.page * self.size)


@dataclass
class TrialRow:
    trial: Trial
    speedup: float | None
    registers: int | None
    smem_bytes: int | None
    spill_bytes: int | None


@dataclass
class ShapeView:
    shape: str
    trials: int
    failed: int
    best_ms: float | None
    baseline_ms: float | None
    speedup: float | None
    kernel: Kernel | None
    convergence: Markup
    scatter: Markup
    counts: dict[str, int]


@dataclass
class FailureGroup:
    status: str
    reason: str
    trials: list[Trial] = field(default_factory=list)

    @property
    def short(self) -> str:
        first = self.reason.strip().splitlines()[0] if self.reason.strip() else "(no reason recorded)"
        return first if len(first) <= 200 else first[:197] + "..."

    @property
    def long(self) -> bool:
        return "\n" in self.reason.strip() or len(self.reason) > 200


#: Columns the trials table sorts by; ``p:<name>`` sorts by a parameter.
TRIAL_SORTS = {
    "seq": lambda r: r.trial.seq,
    "shape": lambda r: tuple(int(v) for v in r.trial.shape_key.split("x") if v.isdigit()),
    "family": lambda r: r.trial.family,
    "status": lambda r: r.trial.status,
    "median_ms": lambda r: r.trial.median_ms,
    "speedup": lambda r: r.speedup,
    "spread": lambda r: r.trial.spread,
    "max_rel_err": lambda r: r.trial.max_rel_err,
    "registers": lambda r: r.registers,
    "spills": lambda r: r.spill_bytes,
}


def job_page(
    store: Store, job_id: int, sort: str = "seq", order: str = "asc", status: str | None = None, page: int = 1
) -> dict[str, Any] | None:
    """Progress, per-shape charts, failures and one page of the trials table; None for an unknown id."""
    job = store.get_job(job_id)
    if job is None:
        return None
    out = job_out(store, job)
    trials = store.trials(job_id)
    served = {
        k.shape_key: k for k in store.list_kernels(job.op, job.dtype, limit=KERNEL_LIMIT)[0] if k.job_id == job_id
    }
    baselines = {s.shape: s.baseline_ms for s in out.per_shape}
    by_shape: dict[str, list[Trial]] = defaultdict(list)
    for t in trials:
        by_shape[t.shape_key].append(t)

    shapes = []
    for s in out.per_shape:
        points = [_point(t) for t in by_shape.get(s.shape, [])]
        shapes.append(
            ShapeView(
                s.shape,
                s.trials,
                s.failed,
                s.best_ms,
                s.baseline_ms,
                s.speedup,
                served.get(s.shape),
                charts.convergence_chart(points, s.baseline_ms, f"convergence for {s.shape}"),
                charts.trials_scatter(points, s.baseline_ms, f"all trials for {s.shape}"),
                _ordered_counts(Counter(t.status for t in by_shape.get(s.shape, []))),
            )
        )

    rows = [_row(t, baselines.get(t.shape_key)) for t in trials]
    param_names = list(dict.fromkeys(name for t in trials for name in (t.params or {})))
    shown = [r for r in rows if status is None or r.trial.status == status]
    shown = sort_rows(shown, sort, order == "desc")
    page = min(page, Pager.last_page(PAGE_SIZE, len(shown)))  # a page past the end (a stale link): the last
    pager = Pager(page, PAGE_SIZE, len(shown))
    return {
        "job": out,
        "attrs_label": attrs_label(job.attrs),
        "run_s": run_s(job),
        "active": job.state in ACTIVE_STATES,
        "cancel_requested": job.cancel_requested,
        "shapes": shapes,
        "counts": _ordered_counts(Counter(t.status for t in trials)),
        "failures": failure_groups(trials),
        "rows": shown[(page - 1) * PAGE_SIZE : page * PAGE_SIZE],
        "param_names": param_names,
        "multi_shape": len(job.shapes) > 1,
        "sort": sort,
        "order": order,
        "status": status,
        "pager": pager,
        "total_trials": len(trials),
    }


def _ordered_counts(counts: Counter) -> dict[str, int]:
    extra = sorted(s for s in counts if s not in STATUSES)
    return {s: counts[s] for s in (*STATUSES, *extra) if counts.get(s)}


def _point(t: Trial) -> charts.TrialPoint:
    what = f"#{t.seq} {t.family} {params_label(t.params)}"
    if t.status == "ok" and t.median_ms is not None:
        title = f"{what}\n{charts.fmt_ms(t.median_ms)}"
        return charts.TrialPoint(t.seq, t.status, t.median_ms, title)
    reason = (t.reason or "").strip().splitlines()[0][:160] if t.reason else ""
    return charts.TrialPoint(t.seq, t.status, None, f"{what}\n{t.status}: {reason}".rstrip(": "))


def _ptxas_entries(ptxas: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per-entry resources; accepts the per-entry dict or the full report with a 'kernels' key."""
    if not ptxas:
        return {}
    if isinstance(ptxas.get("kernels"), dict):
        ptxas = ptxas["kernels"]
    return {name: vals for name, vals in ptxas.items() if isinstance(vals, dict)}


def _row(t: Trial, baseline_ms: float | None) -> TrialRow:
    entries = list(_ptxas_entries(t.ptxas).values())
    regs = max((e.get("registers", 0) for e in entries), default=None)
    smem = max((e.get("smem_bytes", 0) for e in entries), default=None)
    spills = sum(e.get("spill_stores_bytes", 0) + e.get("spill_loads_bytes", 0) for e in entries) if entries else None
    speedup = baseline_ms / t.median_ms if baseline_ms and t.median_ms else None
    return TrialRow(t, speedup, regs, smem, spills)


def sort_rows(rows: list[TrialRow], sort: str, descending: bool) -> list[TrialRow]:
    """Sorted by a column; empty cells always last, ties by trial number."""
    if sort.startswith("p:"):
        name = sort[2:]

        def key(r: TrialRow):
            return (r.trial.params or {}).get(name)
    else:
        key = TRIAL_SORTS.get(sort, TRIAL_SORTS["seq"])
    present = [r for r in rows if key(r) is not None]
    missing = [r for r in rows if key(r) is None]
    present.sort(key=lambda r: r.trial.seq)
    present.sort(key=lambda r: _comparable(key(r)), reverse=descending)
    return present + sorted(missing, key=lambda r: r.trial.seq)


def _comparable(value: Any) -> tuple[int, Any]:
    if isinstance(value, bool):
        return (0, int(value))
    if isinstance(value, int | float):
        return (0, value)
    if isinstance(value, tuple):
        return (1, value)
    return (2, str(value))


def failure_groups(trials: Sequence[Trial]) -> list[FailureGroup]:
    groups: dict[tuple[str, str], FailureGroup] = {}
    for t in trials:
        if t.status == "ok":
            continue
        reason = (t.reason or "").strip()
        key = (t.status, reason)
        groups.setdefault(key, FailureGroup(t.status, reason)).trials.append(t)
    order = {s: i for i, s in enumerate(STATUSES)}
    return sorted(groups.values(), key=lambda g: (order.get(g.status, 99), -len(g.trials), g.reason))


# -- kernel ---------------------------------------------------------------------------


def match_device(devices: Sequence[DeviceRow], name: str | None, arch: str | None) -> DeviceRow | None:
    """The measured device a kernel ran on: same GPU name (and arch), ceilings measured first."""
    same = [d for d in devices if name and d.name == name and (arch is None or d.arch == arch)]
    same.sort(key=lambda d: (d.copy_gbps is None, not d.matrix_tflops))
    return same[0] if same else None


def kernel_page(store: Store, kernel_id: int) -> dict[str, Any] | None:
    """Source, parameters, ptxas, timings, profile and the roofline point; None for an unknown id."""
    kernel = store.kernel(kernel_id)
    if kernel is None:
        return None
    trial = store.trial(kernel.trial_id) if kernel.trial_id is not None else None
    device = match_device(store.devices(), kernel.device_name, kernel.arch)
    copy_gbps = device.copy_gbps if device else None
    # The matrix rate of the precision the kernel computes in (a float32 kernel on TF32 tensor cores: TF32's).
    precision = kernel.precision or kernel.dtype
    peak = ((device.matrix_tflops or {}) if device else {}).get(precision)

    flops = min_bytes = None
    spec = OPS.get(kernel.op)
    if spec is not None:
        try:
            flops = float(spec.flops(tuple(kernel.shape)))
            min_bytes = float(spec.min_bytes(tuple(kernel.shape), kernel.dtype))
        except Exception:  # noqa: BLE001 - a shape the current spec rejects still shows its page
            flops = min_bytes = None
    roof: dict[str, Any] = {"copy_gbps": copy_gbps, "peak_tflops": peak, "precision": precision, "device": device}
    if flops and min_bytes and kernel.median_ms:
        ai = flops / min_bytes
        tflops = flops / (kernel.median_ms * 1e-3) / 1e12
        torch = flops / (kernel.baseline_ms * 1e-3) / 1e12 if kernel.baseline_ms else None
        floor_ms = None
        if copy_gbps:
            floor_ms = min_bytes / (copy_gbps * 1e9) * 1e3
            if peak:
                floor_ms = max(floor_ms, flops / (peak * 1e12) * 1e3)
        roof.update(
            ai=ai,
            tflops=tflops,
            torch_tflops=torch,
            gbps=min_bytes / (kernel.median_ms * 1e-3) / 1e9,
            floor_ms=floor_ms,
            of_floor=floor_ms / kernel.median_ms if floor_ms else None,
            chart=charts.roofline_chart(ai, tflops, torch, copy_gbps, peak, f"roofline of kernel {kernel.id}"),
        )
    return {
        "kernel": kernel,
        "trial": trial,
        "shape": shape_label(kernel.shape),
        "attrs_label": attrs_label(kernel.attrs),
        "ptxas": _ptxas_entries(kernel.ptxas),
        "profile": flatten(trial.profile) if trial and trial.profile else [],
        "source": highlight_cuda(kernel.source),
        "bars": charts.timing_bars(kernel.median_ms, kernel.baseline_ms, roof.get("floor_ms")),
        "verify": trial.verify if trial and trial.verify else None,
        "roof": roof,
        "flops": flops,
        "min_bytes": min_bytes,
    }


def flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested profile metrics as (dotted name, value) rows."""
    if isinstance(data, Mapping):
        rows: list[tuple[str, Any]] = []
        for key, value in data.items():
            rows.extend(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return rows
    return [(prefix or "value", data)]


@cache
def _formatter():
    from pygments.formatters import HtmlFormatter

    return HtmlFormatter(linenos="table", cssclass="highlight", style="default")


def highlight_cuda(source: str) -> Markup:
    """CUDA source as highlighted HTML (Pygments); plain escaped text without Pygments."""
    try:
        from pygments import highlight
        from pygments.lexers import CudaLexer
    except ImportError:  # pragma: no cover - pygments is a declared dependency
        return Markup('<pre class="plain-source">') + escape(source) + Markup("</pre>")
    return Markup(highlight(source, CudaLexer(), _formatter()))


# -- compare --------------------------------------------------------------------------


@dataclass
class CompareRow:
    shape: str
    attrs: str
    cells: list[list[Kernel]]
    prefill: dict[str, str]  # the new-job form's attribute fields for this row


@dataclass
class CompareGroup:
    op: str
    dims: str
    rows: list[CompareRow]


def compare(store: Store, arch: str | None = None) -> dict[str, Any]:
    """Speedups over PyTorch: op x shape rows, dtype columns; one chip per arch in a cell."""
    kernels, _ = store.list_kernels(limit=KERNEL_LIMIT)
    archs = sorted({k.arch for k in kernels})
    if arch:
        kernels = [k for k in kernels if k.arch == arch]
    table: dict[str, dict[tuple[str, tuple[int, ...]], dict[str, list[Kernel]]]] = defaultdict(dict)
    prefill: dict[tuple[str, str], dict[str, str]] = {}
    for k in kernels:
        key = (attrs_label(k.attrs), tuple(int(v) for v in k.shape))
        table[k.op].setdefault(key, defaultdict(list))[k.dtype].append(k)
        prefill[(k.op, key[0])] = {f"attr.{k.op}.{name}": str(v) for name, v in (k.attrs or {}).items()}
    groups = []
    for op in sorted(table, key=_op_order):
        spec = OPS.get(op)
        rows = [
            CompareRow(
                shape_label(shape),
                attrs,
                [sorted(cells.get(dt, []), key=lambda k: (k.arch, k.device_name or "")) for dt in DTYPES],
                prefill[(op, attrs)],
            )
            for (attrs, shape), cells in sorted(table[op].items(), key=lambda item: (item[0][0], item[0][1]))
        ]
        groups.append(CompareGroup(op, " x ".join(spec.dims) if spec else "", rows))
    # Where kernels of several GPU models are served, each chip names its model (an H100's and an H200's kernel
    # for one problem sit side by side).
    models = len({k.device_name for k in kernels}) > 1
    return {
        "groups": groups, "dtypes": DTYPES, "archs": archs, "arch": arch, "n_kernels": len(kernels), "models": models,
    }  # fmt: skip


def speedup_style(speedup: float | None) -> str:
    """Inline colours for a speedup cell: red below 1x, neutral at 1x, green above (log scale, 4x saturates)."""
    if not speedup or speedup <= 0:
        return ""
    t = max(-1.0, min(1.0, math.log2(speedup) / 2))
    hue = 142 if t >= 0 else 0
    strength = abs(t)
    light = 97 - 52 * strength
    sat = 20 + 55 * strength
    text = "#ffffff" if light < 62 else "#1f2328"
    return f"background:hsl({hue} {sat:.0f}% {light:.0f}%);color:{text}"
