"""NVTX ranges of the runtime's ops (runtime.ranges): off by default, which marker carries them when on,
and the one range per op call around its launches."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import shutil
import subprocess
import sys

import pytest

from kernelmill.runtime import ops, ranges


@pytest.fixture(autouse=True)
def _fresh_decision():
    ranges.reset()
    yield
    ranges.reset()


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []

    def push(self, message: str) -> None:
        self.events.append(("push", message))

    def pop(self) -> None:
        self.events.append(("pop", None))


def test_off_by_default_and_the_range_is_a_no_op(monkeypatch):
    monkeypatch.delenv("KERNELMILL_NVTX", raising=False)
    assert ranges.active() is None
    with ranges.nvtx_range("forward"):
        pass
    assert ranges.active() is None  # decided once


def test_on_through_the_setting_with_the_nvtx_package(monkeypatch):
    nvtx = pytest.importorskip("nvtx")
    monkeypatch.setenv("KERNELMILL_NVTX", "1")
    marker = ranges.active()
    assert isinstance(marker, ranges.NvtxPackage) and marker.name == "nvtx"
    with ranges.nvtx_range("forward"):  # no profiler attached: NVTX's calls are no-ops, but real ones
        marker.push("linear 8x8x8 float16 act=none")
        marker.pop()
    assert nvtx.__name__ == "nvtx"


def test_without_nvtx_or_libnvtoolsext_one_log_line_and_no_ranges(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    monkeypatch.setattr(ranges, "find_libnvtoolsext", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.ranges"):
        assert ranges.enable() is None
    assert len(caplog.records) == 1 and "kernelmill[profile]" in caplog.records[0].getMessage()
    with ranges.nvtx_range("forward"):
        pass


STUB = """
static int depth = 0;
static char last[256];
int nvtxRangePushA(const char *message) {
    int i = 0;
    for (; message[i] && i < 255; ++i) last[i] = message[i];
    last[i] = 0;
    return depth++;
}
int nvtxRangePop(void) { return --depth; }
int stub_depth(void) { return depth; }
const char *stub_last(void) { return last; }
"""


def test_libnvtoolsext_through_ctypes_where_there_is_no_package(monkeypatch, tmp_path):
    """A stub library with libnvToolsExt's two entry points stands in for CUDA 11's."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stub libnvToolsExt")
    source, lib = tmp_path / "stub.c", tmp_path / "libnvToolsExt.so.1"
    source.write_text(STUB)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    monkeypatch.setitem(sys.modules, "nvtx", None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / lib.name).symlink_to(lib)
    marker = ranges.enable()
    assert isinstance(marker, ranges.LibNvToolsExt) and marker.path.startswith(str(tmp_path))
    stub = ctypes.CDLL(marker.path)
    stub.stub_last.restype = ctypes.c_char_p
    with ranges.nvtx_range("linear 8x8x8 float16 act=none"):
        assert stub.stub_depth() == 1 and stub.stub_last() == b"linear 8x8x8 float16 act=none"
    assert stub.stub_depth() == 0


def test_enable_and_disable_override_the_setting(monkeypatch):
    monkeypatch.setattr(ranges, "make_marker", Recorder)
    assert isinstance(ranges.enable(), Recorder) and isinstance(ranges.active(), Recorder)
    assert ranges.enable(False) is None and ranges.active() is None


def test_range_names_say_the_problem():
    assert ranges.op_range_name("linear", (16, 11008, 4096), "float16", {"act": "gelu_erf"}) == (
        "linear 16x11008x4096 float16 act=gelu_erf"
    )
    assert ranges.op_range_name("add", (4096,), "bfloat16", {}) == "add 4096 bfloat16"


class _Entry:
    def __init__(self, recorder: Recorder, fail: bool = False) -> None:
        self.recorder, self.fail = recorder, fail

    def run(self, backend, pointers) -> None:
        self.recorder.events.append(("run", ",".join(sorted(pointers))))
        if self.fail:
            raise RuntimeError("launch failed")


class _Registry:
    def __init__(self, entry: _Entry) -> None:
        self.entry = entry

    def get(self, op, shape, dtype, attrs):
        return self.entry


class _Tensor:
    ptr = 0  # aligned: used as it is


@pytest.mark.parametrize("fail", [False, True])
def test_one_range_per_op_call_around_its_launches(monkeypatch, fail):
    recorder = Recorder()
    monkeypatch.setattr(ranges, "_marker", recorder)
    monkeypatch.setattr(ops, "_backend", lambda: None)
    with ops.using_registry(_Registry(_Entry(recorder, fail))):
        if fail:
            with pytest.raises(RuntimeError):
                ops._launch("add", (64,), "float16", {}, {"X": _Tensor(), "R": _Tensor(), "Y": _Tensor()})
        else:
            ops._launch("add", (64,), "float16", {}, {"X": _Tensor(), "R": _Tensor(), "Y": _Tensor()})
    assert recorder.events == [("push", "add 64 float16"), ("run", "R,X,Y"), ("pop", None)]


def test_no_range_when_off(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(ranges, "_marker", None)
    monkeypatch.setattr(ops, "_backend", lambda: None)
    with ops.using_registry(_Registry(_Entry(recorder))):
        ops._launch("add", (64,), "float16", {}, {"X": _Tensor(), "R": _Tensor(), "Y": _Tensor()})
    assert recorder.events == [("run", "R,X,Y")]
