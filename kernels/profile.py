"""Nsight Compute metrics for one variant at one shape (``ncu --clock-control none --csv``).

ncu replays the kernel in a child process (``python -m kernelmill.kernels.profile``
runs the variant on fresh inputs), so the caller's CUDA context is never
touched by the profiler. A missing ncu or a failed run is data, not a crash.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import shutil
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


class ProfileUnavailable(RuntimeError):
    """ncu is not installed or cannot read the counters here."""


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
    found = shutil.which(os.environ.get("KERNELMILL_NCU", "ncu"))
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        if os.path.isdir(root):
            for dirpath, _, files in os.walk(root):
                if "ncu" in files:
                    return os.path.join(dirpath, "ncu")
    return None


def parse_ncu_csv(text: str) -> list[KernelProfile]:
    """Rows of ``ncu --csv --page raw`` (one per profiled launch) -> KernelProfile."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if len(lines) < 2:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, data = rows[0], rows[1:]
    if data and data[0] and data[0][0] == "":  # the units row
        data = data[1:]
    out = []
    for row in data:
        record = dict(zip(header, row, strict=False))
        prof = KernelProfile(record.get("Kernel Name", "?"))
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


def _number(text: str | None) -> float | None:
    if text is None or text.strip() in ("", "n/a"):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


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
    """Profile the variant under ncu in a child process; raises ProfileUnavailable with the reason."""
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
    try:
        # -P and a neutral cwd: a source checkout's kernelmill/ folder must not shadow the installed package.
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=tempfile.gettempdir()
        )
    except subprocess.TimeoutExpired:
        raise ProfileUnavailable(f"ncu did not finish within {timeout_s:.0f} s") from None
    profiles = parse_ncu_csv(proc.stdout)
    if proc.returncode != 0 or not profiles:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise ProfileUnavailable(f"ncu failed (exit {proc.returncode}): {' | '.join(tail)}")
    # The variant's longest launch is the one worth reading (a split-K GEMM's main kernel, not its reduce).
    return max(profiles, key=lambda p: p.metrics.get("duration_ns", 0.0))


def _target(spec_json: str) -> None:
    """Child process: run the variant once on fresh inputs (what ncu measures)."""
    from kernelmill.kernels.device import get_device
    from kernelmill.kernels.variant import BoundVariant, Variant

    spec = json.loads(spec_json)
    variant = Variant.create(spec["op"], spec["family"], spec["dtype"], spec["params"], spec["attrs"])
    device = get_device()
    shape = tuple(spec["shape"])
    bound = BoundVariant(device, variant, variant.compile(arch=spec.get("arch")), shape)
    bound.set_inputs(variant.op.make_inputs(shape, variant.dtype, seed=1))
    bound.run()
    device.synchronize(60.0)


if __name__ == "__main__":  # pragma: no cover - runs under ncu on a GPU host
    _target(sys.argv[1])
