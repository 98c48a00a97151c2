"""The runtime's ops on Tensors: NumPy float32 on the CPU, kernelmill kernels on the GPU.

Every op takes and returns ``Tensor``s on one device. On "cuda" each op runs kernels of a kernelmill op
(chosen by the KernelRegistry: tuned, nearest or default) on the runtime's stream; nothing falls back
to PyTorch. On "cpu" it computes in float32 with NumPy (slow but correct: the no-GPU path).

Layout conventions: row-major; a weight W of a linear layer is (in_features, out_features), i.e. the
transpose of torch's nn.Linear.weight (``nn.Linear.from_torch`` transposes once at load time).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.attention import masked_softmax
from kernelmill.kernels.ops.base import format_shape
from kernelmill.kernels.ops.elementwise import ACT_FUNCTIONS, ELEMENTWISE_ACTIVATIONS
from kernelmill.kernels.ops.embedding import ID_ELEMS, pack_ids
from kernelmill.kernels.ops.fused_mlp import ACTIVATIONS as FUSED_ACTIVATIONS
from kernelmill.runtime import ranges
from kernelmill.runtime.backend import on_device
from kernelmill.runtime.tensor import ALIGNMENT, FLOAT_DTYPES, Tensor, numpy_dtype

_registry: contextvars.ContextVar[Any] = contextvars.ContextVar("kernelmill_registry", default=None)
_recorders: contextvars.ContextVar[tuple] = contextvars.ContextVar("kernelmill_recorders", default=())
_watchers: contextvars.ContextVar[tuple] = contextvars.ContextVar("kernelmill_watchers", default=())
_planning: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernelmill_planning", default=None)
_default_registry = None
_split_mlps: set[tuple] = set()  # fused_mlp problems already logged as running as two linears

log = logging.getLogger(__name__)

#: Activation names the ops accept, with their aliases (torch / HuggingFace spellings).
ACT_ALIASES = {
    None: "none",
    "none": "none",
    "identity": "none",
    "linear": "none",
    "relu": "relu",
    "gelu": "gelu_erf",
    "gelu_erf": "gelu_erf",
    "gelu_python": "gelu_erf",
    "gelu_tanh": "gelu_tanh",
    # transformers' tanh-form GELUs, each within 1e-6 of torch's gelu(approximate="tanh")
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
}


def canonical_act(act: str | None) -> str:
    try:
        return ACT_ALIASES[act if act is None else str(act).lower()]
    except KeyError:
        raise ValueError(f"unknown activation {act!r}; use one of {', '.join(ELEMENTWISE_ACTIVATIONS)}") from None


# -- context: registry and problem recording -------------------------------------------------------------


def default_registry():
    """The process's registry for GPU ops (created on first use: local cache, KERNELMILL_SERVER, defaults)."""
    global _default_registry
    if _default_registry is None:
        from kernelmill.runtime.backend import get_backend
        from kernelmill.runtime.registry import KernelRegistry

        _default_registry = KernelRegistry(backend=get_backend())
    return _default_registry


def current_registry():
    return _registry.get() or default_registry()


@contextlib.contextmanager
def using_registry(registry) -> Iterator[None]:
    """GPU ops inside the block take their kernels from ``registry``."""
    token = _registry.set(registry)
    try:
        yield
    finally:
        _registry.reset(token)


@contextlib.contextmanager
def recording(each: Callable[[tuple], None] | None = None) -> Iterator[list[tuple[str, tuple[int, ...], str, dict]]]:
    """Collects the (op, shape, dtype, attrs) problems that ops meet inside the block, on any device
    (what ``tune_model`` submits). On the CPU the dtype recorded is the tensors' dtype. ``each`` is called
    with every op's problem as the op begins, repeats included (progress through a slow CPU forward)."""
    seen: list = []
    token = _recorders.set((*_recorders.get(), seen))
    watching = _watchers.set((*_watchers.get(), each)) if each is not None else None
    try:
        yield seen
    finally:
        if watching is not None:
            _watchers.reset(watching)
        _recorders.reset(token)


