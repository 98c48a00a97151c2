"""profile-forward on the GPU (marker gpu): the child's forwards with NVTX ranges on, and the whole command,
which gives a summary where nsys makes reports and says clearly why not where it is missing or makes none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from kernelmill.cli import EXIT_NO_PROFILER, EXIT_NO_REPORT, app
from kernelmill.runtime.profile import ForwardSpec, find_nsys

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["mlp-tiny", "bert-tiny"])
def test_the_child_runs_its_forwards_with_nvtx_ranges(tmp_path, preset):
    """No nsys: cuProfilerStart/Stop are no-ops then, and the forwards must run as under nsys."""
    meta = tmp_path / "child.json"
    spec = ForwardSpec(preset=preset, batch=4, seq=32, iters=3, warmup=1)
    (tmp_path / "spec.json").write_text(json.dumps({**asdict(spec), "meta_path": str(meta)}))
    env = {**os.environ, "KERNELMILL_NVTX": "1"}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "kernelmill.runtime.profile", str(tmp_path / "spec.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    status = json.loads(meta.read_text())
    assert proc.returncode == 0 and status["ok"], (status, proc.stderr[-2000:])
    assert status["run"] == "plain" and status["device"]
    try:
        import nvtx  # noqa: F401

        assert status["nvtx"] == "nvtx"
    except ImportError:
        assert status["nvtx"] in (None, "libnvToolsExt")


def test_profile_forward_summary_or_a_clear_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", f"sqlite:///{tmp_path}/gpu.db")
    out = tmp_path / "forward.json"
    argv = ["profile-forward", "--preset", "mlp-tiny", "--batch", "8", "--iters", "3", "--json", str(out)]
    result = CliRunner().invoke(app, argv)
    # Where nsys cannot profile, the command says so (checked here as on the CPU) and nothing was profiled:
    # a skip with the reason, not a pass.
    if find_nsys() is None:
        assert result.exit_code == EXIT_NO_PROFILER, result.output
        assert "nsys not found" in result.output
        pytest.skip("nsys is not installed here: nothing was profiled")
    said = " ".join(result.output.split())
    # Only an nsys without its importer (a raw .qdstrm capture left unconverted) is this host's lack; a report
    # with no kernels, or nsys timing out, is what a misplaced capture window or a parsing bug gives: a failure.
    if result.exit_code == EXIT_NO_REPORT and "raw .qdstrm capture it could not turn into a report" in said:
        assert "nothing profiled" in said and not out.exists()
        pytest.skip(f"this nsys cannot import its raw capture: {said[:200]}")
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["kernel_launches"] >= 3 * 2 and summary["kernel_time_ns"] > 0 and summary["id"] >= 1
    names = {r["name"] for r in summary["ranges"]}
    if summary.get("nvtx"):
        assert "forward" in names and any(n.split()[0] in ("fused_mlp", "linear", "matmul") for n in names)
