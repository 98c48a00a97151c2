"""A stand-in ``ncu`` on PATH for tests without a GPU or Nsight Compute.

``install(bin_dir, mode)`` writes an executable ``ncu`` (a Python script) that prints what ncu prints in each case
and exits as it does:

* ``ok``: a profile of two launches (CSV rows) and exit 0;
* ``no-permission``: ERR_NVGPUCTRPERM (no access to the counters), nothing profiled, exit 0;
* ``lock-file``: its lock file cannot be created, exit 9;
* ``old-ncu``: an ncu that does not know this GPU, exit 1;
* ``unknown-metric``: an ncu older than a metric asked for, exit 1;
* ``crash``: the variant's process raised (a kernel fault), nothing profiled, exit 1;
* ``kernel-error``: ncu failed on the variant's kernel itself, exit 9;
* ``no-kernel``: the variant's process launched nothing ncu captured, exit 0;
* ``not-utf8``: the profile of ``ok`` with bytes that are not UTF-8 (a line of the variant's, a kernel name);
* ``hang``: starts a child that sleeps (its pid in ``bin_dir/child.pid``) and sleeps itself;
* ``run-child``: runs the program after ``--target-processes all`` (the real child), then says nothing was profiled.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

CSV = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","gpu__time_duration.sum",'
    '"dram__throughput.avg.pct_of_peak_sustained_elapsed"\n'
    '"","","","","","","","nsecond","%"\n'
    '"0","1234","python3","127.0.0.1","softmax_block_row","1","7","91,232","71.25"\n'
    '"1","1234","python3","127.0.0.1","km_reduce","1","7","2,001","10.0"\n'
)

_SCRIPT = r"""#!{python}
import subprocess, sys, time
from pathlib import Path

MODE, BIN, CSV = {mode!r}, Path({bin_dir!r}), {csv!r}
args = sys.argv[1:]


def err(*lines):
    for line in lines:
        print(line, file=sys.stderr)


print("==PROF== Connected to process 1234 (/usr/bin/python3)")
if MODE == "ok":
    print('==PROF== Profiling "softmax_block_row" - 0: 0%....50%....100% - 9 passes')
    print(CSV, end="")
    print("==PROF== Disconnected from process 1234")
elif MODE == "no-permission":
    print(
        "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters "
        "on the target device 0."
    )
    print("==PROF== Disconnected from process 1234")
    print("==WARNING== No kernels were profiled.")
elif MODE == "lock-file":
    print("==ERROR== Failed to open/create lock file /tmp/nsight-compute-lock. Please check permissions.")
    print('==ERROR== Failed to profile "softmax_block_row" in process 1234')
    print("==ERROR== The application returned an error code (9).")
    sys.exit(9)
elif MODE == "old-ncu":
    print("==ERROR== Profiling is not supported on this device")
    print("==WARNING== No kernels were profiled.")
    sys.exit(1)
elif MODE == "unknown-metric":
    print("==ERROR== Failed to find metric regex:^sm__warps_active.avg.pct_of_peak_sustained_active$")
    sys.exit(1)
elif MODE == "crash":
    err("Traceback (most recent call last):", "kernelmill.kernels.device.DeviceFault: CUDA_ERROR_ILLEGAL_ADDRESS")
    print("==PROF== Disconnected from process 1234")
    print("==ERROR== The application returned an error code (1).")
    print("==WARNING== No kernels were profiled.")
    sys.exit(1)
elif MODE == "kernel-error":
    print("==ERROR== Failed to prepare kernel for profiling")
    print("==ERROR== Unknown Error on device 0.")
    print('==ERROR== Failed to profile "softmax_block_row" in process 1234')
    print("==ERROR== The application returned an error code (9).")
    sys.exit(9)
elif MODE == "no-kernel":
    print("==PROF== Disconnected from process 1234")
    print("==WARNING== No kernels were profiled.")
elif MODE == "not-utf8":  # the variant's output (or a kernel name) in another encoding
    sys.stdout.flush()
    sys.stdout.buffer.write(b"caf\xe9 au lait\n")
    sys.stdout.buffer.write(CSV.replace("km_reduce", "km_r\xe9duce").encode("latin-1"))
elif MODE == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (BIN / "child.pid").write_text(str(child.pid))
    time.sleep(60)
elif MODE == "run-child":
    program = args[args.index("--target-processes") + 2 :]
    code = subprocess.run(program).returncode
    print("==WARNING== No kernels were profiled.")
    sys.exit(code)
"""


def install(bin_dir: Path, mode: str) -> Path:
    """Write ``bin_dir/ncu`` answering as ``mode`` (see the module docstring); returns its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "ncu"
    path.write_text(_SCRIPT.format(python=sys.executable, mode=mode, bin_dir=str(bin_dir), csv=CSV))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def on_path(monkeypatch, bin_dir: Path) -> None:
    """Put ``bin_dir`` first on PATH, and no KERNELMILL_NCU to look elsewhere."""
    monkeypatch.delenv("KERNELMILL_NCU", raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