@contextlib.contextmanager
def planning() -> Iterator[list[tuple[str, tuple[int, ...], str, dict[str, Any]]]]:
    """Inside the block GPU ops launch nothing (their outputs are allocated but never written); yields the
    list of the (op, shape, dtype, attrs) problems whose kernels they would have launched. A forward run this
    way lists what it needs, so that those kernels can be compiled together before it runs
    (``KernelRegistry.prepare``)."""
    planned: list = []
    token = _planning.set(planned)
    try:
        yield planned
    finally:
        _planning.reset(token)


def _note(op: str, shape: tuple[int, ...], dtype: str, attrs: dict[str, Any], into: tuple = ()) -> None:
    """Adds the problem to every recording under way and to the lists in ``into``, once each; not a problem
    with an empty dimension (a batch of 0), which no kernel runs and no job tunes."""
    if 0 in shape:
        return
    problem = (op, tuple(int(v) for v in shape), dtype, dict(attrs))
    for watch in _watchers.get():
        watch(problem)
    for seen in (*_recorders.get(), *into):
        if problem not in seen:
            seen.append(problem)


def _backend():
    from kernelmill.runtime.backend import get_backend

    return get_backend()


def _takes_tensors(fn):
    """Refuses arguments annotated ``Tensor`` that are not runtime Tensors, with a TypeError naming the op and
    the argument: a NumPy array or a torch tensor failed deep inside (an AttributeError on ``numel``)."""
    params = list(inspect.signature(fn).parameters.values())
    checked = [(i, p.name) for i, p in enumerate(params) if str(p.annotation).startswith("Tensor")]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for i, name in checked:
            value = args[i] if i < len(args) else kwargs.get(name)
            if value is not None and not isinstance(value, Tensor):
                kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
                raise TypeError(
                    f"{fn.__name__}: {name} is a {kind}, not a runtime Tensor; wrap it with runtime.from_numpy "
                    "or runtime.from_torch"
                )
        return fn(*args, **kwargs)

    return wrapper


def _on_cuda(*tensors: Tensor | None) -> bool:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"tensors on different devices: {', '.join(sorted(devices))}")
    return devices == {"cuda"}


def _float_dtype(op: str, *tensors: Tensor | None) -> str:
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1 or not dtypes <= set(FLOAT_DTYPES):
        raise TypeError(f"{op}: expected tensors of one float dtype, got {', '.join(sorted(dtypes))}")
    return dtypes.pop()


def _expect(op: str, name: str, t: Tensor, shape: tuple[int, ...], of: str) -> None:
    """A ValueError naming ``op``, ``name`` and both shapes where ``t`` is not ``shape``: the kernels read
    exactly that many elements, so a short bias or scale would be read past its end."""
    if t.shape != shape:
        raise ValueError(f"{op}: {name} {t.shape} for {of}: expected {shape}")


def _last_dim(op: str, x: Tensor) -> int:
    """The size of ``x``'s last dim, which ``op`` works along; a ValueError for a 0-d tensor, which has none."""
    if not x.shape:
        raise ValueError(f"{op}: a 0-d input has no last dim to work along; give it at least 1 dim")
    return x.shape[-1]


def check_heads(op: str, heads: Any) -> None:
    """A ValueError naming ``op`` unless ``heads`` is a positive integer (attention and its module share it)."""
    if isinstance(heads, bool) or not isinstance(heads, int | np.integer) or heads < 1:
        raise ValueError(f"{op}: heads must be a positive integer, not {heads!r}")


def _matrix(op: str, name: str, w: Tensor) -> tuple[int, int]:
    if w.ndim != 2:
        raise ValueError(f"{op}: {name} {w.shape} is not a matrix")
    return w.shape


def _aligned(t: Tensor) -> Tensor:
    """``t``, or an aligned copy when its address does not allow 16-byte accesses (e.g. a view)."""
    return t if t.ptr % ALIGNMENT == 0 else t.clone()


