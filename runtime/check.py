"""First-use checks: a kernel no tuning job verified at the shape it runs is verified there before it runs.

A tuning job verifies each kernel it serves against a float64 reference at the shape it was tuned for. The
runtime also runs kernels nobody verified at their shape: a kernel tuned for a *nearest* shape, a *default*
compiled from a template's default parameters, a tuned kernel *rebuilt* from this version's template, and the
runners-up a capture times in a default's place. Before such a kernel's first launch, ``FirstUseChecks``
verifies it on this GPU at the actual shape, the way a tuning job does (``kernels.verify``: fresh random
inputs of every kind the op draws, poisoned outputs, guard bytes, a per-element tolerance), then runs it
twice more without poisoning, as a forward runs it again and again (a bounded wait, then the same checks:
what a tuning job's timed repetitions would have caught), and the registry uses it only if it passes
(``runtime/registry.py``: a failed nearest kernel gives way to the default, a failed default to the next
family's).

Each outcome is recorded per GPU model under ``<cache_dir>/verified/<GPU name>/``, keyed by the cubin, its
launches and the problem, so a later process on the same GPU model does not check again. A kernel that
faulted is recorded before the error is raised: its CUDA context is gone, but the next process passes that
kernel over instead of faulting again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelmill.kernels.compile import CompiledKernel
from kernelmill.kernels.device import DeviceFault
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import format_shape
from kernelmill.kernels.variant import BoundVariant, Variant
from kernelmill.kernels.verify import ReferenceCache, compare, fresh_seeds, verify

log = logging.getLogger(__name__)


class NoVerifiedKernel(RuntimeError):
    """Every kernel the runtime could run for a problem failed its first-use check on this GPU."""


class KernelCheckFault(RuntimeError):
    """A kernel faulted while it was checked at first use, and the fault left the CUDA context unusable."""


@dataclass(frozen=True)
class Check:
    """The outcome of one first-use check."""

    ok: bool
    reason: str | None = None
    allowance_used: float | None = None  # the largest share of its per-element allowance an element used
    recorded: bool = False  # read back from an earlier check on this GPU model
    status: str = "ok"  # as VerifyResult.status: ok, wrong_result, fault, timeout; "unloadable": no module

    def describe(self) -> str:
        """A few words for the kernel report: where it was checked and how close it came to its tolerance."""
        where = "recorded" if self.recorded else "here"
        if not self.ok:
            return f"failed ({where})"
        used = f" {self.allowance_used:.2f}" if self.allowance_used is not None else ""
        return f"{where}{used}"

    def sentence(self) -> str:
        """The same for a log line, in words."""
        where = "by an earlier process on this GPU model" if self.recorded else "here"
        if not self.ok:
            return f"failed its first-use check ({where})"
        used = ""
        if self.allowance_used is not None:
            used = f", its worst element at {self.allowance_used:.2f} of its error allowance"
        return f"checked at first use {where}{used}"


def write_atomically(path: Path, data: bytes) -> None:
    """Writes ``data`` to a temporary file beside ``path``, flushes it to disk and renames it over ``path`` (readers
    never see half a file, even after a crash; another process writing the same path replaces it whole). Raises
    OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own for each write: one named after the process was shared by its threads writing one path.
    # (mkstemp's would be readable by its owner alone: the umask's mode is kept, as for the file it replaces.)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())  # on disk before the rename: a power loss leaves the old file or this one
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk left it behind for good
            os.unlink(tmp)
        raise


