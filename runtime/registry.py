"""KernelRegistry: which kernel runs each (op, shape, dtype, arch, attrs) problem of the runtime.

Resolution, once per problem (then kept in memory):

1. the local kernel cache, ``<settings.cache_dir>/served/``: kernels fetched from a service before, so a machine
   that once reached the service works offline; one JSON record per problem holds the kernel and its cubin, written
   whole by one rename, so a crash leaves the old record or the new one (an earlier version's record, its cubin in a
   file beside it, is still read);
2. the service's ``GET /api/kernels/best`` over httpx (``server`` argument or ``KERNELMILL_SERVER``; an answer must
   arrive whole within ``timeout_s``, 2 s; a service that cannot be reached, is too slow, fails (5xx) or is not
   kernelmill (a page that is not JSON, a 404 that is not kernelmill's "nothing tuned": ``kernelmill_answer``) is logged
   once and not asked again, and an unusable answer (another error status, a kernel that is not for the problem asked)
   is a WARNING once per kind, then DEBUG, its body cut to 200 characters). Where a service is configured it is asked
   even when the local cache holds the problem's kernel, so that a kernel tuned since replaces the cached one: the
   cached cubin is used when the service still serves that kernel (no download; the same server, id, family, params and
   code, ``served_digest``: ids are per database, and a problem's better kernel is re-published under its id), the
   service's kernel when it serves another for the exact shape, and the cached one when the service cannot be reached or
   has nothing better than a nearest shape. An answer is checked against the question: another op, dtype or arch than
   asked is an unusable answer, and a kernel is tuned for the problem (no first-use check) only where the answer's shape
   is the problem's, whatever its ``exact`` says. A kernel tuned for a
   *nearest* shape is used only when its family's ``check_shape`` accepts the actual shape; its launches
   are rebuilt for the actual shape from the family and params (the cubin takes shapes as arguments).
   A served or cached kernel whose code differs from what this version's template makes of its family and
   params (tuned with another version) is compiled again from them, so template improvements reach tuned
   kernels without a re-tune, and is not used where this version's code does not render or compile (its cubin
   does not match the launches this version builds); where that code is not known, a cubin that lacks an entry
   those launches name (built before its family's launches changed) is not used;
3. the op's default: a family chosen by dtype and shape, its default parameters (GEMM tiles sized to the
   problem), compiled with nvcc on first use (the compile cache keeps the cubin); ``prepare`` compiles the
   defaults of a forward's problems together before it runs.

Each problem is logged once with the source it got; ``report()`` lists them all (source ``tuned``,
``nearest`` or ``default``, the speedup the service recorded).

A default can be replaced where it runs: ``alternatives`` compiles its runners-up for ``Model`` to time at
capture, ``put`` swaps one in, and ``remember_choice`` records the outcome per GPU model under
``<cache_dir>/chosen/``, which a later capture on the same GPU model takes (``remembered_choice``) without
timing again.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelmill.kernels.compile import CompileError, Compiler, cubin_entries, normalize_arch
from kernelmill.kernels.defaults import DEFAULT_SM_COUNT, default_alternatives, default_params, default_rank
from kernelmill.kernels.device import DeviceFault
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import Family, Launch, SpecError, format_shape
from kernelmill.kernels.render import CODE_HEADER, RenderError, code_digest, render
from kernelmill.runtime.check import Check, FirstUseChecks, NoVerifiedKernel, gpu_folder, write_atomically
from kernelmill.settings import default_server, get_settings

log = logging.getLogger(__name__)

TUNED, NEAREST, DEFAULT = "tuned", "nearest", "default"


def attrs_key(attrs: Mapping[str, Any]) -> str:
    return json.dumps({k: attrs[k] for k in sorted(attrs)}, sort_keys=True, default=str)


def _file_stem(shape, dtype: str, arch: str, attrs: Mapping[str, Any]) -> str:
    """A problem's file name in the kernel cache, without suffix: shape, dtype, arch and a digest of its attrs."""
    digest = hashlib.sha256(attrs_key(attrs).encode()).hexdigest()[:12]
    return f"{format_shape(shape)}-{dtype}-{arch}-{digest}"


def _same_attrs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return {k: str(v) for k, v in a.items()} == {k: str(v) for k, v in b.items()}


@dataclass
class KernelEntry:
    """The kernel chosen for one problem, and (once bound) its loaded entries and workspace."""

    op: str
    shape: tuple[int, ...]
    dtype: str
    attrs: dict[str, Any]
    arch: str
    family: str
    params: dict[str, Any]
    source: str  # tuned | nearest | default
    cubin: bytes
    cubin_key: str
    launches: list[Launch]
    workspace: dict[str, int]
    served_shape: tuple[int, ...] | None = None
    kernel_id: int | None = None
    speedup: float | None = None
    median_ms: float | None = None
    #: The GPU model its ``median_ms`` was timed on, where the service said (times of two models do not compare).
    device_name: str | None = None
    note: str = ""
    #: Digest of the code its cubin was built from (``code_digest``), where known.
    code: str | None = None
    #: Its cubin was compiled here from this version's template, not the one it was tuned with.
    rebuilt: bool = False
    #: Digest of the service's answer it came from (``served_digest``): a cached copy is the service's kernel
    #: only where the digests match, not where the ids do (another server's, or a kernel re-published under its id).
    served: str | None = None
    #: Picked over the shape default by timing the forward on this GPU (``Model.tune_kernels``).
    chosen: bool = False
    #: Its first-use check on this GPU (runtime/check.py), where it had one: no tuning job verified it at its shape.
    checked: Check | None = None
    #: Its kernels wait for the previous grid (Family.pdl): a graph may launch them early.
    pdl: bool = False
    #: Tensors its kernels read before that wait (Family.pdl_early_reads): early only where they are constants.
    early_reads: tuple[str, ...] = ()
    #: Workspaces of arrival counts (Family.counter_workspaces): zeroed when allocated, left zero by the kernels.
    counters: tuple[str, ...] = ()
    calls: int = 0
    _bound: list[tuple[Any, Launch]] | None = field(default=None, repr=False)
    _ws: dict[str, Any] = field(default_factory=dict, repr=False)

    def bind(self, backend) -> None:
        """Loads the cubin on the backend's device and allocates the workspaces (once)."""
        if self._bound is not None:
            return
        module = backend.device.load(self.cubin, self.cubin_key)
        self._ws = {name: backend.alloc(nbytes, persistent=True) for name, nbytes in self.workspace.items()}
        for name in self.counters:  # zeroed once; the kernels leave their arrival counts zero
            backend.fill(self._ws[name].ptr, 0, self._ws[name].nbytes)
        self._bound = [(module.kernel(launch.entry), launch) for launch in self.launches]

    def run(self, backend, pointers: Mapping[str, int]) -> None:
        """Enqueues the launches on the backend's stream; ``pointers`` maps the op's tensor names to addresses."""
        from kernelmill.kernels.device import Buffer

        self.bind(backend)
        buffers = {name: Buffer(ptr, 0) for name, ptr in pointers.items()}
        buffers.update(self._ws)
        # A kernel that reads some tensors before its PDL wait may launch early only if no kernel writes them.
        pdl = self.pdl and all(backend.is_constant(pointers[name]) for name in self.early_reads)
        for kernel, launch in self._bound:
            args = [buffers[a] if isinstance(a, str) else a for a in launch.args]
            backend.before_launch(pdl, self)
            kernel.launch(launch.grid, launch.block, launch.smem_bytes, args, backend.stream)
            backend.after_launch(kernel, args)
        self.calls += 1

    def row(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "shape": format_shape(self.shape),
            "dtype": self.dtype,
            "attrs": dict(self.attrs),
            "family": self.family,
            "params": dict(self.params),
            "source": self.source,
            "served_shape": format_shape(self.served_shape) if self.served_shape else None,
            "kernel_id": self.kernel_id,
            "speedup": self.speedup,
            "calls": self.calls,
            "checked": self.verified_by(),
            "note": self.note,
        }

    def verified_by(self) -> str | None:
        """Who verified this kernel at its shape: "tuning job" (a tuned kernel, as served), its first-use check
        ("here 0.31": passed on this GPU, the largest share of its error allowance an element used; "recorded
        0.31": by an earlier process on this GPU model), or None (not checked: no GPU, or checks off)."""
        if self.source == TUNED and not self.rebuilt:
            return "tuning job"
        return self.checked.describe() if self.checked is not None else None


