"""The Compiler around nvcc without nvcc: a stand-in script plays it (slow, failing or fine as a test says), so
the timeout, the memo of failures and the on-disk cache can be followed."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from kernelmill.kernels.compile import CompileError, Compiler, CompileTimeout

FAKE_NVCC = """#!{python}
import os, subprocess, sys, time
mode = open({mode!r}).read().strip()
if mode == "slow":  # a child of its own (as nvcc runs cicc and ptxas), both outliving a plain kill of nvcc
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open({pidfile!r}, "w").write(str(child.pid))
    time.sleep(60)
if mode == "fail":
    print("kernel.cu(1): error: nope", file=sys.stderr)
    sys.exit(2)
out = sys.argv[sys.argv.index("-o") + 1]
open(out, "wb").write(b"\\x7fELF\\x02\\x01" + b"\\0" * 250)
print("ptxas info    : Used 10 registers, used 0 barriers, 0 bytes smem", file=sys.stderr)
"""


@pytest.fixture
def nvcc(tmp_path, monkeypatch):
    """A fake nvcc whose behaviour is what ``set_mode`` last wrote: "slow", "fail" or "ok"."""
    mode, pidfile = tmp_path / "mode", tmp_path / "child.pid"
    script = tmp_path / "nvcc"
    script.write_text(FAKE_NVCC.format(python=sys.executable, mode=str(mode), pidfile=str(pidfile)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("kernelmill.kernels.compile.nvcc_version", lambda nvcc: "fake 1.0")

    def set_mode(what: str) -> None:
        mode.write_text(what)

    set_mode("ok")
    return str(script), set_mode, pidfile


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_timeout_kills_nvccs_children_and_is_not_remembered(nvcc, tmp_path):
    """Killing nvcc alone left its cicc/ptxas running; and the timeout was remembered as the source's failure for
    the compiler's life, so a busy moment failed that variant in that worker for good."""
    script, set_mode, pidfile = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=1.5)
    set_mode("slow")
    with pytest.raises(CompileTimeout, match=r"nvcc timed out after 1.5 s"):
        compiler.compile("// a source", "sm_90")
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    set_mode("ok")
    compiled = compiler.compile("// a source", "sm_90")  # compiled now: the timeout was not remembered
    assert compiled.cubin.startswith(b"\x7fELF") and not compiled.cached


def test_a_real_failure_is_remembered_and_a_damaged_cache_entry_is_compiled_again(nvcc, tmp_path):
    script, set_mode, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    set_mode("fail")
    with pytest.raises(CompileError, match=r"nvcc failed \(exit 2\)") as first:
        compiler.compile("// broken", "sm_90")
    set_mode("ok")
    with pytest.raises(CompileError) as again:  # not run again: the same source fails the same way
        compiler.compile("// broken", "sm_90")
    assert again.value is first.value

    built = compiler.compile("// fine", "sm_90")
    assert not built.cached and compiler.compile("// fine", "sm_90").cached
    cubin = next((tmp_path / "cache").rglob("*.cubin"))
    cubin.write_bytes(cubin.read_bytes()[:100])  # cut short (a crash mid-copy, a full disk)
    rebuilt = compiler.compile("// fine", "sm_90")
    assert not rebuilt.cached and rebuilt.cubin == built.cubin
    meta = next((tmp_path / "cache").rglob("*.json"))
    meta.write_text('{"cubin_bytes": 256, "kernels": {"k": {"local_bytes": 8}}}')  # another version's fields
    assert not compiler.compile("// fine", "sm_90").cached


def test_flags_from_the_environment_are_part_of_the_key_and_failed_writes_leave_no_files(nvcc, tmp_path, monkeypatch):
    script, _, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    plain = compiler.cache_key("// s", "sm_90", ["-O3"])
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-Xptxas -O0")
    assert compiler.cache_key("// s", "sm_90", ["-O3"]) != plain
    monkeypatch.delenv("NVCC_APPEND_FLAGS")

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    compiler.compile("// s", "sm_90")  # compiled; the cache could not keep it
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


def test_a_missing_nvcc_is_the_machines_failure_not_a_variants_compile_error(tmp_path):
    """A worker without nvcc recorded every trial as the variant's compile_error."""
    from kernelmill.kernels.compile import NvccMissing
    from kernelmill.kernels.evaluate import evaluate
    from kernelmill.kernels.variant import Variant

    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=str(tmp_path / "no-such-nvcc"))
    with pytest.raises(NvccMissing):
        evaluate(Variant.create("add", "vec", "float16"), (1024,), None, compiler, arch="sm_90")
