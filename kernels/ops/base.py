"""What every op and every template family declares; nothing GPU-specific here.

An ``OpSpec`` says what an op computes (float64 reference, inputs, roofline
numbers); a ``Family`` says how one CUDA template computes it (parameter space,
constraints, launch geometry). Verification, timing and compilation live once
in ``kernelmill.kernels`` and work from these declarations alone.
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kernelmill.kernels.compile import base_arch, too_old

try:  # ml_dtypes gives NumPy a real bfloat16 (the JAX project's package)
    from ml_dtypes import bfloat16 as _np_bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a declared dependency
    _np_bfloat16 = None

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

#: CUDA C++ element type for each dtype name.
CTYPES: dict[str, str] = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}

#: Relative-norm tolerance by arithmetic precision (DESIGN.md, measurement rules).
TOLERANCES: dict[str, float] = {
    "float32": 1e-5,
    "tf32": 1e-3,
    "float16": 1e-2,
    "bfloat16": 1e-2,
}

#: Unit roundoff of each arithmetic precision: the largest relative error of one rounding to it. Every
#: family accumulates in float32, whose unit roundoff is the float32 entry.
UNIT_ROUNDOFF: dict[str, float] = {
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}


@dataclass(frozen=True)
class Tolerance:
    """What verification allows an output: a relative norm error, and per element

        |out - ref| <= rtol * |ref| + atol_rms * rms(ref)

    (plus the output format's smallest step near zero). The per-element bound is what catches a kernel that is
    right in norm but wrong in detail: small values flushed, 16-bit accumulation, a dropped term of a sum.
    """

    norm: float
    rtol: float
    atol_rms: float

    @classmethod
    def of(
        cls, precision: str, summed: int = 1, cancels: bool = True, layers: int = 1, intermediates: bool = True
    ) -> Tolerance:
        """The tolerance of an output computed at ``precision`` from ``summed`` terms an element, through
        ``layers`` that each round their output to the storage type.

        A correct kernel rounds its output (half an ulp, at most ``u`` relative), may round intermediates
        (a hidden layer, attention's probabilities: ``intermediates``) to the storage type, and sums in float32
        (an error growing like sqrt(summed) float32 ulps). Where terms of both signs are summed (``cancels``) an
        element can be far smaller than the errors of its terms, so those errors are judged against the
        output's rms: 8 units of roundoff of it where intermediates are rounded (or the inputs, as TF32 does),
        the roundings of chained layers adding up like a random walk, and 1 where only the output is (it is held
        to its own size by rtol). The factors leave correct kernels at most ~1/3 of the allowance in NumPy
        simulations (fp16, bf16, tf32 in both roundings, sequential fp32 sums to K = 16384, four MLP layers),
        and at most 0.45 in the GPU test suite on an H200 (bf16 attention; fp16's subnormals take 0.5, half a
        step; a correct kernel that rounds nothing inside needed at most 0.13 units of the rms there), while
        16-bit accumulation, a dropped term of the sum and flushed small probabilities exceed it
        (tests/unit/test_verify_compare.py, tests/gpu/test_families_gpu.py, docs/PERFORMANCE.md).
        """
        u = UNIT_ROUNDOFF[precision]
        accumulated = 8 * UNIT_ROUNDOFF["float32"] * math.sqrt(max(summed, 1))
        # float32 kernels use the MUFU's approximate exp and reciprocal (a few ulp, more for large arguments,
        # and attention's online softmax rescales its sums once a key tile): no bound under float32's 1e-5.
        floor = TOLERANCES["float32"]
        rtol = max(4 * u, floor) + accumulated
        rounded_inside = intermediates or precision == "tf32"  # TF32 rounds the inputs of every product
        steps = 8 * math.sqrt(layers) if rounded_inside else 1.0
        atol_rms = max(steps * u, floor) + accumulated if cancels else 0.0
        # The relative norm grows with the sum too, from K = 16384 on in float32: a correct sequential float32
        # sum of 262144 terms is off by 1.8e-5 of max|ref| (tests/unit/test_verify_compare.py), over 1e-5.
        norm = max(TOLERANCES[precision], 2 * UNIT_ROUNDOFF["float32"] * math.sqrt(max(summed, 1)))
        return cls(norm, rtol, atol_rms)


#: Limits of an sm_90 SM that families size their blocks against: shared memory one block may use (227 KiB,
#: opted in above the 48 KiB of static arrays) and the registers of the SM.
MAX_SMEM_BYTES = 227 * 1024
SM_REGS = 65536
#: The most threads and blocks an SM holds, and the most registers a thread may have.
SM_THREADS, SM_BLOCKS, MAX_THREAD_REGS = 2048, 32, 255
#: Kernels index their tensors with 32-bit element offsets: a tensor must hold fewer elements than this.
MAX_INDEXED_ELEMS = 2**31
#: Kernels take each shape dim as a 32-bit int, and their loops step past a dim's end before they test it (a
#: softmax pass of up to a million elements, a GEMM's k tile, a split's slice): the largest dim a shape may have
#: leaves 2^24 of room for that step (at 2^31 - 1 the step wrapped negative, and a row was read far before its
#: start, or a GEMM wrote zeros).
MAX_DIM = 2**31 - 2**24


class SpecError(ValueError):
    """Bad user input about an op: unknown name, malformed shape, invalid parameter."""


def numpy_dtype(dtype: str) -> np.dtype:
    """NumPy storage dtype for a kernelmill dtype name."""
    if dtype == "float32":
        return np.dtype(np.float32)
    if dtype == "float16":
        return np.dtype(np.float16)
    if dtype == "bfloat16":
        if _np_bfloat16 is None:  # pragma: no cover
            raise SpecError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        return np.dtype(_np_bfloat16)
    raise SpecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def itemsize(dtype: str) -> int:
    return numpy_dtype(dtype).itemsize


@dataclass(frozen=True)
class Param:
    """One template knob (or op attribute) and the values it may take."""

    name: str
    values: tuple[Any, ...]
    doc: str = ""

    def coerce(self, raw: Any, what: str = "parameter") -> Any:
        """Turn a CLI/JSON/query value into one of ``values`` or raise SpecError (about a ``what``: a template
        parameter, or an op attribute)."""
        number = _float_or_none(raw) if isinstance(raw, str) else None
        for value in self.values:
            if raw == value or str(raw).lower() == str(value).lower():
                return value
            if number is not None and isinstance(value, float) and number == value:  # "1e-5" is 1e-05
                return value
        allowed = ", ".join(str(v) for v in self.values)
        raise SpecError(f"{what} {self.name}={raw!r} is not allowed; choose one of {allowed}")


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class TensorMapArg(NamedTuple):
    """A TMA tensor map (CUtensorMap, 128 bytes by value) over the buffer named by another argument.

    ``of`` is the position, in the same launch's ``args``, of the buffer the map describes: a dense
    row-major tensor of ``dims`` elements (innermost first) of ``dtype``, read in boxes of ``box``
    elements with ``swizzle`` bytes of shared-memory swizzle (0, 32, 64 or 128) and zero fill out of
    bounds. A named tuple, so launches stay JSON-serialisable (as a list starting with "tensor_map").
    """

    kind: str
    of: int
    dims: tuple[int, ...]
    box: tuple[int, ...]
    dtype: str
    swizzle: int = 128


def tensor_map_arg(
    of: int, dims: tuple[int, ...], box: tuple[int, ...], dtype: str, swizzle: int = 128
) -> TensorMapArg:
    """A ``TensorMapArg`` (its ``kind`` filled in)."""
    return TensorMapArg("tensor_map", of, tuple(dims), tuple(box), dtype, swizzle)


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a variant.

    ``args`` names buffers (inputs, outputs or workspaces, passed as device
    pointers), gives int32 scalars, or is a ``TensorMapArg`` built from one of
    the buffer arguments, in the kernel's parameter order.
    """

    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int = 0
    args: tuple[str | int | TensorMapArg, ...] = ()

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Family(ABC):
    """One CUDA template for one op: its knobs, their constraints, its launches."""

    name: str
    template: str  # path under templates/, e.g. "softmax/warp_row.cu.j2"
    params: tuple[Param, ...]
    dtypes: tuple[str, ...] = DTYPES
    #: nvcc arch suffix the family needs ("a" for sm_90a-only instructions).
    arch_suffix: str = ""
    description: str = ""
    #: Programmatic dependent launch: every kernel of the family calls km_pdl_start() (prelude.cuh.j2) before
    #: it reads or writes a buffer, so a CUDA graph may start it while the kernel before it still runs.
    pdl: bool = False
    #: Buffers the kernel reads BEFORE km_pdl_start() (weights): launched early only where the caller
    #: vouches that no kernel writes them (the runtime: a model's parameters), else with a full dependency.
    pdl_early_reads: tuple[str, ...] = ()
    #: Workspaces of arrival counts: zero when a launch starts and left zero when it ends, so they are zeroed
    #: once where they are allocated and never poisoned (a kernel resets each count it finishes with).
    counter_workspaces: tuple[str, ...] = ()

    def needs_sm90(self, params: Mapping[str, Any]) -> str | None:
        """What in ``params`` needs sm_90 or newer (thread-block clusters, TMA), in words; None if nothing does."""
        return None

    def target(self, arch: str, params: Mapping[str, Any] | None = None) -> str:
        """The nvcc target for this family on GPU ``arch`` ("sm_90" -> "sm_90a" where the family needs the suffix).

        Arch-specific (``a``) instructions such as wgmma exist on sm_90 alone, so such a family has no target
        on any other GPU, nor do ``params`` that need sm_90 (``needs_sm90``) on an older one: SpecError says
        so, rather than nvcc failing on a target like compute_80a or on the template's #error."""
        base = base_arch(arch)
        if reason := too_old(base):
            raise SpecError(reason)
        if params is not None and int(base.removeprefix("sm_")) < 90 and (why := self.needs_sm90(params)):
            raise SpecError(f"family {self.name} {why}: it runs on sm_90 or newer, not {base}")
        if not self.arch_suffix:
            return arch
        if base != "sm_90":
            suffixed = f"sm_90{self.arch_suffix}"
            raise SpecError(f"family {self.name} uses {suffixed} instructions: it runs on sm_90 only, not {base}")
        return base + self.arch_suffix

    def precision(self, dtype: str) -> str:
        """Arithmetic precision that sets the tolerance (e.g. "tf32" for fp32 on tensor cores)."""
        return dtype

    def defaults(self, dtype: str) -> dict[str, Any]:
        """A valid, reasonable parameter set (the first valid one unless a family says better)."""
        for params in self.space(dtype):
            return params
        raise SpecError(f"family {self.name} has no valid parameters for {dtype}")  # pragma: no cover

    def check(self, params: Mapping[str, Any], dtype: str) -> str | None:
        """Why ``params`` break a constraint of this family for ``dtype``, or None."""
        return None

    def check_shape(self, shape: tuple[int, ...], params: Mapping[str, Any], dtype: str) -> str | None:
        """Why this variant cannot run ``shape`` (limits, not tile multiples), or None."""
        return None

    @abstractmethod
    def launches(self, shape: tuple[int, ...], params: Mapping[str, Any], dtype: str) -> list[Launch]:
        """The kernel launches, in order, that compute the op for ``shape``."""

    def workspace(self, shape: tuple[int, ...], params: Mapping[str, Any], dtype: str) -> dict[str, int]:
        """Scratch buffers (name -> bytes) the launches use; poisoned before each run, except the
        ``counter_workspaces``."""
        return {}

    def context(self, params: Mapping[str, Any], dtype: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """Template variables beyond the params themselves (always has T, dtype, attrs)."""
        return {}

    # -- generic machinery ----------------------------------------------------

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.params)
        raise SpecError(f"family {self.name} has no parameter {name!r}; its parameters: {known}")

    def resolve(self, overrides: Mapping[str, Any], dtype: str) -> dict[str, Any]:
        """Defaults for ``dtype`` updated with coerced ``overrides``; raises SpecError if invalid."""
        if dtype not in self.dtypes:
            raise SpecError(f"family {self.name} does not support {dtype}; it supports {', '.join(self.dtypes)}")
        params = dict(self.defaults(dtype))
        for name, raw in overrides.items():
            params[name] = self.param(name).coerce(raw)
        reason = self.check(params, dtype)
        if reason:
            raise SpecError(f"invalid parameters for {self.name}: {reason}")
        return params

    def space(self, dtype: str) -> Iterator[dict[str, Any]]:
        """Every valid parameter set for ``dtype``, in declaration order."""
        names = [p.name for p in self.params]
        for combo in itertools.product(*(p.values for p in self.params)):
            params = dict(zip(names, combo, strict=True))
            if self.check(params, dtype) is None:
                yield params

    def space_size(self, dtype: str) -> int:
        return sum(1 for _ in self.space(dtype))


@dataclass(frozen=True)
class Problem:
    """One op at one shape, dtype and attribute set: what a variant must compute."""

    op: OpSpec
    shape: tuple[int, ...]
    dtype: str
    attrs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.attrs.items()))
        return f"{self.op.name} {format_shape(self.shape)} {self.dtype}{extra}"


