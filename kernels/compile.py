"""nvcc -> cubin, with a content-hash disk cache and the ptxas report parsed.

The one place that runs nvcc: callers get a ``CompiledKernel`` or a
``CompileError`` carrying nvcc's log, never a return code.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from kernelmill.settings import get_settings

log = logging.getLogger(__name__)

DEFAULT_ARCH = "sm_90"
#: The oldest GPU the templates target (bf16, cp.async): sm_80. Families that need Hopper (clusters, TMA,
#: wgmma) say so with an #error, or Family.target, on older targets.
MIN_SM = 80


def base_arch(arch: str) -> str:
    """The GPU an nvcc target is for, without its arch-specific ("sm_90a") or family ("sm_100f") suffix."""
    return arch.rstrip("af")


def _sm_number(base: str) -> int | None:
    """90 for "sm_90"; None for a number of more digits than any GPU's (int() raises past 4300 of them)."""
    digits = base.removeprefix("sm_").lstrip("0") or "0"
    return int(digits) if len(digits) <= 4 else None


def _shown(arch: str) -> str:
    return arch if len(arch) <= 24 else f"{arch[:16]}... ({len(arch)} characters)"


def too_old(arch: str) -> str | None:
    """Why GPU ``arch`` (e.g. "sm_75") cannot run kernelmill's kernels, or None."""
    base = base_arch(arch)
    number = _sm_number(base)
    if number is not None and number < MIN_SM:
        return f"kernelmill's kernels need sm_{MIN_SM} or newer, not {base}"
    return None


#: The GPUs nvcc 13 targets from sm_80 on (sm_101 of CUDA 12.9 became sm_110).
KNOWN_SMS: tuple[int, ...] = (80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)


def unknown_gpu(arch: str) -> str | None:
    """Why an arch a user names (a job's, ``compile --arch``) is no GPU nvcc targets ("sm_999"), or None. A job
    for it would wait for ever and a compile would fail in nvcc. Not asked of a GPU that is there: one newer
    than this list runs wherever its nvcc targets it."""
    base = base_arch(arch)
    number = _sm_number(base)
    if number not in KNOWN_SMS:
        return f"{_shown(base)} is not a GPU nvcc targets; known: {', '.join(f'sm_{n}' for n in KNOWN_SMS)}"
    suffix = arch.removeprefix(base)
    if (suffix == "a" and number < 90) or (suffix == "f" and number < 100):  # compute_80a, compute_90f: none
        return f"{arch} is no nvcc target: the 'a' suffix starts at sm_90, the 'f' suffix at sm_100"
    return None


BASE_FLAGS: tuple[str, ...] = ("-std=c++17", "-O3", "-lineinfo", "-Xptxas", "-v")


class CompileError(RuntimeError):
    """nvcc failed (or timed out); ``log`` holds what it printed."""

    def __init__(self, message: str, log_text: str = "") -> None:
        super().__init__(message)
        self.log = log_text

    def __str__(self) -> str:
        first = super().__str__()
        return f"{first}\n{self.log}" if self.log else first


class NvccMissing(CompileError):
    """There is no nvcc to run (KERNELMILL_NVCC names none on PATH): the machine, not the variant."""


class CompileTimeout(CompileError):
    """nvcc ran past the compile timeout: maybe the source, maybe a busy machine (so not remembered)."""


class CompileInterrupted(CompileError):
    """nvcc was stopped by the machine, not the source: killed (itself or its cicc/ptxas, by the OOM killer
    say), out of disk space, or its build folder could not be written. Not remembered: it may build next time."""


#: What nvcc says where a disk it writes its temporaries or its cubin to is full.
_NO_SPACE = os.strerror(errno.ENOSPC)


_ELF64_LE = b"\x7fELF\x02\x01"
_SHT_SYMTAB, _STT_FUNC, _STB_GLOBAL, _STO_CUDA_ENTRY = 2, 2, 1, 0x10