def checked_server_url(url: str) -> str:
    """``url`` without a trailing slash where it is an http(s) URL with a host; ValueError says what is wrong
    otherwise (a bare ``host:port`` reads as a scheme, a broken port or bracket does not parse)."""
    import httpx

    hint = "give it as http://HOST:PORT, e.g. http://127.0.0.1:8000"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"malformed server URL {url!r} ({exc}): {hint}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"malformed server URL {url!r}: {hint}")
    if parsed.port is not None and not 0 < parsed.port < 65536:  # httpx takes 99999, then cannot connect
        raise ValueError(f"malformed server URL {url!r}: port {parsed.port} is out of range 1..65535; {hint}")
    return url.rstrip("/")


def named_server(server: str | None) -> str:
    """The service's URL: ``server``, else KERNELMILL_SERVER, else "" (none); checked, and a malformed one a
    ValueError naming where it came from."""
    url = server if server is not None else default_server() or ""
    if not url:
        return ""
    try:
        return checked_server_url(url)
    except ValueError as exc:
        raise ValueError(f"{'server=' if server is not None else 'KERNELMILL_SERVER'}: {exc}") from None


def served_digest(server: str, served: Mapping[str, Any]) -> str:
    """What makes a served kernel the one a local cache entry holds: the service it came from and the answer's id,
    shape, arch, family, params and code (the service re-publishes a problem's better kernel under its id)."""
    fields = [server] + [served.get(name) for name in ("id", "shape", "arch", "family", "params", "source")]
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _missing_entries(entry: KernelEntry) -> str | None:
    """Why a served or cached cubin cannot run the launches this version builds for its family: the entries
    it lacks (it was built before the family's launches changed), or None."""
    held = cubin_entries(entry.cubin)
    if held is None:  # not an ELF: nothing to look up here (loading it is what fails)
        return None
    missing = sorted({launch.entry for launch in entry.launches} - held)
    if not missing:
        return None
    return f"its cubin has no {', '.join(missing)} (built before this version's launches of {entry.family})"


def _close(tuned: Sequence[int], wanted: Sequence[int]) -> bool:
    """Every dimension within a factor of two."""
    return all(max(a, 1) <= 2 * max(b, 1) and max(b, 1) <= 2 * max(a, 1) for a, b in zip(tuned, wanted, strict=True))


