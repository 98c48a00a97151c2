"""A variant: (op, family, params, dtype, attrs) -> CUDA source -> cubin; and its device-bound runner."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from kernelmill.kernels.compile import CompiledKernel, Compiler, normalize_arch
from kernelmill.kernels.device import Buffer
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import Family, OpSpec, SpecError, format_shape, numpy_dtype
from kernelmill.kernels.render import render

if TYPE_CHECKING:
    from kernelmill.kernels.device import Device


@dataclass(frozen=True, eq=False)
class Variant:
    """One point of an op's search space, for one dtype."""

    op: OpSpec
    family: Family
    params: dict[str, Any]
    dtype: str
    attrs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        op: str | OpSpec,
        family: str,
        dtype: str,
        params: Mapping[str, Any] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> Variant:
        """Validated variant: defaults filled in, overrides coerced; SpecError on bad input."""
        spec = get_op(op) if isinstance(op, str) else op
        spec.check_dtype(dtype)
        fam = spec.family(family)
        return cls(spec, fam, fam.resolve(params or {}, dtype), dtype, spec.resolve_attrs(attrs or {}))

    @cached_property
    def source(self) -> str:
        return render(self.family, self.params, self.dtype, self.attrs)

    @property
    def precision(self) -> str:
        return self.family.precision(self.dtype)

    def compile(self, compiler: Compiler | None = None, arch: str | None = None) -> CompiledKernel:
        """The cubin for ``arch`` (default: this GPU's, else sm_90), with the family's suffix where it needs one."""
        if arch is None:
            from kernelmill.kernels.arch import default_arch

            arch = default_arch()
        return (compiler or Compiler()).compile(self.source, self.family.target(normalize_arch(arch), self.params))

    def check_shape(self, shape: tuple[int, ...]) -> str | None:
        return self.family.check_shape(shape, self.params, self.dtype)

    def describe(self) -> str:
        knobs = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.op.name}/{self.family.name} {self.dtype} {knobs}"


#: Bytes kept on either side of every buffer of a bound variant, filled with GUARD_BYTE: a launch that changes
#: them wrote out of bounds (a write past an output would otherwise land unseen in the pool's free memory).
#: A multiple of 1024, so the buffers keep the pool's alignment.
GUARD_BYTES = 1024
GUARD_BYTE = 0xA5


class BoundVariant:
    """A compiled variant with device buffers for one shape, ready to launch; every buffer has guard bytes on
    either side (``out_of_bounds`` says whether a launch wrote to them)."""

    def __init__(self, device: Device, variant: Variant, compiled: CompiledKernel, shape: tuple[int, ...]) -> None:
        reason = variant.check_shape(shape)
        if reason:
            raise SpecError(f"{variant.describe()} cannot run {format_shape(shape)}: {reason}")
        self.device = device
        self.variant = variant
        self.shape = shape
        op, fam = variant.op, variant.family
        self.tensor_shapes = op.tensor_shapes(shape)
        self.np_dtype = numpy_dtype(variant.dtype)
        item = self.np_dtype.itemsize
        self.buffers: dict[str, Buffer] = {}
        self._guarded: dict[str, Buffer] = {}  # each buffer with its guards (keeps the allocation alive)
        for name in (*op.inputs, *op.outputs):
            self.buffers[name] = self._alloc(name, math.prod(self.tensor_shapes[name]) * item)
        self.workspace_names = []
        for name, nbytes in fam.workspace(shape, variant.params, variant.dtype).items():
            self.buffers[name] = self._alloc(name, nbytes)
            if name in fam.counter_workspaces:
                device.fill(self.buffers[name], 0)  # once: the kernels leave their counts zero
            else:
                self.workspace_names.append(name)
        module = device.load(compiled.cubin, compiled.key)
        self.launches = fam.launches(shape, variant.params, variant.dtype)
        self._calls = []
        for launch in self.launches:
            args = [self.buffers[a] if isinstance(a, str) else a for a in launch.args]
            self._calls.append((module.kernel(launch.entry), launch, args))

    def _alloc(self, name: str, nbytes: int) -> Buffer:
        raw = self.device.alloc(nbytes + 2 * GUARD_BYTES)
        self.device.fill(raw, GUARD_BYTE)
        self._guarded[name] = raw
        return Buffer(raw.ptr + GUARD_BYTES, nbytes)

    def out_of_bounds(self) -> str | None:
        """Which buffer's guard bytes a launch changed, and where, or None (synchronizes with the device)."""
        for name, raw in self._guarded.items():
            inner = self.buffers[name].nbytes
            for side, offset in (("before", 0), ("after", GUARD_BYTES + inner)):
                guard = self.device.download(Buffer(raw.ptr + offset, GUARD_BYTES), (GUARD_BYTES,), np.uint8)
                changed = np.flatnonzero(guard != GUARD_BYTE)
                if changed.size:
                    farthest = GUARD_BYTES - int(changed[0]) if side == "before" else int(changed[-1]) + 1
                    return (
                        f"wrote out of bounds: {changed.size} of the {GUARD_BYTES} guard bytes {side} {name} changed, "
                        f"the farthest {farthest} bytes {side} it"
                    )
        return None

    def set_inputs(self, arrays: Mapping[str, np.ndarray]) -> None:
        for name in self.variant.op.inputs:
            self.device.copy_in(self.buffers[name], arrays[name].astype(self.np_dtype, copy=False))

    def inputs_changed(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """Which input a launch wrote to, and where, or None: ``arrays`` are what set_inputs copied in (bit for
        bit: a NaN written over a NaN input is no change, a -0 over a 0 is one)."""
        for name in self.variant.op.inputs:
            want = np.ascontiguousarray(arrays[name].astype(self.np_dtype, copy=False)).reshape(-1)
            got = self.device.download(self.buffers[name], self.tensor_shapes[name], self.np_dtype).reshape(-1)
            bits = np.dtype(f"u{self.np_dtype.itemsize}")
            changed = np.flatnonzero(got.view(bits) != want.view(bits))
            if changed.size:
                first = tuple(int(i) for i in np.unravel_index(int(changed[0]), self.tensor_shapes[name]))
                return (
                    f"wrote to its input {name}: {changed.size} of its {want.size} elements changed, the first at "
                    f"{first} ({float(want[changed[0]]):.6g} became {float(got[changed[0]]):.6g})"
                )
        return None

    def stray_write(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """The first write a launch made outside its outputs (a guard byte changed, then an input; ``arrays``
        are what set_inputs copied in), or None."""
        return self.out_of_bounds() or self.inputs_changed(arrays)

    def poison(self) -> None:
        """Fill outputs and workspaces with NaN so unwritten elements cannot pass (not the counters, which
        every launch must leave zero)."""
        for name in (*self.variant.op.outputs, *self.workspace_names):
            self.device.fill(self.buffers[name], 0xFF)

    def run(self, stream: Any = None) -> None:
        """Enqueue every launch of the variant."""
        for kernel, launch, args in self._calls:
            kernel.launch(launch.grid, launch.block, launch.smem_bytes, args, stream)

    def outputs(self) -> dict[str, np.ndarray]:
        return {
            name: self.device.download(self.buffers[name], self.tensor_shapes[name], self.np_dtype)
            for name in self.variant.op.outputs
        }