@dataclass(frozen=True)
class ElfSection:
    """One section header of a cubin (a 64-bit little-endian ELF), its name resolved."""

    name: str
    kind: int  # sh_type
    offset: int
    size: int
    link: int
    entsize: int


def _cstr(data: bytes, at: int) -> str:
    return data[at : data.index(b"\0", at)].decode()


def elf_sections(cubin: bytes) -> list[ElfSection]:
    """The section headers of a cubin. A malformed one raises struct.error, ValueError, IndexError or
    UnicodeDecodeError."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    # name, type, flags, addr, offset, size, link, info, addralign, entsize
    raw = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = raw[shstrndx][4]
    return [ElfSection(_cstr(cubin, names_at + r[0]), r[1], r[4], r[5], r[6], r[9]) for r in raw]


def cubin_entries(cubin: bytes) -> frozenset[str] | None:
    """The kernel entry functions a cubin holds (global functions marked as CUDA entries in its ELF symbol
    table), or None where the bytes are not a 64-bit little-endian ELF (nothing to look up)."""
    if not cubin.startswith(_ELF64_LE):
        return None
    try:
        sections = elf_sections(cubin)
        names: set[str] = set()
        for symtab in sections:
            if symtab.kind != _SHT_SYMTAB or not symtab.entsize:
                continue
            strings = sections[symtab.link].offset
            for k in range(symtab.size // symtab.entsize):
                name, info, other = struct.unpack_from("<IBB", cubin, symtab.offset + k * symtab.entsize)
                if info & 0xF == _STT_FUNC and info >> 4 == _STB_GLOBAL and other & _STO_CUDA_ENTRY:
                    names.add(_cstr(cubin, strings + name))
        return frozenset(names)
    except (struct.error, ValueError, IndexError, UnicodeDecodeError):
        return frozenset()  # an ELF whose tables do not parse holds no entry that could be launched


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one entry function."""

    registers: int = 0
    smem_bytes: int = 0
    stack_bytes: int = 0
    spill_stores_bytes: int = 0
    spill_loads_bytes: int = 0
    barriers: int = 0


@dataclass
class CompiledKernel:
    """A cubin and what ptxas said of each of its entries."""

    cubin: bytes
    arch: str
    key: str
    resources: dict[str, KernelResources] = field(default_factory=dict)
    log: str = ""
    cached: bool = False

    @property
    def spills(self) -> bool:
        return any(r.spill_stores_bytes or r.spill_loads_bytes for r in self.resources.values())

    def report(self) -> dict:
        """JSON-ready ptxas report."""
        return {
            "arch": self.arch,
            "key": self.key,
            "cached": self.cached,
            "cubin_bytes": len(self.cubin),
            "kernels": {name: asdict(res) for name, res in self.resources.items()},
        }


def normalize_arch(arch: str | None) -> str:
    """``"90"``, ``"sm_90"``, ``"sm_90a"``, ``"9.0"`` -> ``"sm_90"`` / ``"sm_90a"``."""
    if not arch:
        return DEFAULT_ARCH
    text = arch.strip().lower().replace("compute_", "sm_")
    m = re.fullmatch(r"(?:sm_?)?([0-9]+)\.?([0-9])?([af]?)", text, re.ASCII)
    if not m:
        raise ValueError(f"malformed arch {arch!r}; expected e.g. sm_90")
    major_minor = (m.group(1).lstrip("0") or "0") + (m.group(2) or "")  # sm_090 is sm_90 (a job for it waited)
    return f"sm_{major_minor}{m.group(3)}"


def arch_flags(arch: str) -> list[str]:
    """nvcc target flags. Arch-specific targets (sm_90a) need the -gencode form."""
    num = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{num},code={arch}"]