class OpSpec(ABC):
    """What an op computes: shapes, inputs, float64 reference, roofline numbers."""

    name: str
    dims: tuple[str, ...]  # names of the shape signature, e.g. ("rows", "cols")
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    families: dict[str, Family]
    #: Semantic attributes (not tuned): e.g. fused_mlp's activation.
    attributes: tuple[Param, ...] = ()
    #: True when the matrix units' rate bounds the op (its roofline has a compute term).
    matrix_bound: bool = False
    #: False where every output element is a product of positive factors (softmax): each is then held to its
    #: own size, not to the output's rms (Tolerance.of).
    cancels: bool = True
    #: False where nothing between the inputs and the output is rounded to the storage type (no hidden layer,
    #: no probabilities in 16 bits): the output's own rounding and float32 arithmetic are then all a correct
    #: kernel adds, and the per-element allowance is 8 times tighter near zero (Tolerance.of).
    intermediates: bool = True
    #: Kinds of input make_inputs draws by seed (seed % len): values a kernel takes a separate path for, such as
    #: attention's all-zero mask, get seeds of their own (fresh_seeds gives each kind one).
    input_kinds: tuple[str, ...] = ("uniform",)
    #: A shape a job of the op takes in each of its dtypes, the example that hints and errors give (BERT-base's
    #: sizes where it has them); unset (a plugin's op), 1024 a dim, which not every op takes.
    example_shape: str = ""

    @abstractmethod
    def tensor_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Shape of every input and output tensor, by name."""

    @abstractmethod
    def reference(self, inputs: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The outputs in float64, from the inputs upcast to float64."""

    @abstractmethod
    def flops(self, shape: tuple[int, ...]) -> float:
        """Floating-point operations of one evaluation (for TFLOP/s and the compute floor)."""

    def summed_terms(self, shape: tuple[int, ...]) -> int:
        """Terms summed into one output element (K of a matmul): float32 rounding grows with their number."""
        return 1

    def layers(self, shape: tuple[int, ...]) -> int:
        """Chained layers, each rounding its output to the storage type (mlp_stack's blocks)."""
        return 1

    def tolerance(self, shape: tuple[int, ...], precision: str) -> Tolerance:
        """What verification allows this op's outputs at ``shape`` and arithmetic ``precision``."""
        return Tolerance.of(precision, self.summed_terms(shape), self.cancels, self.layers(shape), self.intermediates)

    def input_kind(self, seed: int) -> str:
        """The kind of inputs ``seed`` draws (one of input_kinds)."""
        return self.input_kinds[seed % len(self.input_kinds)]

    def input_scale(self, name: str, shape: tuple[int, ...]) -> float:
        """Inputs are uniform in [-scale, scale]; ops override to keep values O(1)."""
        return 1.0

    def make_inputs(self, shape: tuple[int, ...], dtype: str, seed: int) -> dict[str, np.ndarray]:
        """Fresh random inputs in the storage dtype (never zeros)."""
        rng = np.random.default_rng(seed)
        shapes = self.tensor_shapes(shape)
        np_dtype = numpy_dtype(dtype)
        out = {}
        for name in self.inputs:
            scale = self.input_scale(name, shape)
            values = rng.uniform(-scale, scale, size=shapes[name]).astype(np.float32)
            out[name] = values.astype(np_dtype)
        return out

    def min_bytes(self, shape: tuple[int, ...], dtype: str) -> int:
        """Fewest bytes through DRAM: each input read once, each output written once."""
        shapes = self.tensor_shapes(shape)
        elems = sum(math.prod(shapes[n]) for n in (*self.inputs, *self.outputs))
        return elems * itemsize(dtype)

    def torch_reference(self, tensors: Mapping[str, Any], attrs: Mapping[str, Any]):  # pragma: no cover - GPU
        """A thunk running the op in PyTorch on ``tensors`` (the baseline), or None."""
        return None

    # -- generic machinery ----------------------------------------------------

    def family(self, name: str) -> Family:
        try:
            return self.families[name]
        except KeyError:
            known = ", ".join(self.families)
            raise SpecError(f"op {self.name} has no family {name!r}; its families: {known}") from None

    def example(self) -> str:
        """A shape the op takes, as text: ``example_shape``, else 1024 a dim."""
        return self.example_shape or "x".join("1024" for _ in self.dims)

    def parse_shape(self, text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """``"8192x8192"`` (or a sequence) -> validated tuple of positive ints."""
        if isinstance(text, str):
            # One separator between dims (x, a comma or spaces): "4096x1024x" or "4096xx1024" is a typo to show,
            # not a shape of fewer dims. ASCII digits only: int() also reads "１２" (full width) and "1_0".
            parts = re.split(r"\s*[x,]\s*|\s+", text.strip().lower())
            if not all(re.fullmatch(r"-?[0-9]+", p) for p in parts):
                raise SpecError(
                    f"malformed shape {text!r} for {self.name}: expected {'x'.join(self.dims)}, e.g. {self.example()}"
                )
            self._check_dim_count(len(parts))
            # Digits counted before int(), which raises past 4300 of them (leading zeros included).
            magnitudes = [part.lstrip("-").lstrip("0") or "0" for part in parts]
            for dim, part, digits in zip(self.dims, parts, magnitudes, strict=True):
                if len(digits) > len(str(MAX_DIM)):
                    bound = "be > 0" if part.startswith("-") else f"be at most {MAX_DIM} (kernels index in 32 bits)"
                    raise SpecError(f"{self.name} shape dim {dim} must {bound}, got a number of {len(digits)} digits")
            shape = tuple(-int(d) if p.startswith("-") else int(d) for p, d in zip(parts, magnitudes, strict=True))
        else:
            if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in text):
                raise SpecError(f"malformed shape {list(text)!r} for {self.name}: dims are whole numbers")
            shape = tuple(int(v) for v in text)
            self._check_dim_count(len(shape))
        for dim, value in zip(self.dims, shape, strict=True):
            if value <= 0:
                raise SpecError(f"{self.name} shape dim {dim} must be > 0, got {value}")
            if value > MAX_DIM:
                raise SpecError(
                    f"{self.name} shape dim {dim} must be at most {MAX_DIM} (kernels index in 32 bits), got {value}"
                )
        return shape

    def _check_dim_count(self, count: int) -> None:
        if count != len(self.dims):
            raise SpecError(f"{self.name} takes a shape of {len(self.dims)} dims ({'x'.join(self.dims)}), got {count}")

    def resolve_attrs(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        attrs = {a.name: a.values[0] for a in self.attributes}
        for name, value in raw.items():
            match = [a for a in self.attributes if a.name == name]
            if not match:
                known = ", ".join(a.name for a in self.attributes) or "none"
                raise SpecError(f"op {self.name} has no attribute {name!r}; its attributes: {known}")
            attrs[name] = match[0].coerce(value, "attribute")
        return attrs

    def check_dtype(self, dtype: str) -> str:
        if dtype not in DTYPES:
            raise SpecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return dtype


def format_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in shape)