class KernelRegistry:
    """Kernels for the runtime's problems: local cache, then the service, then compiled defaults.

    ``backend`` (a runtime Backend) binds kernels to a GPU; without one (no GPU here) the registry still
    resolves and compiles, which is what tests and ``tune_model`` on a CPU machine need. ``client`` may
    be any httpx.Client-like object (tests pass FastAPI's TestClient)."""

    def __init__(
        self,
        server: str | None = None,
        *,
        arch: str | None = None,
        backend: Any = None,
        cache_dir: Path | str | None = None,
        timeout_s: float = 2.0,
        compiler: Compiler | None = None,
        client: Any = None,
        allow_tf32: bool = False,
        use_service: bool = True,
        use_local_cache: bool = True,
        check: bool | None = None,
    ) -> None:
        self.server = named_server(server)
        self.backend = backend
        if arch is None:
            arch = backend.arch if backend is not None else None
        self.arch = normalize_arch(arch) if arch else None
        root = Path(cache_dir) if cache_dir else Path(get_settings().cache_dir)
        self.served_dir = root / "served"
        self.chosen_dir = root / "chosen"
        self.checked_dir = root / "verified"
        #: Verify kernels at their shape before their first launch where no tuning job did (runtime/check.py).
        self.check = get_settings().runtime_check if check is None else check
        self._checks: FirstUseChecks | None = None
        self.compiler = compiler or Compiler(cache_dir=root if cache_dir else None)
        self.timeout_s = timeout_s
        self.allow_tf32 = allow_tf32
        self.use_service = use_service
        self.use_local_cache = use_local_cache
        self._client = client
        self._offline_reason: str | None = None
        self._answers_logged: set[str] = set()  # kinds of unusable answers logged at WARNING (then at DEBUG)
        self._no_device_query = False  # the service refused device= (it predates it)
        self._entries: dict[tuple, KernelEntry] = {}
        # Problems find() met with nothing tuned (or a kernel that failed its check): that lookup, its kernel and notes,
        # which get() then takes instead of asking the service again.
        self._untuned: dict[tuple, tuple[KernelEntry | None, list[str]]] = {}
        self._lock = threading.RLock()

    # -- public ----------------------------------------------------------------------

    @property
    def target_arch(self) -> str:
        if self.arch is None:
            from kernelmill.kernels.arch import default_arch

            self.arch = normalize_arch(default_arch())
        return self.arch

    def get(self, op: str, shape: tuple[int, ...], dtype: str, attrs: Mapping[str, Any] | None = None) -> KernelEntry:
        """The kernel for this problem (resolved on first use, then cached)."""
        spec, shape, attrs, key = self._problem(op, shape, dtype, attrs)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._resolve(spec, shape, dtype, attrs, key)
                self._entries[key] = entry
                self._log(entry)
            return entry

    def prepare(self, problems: Sequence[tuple]) -> None:
        """Resolves the (op, shape, dtype, attrs) ``problems`` not resolved yet, as ``get`` would one by one,
        but compiles the defaults among them together (``Compiler.compile_many``): a model's first forward then
        waits for one round of nvcc instead of one compile per op. A problem that fails here fails again, with
        its own error, where ``get`` meets it."""
        wanted = {}
        with self._lock:
            for op, shape, dtype, attrs in problems:
                spec, shape, attrs, key = self._problem(op, shape, dtype, attrs)
                if key not in self._entries:
                    wanted.setdefault(key, (spec, shape, dtype, attrs))
        by_arch: dict[str, set[str]] = {}
        for spec, shape, dtype, attrs in wanted.values():
            if self.find(spec.name, shape, dtype, attrs) is not None:  # tuned or nearest: no default to compile
                continue
            try:
                fam, params = self.default_choice(spec, shape, dtype, attrs)
                by_arch.setdefault(self.target_arch + fam.arch_suffix, set()).add(render(fam, params, dtype, attrs))
            except (SpecError, RenderError):
                continue
        start = time.perf_counter()
        compiled = self._compile_together(by_arch)
        if compiled:
            log.info("runtime: %d default kernels compiled together in %.1f s", compiled, time.perf_counter() - start)
        for spec, shape, dtype, attrs in wanted.values():
            try:
                self.get(spec.name, shape, dtype, attrs)
            except Exception as exc:  # noqa: BLE001 - the forward meets it again and raises it there
                log.debug("runtime: preparing %s %s: %s", spec.name, format_shape(shape), exc)

    def resolved(
        self, op: str, shape: tuple[int, ...], dtype: str, attrs: Mapping[str, Any] | None = None
    ) -> KernelEntry | None:
        """The kernel this problem already got, or None (never resolves: a fused op's problem that ran as its
        parts has none)."""
        *_, key = self._problem(op, shape, dtype, attrs)
        with self._lock:
            return self._entries.get(key)

    def report(self) -> list[dict[str, Any]]:
        """One row per problem met: op, shape, family, params, source, speedup, calls."""
        with self._lock:
            return [e.row() for e in self._entries.values()]

    def entries(self) -> list[KernelEntry]:
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._untuned.clear()

    def find(self, op: str, shape: tuple[int, ...], dtype: str, attrs: Mapping[str, Any] | None = None):
        """The tuned (or nearest) kernel the local cache or the service has for this problem, or None;
        never compiles a default (ops use it to choose between a fused kernel and its parts)."""
        spec, shape, attrs, key = self._problem(op, shape, dtype, attrs)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry if entry.source != DEFAULT else None
            if key in self._untuned:
                return None
            notes: list[str] = []
            entry = self._lookup(spec, shape, dtype, attrs, notes)
            if entry is None or not self._passes(entry):
                self._untuned[key] = (entry, notes)
                return None
            self._entries[key] = entry
            self._log(entry)
            return entry

    # -- resolution --------------------------------------------------------------------

    def _problem(self, op: str, shape, dtype: str, attrs: Mapping[str, Any] | None):
        """(spec, shape, resolved attrs, cache key) of one problem."""
        spec = get_op(op)
        attrs = spec.resolve_attrs(attrs or {})
        shape = tuple(int(v) for v in shape)
        return spec, shape, attrs, (op, shape, dtype, self.target_arch, attrs_key(attrs))

    def _lookup(self, spec, shape, dtype, attrs, notes: list[str]) -> KernelEntry | None:
        """The service's kernel for the exact shape (the cached copy where it is the same kernel), else the
        local cache's exact one, else the service's nearest, else the cache's nearest."""
        cached = self._from_local(spec, shape, dtype, attrs, notes) if self.use_local_cache else None
        served = self._from_service(spec, shape, dtype, attrs, notes, cached)
        if cached is not None and cached.source == TUNED and (served is None or served.source != TUNED):
            return cached
        return served or cached

    def _resolve(self, spec, shape, dtype, attrs, key) -> KernelEntry:
        notes: list[str] = []
        if key in self._untuned:  # find() looked it up (prepare() does, for each problem): not asked twice
            entry, seen = self._untuned[key]
            notes.extend(seen)
            passed = False
        else:
            entry = self._lookup(spec, shape, dtype, attrs, notes)
            passed = entry is not None and self._passes(entry)
        if passed:
            return entry
        if entry is not None:
            failed = "does not load" if entry.checked.status == "unloadable" else "failed its first-use check"
            notes.append(f"{entry.source} kernel #{entry.kernel_id} {entry.family} {failed}")
        entry = self._default(spec, shape, dtype, attrs, notes)
        entry.note = "; ".join(notes)
        return entry

    def _passes(self, entry: KernelEntry) -> bool:
        """Whether ``entry`` may run: verified on this GPU at its shape before its first launch where no tuning
        job verified it there (nearest, default, rebuilt; ``FirstUseChecks``). Without a GPU, with checks off, or
        met inside a graph capture (which nothing may synchronize) it runs unchecked, the last with a warning.
        Raises KernelCheckFault where the check's fault lost the CUDA context."""
        if self.backend is None:
            return True
        if not self.check or entry.verified_by() == "tuning job":
            return self._loads(entry)  # not checked: but a cubin the driver refuses must not reach the forward
        if self.backend.capturing_graph:
            log.warning(
                "runtime: %s %s: %s kernel first met inside a CUDA graph capture: not checked",
                entry.op,
                format_shape(entry.shape),
                entry.source,
            )
            return True
        if self._checks is None:
            settings = get_settings()
            device = self.backend.device
            self._checks = FirstUseChecks(device, self.checked_dir, settings.verify_seeds, settings.kernel_timeout_s)
        entry.checked = self._checks.check(entry)
        if not entry.checked.ok:
            knobs = " ".join(f"{k}={v}" for k, v in entry.params.items())
            log.warning(
                "runtime: %s %s %s: %s kernel %s %s not used: it failed its first-use check (%s)",
                entry.op,
                format_shape(entry.shape),
                entry.dtype,
                entry.source,
                entry.family,
                knobs,
                entry.checked.reason,
            )
        return entry.checked.ok

    def _loads(self, entry: KernelEntry) -> bool:
        """Whether the driver loads ``entry``'s cubin (kept loaded by its key for the launches to come): a
        damaged or foreign one served, or left in the local cache, gives way to the next kernel."""
        try:
            self.backend.device.load(entry.cubin, entry.cubin_key)
        except DeviceFault as exc:
            if exc.poisoned:
                raise
            entry.checked = Check(False, f"not loadable: {exc}", status="unloadable")
            what = f"{entry.op} {format_shape(entry.shape)} {entry.dtype}"
            log.warning("runtime: %s: %s kernel #%s not used: its cubin does not load (%s)", what, entry.source,
                        entry.kernel_id, exc)  # fmt: skip
            return False
        return True

    def _log(self, entry: KernelEntry) -> None:
        what = f"{entry.op} {format_shape(entry.shape)} {entry.dtype}"
        if entry.attrs:
            what += " " + " ".join(f"{k}={v}" for k, v in sorted(entry.attrs.items()))
        knobs = " ".join(f"{k}={v}" for k, v in entry.params.items())
        if entry.checked is not None:
            knobs += f", {entry.checked.sentence()}"
        if entry.source == DEFAULT:
            why = f" ({entry.note})" if entry.note else ""
            log.info("runtime: %s: default %s %s%s", what, entry.family, knobs, why)
        else:
            speed = f", {entry.speedup:.2f}x over PyTorch" if entry.speedup else ""
            near = f" tuned at {format_shape(entry.served_shape)}" if entry.source == NEAREST else ""
            rebuilt = ", rebuilt from this version's template" if entry.rebuilt else ""
            log.info(
                "runtime: %s: %s kernel #%s%s (%s %s%s)%s",
                what,
                entry.source,
                entry.kernel_id,
                near,
                entry.family,
                knobs,
                speed,
                rebuilt,
            )

    def _family_ok(self, fam: Family, dtype: str) -> str | None:
        """Why this family's precision is not acceptable for ``dtype`` (TF32 for float32), or None."""
        precision = fam.precision(dtype)
        if precision != dtype and not (self.allow_tf32 and precision == "tf32"):
            return f"family {fam.name} computes {dtype} as {precision} (allow_tf32=False)"
        return None

    def _build(
        self,
        spec,
        shape,
        dtype,
        attrs,
        family: str,
        params: Mapping[str, Any],
        source: str,
        cubin: bytes,
        cubin_key: str,
        arch: str | None = None,
        **extra: Any,
    ) -> KernelEntry:
        fam = spec.family(family)
        workspace = fam.workspace(shape, params, dtype)
        return KernelEntry(
            op=spec.name,
            shape=shape,
            dtype=dtype,
            attrs=dict(attrs),
            arch=arch or self.target_arch,
            family=family,
            params=dict(params),
            source=source,
            cubin=cubin,
            cubin_key=cubin_key,
            launches=fam.launches(shape, params, dtype),
            workspace=workspace,
            counters=tuple(name for name in fam.counter_workspaces if name in workspace),
            pdl=fam.pdl,
            early_reads=fam.pdl_early_reads,
            **extra,
        )

    def _usable(
        self, spec, shape, dtype, attrs, family: str, params: Mapping[str, Any], served_attrs
    ) -> tuple[dict[str, Any], None] | tuple[None, str]:
        """A served (family, params) resolved for this version (a parameter the kernel predates takes its
        default), or why it cannot run this problem here: ``(params, None)`` or ``(None, reason)``."""
        try:
            fam = spec.family(family)
            resolved = fam.resolve(params, dtype)
            # Attributes this version does not know or allow (another version's op): not this problem's kernel.
            served_resolved = spec.resolve_attrs(served_attrs or {})
        except SpecError as exc:
            return None, f"served kernel is not valid in this version: {exc}"
        # Each served value must resolve to itself; a parameter the served kernel predates takes this version's
        # default, which keeps the kernel it was (new parameters default to the old behaviour).
        if any(resolved[name] != value for name, value in params.items()):
            return None, "served parameters differ from this version's family"
        if not _same_attrs(served_resolved, attrs):
            return None, f"served kernel has attrs {served_attrs}, this problem needs {attrs}"
        reason = self._family_ok(fam, dtype) or fam.check_shape(shape, resolved, dtype)
        return (None, reason) if reason else (resolved, None)

    # local cache of served kernels -----------------------------------------------------

    def _precisions(self, spec, dtype: str) -> list[str]:
        """The precisions this registry takes kernels of for ``dtype``: the dtype itself, and tf32 for float32
        where ``allow_tf32`` and some family of the op computes it so."""
        tf32 = self.allow_tf32 and any(
            dtype in f.dtypes and f.precision(dtype) == "tf32" for f in spec.families.values()
        )
        return [dtype, "tf32"] if tf32 else [dtype]

    def _local_paths(self, op: str, shape, dtype: str, attrs, precision: str | None = None) -> tuple[Path, Path]:
        stem = _file_stem(shape, dtype, self.target_arch, attrs)
        if precision and precision != dtype:  # a TF32 kernel never takes the IEEE kernel's place
            stem += f"-{precision}"
        folder = self.served_dir / op
        return folder / f"{stem}.json", folder / f"{stem}.cubin"

    def _from_local(self, spec, shape, dtype, attrs, notes) -> KernelEntry | None:
        """The local cache's kernel for the problem, of each precision this registry takes the fastest."""
        found = [self._from_local_in(spec, shape, dtype, attrs, notes, p) for p in self._precisions(spec, dtype)]
        found = [entry for entry in found if entry is not None]
        # As the service's answers are ranked: the kernel timed on this GPU model first, then the faster.
        mine = self._gpu_model()
        return min(found, key=lambda e: (bool(mine) and e.device_name != mine, e.median_ms or math.inf), default=None)

    def _gpu_model(self) -> str | None:
        """This GPU's model name (the one kernels were timed on), or None without a GPU backend."""
        return self.backend.device.info.name if self.backend is not None else None

    def _from_local_in(self, spec, shape, dtype, attrs, notes, precision: str) -> KernelEntry | None:
        meta_path, cubin_path = self._local_paths(spec.name, shape, dtype, attrs, precision)
        try:
            meta = json.loads(meta_path.read_text())
            wrong = _wrong_fields(meta, _CACHED_FIELDS) or _wrong_cached(meta, shape)
            if wrong:
                cubin = b""
            elif meta.get("cubin") is not None:  # one record: the entry and its cubin, written whole or not at all
                cubin = base64.b64decode(meta["cubin"], validate=True)
            else:  # an entry from before the record held its cubin, which lies beside it
                cubin = cubin_path.read_bytes()
        except (OSError, ValueError):
            return None
        digest = hashlib.sha256(cubin).hexdigest()
        if not wrong and meta.get("cubin_sha256", digest) != digest:  # entries from before the digest: no check
            wrong = f"{cubin_path.name} is not the cubin its entry was written with (sha256 differs)"
        if wrong:  # a cache: a damaged entry is passed over (and replaced when the service serves one)
            notes.append(f"local cache entry unusable: {wrong}")
            return None
        params, reason = self._usable(spec, shape, dtype, attrs, meta["family"], meta["params"], meta.get("attrs"))
        if reason:
            notes.append(f"local cache entry unusable: {reason}")
            return None
        entry = self._build(
            spec,
            shape,
            dtype,
            attrs,
            meta["family"],
            params,
            meta["source"],
            cubin,
            f"served-{digest}",
            arch=meta.get("arch"),
            served_shape=tuple(meta["served_shape"]),
            kernel_id=meta.get("kernel_id"),
            speedup=meta.get("speedup"),
            median_ms=meta.get("median_ms"),
            device_name=meta.get("device_name"),
            note="from the local cache",
            code=meta.get("code"),
            rebuilt=bool(meta.get("rebuilt")),
            served=meta.get("served"),
        )
        rebuilt, stale = self._with_current_code(entry)
        if stale:
            notes.append(f"local cache entry unusable: {stale}")
            return None
        if rebuilt:
            self._store_local(entry, meta.get("attrs"))
            return entry
        reason = _missing_entries(entry)
        if reason:
            notes.append(f"local cache entry unusable: {reason}")
            return None
        return entry

    def _with_current_code(self, entry: KernelEntry) -> tuple[bool, str | None]:
        """Compiles ``entry`` again from this version's template where the code its cubin was built from
        (``entry.code``) is known and differs: (whether it did, None), or (False, why its cubin must not run)
        where that code does not render or compile here. Such a cubin is not used: the launches this version
        builds for it (arguments, grid, shared memory) are for other code than it holds."""
        if entry.code is None:
            return False, None
        fam = get_op(entry.op).family(entry.family)
        try:
            source = render(fam, fam.resolve(entry.params, entry.dtype), entry.dtype, entry.attrs)
            code = code_digest(source)
            if code == entry.code:
                return False, None
            compiled = self.compiler.compile(source, self.target_arch + fam.arch_suffix)
        except (RenderError, CompileError) as exc:
            error = excerpt(str(exc), 200, quote=False)
            why = f"built from another template; this version's does not render or compile: {error}"
            log.warning("runtime: %s %s: %s kernel #%s not used: %s", entry.op, format_shape(entry.shape),
                        entry.source, entry.kernel_id, why)  # fmt: skip
            return False, why
        entry.cubin, entry.cubin_key, entry.code, entry.rebuilt = compiled.cubin, compiled.key, code, True
        why = "rebuilt from this version's template (tuned with another)"
        entry.note = f"{entry.note}; {why}" if entry.note else why
        return True, None

    def _store_local(self, entry: KernelEntry, served_attrs) -> None:
        precision = get_op(entry.op).family(entry.family).precision(entry.dtype)
        meta_path, cubin_path = self._local_paths(entry.op, entry.shape, entry.dtype, entry.attrs, precision)
        meta = {
            "family": entry.family,
            "params": entry.params,
            "source": entry.source,
            "served_shape": list(entry.served_shape or entry.shape),
            "arch": entry.arch,
            "attrs": served_attrs,
            "kernel_id": entry.kernel_id,
            "speedup": entry.speedup,
            "median_ms": entry.median_ms,
            "device_name": entry.device_name,
            "server": self.server,
            "code": entry.code,
            "rebuilt": entry.rebuilt,
            "served": entry.served,
            "cubin_sha256": hashlib.sha256(entry.cubin).hexdigest(),
            # In the record itself: a crash between two files' writes left a cubin under another's entry.
            "cubin": base64.b64encode(entry.cubin).decode("ascii"),
        }
        try:
            write_atomically(meta_path, json.dumps(meta).encode())
        except OSError as exc:  # a read-only cache must not fail the forward pass
            log.warning("runtime: could not write the kernel cache at %s: %s", self.served_dir, exc)
            return
        with contextlib.suppress(OSError):  # an earlier version's cubin file, which the record now replaces
            cubin_path.unlink()

    # the service ----------------------------------------------------------------------

    def _http(self):
        if self._client is None:
            import httpx

            timeout = httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 1.0))
            self._client = httpx.Client(base_url=self.server, timeout=timeout)
        return self._client

    def _get(self, path: str, *, within: float | None = None, binary: bool = False, **params) -> Any:
        """GET on the service: kernelmill's answer (a ``binary`` one for a cubin), or None where the service cannot
        be reached, its answer does not arrive within ``within`` seconds in all (default ``timeout_s``: a server
        that trickles bytes; httpx's timeouts bound each read), it fails (5xx), or what answers is not kernelmill
        (``kernelmill_answer``): it is then asked nothing more (``_give_up``)."""
        import httpx

        try:
            resp = request_within(
                self._http(), "GET", path, self.timeout_s if within is None else within, params=params
            )
        except httpx.HTTPError as exc:
            self._give_up("unreachable", f"{type(exc).__name__}: {exc}")
            return None
        if resp.status_code >= 500:
            self._give_up(f"answered {resp.status_code}", excerpt(resp.text, 200))
            return None
        if not kernelmill_answer(resp, binary):
            self._give_up(f"answered {resp.status_code} not as kernelmill does", excerpt(resp.text, 200))
            return None
        return resp

    def _give_up(self, why: str, detail: str) -> None:
        """Asks the service nothing more for this registry's life, logged once: one that cannot be reached, is
        too slow, fails or is not kernelmill would cost every problem a wait for the same answer."""
        with self._lock:
            first = self._offline_reason is None
            if first:
                self._offline_reason = why
        if first:
            log.warning(
                "runtime: kernel service %s %s (%s); using the local cache and default kernels",
                self._service_name(),
                why,
                detail,
            )

    def _service_name(self) -> str:
        """The service's URL (that of a test's client where none was named)."""
        return self.server or str(getattr(self._client, "base_url", "the service"))

    def _log_answer(self, kind: str, message: str, *args: Any) -> None:
        """Logs an unusable answer from a reachable service: the first of each ``kind`` at WARNING, later ones
        (the other arch of the same lookup, the forward's other problems) at DEBUG."""
        with self._lock:
            first = kind not in self._answers_logged
            self._answers_logged.add(kind)
        if first:
            log.warning(message + " (more such answers from %s are logged at DEBUG)", *args, self._service_name())
        else:
            log.debug(message, *args)

    def _from_service(self, spec, shape, dtype, attrs, notes, cached: KernelEntry | None = None) -> KernelEntry | None:
        if not self.use_service or not (self.server or self._client is not None):
            return None
        if self._offline_reason:
            notes.append(f"service {self._offline_reason}")
            return None
        query: dict[str, Any] = {"op": spec.name, "shape": format_shape(shape), "dtype": dtype}
        if self.backend is not None and not self._no_device_query:  # the kernel tuned on this GPU model
            query["device"] = self.backend.device.info.name
        if attrs:  # all of the op's attributes, defaults included (attr=eps:1e-12): served for exactly these
            query["attr"] = [f"{name}:{value}" for name, value in sorted(attrs.items())]
        # Families built for the arch-specific target (sm_90a: wgmma) are served under that arch name.
        arches = [self.target_arch] + ([self.target_arch + "a"] if self.target_arch[-1].isdigit() else [])
        answers = []
        # A kernel of another precision (tf32) is served only when asked for by name; older services take
        # no precision, so the dtype's own is asked for without it.
        asks = [{"arch": arch} for arch in arches]
        asks += [{"arch": arch, "precision": p} for p in self._precisions(spec, dtype)[1:] for arch in arches]
        for ask in asks:
            resp = self._get("/api/kernels/best", **query, **ask)
            if resp is not None and resp.status_code == 422 and "device" in query and "'device'" in resp.text:
                # A service from before device= refuses unknown parameters: ask it as before, from now on.
                self._no_device_query = True
                query.pop("device")
                resp = self._get("/api/kernels/best", **query, **ask)
            if resp is None:
                notes.append(f"service {self._offline_reason}")
                return None
            if resp.status_code == 200:
                served, wrong = _record(resp, _SERVED_FIELDS)
                wrong = wrong or _wrong_rank(served, "shape", shape) or _wrong_problem(served, spec.name, dtype, ask)
                if wrong:
                    wrong = excerpt(wrong, 200, quote=False)
                    notes.append(f"service answered an unusable kernel ({wrong})")
                    what = f"{spec.name} {format_shape(shape)}"
                    self._log_answer("unusable", "runtime: %s: the service's answer is unusable: %s", what, wrong)
                else:  # tuned at this very shape, whatever the answer says: that skips the first-use check
                    answers.append({**served, "exact": served["shape"] == list(shape)})
            elif resp.status_code != 404:  # kernelmill's 404 (``_get``): nothing tuned
                notes.append(f"service answered {resp.status_code}")
                what, body = f"{spec.name} {format_shape(shape)}", excerpt(resp.text, 200)
                self._log_answer(
                    f"HTTP {resp.status_code}", "runtime: %s: service answered %s: %s", what, resp.status_code, body
                )
        if not answers:
            notes.append("no tuned kernel on the service")
            return None
        # Exact shapes first, then the kernel tuned on this GPU model (the service prefers it within an arch; the
        # arches' answers, sm_90 and sm_90a, may come from other models, whose times do not compare), then the faster.
        mine = self._gpu_model()
        answers.sort(
            key=lambda k: (
                not k.get("exact"),
                bool(mine) and k.get("device_name") != mine,
                k.get("median_ms") or math.inf,
            )
        )
        for served in answers:
            entry = self._use_served(spec, shape, dtype, attrs, served, notes, cached)
            if entry is not None:
                return entry
        return None

    def _use_served(
        self, spec, shape, dtype, attrs, served: dict[str, Any], notes: list[str], cached: KernelEntry | None = None
    ) -> KernelEntry | None:
        exact = bool(served.get("exact"))
        digest = served_digest(self._service_name(), served)
        if cached is not None and cached.served == digest and cached.source == (TUNED if exact else NEAREST):
            cached.note = "from the local cache; still the service's"
            return cached  # the kernel the cache holds: no download
        params, reason = self._usable(
            spec, shape, dtype, attrs, served["family"], served["params"], served.get("attrs")
        )
        if not reason and not exact and not _close(served["shape"], shape):
            # Tuned at a shape more than twice as large or small in some dimension, a kernel stands in only for a
            # problem of the same kind: not, say, a wgmma GEMM tuned at M = 256 for a batch-1 product, which the
            # gemv family serves (kernels/defaults.py).
            try:
                default_family = self.default_choice(spec, shape, dtype, attrs)[0].name
            except SpecError:  # no default runs this shape: the served kernel is all there is
                default_family = served["family"]
            if served["family"] != default_family:
                reason = f"family {served['family']}, where this shape's default family is {default_family}"
        if reason:
            where = "" if exact else f" (tuned at {format_shape(served['shape'])})"
            notes.append(f"served kernel #{served['id']}{where} not used: {reason}")
            return None
        # A cubin (up to a few MB) may take longer in all than a lookup; a stalled read still ends at timeout_s.
        cubin_resp = self._get(f"/api/kernels/{served['id']}/cubin", within=CUBIN_READS * self.timeout_s, binary=True)
        if cubin_resp is None or cubin_resp.status_code != 200:
            notes.append(f"cubin of kernel #{served['id']} not fetched")
            return None
        cubin = cubin_resp.content
        code = code_digest(served["source"]) if served.get("source") else None
        built_from = cubin_resp.headers.get(CODE_HEADER)  # absent from services older than the header
        if code and built_from and built_from != code:
            # Re-published under its id between the answer and this read: these bytes belong to another kernel.
            notes.append(f"cubin of kernel #{served['id']} not used: it changed on the service since its answer")
            return None
        entry = self._build(
            spec,
            shape,
            dtype,
            attrs,
            served["family"],
            params,
            TUNED if exact else NEAREST,
            cubin,
            f"served-{hashlib.sha256(cubin).hexdigest()}",
            arch=served["arch"],
            served_shape=tuple(served["shape"]),
            kernel_id=served["id"],
            speedup=served.get("speedup"),
            median_ms=served.get("median_ms"),
            device_name=served.get("device_name"),
            code=code,
            served=digest,
        )
        # Rebuilt, it is this version's code and launches: nothing of the served cubin's is left to check.
        rebuilt, stale = self._with_current_code(entry)
        if stale:
            notes.append(f"served kernel #{served['id']} not used: {stale}")
            return None
        if not rebuilt:
            missing = _missing_entries(entry)
            if missing:
                notes.append(f"served kernel #{served['id']} not used: {missing}")
                return None
            served_entries = [launch["entry"] for launch in served.get("launches", [])]
            if exact and served_entries and served_entries != [launch.entry for launch in entry.launches]:
                notes.append(f"served kernel #{served['id']} launches differ from this version's family")
                return None
        if self.use_local_cache:
            self._store_local(entry, served.get("attrs"))
        return entry

    # defaults ---------------------------------------------------------------------------

    def default_choice(self, spec, shape, dtype, attrs) -> tuple[Family, dict[str, Any]]:
        """The family and parameters a problem gets without a tuned kernel (SpecError where none can run it)."""
        return next(self.default_choices(spec, shape, dtype, attrs))

    def default_choices(self, spec, shape, dtype, attrs) -> Iterator[tuple[Family, dict[str, Any]]]:
        """Each family that can run the problem, best first (``default_rank``), with its default parameters;
        SpecError where none can."""
        # Arch-specific families (sm_90a: wgmma) only where the target is that arch.
        families = [
            f
            for f in spec.families.values()
            if dtype in f.dtypes and (not f.arch_suffix or self.target_arch == "sm_90")
        ]
        families.sort(key=lambda f: default_rank(f, shape, dtype))
        reasons, yielded = [], False
        for fam in families:
            why = self._family_ok(fam, dtype)
            if why:
                reasons.append(why)
                continue
            params = default_params(spec, fam, shape, dtype, self._sm_count())
            why = fam.check_shape(shape, params, dtype)
            if why is None:
                yielded = True
                yield fam, params
            else:
                reasons.append(f"{fam.name}: {why}")
        if not yielded:
            raise SpecError(f"no {spec.name} family can run {format_shape(shape)} {dtype}: {'; '.join(reasons)}")

    def alternatives(self, entry: KernelEntry, limit: int = 4) -> list[KernelEntry]:
        """Compiled stand-ins for a default kernel, to time against it where its problem runs (``Model``'s
        capture-time choice): up to ``limit`` other parameter sets of its family that the defaults rank next
        (``default_alternatives``), compiled in parallel. None for tuned or nearest kernels (a tuning job
        measured those) or for a stand-in already chosen."""
        options = self._alternative_params(entry, limit)
        if not options:
            return []
        log.info(
            "runtime: %s %s: compiling %d runners-up to time in place",
            entry.op,
            format_shape(entry.shape),
            len(options),
        )
        return self._stand_ins(entry, options)

    def _alternative_params(self, entry: KernelEntry, limit: int) -> list[dict[str, Any]]:
        if entry.source != DEFAULT or entry.chosen:
            return []
        spec = get_op(entry.op)
        fam = spec.family(entry.family)
        return [
            p
            for p in default_alternatives(spec, fam, entry.shape, entry.dtype, self._sm_count())
            if p != entry.params and fam.check_shape(entry.shape, p, entry.dtype) is None
        ][:limit]

    def compile_alternatives(self, entries: Sequence[KernelEntry], limit: int = 4) -> None:
        """Compiles the runners-up of all ``entries`` together (one round of nvcc, one process per core), so
        that ``alternatives`` then finds them compiled; failures are left for ``alternatives`` to report."""
        by_arch: dict[str, set[str]] = {}
        for entry in entries:
            fam = get_op(entry.op).family(entry.family)
            for params in self._alternative_params(entry, limit):
                by_arch.setdefault(entry.arch, set()).add(render(fam, params, entry.dtype, entry.attrs))
        self._compile_together(by_arch)

    def _compile_together(self, by_arch: Mapping[str, set[str]]) -> int:
        """Compiles each arch's sources in one ``compile_many`` round where there are several (the compile cache
        then holds them for ``compile``); how many it compiled. Failures are left to whoever compiles again."""
        batches = {arch: sorted(sources) for arch, sources in by_arch.items() if len(sources) > 1}
        for arch, sources in batches.items():
            self.compiler.compile_many(sources, arch)
        return sum(len(sources) for sources in batches.values())

    def stand_in(self, entry: KernelEntry, params: Mapping[str, Any]) -> KernelEntry | None:
        """``entry``'s problem compiled with ``params`` of its family (None where they do not compile)."""
        found = self._stand_ins(entry, [dict(params)])
        return found[0] if found else None

    def _stand_ins(self, entry: KernelEntry, options: list[dict[str, Any]]) -> list[KernelEntry]:
        spec = get_op(entry.op)
        fam = spec.family(entry.family)
        sources = [render(fam, p, entry.dtype, entry.attrs) for p in options]
        found = []
        for params, result in zip(options, self.compiler.compile_many(sources, entry.arch), strict=True):
            if isinstance(result, CompileError):
                log.info(
                    "runtime: %s %s: %s %s does not compile (%s)",
                    entry.op,
                    format_shape(entry.shape),
                    fam.name,
                    params,
                    result,
                )
                continue
            problem = (spec, entry.shape, entry.dtype, entry.attrs)
            stand_in = self._build(*problem, fam.name, params, DEFAULT, result.cubin, result.key, entry.arch)
            if self._passes(stand_in):
                found.append(stand_in)
        return found

    # choices made at capture on this GPU (Model.tune_kernels) ------------------------------

    def _device_dir(self) -> Path | None:
        """``<cache_dir>/chosen/<GPU name>``: GPUs of one arch disagree on the best tiles (an H100 and an H200),
        so a choice holds for the GPU model it was timed on."""
        if self.backend is None:
            return None
        return self.chosen_dir / gpu_folder(self.backend.device.info.name)

    def _choice_path(self, entry: KernelEntry) -> Path | None:
        """``<cache_dir>/chosen/<GPU name>/<op>/<shape>-<dtype>-<arch>-<attrs digest>.json``."""
        device = self._device_dir()
        if device is None:
            return None
        return device / entry.op / f"{_file_stem(entry.shape, entry.dtype, entry.arch, entry.attrs)}.json"

    def _edges_path(self, entries: Sequence[KernelEntry], problems: Sequence[tuple]) -> Path | None:
        """``<cache_dir>/chosen/<GPU name>/edges/<digest>.json``, the digest of a forward: its problems, and its
        PDL kernels (problem, family, params) in launch order."""
        device = self._device_dir()
        if device is None:
            return None
        kernels = [[e.op, e.shape, e.dtype, e.arch, attrs_key(e.attrs), e.family, e.params] for e in entries]
        forward = json.dumps([list(problems), kernels], sort_keys=True, default=str)
        return device / "edges" / f"{hashlib.sha256(forward.encode()).hexdigest()[:24]}.json"

    def remembered_edges(self, entries: Sequence[KernelEntry], problems: Sequence[tuple]) -> set[int] | None:
        """Indexes into ``entries`` (a captured forward's PDL kernels) of those that a capture of the same forward
        on this GPU model kept on plain edges because that replayed faster; None where it was not timed here."""
        path = self._edges_path(entries, problems)
        try:
            plain = json.loads(path.read_text())["plain"] if path is not None else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(plain, list) or not all(isinstance(i, int) and 0 <= i < len(entries) for i in plain):
            return None
        return set(plain)

    def remember_edges(self, entries: Sequence[KernelEntry], problems: Sequence[tuple], plain: set[int]) -> None:
        """Records which of a forward's PDL kernels (indexes into ``entries``) replayed faster on plain edges."""
        path = self._edges_path(entries, problems)
        if path is None:
            return
        names = [f"{e.op} {format_shape(e.shape)}" for e in entries]
        self._record(path, {"plain": sorted(plain), "kernels": names}, "a PDL edge choice")

    def _record(self, path: Path, record: dict[str, Any], what: str) -> None:
        """Writes a capture-time choice with the GPU it was timed on and when."""
        record = {**record, "device": self.backend.device.info.name}
        record["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            write_atomically(path, json.dumps(record).encode())
        except OSError as exc:  # a read-only cache must not fail the forward pass
            log.warning("runtime: could not record %s at %s: %s", what, self.chosen_dir, exc)

    def remembered_choice(self, entry: KernelEntry) -> dict[str, Any] | None:
        """The params a capture on this GPU model kept for ``entry``'s problem when it timed them against this
        same default (its family and params; a default that changed since is timed again), or None."""
        path = self._choice_path(entry)
        if path is None or entry.source != DEFAULT:
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if record.get("family") != entry.family or record.get("default") != entry.params:
            return None
        params = record.get("params")
        if not isinstance(params, dict):
            return None
        spec = get_op(entry.op)
        resolved, _ = self._usable(spec, entry.shape, entry.dtype, entry.attrs, entry.family, params, entry.attrs)
        return resolved

    def remember_choice(self, default: KernelEntry, kept: KernelEntry) -> None:
        """Records that a capture on this GPU timed ``default``'s runners-up and kept ``kept`` (maybe itself)."""
        path = self._choice_path(default)
        if path is None:
            return
        record = {"family": default.family, "default": default.params, "params": kept.params}
        self._record(path, record, "a kernel choice")

    def put(self, entry: KernelEntry) -> None:
        """Makes ``entry`` the kernel of its problem from now on (a stand-in ``alternatives`` compiled)."""
        _spec, _shape, _attrs, key = self._problem(entry.op, entry.shape, entry.dtype, entry.attrs)
        with self._lock:
            self._entries[key] = entry

    def _sm_count(self) -> int:
        if self.backend is not None:
            return self.backend.device.info.sm_count
        return DEFAULT_SM_COUNT

    def _default(self, spec, shape, dtype, attrs, notes: list[str]) -> KernelEntry:
        """The first default (``default_choices``) that compiles and passes its first-use check; the defaults
        that failed theirs are added to ``notes``. NoVerifiedKernel where every default failed."""
        failed = []
        for fam, params in self.default_choices(spec, shape, dtype, attrs):
            arch = self.target_arch + fam.arch_suffix
            compiled = self.compiler.compile(render(fam, params, dtype, attrs), arch)
            cubin, key = compiled.cubin, compiled.key
            entry = self._build(spec, shape, dtype, attrs, fam.name, params, DEFAULT, cubin, key, arch)
            if self._passes(entry):
                notes.extend(f"default {name} failed its first-use check" for name, _ in failed)
                return entry
            failed.append((fam.name, entry.checked.reason))
        raise NoVerifiedKernel(
            f"no kernel for {spec.name} {format_shape(shape)} {dtype} passed its first-use check on this GPU: "
            + "; ".join(f"{name}: {why}" for name, why in failed)
        )


#: The fields of a /api/kernels/best answer and of a local cache entry that the registry reads without a default,
#: and those it reads where present (None allowed).
_SERVED_FIELDS = {"id": int, "op": str, "dtype": str, "arch": str, "family": str, "params": dict, "shape": list}
_CACHED_FIELDS = {"family": str, "params": dict, "source": str, "served_shape": list}
_OPTIONAL_FIELDS = {
    "exact": bool, "attrs": dict, "arch": str, "speedup": (int, float), "median_ms": (int, float), "source": str,
    "launches": list, "kernel_id": int, "code": str, "served": str, "device_name": str, "cubin": str,
}  # fmt: skip


def _wrong_fields(record: Any, fields: dict[str, type]) -> str | None:
    """Why ``record`` (JSON from the service or the local cache) is not an object with ``fields`` of those types."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for name, kind in fields.items():
        value = record.get(name)
        if name not in record:
            return f"no {name}"
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} is {value!r}"
        if kind is list and not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value):
            return f"{name} is {value!r}"
    for name, kind in _OPTIONAL_FIELDS.items():
        value = record.get(name)
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            return f"{name} is {value!r}"
    launches = record.get("launches") or []
    if not all(isinstance(launch, dict) and isinstance(launch.get("entry"), str) for launch in launches):
        return f"launches is {launches!r}"
    return None


def _wrong_rank(record: dict[str, Any], name: str, shape: Sequence[int]) -> str | None:
    """Why ``record[name]``, a shape, cannot stand for a problem of ``shape``: another rank."""
    if len(record[name]) != len(shape):
        return f"{name} is {record[name]!r}, of rank {len(record[name])}, for a problem of rank {len(shape)}"
    return None


def _wrong_problem(served: dict[str, Any], op: str, dtype: str, ask: Mapping[str, str]) -> str | None:
    """Why a served kernel (fields checked) is not one for the problem asked about: another op, dtype or arch."""
    for name, asked in (("op", op), ("dtype", dtype), ("arch", ask["arch"])):
        if served[name] != asked:
            return f"{name} is {served[name]!r}, asked for {asked!r}"
    return None


def _wrong_cached(meta: dict[str, Any], shape: Sequence[int]) -> str | None:
    """Why a local cache entry (fields checked) cannot be trusted for ``shape``: a source other than the two a
    served kernel has (``tuned`` skips the first-use check), or a served shape of another rank."""
    if meta["source"] not in (TUNED, NEAREST):
        return f"source is {meta['source']!r}, not {TUNED!r} or {NEAREST!r}"
    return _wrong_rank(meta, "served_shape", shape)


#: A cubin download may take this many times ``timeout_s`` in all (each read still waits ``timeout_s`` at most).
CUBIN_READS = 10

#: Headers that describe how a body was sent, not what it is: dropped once it is read and decoded.
_TRANSFER_HEADERS = ("content-encoding", "content-length", "transfer-encoding")


def request_within(client: Any, method: str, path: str, within: float, **kwargs: Any) -> Any:
    """``client``'s answer to ``method path``, its whole body read within ``within`` seconds (httpx.ReadTimeout
    if not: httpx's own timeouts bound each read, so a server that sends a byte a second held a caller for
    ever). A client without ``stream`` (a test's stand-in) answers with its own timeouts."""
    import httpx

    deadline = time.monotonic() + within
    if not hasattr(client, "stream"):
        return getattr(client, method.lower())(path, **kwargs)
    with client.stream(method, path, **kwargs) as streamed:
        body = []
        for chunk in streamed.iter_bytes():
            body.append(chunk)
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"no whole answer to {path} within {within:g} s", request=streamed.request)
    # The body is decoded: the new response must not decode it again.
    headers = [(k, v) for k, v in streamed.headers.multi_items() if k.lower() not in _TRANSFER_HEADERS]
    return httpx.Response(streamed.status_code, headers=headers, content=b"".join(body), request=streamed.request)