@lru_cache(maxsize=4)
def nvcc_version(nvcc: str) -> str:
    """nvcc's version banner (part of every cache key)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise NvccMissing(f"nvcc not found ({nvcc}); install the CUDA toolkit or set KERNELMILL_NVCC") from None
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


def find_nvcc() -> str:
    configured = get_settings().nvcc
    found = shutil.which(configured)
    if found is None:
        raise NvccMissing(f"nvcc not found ({configured}); install the CUDA toolkit or set KERNELMILL_NVCC")
    return found


_ENTRY_RE = re.compile(r"(?:Compiling entry function|Function properties for) '?([A-Za-z_][\w$]*)'?")
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log_text: str) -> dict[str, KernelResources]:
    """Registers, shared memory, stack and spills per entry from ``-Xptxas -v`` output."""
    found: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in log_text.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current = m.group(1)
            found.setdefault(current, {})
            continue
        if current is None:
            continue
        entry = found[current]
        if m := _STACK_RE.search(line):
            entry["stack_bytes"] = int(m.group(1))
            entry["spill_stores_bytes"] = int(m.group(2))
            entry["spill_loads_bytes"] = int(m.group(3))
        if m := _REGS_RE.search(line):
            entry["registers"] = int(m.group(1))
            if s := _SMEM_RE.search(line):
                entry["smem_bytes"] = int(s.group(1))
            if b := _BARRIERS_RE.search(line):
                entry["barriers"] = int(b.group(1))
    return {name: KernelResources(**vals) for name, vals in found.items()}


MB = 1 << 20
#: A process prunes the compile cache on its first write and every PRUNE_EVERY writes after it (a scan of the
#: cache's files: tens of ms for ten thousand entries, against seconds for one nvcc run).
PRUNE_EVERY = 64
#: A cache over its limit is cut to (1 - PRUNE_SLACK) of it.
PRUNE_SLACK = 0.1
#: A write's temporary file (mkstemp's name, no extension) this old was left by a writer that died; a write in
#: progress takes milliseconds.
STRAY_WRITE_AGE_S = 3600.0


@dataclass
class CacheEntry:
    key: str
    bytes: int
    used: float  # the cubin's mtime: written, or last loaded


@dataclass
class PruneReport:
    entries: int  # before
    bytes: int  # before
    removed: int
    freed_bytes: int
    kept: int = 0  # entries it could not remove (a read-only cache, say)
    error: str = ""  # the first such entry's error


@contextlib.contextmanager
def _build_folder(key: str) -> Iterator[str]:
    """A folder for one nvcc run, named after the cache key. -lineinfo writes the folder nvcc ran in into the
    cubin (and the source file's mtime, which the compile sets to 0), so a random temp folder made every build
    of one source different bytes: a rebuilt cache entry then missed the runtime's first-use records, which
    are keyed by the cubin. The build holds a lock on the folder: another process building the same key at the
    same moment gets a random folder, and only reproducibility is lost; a folder left by a build that was
    killed (nobody holds its lock) is emptied and used, where it made every later build of its key a random
    folder's."""
    folder = Path(tempfile.gettempdir()) / f"kernelmill-nvcc-{key[:32]}"
    held = _lock_folder(folder)
    if held is None:
        folder = Path(tempfile.mkdtemp(prefix="kernelmill-nvcc-"))
    try:
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if held is not None:
            os.close(held)


def _lock_folder(folder: Path) -> int | None:
    """An open descriptor of ``folder`` (made if missing, emptied if not) holding its lock, or None where another
    process holds it, or it is not this user's own private folder (/tmp is everyone's)."""
    fd = None
    try:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(fd)
        # Still the folder at that name (its last builder may have removed it as this one opened it), and private.
        if st.st_ino != os.stat(folder, follow_symlinks=False).st_ino or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError("not this build's own folder")
        for leftover in os.scandir(folder):
            if leftover.is_dir(follow_symlinks=False):
                shutil.rmtree(leftover.path)
            else:
                os.unlink(leftover.path)
        return fd
    except OSError:
        if fd is not None:
            os.close(fd)
        return None


class Compiler:
    """Compiles CUDA source to cubin through nvcc; caches by content hash."""

    def __init__(self, cache_dir: Path | None = None, nvcc: str | None = None, timeout_s: float | None = None):
        settings = get_settings()
        self.cache_dir = Path(cache_dir or settings.cache_dir) / "cubin"
        self._nvcc = nvcc
        self.timeout_s = timeout_s or settings.compile_timeout_s
        # nvcc's failures by cache key, for this compiler's life: a batch compiled in parallel first and then
        # one variant at a time (agents.evaluator) ran nvcc twice on each failing source. Not timeouts nor
        # CompileInterrupted: a busy or full machine's would have failed that source in this worker for good.
        self._failed: dict[str, CompileError] = {}
        self.max_cache_bytes = int(settings.compile_cache_max_mb * MB)
        self._stores = 0
        self._pruning = threading.Lock()
        self._key_locks: dict[str, tuple[threading.Lock, int]] = {}  # the key's lock, and its holder and waiters
        self._key_locks_guard = threading.Lock()

    @property
    def nvcc(self) -> str:
        if self._nvcc is None:
            self._nvcc = find_nvcc()
        return self._nvcc

    def cache_key(self, source: str, arch: str, flags: Sequence[str]) -> str:
        """sha256 of everything that changes the binary: source, nvcc version, arch, flags (those nvcc takes
        from the environment too: an unoptimised NVCC_APPEND_FLAGS build was served to later plain runs)."""
        env_flags = [os.environ.get(name, "") for name in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")]
        h = hashlib.sha256()
        for part in (source, nvcc_version(self.nvcc), arch, "\0".join([*flags, *env_flags])):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def compile(self, source: str, arch: str | None = None, extra_flags: Sequence[str] = ()) -> CompiledKernel:
        """cubin for ``source`` on ``arch``; raises CompileError with nvcc's log."""
        arch = normalize_arch(arch)
        flags = [*BASE_FLAGS, *arch_flags(arch), *extra_flags]
        key = self.cache_key(source, arch, flags)
        hit = self._load(key, arch)
        if hit is not None:
            return hit
        with self._building(key):
            hit = self._load(key, arch)  # built by another thread while this one waited
            if hit is not None:
                return hit
            if key in self._failed:
                raise self._failed[key]
            try:
                compiled = self._nvcc_compile(source, arch, flags, key)
            except (CompileTimeout, CompileInterrupted, NvccMissing):
                raise
            except CompileError as exc:
                self._failed[key] = exc
                raise
            self._store(compiled)
            return compiled

    @contextlib.contextmanager
    def _building(self, key: str) -> Iterator[None]:
        """One build of ``key`` at a time in this compiler; the others wait for its cache entry. compile_many with
        a source twice (or a worker's threads) ran nvcc for each, all but one in a random folder: other bytes."""
        with self._key_locks_guard:
            lock, waiting = self._key_locks.get(key, (threading.Lock(), 0))
            self._key_locks[key] = (lock, waiting + 1)
        try:
            with lock:
                yield
        finally:
            with self._key_locks_guard:
                lock, waiting = self._key_locks[key]
                if waiting == 1:
                    del self._key_locks[key]
                else:
                    self._key_locks[key] = (lock, waiting - 1)

    def _nvcc_compile(self, source: str, arch: str, flags: list[str], key: str) -> CompiledKernel:
        try:
            return self._run_nvcc(source, arch, flags, key)
        except FileNotFoundError as exc:
            if exc.filename == self.nvcc:  # removed since find_nvcc found it
                raise NvccMissing(
                    f"nvcc not found ({self.nvcc}); install the CUDA toolkit or set KERNELMILL_NVCC"
                ) from None
            raise CompileInterrupted(f"nvcc could not run on this machine: {exc}") from None
        except OSError as exc:  # the temp folder full or read-only: raised out of compile_many's whole batch
            raise CompileInterrupted(f"nvcc could not run on this machine: {exc}") from None

    def _run_nvcc(self, source: str, arch: str, flags: list[str], key: str) -> CompiledKernel:
        with _build_folder(key) as tmp:
            src = Path(tmp) / "kernel.cu"
            out = Path(tmp) / "kernel.cubin"
            src.write_text(source)
            os.utime(src, (0, 0))  # -lineinfo records the source's mtime too
            cmd = [self.nvcc, "-cubin", *flags, "-o", out.name, src.name]
            # A session of its own: on a timeout the whole group goes (killing nvcc alone left its cicc or ptxas
            # running, a core each, and the next compiles timed out behind them).
            proc = subprocess.Popen(
                cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            timed_out = False
            try:
                stdout, stderr = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            log_text = stdout + stderr
            if timed_out:
                raise CompileTimeout(f"nvcc timed out after {self.timeout_s:g} s", log_text)
            # Killed by a signal: nvcc itself (a negative code), or its cicc or ptxas (nvcc's shell exits 128 + N).
            signalled = proc.returncode < 0 or 128 < proc.returncode <= 128 + 64
            if signalled or _NO_SPACE in log_text:
                why = "was killed" if signalled else "ran out of disk space"
                raise CompileInterrupted(f"nvcc {why} (exit {proc.returncode}): the machine, not the source", log_text)
            if proc.returncode != 0 or not out.exists():
                raise CompileError(f"nvcc failed (exit {proc.returncode})", log_text)
            return CompiledKernel(out.read_bytes(), arch, key, parse_ptxas(log_text), log_text)

    def compile_many(
        self, sources: Iterable[str], arch: str | None = None, workers: int | None = None
    ) -> list[CompiledKernel | CompileError]:
        """Compile in parallel (one nvcc process per worker); failures come back as CompileError values."""
        sources = list(sources)
        workers = workers or get_settings().compile_workers

        def one(src: str) -> CompiledKernel | CompileError:
            try:
                return self.compile(src, arch)
            except CompileError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(one, sources))

    # -- cache -----------------------------------------------------------------

    def _paths(self, key: str) -> tuple[Path, Path]:
        folder = self.cache_dir / key[:2]
        return folder / f"{key}.cubin", folder / f"{key}.json"

    def _load(self, key: str, arch: str) -> CompiledKernel | None:
        """The cached compile of ``key``, or None: also where the entry is damaged (a cubin cut short or not an
        ELF, metadata another version wrote), which is then removed so the compile writes it anew."""
        cubin_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
        except IsADirectoryError as exc:  # no write could replace it: compiled again on every use
            return self._damaged(key, exc)
        except (OSError, ValueError):
            return None
        with contextlib.suppress(OSError):  # its last use, which pruning keeps the latest of
            os.utime(cubin_path)
        try:
            if not cubin.startswith(_ELF64_LE) or len(cubin) != meta["cubin_bytes"]:
                raise ValueError(f"cubin of {len(cubin)} bytes, {meta['cubin_bytes']} recorded")
            digest = hashlib.sha256(cubin).hexdigest()
            if meta.get("cubin_sha256", digest) != digest:  # entries from before the digest: no check
                raise ValueError("the cubin is not the one its entry was written with (sha256 differs)")
            resources = {name: KernelResources(**vals) for name, vals in meta.get("kernels", {}).items()}
            return CompiledKernel(cubin, arch, key, resources, meta.get("log", ""), cached=True)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return self._damaged(key, exc)

    def _damaged(self, key: str, why: Exception) -> None:
        """Removes a damaged entry, so the compile writes it anew."""
        log.warning("compile cache entry %s is damaged (%s): compiling it again", key[:12], why)
        with contextlib.suppress(OSError):  # a read-only cache: compiled, not written
            for path in self._paths(key):
                _remove(path)

    def _store(self, compiled: CompiledKernel) -> None:
        cubin_path, meta_path = self._paths(compiled.key)
        try:
            cubin_path.parent.mkdir(parents=True, exist_ok=True)
            meta = {
                **compiled.report(),
                "log": compiled.log,
                "cubin_sha256": hashlib.sha256(compiled.cubin).hexdigest(),
            }
            # Write-then-rename so a concurrent reader never sees half a file.
            for path, data in ((cubin_path, compiled.cubin), (meta_path, json.dumps(meta).encode())):
                fd, tmp = tempfile.mkstemp(dir=path.parent)
                try:
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(data)
                    os.replace(tmp, path)
                except OSError:
                    Path(tmp).unlink(missing_ok=True)  # a full disk left one such file per failed write
                    raise
        except OSError as exc:  # a read-only cache must not fail the compile
            log.warning("could not write the compile cache at %s: %s", self.cache_dir, exc)
            return
        self._stores += 1
        # On the first write and every PRUNE_EVERY after it: a tuning worker writes a cubin per variant (tens
        # of KB each, thousands a day), and the cache grew without end.
        if self.max_cache_bytes and self._stores % PRUNE_EVERY == 1 and self._pruning.acquire(blocking=False):
            try:
                report = self.prune(self.max_cache_bytes, slack=PRUNE_SLACK)
                if report.kept:
                    log.warning(
                        "compile cache at %s: %d entries could not be removed: %s",
                        self.cache_dir,
                        report.kept,
                        report.error,
                    )
            finally:
                self._pruning.release()

    def entries(self) -> list[CacheEntry]:
        """The cache's entries, least recently used first."""
        found: dict[str, CacheEntry] = {}
        # A cache folder not made yet, or under a file (a wrong KERNELMILL_CACHE_DIR): empty, not a traceback.
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(self.cache_dir) as folders:
            for folder in folders:
                if not folder.is_dir():
                    continue
                with contextlib.suppress(FileNotFoundError), os.scandir(folder.path) as files:
                    for f in files:
                        key, _, ext = f.name.partition(".")
                        if ext not in ("cubin", "json"):
                            self._remove_stray(Path(f.path))  # a write in progress (mkstemp's name), or a dead one's
                            continue
                        with contextlib.suppress(FileNotFoundError):
                            st = f.stat()
                            entry = found.setdefault(key, CacheEntry(key, 0, 0.0))
                            entry.bytes += st.st_size
                            if ext == "cubin":
                                entry.used = st.st_mtime
        return sorted(found.values(), key=lambda e: e.used)

    def prune(self, max_bytes: int, slack: float = 0.0) -> PruneReport:
        """Remove the least recently used entries until the cache holds at most ``max_bytes`` (0: all of them).
        With ``slack``, a cache over its limit is cut to ``(1 - slack) * max_bytes``, so the next writes do not
        each prune again. Another process may prune or write at the same time: a missing file is no error."""
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        report = PruneReport(len(entries), total, 0, 0)
        if total <= max_bytes:
            return report
        target = max_bytes * (1.0 - slack)
        for entry in entries:
            if total <= target:
                break
            try:
                for path in self._paths(entry.key):
                    _remove(path)
            except OSError as exc:  # a read-only cache: reported, never raised out of a compile's write
                report.kept += 1
                report.error = report.error or str(exc)
                continue
            total -= entry.bytes
            report.removed += 1
            report.freed_bytes += entry.bytes
        log.info(
            "compile cache at %s: %d of %d entries removed (%.1f MB freed, least recently used first)",
            self.cache_dir,
            report.removed,
            report.entries,
            report.freed_bytes / MB,
        )
        return report

    @staticmethod
    def _remove_stray(path: Path) -> None:
        """Removes a write's temporary file left by a writer that died (killed between writing and renaming)."""
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > STRAY_WRITE_AGE_S:
                _remove(path)


def _remove(path: Path) -> None:
    """Removes a cache file, or a folder where one should be (which made every prune raise IsADirectoryError). A
    file already gone (another process pruning) is no error; any other OSError is raised."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path)
