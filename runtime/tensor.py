"""Tensor: a contiguous n-d array on the CPU (NumPy) or the GPU (pooled device memory).

Zero-copy exchange with PyTorch both ways: ``from_torch`` wraps a CUDA (or CPU) torch tensor's memory and
keeps the torch tensor alive; ``to_torch`` hands torch a DLPack capsule that keeps the runtime tensor alive.
bfloat16 goes through both (NumPy holds it as ml_dtypes.bfloat16).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from kernelmill.kernels.device import Buffer
from kernelmill.kernels.ops.base import numpy_dtype as _float_numpy_dtype
from kernelmill.runtime import dlpack
from kernelmill.runtime.backend import on_device

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "int32", "int64")
FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
DEVICES: tuple[str, ...] = ("cpu", "cuda")

#: Base pointers the kernels may assume (16-byte vector accesses); pooled allocations are 256-aligned.
ALIGNMENT = 16


def numpy_dtype(dtype: str) -> np.dtype:
    if dtype in ("int32", "int64"):
        return np.dtype(dtype)
    return _float_numpy_dtype(dtype)


def dtype_name(dt: Any) -> str:
    """Runtime dtype name of a NumPy dtype (or name)."""
    dt = np.dtype(dt) if not isinstance(dt, str) else dt
    if isinstance(dt, str):
        if dt not in DTYPES:
            raise TypeError(f"unsupported dtype {dt!r}; use one of {', '.join(DTYPES)}")
        return dt
    for name in DTYPES:
        if numpy_dtype(name) == dt:
            return name
    raise TypeError(f"unsupported dtype {dt}; use one of {', '.join(DTYPES)}")


def _check_device(device: str) -> str:
    device = str(device)
    if device.startswith("cuda"):
        if device not in ("cuda", "cuda:0"):
            raise ValueError(f"only cuda:0 is supported by the runtime for now, got {device!r}")
        return "cuda"
    if device != "cpu":
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    return device


def _dims(shape: Any, what: str, least: int | None = 0) -> tuple[int, ...]:
    """``shape`` as a tuple of whole numbers >= ``least`` (None: any; an int alone is a 1-d shape, as NumPy and
    torch take it), or an error naming ``what``: int() cut a 2.5 to 2 and read "3" as 3, and an int failed as
    "not iterable"."""
    dims = (shape,) if isinstance(shape, int | np.integer) else shape
    try:
        dims = tuple(dims)
        if any(isinstance(d, bool | np.bool_) for d in dims):
            raise TypeError
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(f"{what}: a shape is whole numbers, got {shape!r}") from None
    if least is not None and any(d < least for d in dims):
        raise ValueError(f"{what}: a shape's dims must be at least {least}, got {shape!r}")
    return dims


def _backend():
    from kernelmill.runtime.backend import get_backend

    return get_backend()


class Tensor:
    """Contiguous, row-major. ``device`` is "cpu" (``array`` holds the data) or "cuda" (``buffer``)."""

    __array_priority__ = 100  # NumPy leaves mixed expressions to Tensor (which refuses them) rather than guessing

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: str,
        device: str,
        *,
        array: np.ndarray | None = None,
        buffer: Buffer | None = None,
        owner: Any = None,
    ) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype_name(dtype)
        self.device = _check_device(device)
        if self.device == "cpu":
            if array is None:
                raise ValueError("a cpu Tensor needs its NumPy array")
            self.array = array
            self.buffer = None
        else:
            if buffer is None:
                raise ValueError("a cuda Tensor needs its device buffer")
            self.array = None
            self.buffer = buffer
        self._owner = owner  # what must live as long as this tensor (a torch tensor, a parent tensor)

    # -- construction ----------------------------------------------------------------

    @classmethod
    @on_device(cuda_args_only=True)
    def empty(cls, shape, dtype: str = "float32", device: str = "cpu") -> Tensor:
        shape = _dims(shape, "Tensor.empty")
        device = _check_device(device)
        if device == "cpu":
            return cls(shape, dtype, device, array=np.empty(shape, dtype=numpy_dtype(dtype)))
        nbytes = math.prod(shape) * numpy_dtype(dtype).itemsize
        return cls(shape, dtype, device, buffer=_backend().alloc(nbytes))

    @classmethod
    @on_device(cuda_args_only=True)
    def zeros(cls, shape, dtype: str = "float32", device: str = "cpu") -> Tensor:
        t = cls.empty(_dims(shape, "Tensor.zeros"), dtype, device)
        if t.device == "cpu":
            t.array[...] = 0
        else:
            _backend().fill(t.ptr, 0, t.nbytes)
        return t

    @classmethod
    @on_device(cuda_args_only=True)
    def from_numpy(cls, a: Any, device: str = "cpu", dtype: str | None = None) -> Tensor:
        """A tensor with ``a``'s values (converted to ``dtype``). On the CPU it shares ``a``'s memory
        when no conversion or copy for contiguity is needed."""
        if type(a).__module__.startswith("torch"):  # np.asarray fails on grad and bfloat16 tensors
            raise TypeError("from_numpy takes a NumPy array; a torch tensor goes through runtime.from_torch")
        a = nested_array(a)
        # Given, a name or a NumPy dtype (np.float16); a refusal names every dtype, the integer ones too.
        default = "float32" if a.dtype == np.float64 else a.dtype
        dtype = dtype_name(default if dtype is None else dtype)
        a = np.require(a, numpy_dtype(dtype), "C")  # not ascontiguousarray: it makes a 0-d array 1-d
        device = _check_device(device)
        if device == "cpu":
            # Shared, unless read-only (a memory map, bytes): ops and to_torch consumers may write, and writing
            # there crashed the process or changed an immutable object.
            return cls(a.shape, dtype, "cpu", array=a if a.flags.writeable else a.copy())
        t = cls.empty(a.shape, dtype, "cuda")
        if t.nbytes:
            _backend().upload(t.ptr, a)
        return t

    # -- facts -------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return numpy_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides (contiguous row-major)."""
        out, step = [], 1
        for dim in reversed(self.shape):
            out.append(step)
            step *= dim
        return tuple(reversed(out))

    @property
    def ptr(self) -> int:
        """Device address (cuda) or host address (cpu) of the first element."""
        if self.device == "cpu":
            return int(self.array.ctypes.data)
        return self.buffer.ptr

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # -- data movement -----------------------------------------------------------------

    @on_device(cuda_args_only=True)
    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (the array itself on the CPU; a copy from the GPU)."""
        if self.device == "cpu":
            return self.array
        out = np.empty(self.shape, dtype=numpy_dtype(self.dtype))
        if self.nbytes:
            _backend().download(self.ptr, out)
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """np.asarray(t), np.save(path, t): the values, as .numpy() gives them (it was a 0-d object array)."""
        out = self.numpy()
        if dtype is not None:
            out = out.astype(dtype, copy=False)
        return out.copy() if copy and out is self.array else out

    @on_device(cuda_args_only=True)
    def to(self, device: str | None = None, dtype: str | None = None) -> Tensor:
        device = _check_device(device or self.device)
        dtype = dtype or self.dtype
        if device == self.device and dtype == self.dtype:
            return self
        if device == "cuda" and self.device == "cuda":  # a dtype change on the GPU goes through the host
            return Tensor.from_numpy(self.numpy().astype(np.float32).astype(numpy_dtype(dtype)), "cuda", dtype)
        values = self.numpy()
        if dtype != self.dtype:
            values = values.astype(np.float32).astype(numpy_dtype(dtype)) if dtype in FLOAT_DTYPES else values
        return Tensor.from_numpy(values, device, dtype)

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def cuda(self) -> Tensor:
        return self.to("cuda")

    @on_device(cuda_args_only=True)
    def copy_(self, src: Tensor) -> Tensor:
        """Copies ``src`` (same shape and dtype, any device) into this tensor."""
        if src.shape != self.shape or src.dtype != self.dtype:
            raise ValueError(f"copy_ from {src} into {self}: shapes and dtypes must match")
        if self.device == "cpu":
            self.array[...] = src.numpy()
        elif src.device == "cpu":
            _backend().upload(self.ptr, np.ascontiguousarray(src.array))
        else:
            _backend().copy(self.ptr, src.ptr, self.nbytes)
        return self

    @on_device(cuda_args_only=True)
    def clone(self) -> Tensor:
        if self.device == "cpu":
            return Tensor(self.shape, self.dtype, "cpu", array=self.array.copy())
        out = Tensor.empty(self.shape, self.dtype, "cuda")
        _backend().copy(out.ptr, self.ptr, self.nbytes)
        return out

    # -- views -------------------------------------------------------------------------

    def reshape(self, *shape) -> Tensor:
        """A view with another shape (same memory); one dim may be -1."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        shape = list(_dims(shape, f"cannot reshape {self.shape}", least=None))
        if shape.count(-1) > 1 or any(d < -1 for d in shape):
            raise ValueError(f"cannot reshape {self.shape} to {tuple(shape)}: one dim at most may be -1, none below")
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            if not known:  # 0 elements: any size fits the -1 (torch refuses it too)
                raise ValueError(f"cannot reshape {self.shape} to {tuple(shape)}: the -1 is ambiguous beside a 0")
            shape[shape.index(-1)] = self.numel // known
        if math.prod(shape) != self.numel:
            raise ValueError(f"cannot reshape {self.shape} to {tuple(shape)}")
        if self.device == "cpu":
            return Tensor(tuple(shape), self.dtype, "cpu", array=self.array.reshape(shape), owner=self)
        return Tensor(tuple(shape), self.dtype, "cuda", buffer=self.buffer, owner=self)

    def view(self, *shape) -> Tensor:
        return self.reshape(*shape)

    def rows(self, start: int, stop: int) -> Tensor:
        """Rows start..stop-1 of the first dim (a view: contiguous rows of a contiguous tensor)."""
        if not self.shape:
            raise ValueError("rows of a 0-d tensor: it has no first dim")
        if not 0 <= start <= stop <= self.shape[0]:
            raise IndexError(f"rows {start}..{stop} out of 0..{self.shape[0]}")
        shape = (stop - start, *self.shape[1:])
        if self.device == "cpu":
            return Tensor(shape, self.dtype, "cpu", array=self.array[start:stop], owner=self)
        row_bytes = math.prod(self.shape[1:]) * self.itemsize
        buf = Buffer(self.buffer.ptr + start * row_bytes, (stop - start) * row_bytes)
        return Tensor(shape, self.dtype, "cuda", buffer=buf, owner=self)

    # -- interchange -------------------------------------------------------------------

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device != "cuda":
            raise AttributeError("__cuda_array_interface__ exists on cuda tensors only")
        if self.dtype == "bfloat16":
            raise AttributeError("the CUDA array interface has no bfloat16 type; use DLPack (to_torch)")
        return {
            "shape": self.shape,
            "typestr": numpy_dtype(self.dtype).str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            # Work is queued on the runtime's stream; a consumer on another stream must synchronize with it.
            "stream": _backend().stream_handle or None,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.KDL_CUDA, 0) if self.device == "cuda" else (dlpack.KDL_CPU, 0)

    @on_device(cuda_args_only=True)
    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None):
        if copy:
            return self.clone().__dlpack__(stream=stream)
        if self.device == "cuda" and stream not in (None, 1):
            # The consumer works on another stream than the legacy default one (1, or None: DLPack's default),
            # which alone CUDA orders with the runtime's blocking stream; the per-thread default stream (2) is
            # not: let our queued writes land first.
            _backend().synchronize()
        device_type, device_id = self.__dlpack_device__()
        return dlpack.capsule(self, self.ptr, self.shape, self.dtype, device_type, device_id)


