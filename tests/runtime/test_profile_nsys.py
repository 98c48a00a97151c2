"""runtime.profile without a GPU: nsys stats CSV parsing (new and old report names and columns), the
summary, and the whole profile_forward pipeline against a fake nsys on PATH."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kernelmill import settings
from kernelmill.runtime import profile
from kernelmill.runtime.profile import (
    REPORTS,
    ForwardFailed,
    ForwardSpec,
    NsysNoReport,
    NsysUnavailable,
    parse_report_names,
    parse_stats_csv,
    pick_reports,
    profile_forward,
    summarize,
)
from tests.runtime import fake_nsys

NEW = fake_nsys.REPORTS / "new"
OLD = fake_nsys.REPORTS / "old"

# The fixtures' timeline: idle gaps of 2.5, 2, 55, 2.5 and 8 us between the GPU's activities.
GAPS_NS = [2500.0, 2000.0, 55000.0, 2500.0, 8000.0]
LAYERNORM = "void layernorm_warp_row<__half, 4>(const __half *, __half *, int)"


def tables(folder, names: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    return {table: parse_stats_csv((folder / f"{name}.csv").read_text()) for table, name in names.items()}


NEW_TABLES = {t: c[0] for t, c in REPORTS.items()}
OLD_TABLES = {
    "kernels": "gpukernsum",
    "api": "cudaapisum",
    "trace": "gputrace",
    "mem_time": "gpumemtimesum",
    "mem_size": "gpumemsizesum",
    "nvtx": "nvtxsum",
}


# -- parsing ----------------------------------------------------------------------------------------------


def test_parse_stats_csv_reads_quoted_names_and_skips_notices():
    rows = parse_stats_csv((OLD / "gpukernsum.csv").read_text())
    assert [r["Name"] for r in rows] == ["linear_tensorcore", LAYERNORM]
    assert rows[0]["Total Time (ns)"] == "41000" and rows[0]["Average"] == "20500.0"
    rows = parse_stats_csv((NEW / "cuda_gpu_kern_sum.csv").read_text())
    assert rows[1]["Name"] == LAYERNORM and rows[1]["Med (ns)"] == "17500.0"
    assert parse_stats_csv("") == [] and parse_stats_csv("NOTICE: nothing to report\n") == []


@pytest.mark.parametrize(("folder", "names"), [(NEW, NEW_TABLES), (OLD, OLD_TABLES)], ids=["new", "old"])
def test_summary_of_new_and_old_reports(folder, names):
    s = summarize(tables(folder, names))
    assert s["kernel_time_ns"] == 76000.0 and s["kernel_launches"] == 4
    top = s["top_kernels"]
    assert [k["name"] for k in top] == ["linear_tensorcore", LAYERNORM]
    assert top[0]["instances"] == 2 and top[0]["avg_ns"] == 20500.0
    assert top[0]["pct"] == pytest.approx(100 * 41 / 76)
    gaps = s["gaps"]
    assert gaps["count"] == 5 and gaps["total_ns"] == sum(GAPS_NS)
    assert gaps["median_ns"] == 2500.0 and gaps["max_ns"] == 55000.0 and gaps["p90_ns"] == 55000.0
    assert s["span_ns"] == 150500.0 - 1000.0
    memcpy = s["memcpy"]
    assert memcpy["time_ns"] == 3000.0 and memcpy["count"] == 2
    assert memcpy["bytes"] == pytest.approx(8000.0, rel=1e-3)  # old: 7.812 KiB
    ops = {m["operation"]: m for m in memcpy["by_operation"]}
    assert ops["[CUDA memset]"]["time_ns"] == 500.0  # listed, but not a copy
    api = s["api"]
    assert api[0]["name"] == "cuStreamSynchronize" and api[1] == {
        "name": "cuLaunchKernel",
        "calls": 4,
        "total_ns": 45000.0,
        "avg_ns": 11250.0,
    }
    ranges = {r["name"]: r for r in s["ranges"]}
    assert set(ranges) == {"forward", "linear 8x384x128 float16 act=none", "layernorm 8x128 float16 eps=1e-12"}
    assert ranges["forward"]["instances"] == 2 and ranges["forward"]["cpu_ns"] == 160000.0


def test_ranges_get_projected_gpu_time_where_nsys_has_it():
    s = summarize(tables(NEW, NEW_TABLES))
    first, *_ = s["ranges"]
    assert first == {"name": "forward", "instances": 2, "cpu_ns": 160000.0, "gpu_ns": 79000.0, "gpu_ops": 6}
    linear = next(r for r in s["ranges"] if r["name"].startswith("linear"))
    assert linear["gpu_ns"] == 41000.0 and linear["gpu_ops"] == 2
    # Old nsys has no projection: GPU time unknown, not zero.
    assert all(r["gpu_ns"] is None for r in summarize(tables(OLD, OLD_TABLES))["ranges"])


def test_summary_from_the_trace_alone():
    s = summarize({"trace": parse_stats_csv((NEW / "cuda_gpu_trace.csv").read_text())})
    assert s["kernel_time_ns"] == 76000.0 and s["kernel_launches"] == 4
    assert s["top_kernels"][0]["name"] == "linear_tensorcore"
    assert s["memcpy"]["time_ns"] == 3000.0 and s["memcpy"]["bytes"] == pytest.approx(8000.0)
    assert s["ranges"] == [] and s["api"] == []


def test_overlapping_activities_leave_no_gap():
    gaps, span = profile.launch_gaps([(0.0, 100.0, "a", None), (50.0, 100.0, "b", None), (150.0, 10.0, "c", None)])
    assert gaps["count"] == 0 and gaps["total_ns"] == 0.0 and span == 160.0
    gaps, span = profile.launch_gaps([])
    assert gaps["count"] == 0 and span is None


def test_units_scale_to_ns_and_bytes():
    rows = parse_stats_csv("Start (us),Duration (ms),Bytes (KiB),Name\n1.5,0.002,2,[CUDA memcpy Device-to-Device]\n")
    ((start, duration, name, nbytes),) = profile.trace_activities(rows)
    assert (start, duration, nbytes) == (1500.0, 2000.0, 2048.0) and name.startswith("[CUDA memcpy")


def test_report_names_from_help_reports_new_old_or_none():
    text = """