@on_device
def _launch(op: str, shape: tuple[int, ...], dtype: str, attrs: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    if 0 in shape:  # nothing to compute (a batch of 0): no kernel, whose grid would be empty, and no problem to tune
        filled = [name for name in get_op(op).outputs if name in tensors and tensors[name].numel]
        if filled:  # a sum over nothing (K = 0) that the CPU would answer with zeros: no kernel takes it
            empty = format_shape(shape)
            raise ValueError(f"{op}: {empty} has an empty dimension to reduce over; no GPU kernel runs it")
        return
    planned = _planning.get()
    _note(op, shape, dtype, attrs, into=() if planned is None else (planned,))
    if planned is not None:
        return
    entry = current_registry().get(op, shape, dtype, attrs)
    # Inputs that need an aligned copy are kept alive until the launches are queued; the pool then reuses
    # their memory only for work queued after them on the same stream.
    aligned = {name: _aligned(t) for name, t in tensors.items()}
    marker = ranges.active()
    if marker is None:
        entry.run(_backend(), {name: t.ptr for name, t in aligned.items()})
        return
    marker.push(ranges.op_range_name(op, shape, dtype, attrs))
    try:
        entry.run(_backend(), {name: t.ptr for name, t in aligned.items()})
    finally:
        marker.pop()


def _f32(t: Tensor) -> np.ndarray:
    return np.asarray(t.numpy(), dtype=np.float32)


def _cpu(a: np.ndarray, dtype: str) -> Tensor:
    """A CPU op's float32 result as a tensor of its inputs' ``dtype`` (rounded once, as a kernel rounds its
    output): a float16 module's next op then gets the dtype its weights have."""
    return Tensor.from_numpy(np.require(a, np.float32, "C"), "cpu", dtype)


_ZEROS: dict[tuple, Tensor] = {}


def _zeros(shape: tuple[int, ...], dtype: str) -> Tensor:
    """A cached all-zero cuda tensor (never written: biases of plain activations, masks of no mask)."""
    key = (shape, dtype)
    if key not in _ZEROS:
        _ZEROS[key] = Tensor.from_numpy(np.zeros(shape, dtype=numpy_dtype(dtype)), "cuda", dtype)
    return _ZEROS[key]


# -- CPU math ---------------------------------------------------------------------------------------------


#: A & S 7.1.26's coefficients, highest power first (erfc(a) = poly(t) exp(-a^2), t = 1 / (1 + P a)).
_ERFC_P, _ERFC_POLY = 0.3275911, (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)


def _erfc_abs(a: np.ndarray) -> np.ndarray:
    """erfc(a) for a >= 0 (Abramowitz & Stegun 7.1.26, ~1.5e-7 absolute), in float64, without cancellation."""
    t = 1.0 / (1.0 + _ERFC_P * a)
    poly = 0.0
    for c in _ERFC_POLY:  # Horner's rule, highest power first, then the factor t of the lowest
        poly = (poly + c) * t
    return poly * np.exp(-a * a)


def erf(x: np.ndarray) -> np.ndarray:
    """erf to ~1.5e-7 absolute, vectorized; NumPy has none."""
    x64 = np.asarray(x, dtype=np.float64)
    return np.sign(x64) * (1.0 - _erfc_abs(np.abs(x64)))


def erfc(x: np.ndarray) -> np.ndarray:
    """erfc, vectorized, with its relative precision kept in the tail (x > 0)."""
    x64 = np.asarray(x, dtype=np.float64)
    h = _erfc_abs(np.abs(x64))
    return np.where(x64 >= 0, h, 2.0 - h)


def _gelu_erf_f32(x: np.ndarray) -> np.ndarray:
    """0.5 x erfc(-x / sqrt 2) on float32, in place on two temporaries: erfc (A & S 7.1.26) of |x| / sqrt 2,
    and 2 minus it where x >= 0, so that no branch cancels (3x faster than the float64 erfc above)."""
    a = np.abs(x)
    a *= np.float32(1.0 / math.sqrt(2.0))
    t = a * np.float32(_ERFC_P)
    t += np.float32(1.0)
    np.reciprocal(t, out=t)
    p = t * np.float32(_ERFC_POLY[0])
    for c in _ERFC_POLY[1:]:
        p += np.float32(c)
        p *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    with np.errstate(under="ignore"):
        np.exp(a, out=a)
    p *= a  # erfc(|x| / sqrt 2)
    np.subtract(np.float32(2.0), p, out=p, where=x >= 0)
    p *= x
    p *= np.float32(0.5)
    return p


def _gelu_tanh_f32(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-2 sqrt(2 / pi) (x + 0.044715 x^3))) on float32 (the reference's form; x**3 is a slow pow)."""
    u = x * x
    u *= x
    u *= np.float32(0.044715)
    u += x
    u *= np.float32(-2.0 * math.sqrt(2.0 / math.pi))
    with np.errstate(over="ignore"):  # exp = inf for very negative x: the GELU is -0 there
        np.exp(u, out=u)
    u += np.float32(1.0)
    return np.divide(x, u, out=u)


def _act_np(x: np.ndarray, act: str) -> np.ndarray:
    """act on float32 CPU activations, in the float64 references' forms (kernels/ops: ACT_FUNCTIONS), which do
    not cancel for negative x, computed in float32: the GELUs by the functions above (the erf reference calls
    math.erfc per element, far too slow for a model's activations)."""
    x = np.asarray(x, dtype=np.float32)
    if act == "gelu_erf":
        return _gelu_erf_f32(x)
    if act == "gelu_tanh":
        return _gelu_tanh_f32(x)
    with np.errstate(over="ignore"):  # exp(-x) = inf for very negative x: silu is -0 there
        return np.asarray(ACT_FUNCTIONS[act](x), dtype=np.float32)


def _softmax_np(x: np.ndarray) -> np.ndarray:
    if not x.size:  # rows of no element (or no rows): nothing to normalise, and max() has no identity
        return x.copy()
    with np.errstate(invalid="ignore"):  # a row of only -inf (all masked) is NaN, as torch gives, without a warning
        e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sdpa_np(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """softmax(q k^T / sqrt(d) + key mask) v on float32 (batch, heads, seq, head_dim) arrays, mask (batch, seq)."""
    scores = q @ np.swapaxes(k, -1, -2) / np.float32(math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores + mask[:, None, None, :]
    return masked_softmax(scores) @ v  # a query whose every key is -inf gives 0, as torch's sdpa does


# -- ops --------------------------------------------------------------------------------------------------


@_takes_tensors
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a (..., K) @ b (K, N) -> (..., N)."""
    k, n = _matrix("matmul", "b", b)
    if _last_dim("matmul", a) != k:
        raise ValueError(f"matmul: {a.shape} @ {b.shape}")
    m = a.numel // k if k else 0
    dtype = _float_dtype("matmul", a, b)
    if not _on_cuda(a, b):
        _note("matmul", (m, n, k), dtype, {})
        return _cpu(_f32(a) @ _f32(b), dtype)
    out = Tensor.empty((*a.shape[:-1], n), dtype, "cuda")
    _launch("matmul", (m, n, k), dtype, {}, {"A": a, "B": b, "C": out})
    return out


@_takes_tensors
def bias_act(x: Tensor, b: Tensor, act: str = "none") -> Tensor:
    """act(x + b) with b broadcast over the last dim."""
    act = canonical_act(act)
    cols = _last_dim("bias_act", x)
    rows = x.numel // cols if cols else 0
    if b.shape != (cols,):
        raise ValueError(f"bias_act: bias {b.shape} for input {x.shape}")
    dtype = _float_dtype("bias_act", x, b)
    if not _on_cuda(x, b):
        _note("bias_act", (rows, cols), dtype, {"act": act})
        return _cpu(_act_np(_f32(x) + _f32(b), act), dtype)
    out = Tensor.empty(x.shape, dtype, "cuda")
    _launch("bias_act", (rows, cols), dtype, {"act": act}, {"X": x, "b": b, "Y": out})
    return out


@_takes_tensors
def activation(x: Tensor, act: str) -> Tensor:
    """act(x) elementwise (on the GPU: the bias_act kernel with a zero bias)."""
    act = canonical_act(act)
    if not x.shape:  # elementwise: a 0-d tensor is one element
        return activation(x.reshape(1), act).reshape()
    if not x.is_cuda:  # a zero bias of x's dtype: a float16 CPU tensor took a float32 one and was refused
        return bias_act(x, Tensor.from_numpy(np.zeros(x.shape[-1], numpy_dtype(x.dtype)), "cpu", x.dtype), act)
    return bias_act(x, _zeros((x.shape[-1],), x.dtype), act)


@_takes_tensors
def relu(x: Tensor) -> Tensor:
    return activation(x, "relu")


@_takes_tensors
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU as torch's ``F.gelu``: erf (``approximate="none"``) or its tanh approximation (``"tanh"``)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate={approximate!r}; use 'none' (erf) or 'tanh'")
    return activation(x, "gelu_tanh" if approximate == "tanh" else "gelu_erf")


@_takes_tensors
def silu(x: Tensor) -> Tensor:
    return activation(x, "silu")


@_takes_tensors
def linear(x: Tensor, w: Tensor, b: Tensor | None = None, act: str = "none") -> Tensor:
    """act(x @ w + b): x (..., K), w (K, N), b (N,) or None."""
    act = canonical_act(act)
    k, n = _matrix("linear", "weight", w)
    if _last_dim("linear", x) != k:
        raise ValueError(f"linear: input {x.shape} for weight {w.shape} (in_features, out_features)")
    if b is None:
        y = matmul(x, w)
        return y if act == "none" else activation(y, act)
    _expect("linear", "bias", b, (n,), f"weight {w.shape}")
    m = x.numel // k if k else 0
    dtype = _float_dtype("linear", x, w, b)
    if not _on_cuda(x, w, b):
        _note("linear", (m, n, k), dtype, {"act": act})
        return _cpu(_act_np(_f32(x) @ _f32(w) + _f32(b), act), dtype)
    out = Tensor.empty((*x.shape[:-1], n), dtype, "cuda")
    _launch("linear", (m, n, k), dtype, {"act": act}, {"X": x, "W": w, "b": b, "Y": out})
    return out


@_takes_tensors
def add(x: Tensor, y: Tensor) -> Tensor:
    """x + y (same shapes: residual connections)."""
    if x.shape != y.shape:
        raise ValueError(f"add: shapes {x.shape} and {y.shape} differ")
    dtype = _float_dtype("add", x, y)
    if not _on_cuda(x, y):
        _note("add", (x.numel,), dtype, {})
        return _cpu(_f32(x) + _f32(y), dtype)
    out = Tensor.empty(x.shape, dtype, "cuda")
    _launch("add", (x.numel,), dtype, {}, {"X": x, "R": y, "Y": out})
    return out


@_takes_tensors
def softmax(x: Tensor) -> Tensor:
    """softmax over the last dim."""
    cols = _last_dim("softmax", x)
    rows = x.numel // cols if cols else 0
    dtype = _float_dtype("softmax", x)
    if not x.is_cuda:
        _note("softmax", (rows, cols), dtype, {})
        return _cpu(_softmax_np(_f32(x)), dtype)
    out = Tensor.empty(x.shape, dtype, "cuda")
    _launch("softmax", (rows, cols), dtype, {}, {"x": x, "y": out})
    return out


@_takes_tensors
def layernorm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-12, residual: Tensor | None = None) -> Tensor:
    """LayerNorm over the last dim of x (of x + residual when given: the fused post-LN residual block)."""
    cols = _last_dim("layernorm", x)
    rows = x.numel // cols if cols else 0
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"layernorm: residual {residual.shape} for input {x.shape}")
    _expect("layernorm", "gamma", gamma, (cols,), f"input {x.shape}")
    _expect("layernorm", "beta", beta, (cols,), f"input {x.shape}")
    op = "layernorm" if residual is None else "add_layernorm"
    attrs = {"eps": float(eps)}
    dtype = _float_dtype("layernorm", x, gamma, beta, residual)
    if not _on_cuda(x, gamma, beta, residual):
        _note(op, (rows, cols), dtype, attrs)
        h = _f32(x) if residual is None else _f32(x) + _f32(residual)
        if not h.size:  # no element to normalise: the mean of an empty row warned and was NaN
            return _cpu(h, dtype)
        # The statistics in float64: a float32 mean of a constant row was an ulp off, and that ulp over
        # sqrt(eps) gave about +-gamma where torch gives beta (-0.23 everywhere at 1.7, eps 1e-12).
        centred = h - h.mean(axis=-1, keepdims=True, dtype=np.float64)
        var = (centred * centred).mean(axis=-1, keepdims=True)
        return _cpu(centred / np.sqrt(var + eps) * _f32(gamma) + _f32(beta), dtype)
    out = Tensor.empty(x.shape, dtype, "cuda")
    tensors = {"X": x, "gamma": gamma, "beta": beta, "Y": out}
    if residual is not None:
        tensors["R"] = residual
    _launch(op, (rows, cols), dtype, attrs, tensors)
    return out


#: Largest batch that runs the fused_mlp op's default kernel when nothing is tuned for it: none. With the
#: gemv defaults of kernels/defaults.py the two linears win at every batch (H200, 2026-11-22, forward.py:
#: MLP 4x(4096-11008-4096) fp16 batch 1 in 0.202 ms as linears vs 0.228 ms on the fused small_batch default;
#: an H100 before those defaults had the fused kernel ahead at batch 1, 72 vs 81 us a block).
FUSED_MLP_DEFAULT_MAX_BATCH = 0


@_takes_tensors
def fused_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, act: str = "gelu_erf") -> Tensor:
    """act(x @ w1 + b1) @ w2 + b2 in one fused_mlp kernel (two linear kernels for acts it lacks)."""
    act = canonical_act(act)
    d_in, d_hidden = _matrix("fused_mlp", "w1", w1)
    d_out = _matrix("fused_mlp", "w2", w2)[1]
    if _last_dim("fused_mlp", x) != d_in or w2.shape[0] != d_hidden:
        raise ValueError(f"fused_mlp: input {x.shape}, w1 {w1.shape}, w2 {w2.shape}")
    _expect("fused_mlp", "b1", b1, (d_hidden,), f"w1 {w1.shape}")
    _expect("fused_mlp", "b2", b2, (d_out,), f"w2 {w2.shape}")
    if act not in FUSED_ACTIVATIONS:
        return linear(linear(x, w1, b1, act), w2, b2)
    batch = x.numel // d_in if d_in else 0
    dtype = _float_dtype("fused_mlp", x, w1, b1, w2, b2)
    if not _on_cuda(x, w1, b1, w2, b2):
        _note("fused_mlp", (batch, d_in, d_hidden, d_out), dtype, {"act": act})
        h = _act_np(_f32(x) @ _f32(w1) + _f32(b1), act)
        return _cpu(h @ _f32(w2) + _f32(b2), dtype)
    shape = (batch, d_in, d_hidden, d_out)
    if batch > FUSED_MLP_DEFAULT_MAX_BATCH and current_registry().find("fused_mlp", shape, dtype, {"act": act}) is None:
        # Nothing tuned for the fused op: its two linears (gemv / wgmma defaults) beat the fused templates'
        # defaults; a tuned fused_mlp kernel, once served, replaces them.
        _note("fused_mlp", shape, dtype, {"act": act})
        if (shape, dtype, act) not in _split_mlps:
            _split_mlps.add((shape, dtype, act))
            log.info("runtime: fused_mlp %s %s act=%s: nothing tuned, running its two linears", shape, dtype, act)
        return linear(linear(x, w1, b1, act), w2, b2)
    out = Tensor.empty((*x.shape[:-1], d_out), dtype, "cuda")
    tensors = {"X": x, "W1": w1, "b1": b1, "W2": w2, "b2": b2, "Y": out}
    _launch("fused_mlp", shape, dtype, {"act": act}, tensors)
    return out


@_takes_tensors
def embedding(ids: Any, word: Tensor, pos: Tensor, types: Tensor, type_ids: Any = None) -> Tensor:
    """word[ids] + pos[0..seq-1] + types[type_ids] for ids (batch, seq) -> (batch, seq, hidden).

    ids / type_ids: integer arrays (or tensors) of shape (batch, seq); on the GPU also the packed tensors
    ``device_ids`` makes (batch, seq, 3), which is what a captured forward passes."""
    packed = _packed_ids(ids)
    ids_np = None if isinstance(ids, Tensor) else np.asarray(ids)
    if not packed:
        _token_ids("ids", ids_np if ids_np is not None else ids)
    batch, seq = (ids.shape[:2] if packed else ids.shape) if ids_np is None else ids_np.shape
    if type_ids is not None and not _packed_ids(type_ids):
        tshape = _token_ids("type_ids", type_ids if isinstance(type_ids, Tensor) else np.asarray(type_ids))
        if tshape != (batch, seq):
            raise ValueError(f"embedding: type_ids {tshape} for ids {(batch, seq)}")
    vocab, hidden = _matrix("embedding", "word embeddings", word)
    for name, table in (("position", pos), ("token type", types)):
        if table.ndim != 2 or table.shape[1] != hidden:
            raise ValueError(f"embedding: {name} embeddings {table.shape} for word embeddings {word.shape}")
    type_vocab = types.shape[0]
    if seq > pos.shape[0]:
        raise ValueError(f"embedding: sequence of {seq} > {pos.shape[0]} position embeddings")
    shape = (batch, seq, hidden, vocab, type_vocab)
    dtype = _float_dtype("embedding", word, pos, types)
    # Ids given as values are checked on the host, for the GPU too: its kernel clamps an id past the table to
    # the last row (an id == vocab read word row vocab - 1, where the CPU and torch raise). Packed ids come
    # from device_ids, whose callers checked them (BertModel.prepare).
    idx = None if packed else (ids_np if ids_np is not None else ids.numpy())
    tidx = None if type_ids is None or _packed_ids(type_ids) else _host_ints(type_ids)
    for name, values, n in (("ids", idx, vocab), ("type_ids", tidx, type_vocab)):
        if values is not None and values.size and (values.min() < 0 or values.max() >= n):
            raise IndexError(f"embedding: {name} out of range 0..{n - 1}")
    if not _on_cuda(word, pos, types):
        if idx is None:
            raise ValueError("embedding: ids packed for the GPU with embedding tables on the CPU")
        _note("embedding", shape, dtype, {})
        tidx = np.zeros_like(idx) if tidx is None else tidx
        return _cpu(_f32(word)[idx] + _f32(pos)[:seq][None] + _f32(types)[tidx], dtype)
    ids_t = device_ids(ids if idx is None else idx, dtype)
    if type_ids is None:
        key = ("type_ids", batch, seq, dtype)
        if key not in _ZEROS:
            _ZEROS[key] = device_ids(np.zeros((batch, seq), np.int64), dtype)
        tids_t = _ZEROS[key]
    else:  # the host copy checked above, not a second download of a cuda tensor
        tids_t = device_ids(type_ids if tidx is None else tidx, dtype)
    out = Tensor.empty((batch, seq, hidden), dtype, "cuda")
    tensors = {"ids": ids_t, "type_ids": tids_t, "word": word, "pos": pos, "types": types, "Y": out}
    _launch("embedding", shape, dtype, {}, tensors)
    return out


def _packed_ids(ids: Any) -> bool:
    """Whether ``ids`` are token ids packed for the GPU's embedding kernel (``device_ids``: batch, seq, 3)."""
    return isinstance(ids, Tensor) and ids.is_cuda and ids.ndim == 3 and ids.shape[-1] == ID_ELEMS


def _token_ids(name: str, ids: Any) -> tuple[int, ...]:
    """The shape of (batch, seq) integer token ids; a ValueError naming them where they are another rank or
    not integers (NumPy failed on a float index, after the range check had passed)."""
    kind = np.dtype(numpy_dtype(ids.dtype)).kind if isinstance(ids, Tensor) else ids.dtype.kind
    if ids.ndim != 2 or kind not in "iu":
        dtype = ids.dtype if isinstance(ids, Tensor) else ids.dtype.name
        raise ValueError(f"embedding: {name} must be integers of shape (batch, seq), not {dtype} {tuple(ids.shape)}")
    return tuple(ids.shape)


def _host_ints(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)


def device_ids(ids: Any, dtype: str) -> Tensor:
    """Token ids (batch, seq) as the packed cuda tensor (batch, seq, 3) of ``dtype`` that the embedding
    kernel reads (kernels.ops.embedding.pack_ids); packed cuda tensors pass through."""
    if isinstance(ids, Tensor):
        if ids.is_cuda and ids.dtype == dtype and ids.ndim == 3 and ids.shape[-1] == ID_ELEMS:
            return ids
        ids = ids.numpy()
    return Tensor.from_numpy(pack_ids(np.asarray(ids), dtype), "cuda", dtype)


@_takes_tensors
def attention(qkv: Tensor, heads: int, mask: Tensor | None = None) -> Tensor:
    """Multi-head self-attention on packed q|k|v (batch, seq, 3*hidden) with an additive key mask
    (batch, seq) or None -> (batch, seq, hidden), heads side by side (one fused kernel on the GPU)."""
    if qkv.ndim != 3:
        raise ValueError(f"attention: qkv {qkv.shape}, expected (batch, seq, 3 * hidden)")
    check_heads("attention", heads)
    batch, seq, width = qkv.shape
    if width % (3 * heads):
        raise ValueError(f"attention: width {width} is not 3 * heads({heads}) * head_dim")
    head_dim = width // (3 * heads)
    if mask is not None and mask.shape != (batch, seq):
        raise ValueError(f"attention: mask {mask.shape}, expected {(batch, seq)}")
    shape = (batch, heads, seq, head_dim)
    dtype = _float_dtype("attention", qkv, mask)
    if not _on_cuda(qkv, mask):
        _note("attention", shape, dtype, {})
        x = _f32(qkv).reshape(batch, seq, 3, heads, head_dim).transpose(2, 0, 3, 1, 4)
        out = _sdpa_np(x[0], x[1], x[2], None if mask is None else _f32(mask))
        return _cpu(out.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim), dtype)
    mask = _zeros((batch, seq), dtype) if mask is None else mask
    out = Tensor.empty((batch, seq, heads * head_dim), dtype, "cuda")
    _launch("attention", shape, dtype, {}, {"qkv": qkv, "mask": mask, "out": out})
    return out


@_takes_tensors
def narrow(x: Tensor, length: int) -> Tensor:
    """``x[:, :length]`` of a (batch, seq, ...) tensor, contiguous: a view where batch is 1, else a copy (one
    strided copy on the GPU)."""
    if x.ndim < 2:
        raise ValueError(f"narrow: x {x.shape}, expected (batch, seq, ...)")
    batch, seq, *rest = x.shape
    if not 0 <= length <= seq:
        raise ValueError(f"narrow: length {length} out of 0..{seq}")
    if length == seq:
        return x
    if batch == 1:
        return x.reshape(seq, *rest).rows(0, length).reshape(1, length, *rest)
    if x.device == "cpu":
        return Tensor((batch, length, *rest), x.dtype, "cpu", array=np.ascontiguousarray(x.array[:, :length]))
    out = Tensor.empty((batch, length, *rest), x.dtype, "cuda")
    row = math.prod(rest) * x.itemsize
    _backend().copy_2d(out.ptr, length * row, x.ptr, seq * row, length * row, batch)
    return out


@_takes_tensors
def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for (batch, heads, seq, head_dim) q, k, v (PyTorch's layout) with an
    additive key mask (batch, seq) or None -> (batch, heads, seq, head_dim). On the GPU one fused kernel (the
    sdpa op); models hold q | k | v packed and run ``attention`` instead, which needs no transposes."""
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"scaled_dot_product_attention: q {q.shape}, k {k.shape}, v {v.shape}: expected 4-D, alike")
    batch, heads, seq, head_dim = q.shape
    if mask is not None and mask.shape != (batch, seq):
        expected = (batch, seq)
        raise ValueError(f"scaled_dot_product_attention: mask {mask.shape}, expected an additive key mask {expected}")
    shape = (batch, heads, seq, head_dim)
    dtype = _float_dtype("scaled_dot_product_attention", q, k, v, mask)
    if not _on_cuda(q, k, v, mask):
        _note("sdpa", shape, dtype, {})
        return _cpu(_sdpa_np(_f32(q), _f32(k), _f32(v), None if mask is None else _f32(mask)), dtype)
    mask = _zeros((batch, seq), dtype) if mask is None else mask
    out = Tensor.empty(shape, dtype, "cuda")
    _launch("sdpa", shape, dtype, {}, {"q": q, "k": k, "v": v, "mask": mask, "out": out})
    return out


__all__ = [
    "activation",
    "add",
    "attention",
    "bias_act",
    "embedding",
    "fused_mlp",
    "gelu",
    "layernorm",
    "linear",
    "matmul",
    "narrow",
    "planning",
    "recording",
    "relu",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
    "using_registry",
]
