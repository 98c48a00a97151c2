"""The Compiler around nvcc without nvcc: a stand-in script plays it (slow, failing or fine as a test says), so
the timeout, the memo of failures and the on-disk cache can be followed."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kernelmill.kernels.compile import (
    BASE_FLAGS,
    MB,
    CompileError,
    CompileInterrupted,
    Compiler,
    CompileTimeout,
    NvccMissing,
    arch_flags,
)
from kernelmill.settings import override_settings

FAKE_NVCC = """#!{python}
import os, subprocess, sys, time
mode = open({mode!r}).read().strip()
if mode == "slow":  # a child of its own (as nvcc runs cicc and ptxas), both outliving a plain kill of nvcc
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open({pidfile!r}, "w").write(str(child.pid))
    time.sleep(60)
if mode == "killed":
    os.kill(os.getpid(), 9)
if mode == "child-killed":  # cicc killed: nvcc's shell says so and exits 128 + 9
    print("Killed", file=sys.stderr)
    sys.exit(137)
if mode == "no-space":
    print("<built-in>: fatal error: when writing output to /tmp/x.ii: No space left on device", file=sys.stderr)
    sys.exit(1)
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


def test_the_key_changes_with_everything_that_changes_the_binary(nvcc, monkeypatch):
    """Source, arch, flags and nvcc's version: a key without the arch would serve an sm_80 cubin for sm_90."""
    script, _, _ = nvcc
    compiler = Compiler(nvcc=script)
    base = compiler.cache_key("// s", "sm_90", ["-O3"])
    assert compiler.cache_key("// s", "sm_90", ["-O3"]) == base
    others = [
        compiler.cache_key("// t", "sm_90", ["-O3"]),
        compiler.cache_key("// s", "sm_80", ["-O3"]),
        compiler.cache_key("// s", "sm_90a", ["-O3"]),
        compiler.cache_key("// s", "sm_90", ["-O2"]),
        compiler.cache_key("// s", "sm_90", ["-O3", "-lineinfo"]),
        compiler.cache_key("// s", "sm_90", ["-O", "3"]),  # not the same as one flag "-O3"
    ]
    monkeypatch.setattr("kernelmill.kernels.compile.nvcc_version", lambda nvcc: "fake 1.1")
    others.append(compiler.cache_key("// s", "sm_90", ["-O3"]))
    assert len({base, *others}) == len(others) + 1


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


def _age(compiler: Compiler, source: str, seconds_ago: float) -> None:
    """Mark ``source``'s cache entry as last used ``seconds_ago``."""
    key = compiler.cache_key(source, "sm_90", [*BASE_FLAGS, *arch_flags("sm_90")])
    cubin, _ = compiler._paths(key)
    when = time.time() - seconds_ago
    os.utime(cubin, (when, when))