def from_numpy(a: Any, device: str = "cpu", dtype: str | None = None) -> Tensor:
    return Tensor.from_numpy(a, device=device, dtype=dtype)


_TORCH_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int32": "int32",
    "int64": "int64",
}


def from_torch(t: Any) -> Tensor:
    """A runtime Tensor over a torch tensor's memory (no copy); the torch tensor stays alive with it.

    CUDA tensors become "cuda" tensors, CPU tensors "cpu" ones. Non-contiguous tensors are refused
    (call .contiguous() first: that is a copy, and it should be visible). A tensor that requires grad is
    wrapped through ``detach()``, a view of the same memory: the runtime computes no gradients."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch takes a torch.Tensor, not a {type(t).__name__} (runtime.from_numpy takes arrays)")
    t = t.detach()  # no copy; torch refuses .numpy() on a tensor that requires grad
    if not t.is_contiguous():
        raise ValueError("from_torch needs a contiguous tensor (call .contiguous() first)")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise TypeError(f"unsupported torch dtype {t.dtype}; use one of {', '.join(_TORCH_DTYPES)}")
    shape = tuple(t.shape)
    if t.is_cuda:
        if t.device.index not in (None, 0):
            raise ValueError("only cuda:0 tensors are supported by the runtime for now")
        buf = Buffer(int(t.data_ptr()), t.numel() * t.element_size())
        return Tensor(shape, dtype, "cuda", buffer=buf, owner=t)
    bf16 = t.dtype == torch.bfloat16  # NumPy has no bfloat16 of its own: view the bits as ml_dtypes'
    array = t.view(torch.int16).numpy().view(numpy_dtype("bfloat16")) if bf16 else t.numpy()
    return Tensor(shape, dtype, "cpu", array=array, owner=t)


def to_torch(t: Tensor):
    """The tensor as a torch tensor over the same memory (DLPack); the runtime tensor stays alive with it."""
    try:
        import torch
    except ImportError as exc:  # torch is no dependency of the runtime
        raise ModuleNotFoundError(
            f"runtime.to_torch needs PyTorch (pip install torch); without it, .numpy() gives the tensor as a "
            f"NumPy array ({exc})",
            name="torch",
        ) from None

    return torch.from_dlpack(t)


def nested_array(x: Any) -> np.ndarray:
    """np.asarray, with nested lists of different lengths named as such (NumPy's "setting an array element
    with a sequence ... inhomogeneous shape" said nothing of padding)."""
    try:
        return np.asarray(x)
    except ValueError as exc:
        if not isinstance(x, list | tuple) or "inhomogeneous" not in str(exc):
            raise
        lengths = sorted({len(row) if isinstance(row, list | tuple) else 0 for row in x})
        raise ValueError(
            f"the input's rows have different lengths ({', '.join(map(str, lengths[:6]))}): pad them to one "
            "length (a BERT model's padding masked out with attention_mask)"
        ) from None


def as_tensor(x: Any, device: str | None = None, dtype: str | None = None) -> Tensor:
    """A Tensor from a Tensor, a NumPy array or nested lists, or a torch tensor (zero-copy where possible)."""
    if isinstance(x, Tensor):
        return x.to(device or x.device, dtype or x.dtype)
    if type(x).__module__.startswith("torch"):
        if str(x.dtype) == "torch.float64":  # as from_numpy does for float64 arrays: float32 (a copy)
            x = x.float()
        t = from_torch(x.contiguous())
        return t.to(device or t.device, dtype or t.dtype)
    return Tensor.from_numpy(x, device=device or "cpu", dtype=dtype)
