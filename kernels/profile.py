"""Nsight Compute metrics for one variant at one shape (``ncu --clock-control none --csv``).

ncu replays the kernel in a child process (``python -m kernelmill.kernels.profile``
runs the variant on fresh inputs), so the caller's CUDA context is never
touched by the profiler. A missing ncu or a failed run is data, not a crash:
``ProfileUnavailable`` where nothing can be profiled on this machine (no ncu, no
permission to read the counters, no GPU, an ncu that does not know this GPU or
these metrics), ``ProfileFailed`` where only this variant could not be (it hung
or crashed under ncu, or no launch was captured).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: ncu metric -> our name. Percentages are of the device's sustained peak.
METRICS: dict[str, str] = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__occupancy_limit_registers": "occupancy_limit_registers",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block_dynamic": "smem_dynamic_bytes",
    "launch__shared_mem_per_block_static": "smem_static_bytes",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
}

STALL_REASONS = (
    "long_scoreboard",
    "short_scoreboard",
    "mio_throttle",
    "lg_throttle",
    "barrier",
    "membar",
    "math_pipe_throttle",
    "wait",
    "not_selected",
    "dispatch_stall",
    "no_instruction",
    "tex_throttle",
    "sleeping",
    "branch_resolving",
    "drain",
    "imc_miss",
)
_STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


class ProfileFailed(RuntimeError):
    """ncu could not profile this variant (it timed out, its process failed, no launch was captured); the next
    variant may still be profiled."""


class ProfileUnavailable(ProfileFailed):
    """ncu cannot profile anything here: not installed, no permission to read the counters, no GPU, or a version
    that does not know this GPU or these metrics. Every variant would fail alike."""


#: What the child prints (on stderr, under ncu) where this machine has no usable GPU.
NO_GPU = "kernelmill: no GPU:"
#: What ncu prints where it cannot profile on this machine, whatever the kernel (read on its ==ERROR== and
#: ==WARNING== lines only: a variant's own output may say anything).
_MACHINE_FAILURES = re.compile(
    r"ERR_NVGPUCTRPERM"  # no permission to read the GPU's performance counters
    r"|lock file"  # its lock file (/tmp/nsight-compute-lock) cannot be created
    r"|driver resource was unavailable"  # another profiler (DCGM) holds the counters
    r"|failed to find metric"  # an ncu older than these metric names
    r"|(device|gpu|chip|architecture)\b.*\b(not supported|unsupported)"  # an ncu older than this GPU
    r"|(not supported|unsupported)\b.*\b(device|gpu|chip|architecture)",
    re.IGNORECASE,
)


@dataclass
class KernelProfile:
    """ncu's view of one kernel launch (the variant's longest one when it has several)."""

    kernel: str
    metrics: dict[str, float] = field(default_factory=dict)
    stalls: dict[str, float] = field(default_factory=dict)

    def top_stalls(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.stalls.items(), key=lambda kv: kv[1], reverse=True)[:n]

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, **self.metrics, "top_stalls": [list(s) for s in self.top_stalls()]}


def find_ncu() -> str | None:
    """ncu: KERNELMILL_NCU (a name on PATH or a path), else CUDA's or Nsight Compute's install folders."""
    found = shutil.which(os.environ.get("KERNELMILL_NCU", "ncu"))
    if found:  # absolute: ncu runs in a neutral folder, where ./tools/ncu is not found
        return os.path.abspath(found)
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        if os.path.isdir(root):
            for dirpath, _, files in os.walk(root):
                if "ncu" in files:
                    return os.path.join(dirpath, "ncu")
    return None


def parse_ncu_csv(text: str) -> list[KernelProfile]:
    """Rows of ``ncu --csv --page raw`` (one per profiled launch) -> KernelProfile. Only whole rows count: a row
    cut short (ncu killed mid-line) is left out, and so is any line before the header (the variant's own
    output), the units row and a repeated header; a value that is not a finite number is absent, not guessed."""
    # Every whole row of ncu's CSV starts and ends with a quote.
    lines = [ln for ln in (ln.strip() for ln in text.splitlines()) if len(ln) > 1 and ln[0] == ln[-1] == '"']
    rows = [row for row in map(_cells, lines) if row is not None]
    header_at = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if header_at is None:
        return []
    header = rows[header_at]
    out = []
    for row in rows[header_at + 1 :]:
        record = dict(zip(header, row, strict=False))
        kernel = record.get("Kernel Name", "")
        if row == header or not kernel:  # a repeated header, or the units row (its name column is empty)
            continue
        prof = KernelProfile(kernel)
        for metric, name in METRICS.items():
            value = _number(record.get(metric))
            if value is not None:
                prof.metrics[name] = value
        for reason in STALL_REASONS:
            value = _number(record.get(_STALL_METRIC.format(reason)))
            if value is not None:
                prof.stalls[reason] = value
        out.append(prof)
    return out


def _cells(line: str) -> list[str] | None:
    """One CSV line's fields; None for one the csv module refuses (a field past its size limit)."""
    try:
        return next(csv.reader([line]))
    except csv.Error:
        return None