def test_prune_removes_the_least_recently_used_and_a_hit_counts_as_a_use(nvcc, tmp_path):
    script, _, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    sources = [f"// source {i}" for i in range(4)]
    for i, src in enumerate(sources):
        compiler.compile(src, "sm_90")
        _age(compiler, src, 1000 - i * 100)  # source 0 the oldest
    assert compiler.compile(sources[0], "sm_90").cached  # used now: the newest
    entries = compiler.entries()
    assert len(entries) == 4 and all(e.bytes > 256 for e in entries)  # the cubin and its report
    one = entries[0].bytes

    report = compiler.prune(2 * one + one // 2)  # room for two
    assert (report.entries, report.removed, report.freed_bytes) == (4, 2, 2 * one)
    assert compiler.compile(sources[0], "sm_90").cached and compiler.compile(sources[3], "sm_90").cached
    assert not compiler.compile(sources[1], "sm_90").cached  # removed: compiled again

    assert compiler.prune(10 * one).removed == 0
    assert compiler.prune(0).removed == 3 and compiler.entries() == []


def test_writes_prune_the_cache_to_its_limit(nvcc, tmp_path, monkeypatch):
    """The cache grew without end: a tuning worker writes one cubin per variant."""
    script, _, _ = nvcc
    monkeypatch.setattr("kernelmill.kernels.compile.PRUNE_EVERY", 2)
    probe = Compiler(cache_dir=tmp_path / "probe", nvcc=script, timeout_s=30)
    probe.compile("// probe", "sm_90")
    one = probe.entries()[0].bytes
    override_settings(compile_cache_max_mb=3.5 * one / MB)
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    for i in range(7):
        compiler.compile(f"// source {i}", "sm_90")
        _age(compiler, f"// source {i}", 1000 - i * 100)
    # Pruned at the 1st, 3rd, 5th and 7th writes, to at most 90% of 3.5 entries: 3 left after the 7th.
    assert sorted(e.key for e in compiler.entries()) == sorted(
        compiler.cache_key(f"// source {i}", "sm_90", [*BASE_FLAGS, *arch_flags("sm_90")]) for i in (4, 5, 6)
    )
    override_settings(compile_cache_max_mb=0)  # no limit
    unlimited = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    for i in range(10, 16):
        unlimited.compile(f"// source {i}", "sm_90")
    assert len(unlimited.entries()) == 9


def test_nvcc_runs_in_a_folder_named_after_the_key_and_removed_after(nvcc, tmp_path, monkeypatch):
    """-lineinfo writes the folder nvcc ran in into the cubin: a random temp folder made each build of a source
    other bytes, so a rebuilt cache entry missed the runtime's first-use records (keyed by the cubin)."""
    script, _, _ = nvcc
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    seen = tmp_path / "cwd"
    Path(script).write_text(
        Path(script)
        .read_text()
        .replace("mode = open(", f"open({str(seen)!r}, 'a').write(os.getcwd() + '\\n')\nmode = open(")
    )
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    key = compiler.cache_key("// a", "sm_90", [*BASE_FLAGS, *arch_flags("sm_90")])
    compiler.compile("// a", "sm_90")
    assert seen.read_text().split() == [str(tmp_path / "tmp" / f"kernelmill-nvcc-{key[:32]}")]

    keyed = tmp_path / "tmp" / f"kernelmill-nvcc-{key[:32]}"
    keyed.mkdir(mode=0o700)  # another process building it at this moment: it holds the folder's lock
    building = os.open(keyed, os.O_RDONLY)
    fcntl.flock(building, fcntl.LOCK_EX)
    compiler.prune(0)
    assert not compiler.compile("// a", "sm_90").cached  # built in a folder of its own
    second = seen.read_text().split()[1]
    assert second.startswith(str(tmp_path / "tmp" / "kernelmill-nvcc-")) and not second.endswith(key[:32])
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == [f"kernelmill-nvcc-{key[:32]}"]
    os.close(building)

    # Left by a build that was killed (nobody holds its lock): every later build of the key got a random folder,
    # so other bytes each time.
    (keyed / "kernel.cubin").write_bytes(b"half a cubin")
    compiler.prune(0)
    assert not compiler.compile("// a", "sm_90").cached
    assert seen.read_text().split()[2] == str(keyed) and not keyed.exists()


@pytest.mark.parametrize("how", ["killed", "child-killed", "no-space"])
def test_nvcc_stopped_by_the_machine_is_not_remembered_as_the_sources_failure(nvcc, tmp_path, how):
    """nvcc killed (the OOM killer, on itself or on its cicc: 137 and "Killed") or out of disk space for its
    temporaries was remembered as the source's compile error: the worker failed that variant again without
    running nvcc for the rest of its life."""
    script, set_mode, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    set_mode(how)
    with pytest.raises(CompileInterrupted) as first:
        compiler.compile("// a source", "sm_90")
    assert "the machine" in str(first.value)
    set_mode("ok")
    assert not compiler.compile("// a source", "sm_90").cached  # nvcc ran again, and built it


def test_a_build_folder_that_cannot_be_written_fails_the_compile_not_the_batch(nvcc, tmp_path, monkeypatch):
    """A full or read-only temp folder raised OSError out of compile(), and out of compile_many's whole batch."""
    script, _, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    write_text = Path.write_text

    def full(path, *args, **kwargs):
        if path.name == "kernel.cu":
            raise OSError(28, "No space left on device")
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    results = compiler.compile_many(["// a", "// b", "// a"], "sm_90", workers=2)
    assert all(isinstance(r, CompileInterrupted) and "No space left on device" in str(r) for r in results)
    monkeypatch.setattr(Path, "write_text", write_text)
    assert not compiler.compile("// a", "sm_90").cached  # not remembered


def test_a_folder_where_an_entry_should_be_or_an_entry_that_cannot_go_does_not_break_prune(nvcc, tmp_path, monkeypatch):
    """A folder at an entry's cubin path made every prune raise IsADirectoryError (kernelmill cache prune's
    traceback; a compile's write over the limit raised it out of compile()), and the entry was compiled again on
    every use; an entry that cannot be removed (a read-only cache) raised the same way."""
    script, _, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    built = compiler.compile("// a", "sm_90")
    cubin, _ = compiler._paths(built.key)
    cubin.unlink()
    cubin.mkdir()
    assert not compiler.compile("// a", "sm_90").cached and compiler.compile("// a", "sm_90").cached
    cubin.unlink()
    cubin.mkdir()
    (cubin / "inside").write_bytes(b"x")
    assert compiler.prune(0).removed == 1 and not cubin.exists()

    stuck = compiler.compile("// b", "sm_90").key
    compiler.compile("// c", "sm_90")
    unlink = Path.unlink

    def read_only(path, missing_ok=False):
        if path.name.startswith(stuck):
            raise OSError(30, "Read-only file system")
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    report = compiler.prune(0)
    assert (report.removed, report.kept) == (1, 1) and "Read-only file system" in report.error
    compiler.max_cache_bytes, compiler._stores = 1, 0  # the next write prunes
    assert not compiler.compile("// d", "sm_90").cached  # pruned on its write; what could not go stayed
    assert {e.key for e in compiler.entries()} == {stuck}


def test_prune_removes_the_temporary_files_of_writers_that_died(nvcc, tmp_path):
    """A writer killed between its temporary file and the rename left the file for ever: prune --all kept it."""
    script, _, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    built = compiler.compile("// a", "sm_90")
    folder = compiler._paths(built.key)[0].parent
    dead, writing = folder / "tmpdead0000", folder / "tmpnow00000"
    dead.write_bytes(b"\x7fELF")
    writing.write_bytes(b"\x7fELF")
    os.utime(dead, (time.time() - 2 * 3600, time.time() - 2 * 3600))
    assert compiler.prune(0).removed == 1
    assert sorted(p.name for p in folder.iterdir()) == ["tmpnow00000"]  # a write in progress is left alone


def test_one_source_compiled_by_several_threads_at_once_runs_nvcc_once(nvcc, tmp_path):
    """compile_many with a source twice (or two threads of one worker) ran nvcc for each, the others in random
    folders: other bytes for one cache key in one batch (-lineinfo), and the cache kept whichever wrote last."""
    script, _, _ = nvcc
    runs = tmp_path / "runs"
    Path(script).write_text(
        Path(script).read_text().replace("mode = open(", f"open({str(runs)!r}, 'a').write('run\\n')\nmode = open(")
    )
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    results = compiler.compile_many(["// a"] * 4 + ["// b"], "sm_90", workers=5)
    assert runs.read_text().split() == ["run", "run"]
    assert sorted(r.cached for r in results[:4]) == [False, True, True, True]
    assert len({r.cubin for r in results[:4]}) == 1


def test_a_cached_cubin_damaged_in_place_is_compiled_again_not_used(nvcc, tmp_path):
    """Only the cubin's length and ELF magic were checked: a cubin damaged without changing its length (a bad
    disk block, another program's write) was loaded as the compile of its source."""
    script, _, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    built = compiler.compile("// a", "sm_90")
    cubin_path, meta_path = compiler._paths(built.key)
    cubin_path.write_bytes(built.cubin[:-1] + b"\x01")
    again = compiler.compile("// a", "sm_90")
    assert not again.cached and again.cubin == built.cubin

    meta = json.loads(meta_path.read_text())  # an entry written before the digest is still read
    del meta["cubin_sha256"]
    meta_path.write_text(json.dumps(meta))
    assert compiler.compile("// a", "sm_90").cached


def test_nvcc_gone_since_it_was_found_is_the_machines_failure_and_not_remembered(nvcc, tmp_path):
    script, _, _ = nvcc
    compiler = Compiler(cache_dir=tmp_path / "cache", nvcc=script, timeout_s=30)
    Path(script).rename(tmp_path / "away")  # a toolkit upgrade replacing it, say
    with pytest.raises(NvccMissing, match="nvcc not found"):
        compiler.compile("// a", "sm_90")
    (tmp_path / "away").rename(script)
    assert not compiler.compile("// a", "sm_90").cached
