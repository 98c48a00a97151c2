"""A model's forward under Nsight Systems: per-op NVTX ranges, kernel time, launch gaps, copies.

``profile_forward(spec)`` runs ``nsys profile`` on a child process (``python -m
kernelmill.runtime.profile SPEC``) that loads the model, runs its warm-up forwards (kernels are resolved,
compiled and loaded then), and only then opens nsys's capture window (cuProfilerStart) around ``iters``
forwards with NVTX ranges on (``KERNELMILL_NVTX=1``). ``nsys stats --format csv`` then turns the report into
tables that ``summarize`` reduces to a ``ForwardProfile``. The caller's process never touches the GPU.

Failures are exceptions that say what happened, never a half summary: ``NsysUnavailable`` (no nsys here, or
one that cannot be started),
``ForwardFailed`` (the child could not run the forward: no GPU, a bad model file, ...), ``NsysNoReport``
(nsys ran but wrote no report, or one without kernels; with the tail of what nsys printed).

Report names changed in nsys 2023 (``gpukernsum`` became ``cuda_gpu_kern_sum`` and so on): the names this
nsys knows are read from ``nsys stats --help-reports`` and the first known candidate of each is used.
Columns are found by name with their units (``Total Time (ns)``, ``Bytes (MB)``), old spellings included.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Our name of each table -> the report names that produce it, newest first.
REPORTS: dict[str, tuple[str, ...]] = {
    "kernels": ("cuda_gpu_kern_sum", "gpukernsum"),
    "api": ("cuda_api_sum", "cudaapisum"),
    "trace": ("cuda_gpu_trace", "gputrace"),
    "mem_time": ("cuda_gpu_mem_time_sum", "gpumemtimesum"),
    "mem_size": ("cuda_gpu_mem_size_sum", "gpumemsizesum"),
    "nvtx": ("nvtx_sum", "nvtx_pushpop_sum", "nvtxsum", "nvtxppsum"),
    "nvtx_gpu": ("nvtx_gpu_proj_sum",),  # GPU time projected onto each range (nsys 2023.3 and later)
}

#: Built-in models (benchmarks/forward.py's cases, and tiny ones for tests): kind and shape.
PRESETS: dict[str, dict[str, Any]] = {
    "bert-base": {
        "kind": "bert",
        "vocab_size": 30522,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
    },
    "bert-tiny": {
        "kind": "bert",
        "vocab_size": 1000,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 512,
        "max_position_embeddings": 128,
        "type_vocab_size": 2,
    },
    "mlp": {"kind": "mlp", "blocks": 4, "d_model": 4096, "d_hidden": 11008, "act": "gelu_erf"},
    "mlp-tiny": {"kind": "mlp", "blocks": 2, "d_model": 256, "d_hidden": 1024, "act": "gelu_erf"},
}

TOP_KERNELS = 10
TOP_API_CALLS = 8
MAX_RANGES = 64
_TAIL_LINES = 12
_CHILD_MODULE = "kernelmill.runtime.profile"


class NsysUnavailable(RuntimeError):
    """nsys (Nsight Systems) is not installed or not on PATH."""


class NsysNoReport(RuntimeError):
    """nsys ran but produced no usable report; ``tail`` holds the last lines it printed."""

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


class ForwardFailed(RuntimeError):
    """The child could not run the forward; ``kind``: "no_gpu", "bad_input" or "error"."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass
class ForwardSpec:
    """What to profile: a model file or directory (``path``) or a built-in ``preset``, and how to run it."""

    path: str | None = None
    preset: str | None = None
    batch: int = 8
    seq: int = 128
    dtype: str = "float16"
    act: str | None = None
    iters: int = 10
    warmup: int = 2
    graphs: bool = False
    server: str | None = None

    def check(self) -> None:
        """ValueError for a spec that cannot run (before nsys is started)."""
        from kernelmill.runtime.tensor import FLOAT_DTYPES

        if self.path is None and self.preset is None:
            raise ValueError("give a model (a BERT directory or an MLP state_dict file) or --preset NAME")
        if self.path is not None and self.preset is not None:
            raise ValueError("give a model or --preset, not both")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; use one of {', '.join(PRESETS)}")
        if self.path is not None and not Path(self.path).exists():
            raise ValueError(f"no model at {self.path}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(FLOAT_DTYPES)}")
        for name in ("batch", "seq", "iters", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        preset = PRESETS.get(self.preset or "", {})
        if preset.get("kind") == "bert" and self.act is not None:  # it was ignored
            raise ValueError(f"--act is for an MLP; {self.preset}'s activation is its config's hidden_act (GELU)")
        if self.act is not None:  # else refused only by the child, once nsys had started
            from kernelmill.runtime.ops import canonical_act

            if self.path is not None and Path(self.path).is_dir():
                raise ValueError(f"--act is for an MLP file; {self.path}'s activation is its config's hidden_act")
            canonical_act(self.act)
        if preset.get("kind") == "bert" and self.seq > preset["max_position_embeddings"]:
            raise ValueError(f"--seq {self.seq} > {preset['max_position_embeddings']} positions of {self.preset}")

    @property
    def model_name(self) -> str:
        return self.preset or str(Path(self.path).resolve())


@dataclass
class ForwardProfile:
    """nsys's view of ``iters`` forwards of one model (times in ns, sizes in bytes)."""

    model: str
    dtype: str
    batch: int
    seq: int | None
    iters: int
    graphs: bool
    kernel_time_ns: float
    kernel_launches: int
    top_kernels: list[dict[str, Any]] = field(default_factory=list)
    ranges: list[dict[str, Any]] = field(default_factory=list)
    gaps: dict[str, Any] = field(default_factory=dict)
    memcpy: dict[str, Any] = field(default_factory=dict)
    api: list[dict[str, Any]] = field(default_factory=list)
    span_ns: float | None = None
    device_name: str | None = None
    nsys_version: str | None = None
    nvtx: str | None = None  # what carried the ranges ("nvtx", "libnvToolsExt") or None
    run: str | None = None  # how the forwards ran: "plain" or "graph"
    reports: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    report_path: str | None = None

    @property
    def kernel_ms_per_forward(self) -> float:
        return self.kernel_time_ns / self.iters / 1e6

    @property
    def gpu_busy_pct(self) -> float | None:
        if not self.span_ns:
            return None
        return 100.0 * (self.span_ns - self.gaps.get("total_ns", 0.0)) / self.span_ns

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(kernel_ms_per_forward=self.kernel_ms_per_forward, gpu_busy_pct=self.gpu_busy_pct)
        return out


# -- nsys on this machine --------------------------------------------------------------------------------


#: Where Nsight Systems installs itself when it is not on PATH (newest version first).
NSYS_GLOBS = ("/opt/nvidia/nsight-systems/*/bin/nsys", "/opt/nvidia/nsight-systems-cli/*/bin/nsys")


def find_nsys(name: str | None = None) -> str | None:
    """The nsys executable: settings ``nsys`` (KERNELMILL_NSYS, a name on PATH or a path), else
    CUDA's bin folder or Nsight Systems' own install folders; None where there is none."""
    if name is None:
        from kernelmill.settings import get_settings

        name = get_settings().nsys
    found = shutil.which(name)
    if found or name != "nsys":  # absolute: nsys runs in a work folder, where ./nsys is not found
        return os.path.abspath(found) if found else None
    candidates = [os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nsys")]
    for pattern in NSYS_GLOBS:
        candidates += sorted(glob.glob(pattern), reverse=True)
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def nsys_version(nsys: str) -> str | None:
    """e.g. "2025.3.1.90" from ``nsys --version``; None where it does not answer."""
    try:
        proc = subprocess.run(
            [nsys, "--version"], capture_output=True, text=True, errors="replace", timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"(\d{4}\.\d+(?:\.\d+)*)", proc.stdout + proc.stderr)
    return found.group(1) if found else None


def known_reports(nsys: str) -> set[str]:
    """Report names ``nsys stats --help-reports`` lists (empty where it lists none)."""
    try:
        proc = subprocess.run(
            [nsys, "stats", "--help-reports"], capture_output=True, text=True, errors="replace", timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return parse_report_names(proc.stdout + "\n" + proc.stderr)


def parse_report_names(text: str) -> set[str]:
    """Names from ``--help-reports`` lines like ``  cuda_gpu_kern_sum[:base|:mangled] -- CUDA GPU Kernel Summary``."""
    return set(re.findall(r"^\s*([a-z][a-z0-9_]*)(?:\[[^\]]*\])*\s+--\s", text, flags=re.MULTILINE))


def pick_reports(known: set[str]) -> dict[str, str]:
    """Our table -> the report name to ask for: the first candidate nsys knows; the newest where it lists none."""
    picked = {}
    for table, candidates in REPORTS.items():
        name = next((c for c in candidates if c in known), None)
        if name is None and not known:
            name = candidates[0]
        if name is not None:
            picked[table] = name
    return picked


# -- parsing nsys stats CSV --------------------------------------------------------------------------------

_TIME_UNITS = {"ns": 1.0, "us": 1e3, "µs": 1e3, "μs": 1e3, "ms": 1e6, "s": 1e9}
_SIZE_UNITS = {"b": 1.0, "kb": 1e3, "kib": 1024.0, "mb": 1e6, "mib": 2.0**20, "gb": 1e9, "gib": 2.0**30}
_HEADER_WORDS = {"name", "operation", "range", "kernel name"}


def parse_stats_csv(text: str) -> list[dict[str, str]]:
    """The rows of one ``nsys stats --format csv`` report; lines before its header (notices) are skipped."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        fields = next(csv.reader([line]), [])
        names = {f.strip().lower() for f in fields}
        if len(fields) >= 2 and (names & _HEADER_WORDS or any(n.startswith(("total", "start")) for n in names)):
            reader = csv.DictReader(io.StringIO("\n".join(lines[index:])))
            return [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
    return []


def _split_header(header: str) -> tuple[str, str | None]:
    """ "Total Time (ns)" -> ("totaltime", "ns"); "Time(%)" -> ("time", "%"); "Average" -> ("average", None)."""
    found = re.match(r"^(.*?)\s*\(([^)]*)\)\s*$", header)
    base, unit = (found.group(1), found.group(2)) if found else (header, None)
    return re.sub(r"[^a-z]", "", base.lower()), unit


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    text = text.replace(",", "").strip()
    if not text or text.lower() in ("n/a", "nan", "-"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


class _Row:
    """Column access by base name with unit scaling (to ns or bytes)."""

    def __init__(self, row: dict[str, str]) -> None:
        self.row = row
        self.columns = {}
        for key in row:
            base, unit = _split_header(key)
            self.columns.setdefault(base, (key, unit))

    def text(self, *bases: str) -> str:
        for base in bases:
            if base in self.columns:
                return self.row[self.columns[base][0]]
        return ""

    def number(self, *bases: str) -> float | None:
        for base in bases:
            if base in self.columns:
                return _number(self.row[self.columns[base][0]])
        return None

    def ns(self, *bases: str) -> float | None:
        return self._scaled(bases, _TIME_UNITS, "ns", fold_case=False)

    def nbytes(self, *bases: str, default_unit: str = "b") -> float | None:
        return self._scaled(bases, _SIZE_UNITS, default_unit, fold_case=True)

    def _scaled(self, bases, units: dict[str, float], default_unit: str, fold_case: bool) -> float | None:
        """The first present column of ``bases``, times its unit's factor (from the header, else the default)."""
        for base in bases:
            if base in self.columns:
                key, unit = self.columns[base]
                value = _number(self.row[key])
                if value is None:
                    return None
                unit = (unit or default_unit).strip()
                return value * units.get(unit.lower() if fold_case else unit, 1.0)
        return None


def _rows(table: Iterable[dict[str, str]]) -> list[_Row]:
    return [_Row(r) for r in table]


def range_name(raw: str) -> str:
    """nsys writes a range as "domain:name" (":name" without a domain); ours drop the domain."""
    for prefix in ("kernelmill:", ":"):
        if raw.startswith(prefix):
            return raw[len(prefix) :]
    return raw


def _is_memory_op(name: str) -> bool:
    return name.startswith("[CUDA ") or name.startswith("[Unified Memory")


def kernel_summary(table: list[dict[str, str]]) -> tuple[float, int, list[dict[str, Any]]]:
    """cuda_gpu_kern_sum -> (kernel time ns, launches, the top kernels by time)."""
    kernels = []
    for row in _rows(table):
        total = row.ns("totaltime") or 0.0
        count = int(row.number("instances", "count") or 0)
        kernels.append({"name": row.text("name"), "total_ns": total, "instances": count})
    total_ns = sum(k["total_ns"] for k in kernels)
    kernels.sort(key=lambda k: k["total_ns"], reverse=True)
    for k in kernels:
        k["avg_ns"] = k["total_ns"] / k["instances"] if k["instances"] else None
        k["pct"] = 100.0 * k["total_ns"] / total_ns if total_ns else 0.0
    return total_ns, sum(k["instances"] for k in kernels), kernels[:TOP_KERNELS]


def trace_activities(table: list[dict[str, str]]) -> list[tuple[float, float, str, float | None]]:
    """cuda_gpu_trace -> (start ns, duration ns, name, bytes or None) per GPU activity, by start."""
    out = []
    for row in _rows(table):
        start, duration = row.ns("start"), row.ns("duration")
        if start is None or duration is None:
            continue
        out.append((start, duration, row.text("name"), row.nbytes("bytes", "size", default_unit="b")))
    out.sort(key=lambda a: a[0])
    return out


def launch_gaps(activities: list[tuple[float, float, str, float | None]]) -> tuple[dict[str, Any], float | None]:
    """Idle intervals of the GPU between consecutive activities (kernels, copies, memsets) and the span
    from the first start to the last end. Overlapping activities leave no gap."""
    if not activities:
        return {"count": 0, "total_ns": 0.0, "median_ns": None, "p90_ns": None, "max_ns": None}, None
    gaps = []
    busy_until = activities[0][0] + activities[0][1]
    for start, duration, _name, _bytes in activities[1:]:
        if start > busy_until:
            gaps.append(start - busy_until)
        busy_until = max(busy_until, start + duration)
    span = busy_until - activities[0][0]
    if not gaps:
        return {"count": 0, "total_ns": 0.0, "median_ns": None, "p90_ns": None, "max_ns": None}, span
    ordered = sorted(gaps)
    return {
        "count": len(gaps),
        "total_ns": float(sum(gaps)),
        "median_ns": float(statistics.median(gaps)),
        "p90_ns": float(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]),
        "max_ns": float(ordered[-1]),
    }, span


def memory_summary(
    time_table: list[dict[str, str]], size_table: list[dict[str, str]], activities: list[tuple] | None = None
) -> dict[str, Any]:
    """Copies and memsets by operation (time, count, bytes) and memcpy totals. From the summary reports,
    else from the trace's memory rows."""
    ops: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        return ops.setdefault(name, {"operation": name, "time_ns": 0.0, "count": 0, "bytes": 0.0})

    if time_table or size_table:
        for row in _rows(time_table):
            e = entry(row.text("operation", "name"))
            e["time_ns"] += row.ns("totaltime") or 0.0
            e["count"] += int(row.number("count", "operations", "instances") or 0)
        for row in _rows(size_table):
            # gpumemsizesum (before 2023) wrote KiB without a unit in the header.
            e = entry(row.text("operation", "name"))
            e["bytes"] += row.nbytes("total", default_unit="kib") or 0.0
            if not e["count"]:
                e["count"] = int(row.number("count", "operations") or 0)
    else:
        for _start, duration, name, nbytes in activities or []:
            if _is_memory_op(name):
                e = entry(name)
                e["time_ns"] += duration
                e["count"] += 1
                e["bytes"] += nbytes or 0.0
    by_op = sorted(ops.values(), key=lambda e: e["time_ns"], reverse=True)
    copies = [e for e in by_op if "memset" not in e["operation"].lower()]
    return {
        "time_ns": float(sum(e["time_ns"] for e in copies)),
        "bytes": float(sum(e["bytes"] for e in copies)),
        "count": sum(e["count"] for e in copies),
        "by_operation": by_op,
    }


def range_summary(nvtx_table: list[dict[str, str]], proj_table: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Per NVTX range: instances, CPU time (push to pop) and, where nsys projects it, GPU time and GPU ops."""
    ranges: dict[str, dict[str, Any]] = {}

    def entry(raw: str) -> dict[str, Any]:
        name = range_name(raw)
        return ranges.setdefault(name, {"name": name, "instances": 0, "cpu_ns": None, "gpu_ns": None, "gpu_ops": None})

    for row in _rows(nvtx_table):
        e = entry(row.text("range", "name"))
        e["instances"] = int(row.number("instances") or 0)
        e["cpu_ns"] = row.ns("totaltime")
    for row in _rows(proj_table):
        e = entry(row.text("range", "name"))
        e["gpu_ns"] = row.ns("totalprojtime")
        e["gpu_ops"] = int(row.number("totalgpuops") or 0)
        if not e["instances"]:
            e["instances"] = int(row.number("rangeinstances", "instances") or 0)
        if e["cpu_ns"] is None:
            e["cpu_ns"] = row.ns("totalrangetime")
    out = sorted(ranges.values(), key=lambda e: (e["gpu_ns"] or 0.0, e["cpu_ns"] or 0.0), reverse=True)
    return out[:MAX_RANGES]


def api_summary(table: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The CUDA API calls that took the host longest (launches, synchronizations, copies)."""
    calls = []
    for row in _rows(table):
        total = row.ns("totaltime") or 0.0
        count = int(row.number("numcalls", "calls", "count", "instances") or 0)
        calls.append(
            {"name": row.text("name"), "calls": count, "total_ns": total, "avg_ns": total / count if count else None}
        )
    calls.sort(key=lambda c: c["total_ns"], reverse=True)
    return calls[:TOP_API_CALLS]


def summarize(tables: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    """Parsed report tables (keys of REPORTS) -> the measured fields of a ForwardProfile."""
    activities = trace_activities(tables.get("trace", []))
    if tables.get("kernels"):
        kernel_ns, launches, top = kernel_summary(tables["kernels"])
    else:  # no summary report: the trace's kernel rows
        rows = [
            {"Name": name, "Total Time (ns)": str(duration), "Instances": "1"}
            for _start, duration, name, _nbytes in activities
            if not _is_memory_op(name)
        ]
        kernel_ns, launches, top = kernel_summary(_merge_by_name(rows))
    gaps, span = launch_gaps(activities)
    return {
        "kernel_time_ns": kernel_ns,
        "kernel_launches": launches,
        "top_kernels": top,
        "ranges": range_summary(tables.get("nvtx", []), tables.get("nvtx_gpu", [])),
        "gaps": gaps,
        "memcpy": memory_summary(tables.get("mem_time", []), tables.get("mem_size", []), activities),
        "api": api_summary(tables.get("api", [])),
        "span_ns": span,
    }


def _merge_by_name(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    merged: dict[str, list[float]] = {}
    for row in rows:
        total = merged.setdefault(row["Name"], [0.0, 0])
        total[0] += float(row["Total Time (ns)"])
        total[1] += 1
    return [{"Name": n, "Total Time (ns)": str(t), "Instances": str(c)} for n, (t, c) in merged.items()]


# -- running nsys --------------------------------------------------------------------------------------------


def _tail(*texts: str | None) -> str:
    lines = [ln for text in texts if text for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-_TAIL_LINES:])


def _run(cmd: list[str], timeout_s: float, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``cmd`` in its own process group; on timeout the whole group (nsys and its child) is killed."""
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            start_new_session=True,
        )  # fmt: skip
    except OSError as exc:  # found but cannot be run (a broken install, a script without its interpreter)
        raise NsysUnavailable(f"{cmd[0]} could not be started: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        what = f"{Path(cmd[0]).name} {cmd[1]}"
        raise NsysNoReport(f"{what} did not finish within {timeout_s:.0f} s", _tail(out, err)) from None
    return proc.returncode, out, err


def profile_command(nsys: str, spec: ForwardSpec, report_base: Path, spec_path: Path) -> list[str]:
    """``nsys profile`` over the child; only the window between cuProfilerStart and Stop is captured."""
    cmd = [
        nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
        "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
        "--force-overwrite=true", "--output", str(report_base),
    ]  # fmt: skip
    if spec.graphs:
        cmd.append("--cuda-graph-trace=node")  # each kernel of a replayed graph, not one block per replay
    # -P and the work folder as cwd: a source checkout's kernelmill/ folder must not shadow the install.
    return [*cmd, sys.executable, "-P", "-m", _CHILD_MODULE, str(spec_path)]


def profile_forward(
    spec: ForwardSpec, *, nsys: str | None = None, keep_dir: Path | None = None, timeout_s: float = 1800.0
) -> ForwardProfile:
    """Profile ``spec``'s forwards under nsys (see the module docstring); raises what went wrong."""
    spec.check()
    nsys = nsys or find_nsys()
    if nsys is None:
        raise NsysUnavailable("nsys (Nsight Systems) is not on PATH")
    if spec.path is not None:  # nsys starts the forward in the work directory: paths must not be relative
        spec = replace(spec, path=str(Path(spec.path).resolve()))
    workdir = Path(keep_dir).resolve() if keep_dir else Path(tempfile.mkdtemp(prefix="kernelmill-nsys-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _profile_in(workdir, spec, nsys, timeout_s, keep=keep_dir is not None)
    finally:
        if keep_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _profile_in(workdir: Path, spec: ForwardSpec, nsys: str, timeout_s: float, keep: bool) -> ForwardProfile:
    spec_path, meta_path, report_base = workdir / "spec.json", workdir / "child.json", workdir / "forward"
    meta_path.unlink(missing_ok=True)
    for suffix in (".nsys-rep", ".qdrep", ".sqlite"):
        report_base.with_suffix(suffix).unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**asdict(spec), "meta_path": str(meta_path)}))
    env = {**os.environ, "KERNELMILL_NVTX": "1"}
    code, out, err = _run(profile_command(nsys, spec, report_base, spec_path), timeout_s, workdir, env)
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if meta.get("ok") is False:
        raise ForwardFailed(meta.get("kind", "error"), meta.get("reason", "the forward failed"))
    report = next((p for p in (report_base.with_suffix(s) for s in (".nsys-rep", ".qdrep")) if p.exists()), None)
    if report is None:
        why = f"exit {code}"
        if list(workdir.glob("*.qdstrm")):  # raw capture left unconverted: this nsys lacks its importer
            why += "; it left a raw .qdstrm capture it could not turn into a report"
        raise NsysNoReport(f"nsys wrote no report ({why}); nothing profiled", _tail(out, err))
    picked = pick_reports(known_reports(nsys))
    stats_base = workdir / "stats"
    stats_cmd = [
        nsys, "stats", "--report", ",".join(picked.values()), "--format", "csv",
        "--output", str(stats_base), "--force-overwrite=true", "--force-export=true", str(report),
    ]  # fmt: skip
    stats_code, stats_out, stats_err = _run(stats_cmd, timeout_s, workdir)
    tables = {}
    for table, name in picked.items():
        found = sorted(workdir.glob(f"{stats_base.name}_{name}*.csv"))
        if found:
            tables[table] = parse_stats_csv(found[0].read_text(errors="replace"))
    summary = summarize(tables)
    if not summary["kernel_launches"]:
        what = "no CUDA kernels" if tables else f"no tables (nsys stats exit {stats_code})"
        raise NsysNoReport(f"nsys's report holds {what}; nothing profiled", _tail(stats_out, stats_err, out, err))
    notes = []
    if spec.graphs:
        notes.append("CUDA graph replay: per-op NVTX ranges exist only in the warm-up, outside the capture")
    if meta.get("ok") and not meta.get("nvtx"):
        notes.append("no NVTX ranges in the child (pip install 'kernelmill[profile]' for per-op ranges)")
    missing = sorted(set(REPORTS) - set(tables))
    if missing:
        notes.append(f"reports missing: {', '.join(missing)}")
    return ForwardProfile(
        model=spec.model_name,
        dtype=spec.dtype,
        batch=spec.batch,
        seq=spec.seq if _is_bert(spec) else None,
        iters=spec.iters,
        graphs=spec.graphs,
        device_name=meta.get("device"),
        nsys_version=nsys_version(nsys),
        nvtx=meta.get("nvtx"),
        run=meta.get("run"),
        reports={t: picked[t] for t in tables},
        notes=notes,
        report_path=str(report) if keep else None,
        **summary,
    )


def _is_bert(spec: ForwardSpec) -> bool:
    if spec.preset is not None:
        return PRESETS[spec.preset]["kind"] == "bert"
    return Path(spec.path).is_dir()


# -- the child: load, warm up, profile ------------------------------------------------------------------------


def build_module(spec: ForwardSpec):
    """The spec's Module on the CPU in float32 (a file's weights, or a preset's random ones)."""
    from kernelmill.runtime.models import BertModel, load_module
    from kernelmill.runtime.nn import MLP, Sequential

    if spec.path is not None:
        return load_module(spec.path, spec.act)
    preset = dict(PRESETS[spec.preset])
    kind = preset.pop("kind")
    if kind == "bert":
        return BertModel.random(preset)
    act = spec.act or preset["act"]
    d, hidden = preset["d_model"], preset["d_hidden"]
    return Sequential(*(MLP.random(d, hidden, d, act, seed=2 * i) for i in range(preset["blocks"])))


def example_inputs(module, batch: int, seq: int, seed: int = 0) -> tuple:
    """Random inputs of the module's kind: token ids (batch, seq) for BERT, (batch, in_features) otherwise."""
    import numpy as np

    from kernelmill.runtime.models import BertModel

    rng = np.random.default_rng(seed)
    if isinstance(module, BertModel):
        vocab = module.embeddings.word.shape[0]
        return (rng.integers(0, vocab, (batch, seq)),)
    in_features = next(t.shape[0] for _, t in module.named_tensors() if t.ndim == 2)
    return (rng.standard_normal((batch, in_features)).astype(np.float32),)


def _profiler(cuda: Any, on: bool) -> None:
    """cuProfilerStart / Stop: nsys's capture window (``--capture-range=cudaProfilerApi``)."""
    fn = getattr(cuda, "start_profiler" if on else "stop_profiler", None)
    if fn is not None:
        fn()
        return
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    status = (libcuda.cuProfilerStart if on else libcuda.cuProfilerStop)()
    if status != 0:
        raise RuntimeError(f"cuProfiler{'Start' if on else 'Stop'} failed: CUresult {status}")


def _child(spec_path: str) -> int:
    """Runs under nsys: writes what happened to the spec's meta_path (JSON), the parent reads it."""
    fields = json.loads(Path(spec_path).read_text())
    meta_path = Path(fields.pop("meta_path"))
    spec = ForwardSpec(**fields)

    def finish(code: int, **meta: Any) -> int:
        meta_path.write_text(json.dumps(meta))
        return code

    from kernelmill.kernels.device import GpuUnavailable
    from kernelmill.runtime import ranges
    from kernelmill.runtime.models import Model

    try:
        module = build_module(spec)
        inputs = example_inputs(module, spec.batch, spec.seq)
        model = Model(module, "cuda", spec.dtype, server=spec.server, graphs=spec.graphs)
        # With graphs the capture happens on the call after the first: keep it out of the window too.
        for _ in range(max(spec.warmup, 2 if spec.graphs else 1)):
            model.forward(*inputs)
        model.synchronize()
        marker = ranges.active()
        _profiler(model.backend.cuda, True)
        for _ in range(spec.iters):
            with ranges.nvtx_range("forward"):
                model.forward(*inputs)
        model.synchronize()
        _profiler(model.backend.cuda, False)
    except GpuUnavailable as exc:
        return finish(3, ok=False, kind="no_gpu", reason=str(exc))
    except (ValueError, KeyError, IndexError, FileNotFoundError) as exc:
        return finish(2, ok=False, kind="bad_input", reason=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure is reported to the parent as data
        return finish(1, ok=False, kind="error", reason=f"{type(exc).__name__}: {exc}")
    info = model.backend.device.info
    return finish(0, ok=True, device=info.name, arch=info.arch, run=model.last_run, nvtx=marker and marker.name)


if __name__ == "__main__":  # pragma: no cover - runs under nsys on a GPU host
    sys.exit(_child(sys.argv[1]))