#: A number as ncu writes it: digits with commas between thousands (91,232), a decimal point, an exponent.
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d+)?")


def _number(text: str | None) -> float | None:
    """The value of one cell, or None for "n/a", "nan", "inf", a decimal comma ("12,5") or anything else that
    is not a finite number written as above (never a number guessed from it)."""
    if text is None or not _NUMBER.fullmatch(text.strip()):
        return None
    value = float(text.strip().replace(",", ""))
    return value if math.isfinite(value) else None


def profile(
    op: str,
    family: str,
    dtype: str,
    params: dict[str, Any],
    shape: tuple[int, ...],
    attrs: dict[str, Any] | None = None,
    arch: str | None = None,
    timeout_s: float = 300.0,
) -> KernelProfile:
    """Profile the variant under ncu in a child process; raises ProfileUnavailable (nothing can be profiled here)
    or ProfileFailed (this variant could not be) with the reason."""
    ncu = find_ncu()
    if ncu is None:
        raise ProfileUnavailable("ncu (Nsight Compute) is not installed or not on PATH")
    spec = {"op": op, "family": family, "dtype": dtype, "params": params, "shape": list(shape)}
    spec.update(attrs=attrs or {}, arch=arch)
    metrics = ",".join([*METRICS, *(_STALL_METRIC.format(r) for r in STALL_REASONS)])
    cmd = [
        ncu, "--clock-control", "none", "--csv", "--page", "raw", "--metrics", metrics,
        "--kernel-name-base", "function", "--target-processes", "all",
        sys.executable, "-P", "-m", "kernelmill.kernels.profile", json.dumps(spec),
    ]  # fmt: skip
    code, out, err = _run(cmd, timeout_s)
    profiles = parse_ncu_csv(out)
    if code == 0 and profiles:
        # The variant's longest launch is the one worth reading (a split-K GEMM's main kernel, not its reduce).
        return max(profiles, key=lambda p: p.metrics.get("duration_ns", 0.0))
    said = _said(out, err)
    ncu_lines = [ln for ln in f"{out}\n{err}".splitlines() if ln.startswith(("==ERROR==", "==WARNING=="))]
    if any(ln.startswith(NO_GPU) for ln in err.splitlines()) or any(_MACHINE_FAILURES.search(ln) for ln in ncu_lines):
        raise ProfileUnavailable(f"ncu cannot profile on this machine: {said}")
    raise ProfileFailed(f"ncu could not profile this variant (exit {code}): {said}")


def _run(cmd: list[str], timeout_s: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ncu. It runs in a process group of its own: on timeout the whole group
    is killed, the child running the variant with it (killing ncu alone left a hung variant on the GPU)."""
    try:
        # -P and a neutral cwd: a source checkout's kernelmill/ folder must not shadow the installed package.
        proc = subprocess.Popen(
            cmd, cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
    except OSError as exc:  # found but cannot be run (a broken install, a script without its interpreter)
        raise ProfileUnavailable(f"ncu ({cmd[0]}) could not be started: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()  # not communicate(): a child that left the group would keep the pipes open
        proc.stdout.close()
        proc.stderr.close()
        raise ProfileFailed(f"ncu did not finish within {timeout_s:.0f} s (the variant hung under it)") from None
    return proc.returncode, out, err


#: The most of what ncu said that a failure keeps (it is stored with the trial).
_SAID_CHARS = 600


def _said(out: str, err: str) -> str:
    """What explains a failed run, on one line: the child's last line of its own (an exception) and ncu's last
    errors and warnings (its progress lines and CSV rows left out)."""
    lines = [ln.strip() for ln in f"{err}\n{out}".splitlines() if ln.strip() and not ln.startswith('"')]
    ncu = [ln for ln in lines if ln.startswith(("==ERROR==", "==WARNING=="))]
    own = [ln for ln in lines if not ln.startswith("==")]
    said = " | ".join(own[-1:] + ncu[-4:]) or "it printed nothing"
    return said if len(said) <= _SAID_CHARS else said[: _SAID_CHARS - 3] + "..."


def _target(spec_json: str) -> int:
    """Child process: run the variant once on fresh inputs (what ncu measures). Exit 3 where there is no GPU."""
    from kernelmill.kernels.device import GpuUnavailable, get_device
    from kernelmill.kernels.variant import BoundVariant, Variant

    spec = json.loads(spec_json)
    variant = Variant.create(spec["op"], spec["family"], spec["dtype"], spec["params"], spec["attrs"])
    try:
        device = get_device()
    except GpuUnavailable as exc:  # the machine's failure, not the variant's: said so the parent can tell
        print(f"{NO_GPU} {exc}", file=sys.stderr)
        return 3
    shape = tuple(spec["shape"])
    bound = BoundVariant(device, variant, variant.compile(arch=spec.get("arch")), shape)
    bound.set_inputs(variant.op.make_inputs(shape, variant.dtype, seed=1))
    bound.run()
    device.synchronize(60.0)
    return 0


if __name__ == "__main__":  # pragma: no cover - runs under ncu on a GPU host
    sys.exit(_target(sys.argv[1]))