The following built-in reports are available:

  cuda_api_gpu_sum[:nvtx-name][:base|:mangled] -- CUDA Summary (API/Kernels/MemOps)
  cuda_api_sum -- CUDA API Summary
  cuda_gpu_kern_sum[:nvtx-name][:base|:mangled] -- CUDA GPU Kernel Summary
  cuda_gpu_mem_size_sum -- CUDA GPU MemOps Summary (by Size)
  cuda_gpu_mem_time_sum -- CUDA GPU MemOps Summary (by Time)
  cuda_gpu_trace[:nvtx-name][:base|:mangled] -- CUDA GPU Trace
  nvtx_gpu_proj_sum -- NVTX GPU Projection Summary
  nvtx_sum -- NVTX Range Summary
"""
    known = parse_report_names(text)
    assert {"cuda_gpu_kern_sum", "cuda_api_gpu_sum", "nvtx_sum"} <= known
    assert pick_reports(known) == {t: c[0] for t, c in REPORTS.items()}
    old = pick_reports({"gpukernsum", "cudaapisum", "gputrace", "gpumemtimesum", "gpumemsizesum", "nvtxsum"})
    assert old == OLD_TABLES  # no projection report before 2023: not asked for
    assert pick_reports(set()) == {t: c[0] for t, c in REPORTS.items()}  # nothing listed: the newest names


# -- the spec and the child's model ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "give a model"),
        ({"preset": "mlp-tiny", "path": "x"}, "not both"),
        ({"preset": "gpt"}, "unknown preset"),
        ({"path": "/no/such/model"}, "no model at"),
        ({"preset": "mlp-tiny", "dtype": "int8"}, "unknown dtype"),
        ({"preset": "mlp-tiny", "iters": 0}, "--iters"),
        ({"preset": "bert-tiny", "seq": 4096}, "positions"),
        ({"preset": "mlp-tiny", "act": "swishy"}, "unknown activation 'swishy'"),  # the child refused it, under nsys
        ({"path": str(Path(__file__).parent), "act": "relu"}, "--act is for an MLP file"),  # a checkpoint folder
    ],
)
def test_spec_check_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        ForwardSpec(**fields).check()


@pytest.mark.parametrize("preset", ["mlp-tiny", "bert-tiny"])
def test_presets_build_and_run_on_the_cpu(preset):
    from kernelmill.runtime.models import Model

    spec = ForwardSpec(preset=preset, batch=2, seq=16)
    module = profile.build_module(spec)
    (inputs,) = profile.example_inputs(module, spec.batch, spec.seq)
    out = Model(module, "cpu").forward(inputs).numpy()
    hidden = 128 if preset == "bert-tiny" else 256
    assert out.shape == ((2, 16, hidden) if preset == "bert-tiny" else (2, hidden))
    assert np.isfinite(out).all()


# -- the pipeline against a fake nsys ----------------------------------------------------------------------


@pytest.fixture
def nsys_bin(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    fake_nsys.on_path(monkeypatch, bin_dir)
    return bin_dir


def test_without_nsys_nothing_runs(tmp_path, monkeypatch):
    fake_nsys.nowhere(monkeypatch, tmp_path)
    assert profile.find_nsys() is None
    with pytest.raises(NsysUnavailable):
        profile_forward(ForwardSpec(preset="mlp-tiny"))


def test_nsys_from_the_setting_or_its_install_folder(tmp_path, monkeypatch):
    fake_nsys.nowhere(monkeypatch, tmp_path)
    script = fake_nsys.install(tmp_path / "opt" / "nsight-systems" / "2025.3.1" / "bin")
    monkeypatch.setattr(profile, "NSYS_GLOBS", (str(tmp_path / "opt" / "nsight-systems" / "*" / "bin" / "nsys"),))
    assert profile.find_nsys() == str(script)
    monkeypatch.setenv("KERNELMILL_NSYS", str(script))
    settings.reset_settings()
    assert profile.find_nsys() == str(script)
    monkeypatch.setenv("KERNELMILL_NSYS", str(tmp_path / "missing" / "nsys"))
    settings.reset_settings()
    assert profile.find_nsys() is None  # a path that is asked for is not second-guessed


def test_profile_forward_with_a_fake_nsys(nsys_bin, tmp_path):
    fake_nsys.install(nsys_bin, "ok", "new")
    keep = tmp_path / "kept"
    result = profile_forward(ForwardSpec(preset="mlp-tiny", batch=8, iters=2), keep_dir=keep)
    assert result.kernel_time_ns == 76000.0 and result.kernel_launches == 4
    assert result.kernel_ms_per_forward == pytest.approx(0.038)
    assert result.gpu_busy_pct == pytest.approx(100 * (149500 - 70000) / 149500)
    assert result.nsys_version == "2025.3.1.90" and result.seq is None and result.model == "mlp-tiny"
    assert result.reports["kernels"] == "cuda_gpu_kern_sum" and result.report_path.endswith("forward.nsys-rep")
    assert result.notes == [] and result.device_name is None  # the child did not run: nothing from it
    json.dumps(result.to_dict())  # storable as it is
    profile_cmd, stats_cmd = (c for c in fake_nsys.calls(nsys_bin) if c[0] in ("profile", "stats") and len(c) > 2)
    assert "--capture-range=cudaProfilerApi" in profile_cmd and "--trace=cuda,nvtx" in profile_cmd
    assert profile_cmd[-4:-1] == ["-P", "-m", "kernelmill.runtime.profile"]
    spec = json.loads((keep / "spec.json").read_text())
    assert spec["preset"] == "mlp-tiny" and spec["iters"] == 2
    assert "--format" in stats_cmd and stats_cmd[-1].endswith("forward.nsys-rep")
    assert set(stats_cmd[stats_cmd.index("--report") + 1].split(",")) == {c[0] for c in REPORTS.values()}


def test_output_that_is_not_utf8_is_read_not_raised(nsys_bin):
    """nsys's output (the child's prints pass through it) was decoded strictly: UnicodeDecodeError after the run."""
    fake_nsys.install(nsys_bin, "not-utf8", "new")
    assert profile_forward(ForwardSpec(preset="mlp-tiny", iters=2)).kernel_launches == 4


def test_relative_model_and_keep_paths_are_made_absolute_for_nsys(nsys_bin, tmp_path, monkeypatch):
    """nsys starts the forward in the work directory: a relative model path or --keep would point elsewhere."""
    fake_nsys.install(nsys_bin, "ok", "new")
    monkeypatch.chdir(tmp_path)
    Path("mlp.pt").write_bytes(b"not read: the fake nsys does not run the forward")
    result = profile_forward(ForwardSpec(path="mlp.pt", iters=2), keep_dir=Path("kept"))
    assert result.kernel_launches == 4 and Path(result.report_path) == tmp_path / "kept" / "forward.nsys-rep"
    spec = json.loads((tmp_path / "kept" / "spec.json").read_text())
    assert spec["path"] == str(tmp_path / "mlp.pt") and spec["meta_path"] == str(tmp_path / "kept" / "child.json")


def test_old_nsys_gets_old_report_names(nsys_bin):
    fake_nsys.install(nsys_bin, "ok", "old")
    result = profile_forward(ForwardSpec(preset="mlp-tiny", iters=2))
    assert result.reports == OLD_TABLES
    assert result.kernel_time_ns == 76000.0 and result.gaps["count"] == 5
    assert "reports missing: nvtx_gpu" in result.notes


def test_no_report_is_an_error_with_what_nsys_said(nsys_bin):
    fake_nsys.install(nsys_bin, "no-report")
    with pytest.raises(NsysNoReport, match="wrote no report") as info:
        profile_forward(ForwardSpec(preset="mlp-tiny"))
    assert "No reports were generated" in info.value.tail


def test_a_raw_capture_without_a_report_says_so(nsys_bin):
    fake_nsys.install(nsys_bin, "qdstrm")
    with pytest.raises(NsysNoReport, match="raw .qdstrm capture") as info:
        profile_forward(ForwardSpec(preset="mlp-tiny"))
    assert "QdstrmImporter" in info.value.tail


def test_a_report_without_kernels_is_an_error(nsys_bin, tmp_path):
    empty = tmp_path / "empty-reports"
    empty.mkdir()
    (empty / "cuda_gpu_kern_sum.csv").write_text("Time (%),Total Time (ns),Instances,Name\n")
    fake_nsys.install(nsys_bin, "ok", empty)
    with pytest.raises(NsysNoReport, match="no CUDA kernels"):
        profile_forward(ForwardSpec(preset="mlp-tiny"))


def test_the_child_says_there_is_no_gpu(nsys_bin, monkeypatch):
    """The fake nsys runs the real child, which finds no GPU (none visible): data, not a traceback."""
    fake_nsys.install(nsys_bin, "run-child")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ForwardFailed) as info:
        profile_forward(ForwardSpec(preset="mlp-tiny", iters=1, warmup=1))
    assert info.value.kind == "no_gpu"