def gpu_folder(name: str) -> str:
    """A GPU model's name as a folder name (GPUs of one arch differ: an H100 and an H200)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def check_key(entry: Any) -> str:
    """What a check of ``entry`` (a registry KernelEntry) depends on: its cubin, the launches this version
    builds for it, and the problem."""
    launches = [[lx.entry, lx.grid, lx.block, lx.smem_bytes, [str(a) for a in lx.args]] for lx in entry.launches]
    problem = [entry.op, list(entry.shape), entry.dtype, entry.attrs, entry.family, entry.params, entry.workspace]
    digest = hashlib.sha256(entry.cubin)
    digest.update(json.dumps([problem, launches], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


class FirstUseChecks:
    """Verifies kernels on ``device`` (a kernels.device.Device) at their problem's shape, once per GPU model."""

    def __init__(self, device: Any, root: Path, seeds: int, timeout_s: float) -> None:
        self.device = device
        self.folder = Path(root) / gpu_folder(device.info.name)
        self.seeds = seeds
        self.timeout_s = timeout_s
        self._memo: dict[str, Check] = {}
        # Kernels checked for one problem (a default, its runners-up) share its seeds and float64 references:
        # fresh random ones, drawn once per problem and process.
        self._seeds: dict[tuple, list[int]] = {}
        self._references = ReferenceCache(max_bytes=1 << 30)

    def check(self, entry: Any) -> Check:
        """``entry``'s check: remembered, recorded by an earlier process on this GPU model, or run now.
        Raises KernelCheckFault (after recording the failure) where the kernel poisoned the context."""
        key = check_key(entry)
        if key in self._memo:
            return self._memo[key]
        path = self.folder / entry.op / f"{key}.json"
        found = self._read(path)
        if found is None and getattr(self.device, "poisoned", False):
            # Nothing can run, and a check now would fail whatever the kernel: record nothing.
            raise KernelCheckFault(
                f"{entry.op} {format_shape(entry.shape)} {entry.dtype}: not checked, the CUDA context was lost "
                "earlier in this process (a fault); start a new process"
            )
        if found is None:
            started = time.perf_counter()
            found, poisoned = self._run(entry)
            log.info(
                "runtime: %s %s %s: %s checked at first use in %.1f s: %s",
                entry.op,
                format_shape(entry.shape),
                entry.dtype,
                entry.family,
                time.perf_counter() - started,
                "passed" if found.ok else found.reason,
            )
            self._write(path, entry, found)
            if poisoned:
                still = (
                    " The kernel is still running, and the driver waits for it when the process ends: end it with "
                    "a signal (Ctrl-C does not reach it; kill does)."
                    if found.status == "timeout"
                    else ""
                )
                raise KernelCheckFault(
                    f"{entry.op} {format_shape(entry.shape)} {entry.dtype}: {entry.source} kernel {entry.family} "
                    f"faulted when checked at first use ({found.reason}); the CUDA context is lost, so this process "
                    f"can run no more kernels. The failure is recorded in {path}: the next process passes this "
                    f"kernel over.{still}"
                )
        self._memo[key] = found
        return found

    def _run(self, entry: Any) -> tuple[Check, bool]:
        spec = get_op(entry.op)
        variant = Variant(spec, spec.family(entry.family), dict(entry.params), entry.dtype, dict(entry.attrs))
        try:
            bound = BoundVariant(
                self.device, variant, CompiledKernel(entry.cubin, entry.arch, entry.cubin_key), entry.shape
            )
        except DeviceFault as exc:  # a cubin this driver cannot load: no launch was made
            return Check(False, f"not loadable: {exc.reason}", status="unloadable"), exc.poisoned
        problem = (entry.op, entry.shape, entry.dtype, json.dumps(entry.attrs, sort_keys=True, default=str))
        seeds = self._seeds.setdefault(problem, fresh_seeds(self.seeds, len(spec.input_kinds)))
        result = verify(self.device, bound, seeds=seeds, timeout_s=self.timeout_s, cache=self._references)
        check = Check(result.ok, result.reason, result.allowance_used, status=result.status)
        if not result.ok:
            return check, result.poisoned
        return self._run_again(bound, seeds[-1], check)

    def _run_again(self, bound: Any, seed: int, passed: Check) -> tuple[Check, bool]:
        """``passed`` where the kernel, run twice more on the last seed's inputs as a forward runs it again and
        again, still finishes within the timeout, writes nothing out of bounds or to its inputs and gives a
        right result each time; else why not. The first run finds its last output in place (a kernel that adds
        to it, or waits on it, fails only so); the second finds its outputs and workspaces poisoned and split-k
        arrival counts as the launches before left them (a kernel that writes nothing once launched enough fails
        only so: unpoisoned, the values of the launch before stood in for its output)."""
        variant, shape = bound.variant, bound.shape
        inputs, reference = self._references.get(variant.op, shape, variant.dtype, variant.attrs, seed)
        tolerance = variant.op.tolerance(shape, variant.precision)
        for poisoned in (False, True):
            try:
                if poisoned:
                    bound.poison()
                bound.run()
                self.device.synchronize(self.timeout_s)
                outputs, stray = bound.outputs(), bound.stray_write(inputs)
            except DeviceFault as exc:
                status = "timeout" if exc.timed_out else "fault"
                return Check(False, f"run again: {exc.reason}", status=status), exc.poisoned
            if stray:
                return Check(False, f"run again: {stray}", status="wrong_result"), False
            for name in variant.op.outputs:
                why = compare(outputs[name], reference[name], seed, name, tolerance).failure()
                if why:
                    return Check(False, f"wrong result when run again: {why}", status="wrong_result"), False
        return passed, False

    def _read(self, path: Path) -> Check | None:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("ok"), bool):
            return None
        used = record.get("allowance_used")
        used = float(used) if isinstance(used, int | float) and math.isfinite(used) else None
        reason = record.get("reason") if isinstance(record.get("reason"), str) else None
        status = record.get("status") if isinstance(record.get("status"), str) else ("ok" if record["ok"] else "?")
        return Check(record["ok"], reason, used, recorded=True, status=status)

    def _write(self, path: Path, entry: Any, check: Check) -> None:
        record = {
            "ok": check.ok,
            "status": check.status,
            "reason": check.reason,
            "allowance_used": check.allowance_used,
            "op": entry.op,
            "shape": list(entry.shape),
            "dtype": entry.dtype,
            "attrs": entry.attrs,
            "family": entry.family,
            "params": entry.params,
            "source": entry.source,
            "device": self.device.info.name,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        try:
            write_atomically(path, json.dumps(record, default=str).encode())
        except OSError as exc:  # a read-only cache must not fail the forward: the check runs again next time
            log.warning("runtime: could not record a first-use check at %s: %s", path, exc)