def excerpt(text: str, limit: int = 80, quote: bool = True) -> str:
    """``text`` in one line for a message or a log line: whitespace runs as one space, quoted (``quote``), cut
    to ``limit`` characters with the whole length named (a service's error page can be long)."""
    flat = " ".join(text.split())
    cut = repr(flat[:limit]) if quote else flat[:limit]
    return cut if len(flat) <= limit else f"{cut}... ({len(flat)} characters)"


def answer_detail(resp: Any, limit: int = 80) -> str:
    """Why an HTTP answer refused a request, in one line: kernelmill's reason (the Problem body's ``detail``),
    else an excerpt of what answered (another server's HTML error page, a proxy's text)."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"]
    if not resp.text.strip():
        return "an empty answer"
    return f"not a kernelmill answer: {excerpt(resp.text, limit)}"


def kernelmill_answer(resp: Any, binary: bool = False) -> bool:
    """Whether an HTTP answer is one kernelmill gives: a 200's body JSON (or anything, ``binary``), an error's its
    Problem body (``{"detail": "no tuned kernel for ..."}``); not another server's page, a proxy's, nor FastAPI's
    ``{"detail": "Not Found"}`` for a route kernelmill lacks (a wrong port or path prefix), so that such a 404 is
    never read as "nothing tuned"."""
    if resp.status_code == 200 and binary:
        return True
    try:
        body = resp.json()
    except ValueError:
        return False
    if resp.status_code == 200:
        return True
    return isinstance(body, dict) and "detail" in body and body["detail"] != "Not Found"


def _record(resp: Any, fields: dict[str, type]) -> tuple[Any, str | None]:
    """(the JSON of ``resp``, or why it is unusable)."""
    try:
        record = resp.json()
    except ValueError:
        return None, f"not JSON: {excerpt(resp.text, 60)}"
    return record, _wrong_fields(record, fields)
