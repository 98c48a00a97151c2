"""benchmarks/device_check.sh without a GPU: a pytest run or bench that fails fails the script, and says so.

A fake ``python3`` and ``nvidia-smi`` stand in for the GPU host's; the script's own logic is what runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

FAKE_PYTHON = """#!/usr/bin/env bash
# -c "import xdist": not there; -m pytest: print $FAKE_PYTEST_OUT, exit $FAKE_PYTEST_RC; -m kernelmill: $FAKE_KM_RC
# (serve: its pid into $FAKE_SERVE_PID, then a 30 s sleep; tune: $FAKE_TUNE_RC)
case "$*" in
  *"import xdist"*) exit 1 ;;
  *"-m pytest"*) printf '%b' "$FAKE_PYTEST_OUT"; exit "$FAKE_PYTEST_RC" ;;
  *"-m kernelmill serve"*) echo $$ > "$FAKE_SERVE_PID"; exec sleep 30 ;;
  *"-m kernelmill tune"*) echo "job failed"; exit "${FAKE_TUNE_RC:-0}" ;;
  *"-m kernelmill"*) echo "error: no GPU here"; exit "$FAKE_KM_RC" ;;
esac
exit 99
"""


def _run(
    tmp_path: Path, part: str, pytest_out: str, pytest_rc: int, km_rc: int = 0, **env_extra: str
) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, driver_version'\necho 'NVIDIA H200, 580.1'\n")
    (bin_dir / "curl").write_text("#!/usr/bin/env bash\nexit 0\n")  # the service answers at once
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PART": part,
        "OUT": str(tmp_path / "out"),
        "TMPDIR": str(tmp_path),
        "FAKE_PYTEST_OUT": pytest_out,
        "FAKE_PYTEST_RC": str(pytest_rc),
        "FAKE_KM_RC": str(km_rc),
        "FAKE_SERVE_PID": str(tmp_path / "serve.pid"),
        **env_extra,
    }
    return subprocess.run(
        ["bash", str(BENCHMARKS / "device_check.sh")],
        cwd=BENCHMARKS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_session_that_cannot_start_fails_the_run_and_its_error_is_the_summary(tmp_path):
    # What KERNELMILL_REQUIRE_MODULES prints where cuda.bindings is missing: its last line is empty.
    error = "ERROR: KERNELMILL_REQUIRE_MODULES names cuda.bindings, which does not import here"
    done = _run(tmp_path, "verify", f"{error}\\n\\n", 4)
    assert done.returncode != 0, done.stdout
    assert f"verification files (one process): {error}" in done.stdout


def test_failed_tests_fail_the_run(tmp_path):
    done = _run(tmp_path, "rest", "F.\\n1 failed, 1 passed in 2.00s\\n", 1)
    assert done.returncode != 0, done.stdout
    assert "test_faults_gpu: 1 failed, 1 passed in 2.00s" in done.stdout


def test_a_failed_bench_fails_the_run(tmp_path):
    done = _run(tmp_path, "rest", "3 passed in 2.00s\\n", 0, km_rc=3)
    assert done.returncode != 0, done.stdout
    assert "bench softmax: failed (exit 3)" in done.stdout


def test_a_run_that_passes_exits_0_and_leaves_no_copy_of_the_tests(tmp_path):
    for part in ("verify", "all"):
        done = _run(tmp_path, part, "3 passed in 2.00s\\n", 0)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "3 passed in 2.00s" in done.stdout
    assert not list(tmp_path.glob("kmtests*"))


def test_the_run_states_date_command_and_device(tmp_path):
    done = _run(tmp_path, "verify", "3 passed in 2.00s\\n", 0, NW="4")
    assert done.returncode == 0, done.stdout + done.stderr
    run = (tmp_path / "out" / "run.txt").read_text()
    assert re.search(r"^date: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", run, re.M), run
    assert "command: PART=verify NW=4 CHECK_SERVE=0 bash benchmarks/device_check.sh" in run
    assert "NVIDIA H200, 580.1" in run and f"run: {tmp_path / 'out'}/run.txt" in done.stdout


def test_check_serve_stops_its_service_and_a_failed_tune_fails_the_run(tmp_path):
    done = _run(tmp_path, "rest", "3 passed in 2.00s\\n", 0, CHECK_SERVE="1", FAKE_TUNE_RC="1")
    pid = int((tmp_path / "serve.pid").read_text())
    try:
        alive = True
        os.kill(pid, 0)
    except ProcessLookupError:
        alive = False
    finally:
        if alive:
            os.kill(pid, signal.SIGKILL)
    assert not alive, "the service outlived the script"
    assert done.returncode != 0 and "served tune: failed (exit 1)" in done.stdout, done.stdout
