"""Layers on the runtime's ops: Linear, MLP (fused), LayerNorm, MultiHeadAttention,
TransformerEncoderLayer (BERT-style, post-LN), Embeddings, Sequential.

Parameters are runtime Tensors. ``Module.to(device, dtype)`` moves them (integer tensors keep their
dtype). Weights of linear layers are stored (in_features, out_features); ``from_torch`` constructors
take torch's (out_features, in_features) arrays and transpose once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kernelmill.kernels.ops.base import numpy_dtype
from kernelmill.runtime import ops
from kernelmill.runtime.tensor import FLOAT_DTYPES, Tensor, nested_array

_BF16 = numpy_dtype("bfloat16")


def _param(a: Any) -> Tensor:
    if isinstance(a, Tensor):
        return a
    a = host_array(a)  # a torch Parameter (requires grad) or a bfloat16 tensor too
    return Tensor.from_numpy(a.astype(np.float32) if a.dtype.kind == "f" or a.dtype == _BF16 else a)


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest of the sorted ``buckets`` that holds ``size``; ``size`` itself past the largest."""
    return next((b for b in buckets if b >= size), size)


#: What ``Module.prepare_padded`` returns besides the tensors: takes the padding off forward's output.
Restore = Callable[[Tensor], Tensor]


class Module:
    """A tree of layers; tensors and modules held in attributes (or lists of modules) are its parts."""

    #: Each output row (every dim but the last) depends on the same input row only, so padding the rows
    #: with zeros changes no output row (Linear, MLP, LayerNorm, activations and Sequentials of them).
    rowwise = False

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def named_tensors(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        for name, value in vars(self).items():
            if isinstance(value, Tensor):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value.named_tensors(f"{prefix}{name}.")
            elif isinstance(value, list | tuple):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield from item.named_tensors(f"{prefix}{name}.{i}.")

    def to(self, device: str | None = None, dtype: str | None = None) -> Module:
        """Moves every parameter to ``device`` and float parameters to ``dtype`` (in place; returns self)."""
        for name, value in list(vars(self).items()):
            if isinstance(value, Tensor):
                want = dtype if dtype and value.dtype in FLOAT_DTYPES else value.dtype
                setattr(self, name, value.to(device or value.device, want))
            elif isinstance(value, Module):
                value.to(device, dtype)
            elif isinstance(value, list | tuple):
                for item in value:
                    if isinstance(item, Module):
                        item.to(device, dtype)
        return self

    @property
    def device(self) -> str:
        for _, t in self.named_tensors():
            return t.device
        return "cpu"

    @property
    def dtype(self) -> str:
        for _, t in self.named_tensors():
            if t.dtype in FLOAT_DTYPES:
                return t.dtype
        return "float32"

    def num_parameters(self) -> int:
        return sum(t.numel for _, t in self.named_tensors())

    def prepare(self, *inputs: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        """Host-side preparation of forward's inputs into device tensors of the right dtype (what a CUDA
        graph replays with); the default converts every input to the module's device and float dtype."""
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no keyword inputs")
        device, dtype = self.device, self.dtype
        return tuple(_as_input(x, device, dtype, ints_are_values=self.rowwise) for x in inputs)

    def forward_prepared(self, *tensors: Tensor) -> Tensor:
        """forward on prepare()'s tensors: device work only (no host syncs), so it can be captured."""
        return self.forward(*tensors)

    @property
    def in_features(self) -> int | None:
        """The size of the last dim a row-wise module's input must have; None where any size goes."""
        return None

    @property
    def pads_inputs(self) -> bool:
        """Whether ``prepare_padded`` pads (``Model(..., buckets=)``): row-wise modules pad their rows."""
        return self.rowwise

    def prepare_padded(self, buckets: Sequence[int], *inputs: Any, **kwargs: Any) -> tuple[tuple, Restore | None]:
        """``prepare``, with the input's rows (every dim but the last, flattened) padded with zeros up to the
        smallest of ``buckets`` that holds them, so that inputs of many sizes share a few shapes (and CUDA
        graphs). Returns the tensors and what takes the padding off the output (None where the input is left as
        it is: a matrix whose rows fill their bucket, rows past the largest bucket, a module that is not
        row-wise)."""
        prepared = self.prepare(*inputs, **kwargs)
        if not self.rowwise or len(prepared) != 1 or prepared[0].ndim < 2:
            return prepared, None
        x = prepared[0]
        lead, features = x.shape[:-1], x.shape[-1]
        if self.in_features is not None and features != self.in_features:  # said of the input as given, unpadded
            raise ValueError(
                f"input {x.shape}: its last dim must be {self.in_features}, the features {type(self).__name__} takes"
            )
        rows = math.prod(lead)
        size = bucket_for(rows, buckets)
        if size == rows and x.ndim == 2:
            return prepared, None
        if size == rows:  # as (rows, features), the shape a padded input of this bucket has
            padded = x.reshape(rows, features)
        else:
            padded = Tensor.zeros((size, features), x.dtype, x.device)
            padded.rows(0, rows).copy_(x.reshape(rows, features))
        return (padded,), lambda out: out.rows(0, rows).reshape(*lead, out.shape[-1])

    def resize_inputs(self, size: int, *inputs: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]] | None:
        """Inputs like these (an example request) with the dimension ``prepare_padded`` pads made ``size`` long,
        their values repeated or cut, as host arrays: what ``Model.capture_buckets`` captures a bucket with.
        None where the module does not pad to ``size``; row-wise modules take one input of rows."""
        if not self.rowwise:
            raise ValueError(f"{type(self).__name__} has no dimension to pad")
        if len(inputs) != 1 or kwargs:
            raise TypeError(f"{type(self).__name__} takes one input (rows x features)")
        x = host_array(inputs[0])
        if x.ndim < 2:
            raise ValueError(f"the example input must have rows (at least 2 dims), got shape {x.shape}")
        return (np.resize(x.reshape(-1, x.shape[-1]), (size, x.shape[-1])),), {}


def host_array(x: Any) -> np.ndarray:
    """An input (array, nested lists, Tensor on any device, torch tensor) as a NumPy array on the host."""
    if isinstance(x, Tensor):
        return x.numpy()
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: the same bits, as ml_dtypes' bfloat16
            return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
        return t.numpy()
    return nested_array(x)


def _as_input(x: Any, device: str, dtype: str, ints_are_values: bool = False) -> Tensor:
    from kernelmill.runtime.tensor import as_tensor

    t = as_tensor(x)
    # A row-wise module's integers are values in the model's dtype, as float64 always was (an int64 input failed
    # in the first op with "expected tensors of one float dtype"); elsewhere they may be indices: kept.
    numeric = t.dtype in FLOAT_DTYPES or (ints_are_values and t.dtype in ("int32", "int64"))
    return t.to(device, dtype if numeric else t.dtype)


class Linear(Module):
    """y = act(x @ weight + bias); weight (in_features, out_features)."""

    rowwise = True

    def __init__(self, weight: Any, bias: Any = None, act: str = "none") -> None:
        self.weight = _param(weight)
        self.bias = None if bias is None else _param(bias)
        self.act = ops.canonical_act(act)

    @classmethod
    def from_torch(cls, weight: Any, bias: Any = None, act: str = "none") -> Linear:
        """From torch's (out_features, in_features) weight."""
        return cls(np.ascontiguousarray(host_array(weight).astype(np.float32).T), bias, act)

    @classmethod
    def random(cls, in_features: int, out_features: int, act: str = "none", seed: int = 0) -> Linear:
        rng = np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(in_features)
        w = rng.uniform(-bound, bound, (in_features, out_features)).astype(np.float32)
        return cls(w, rng.uniform(-bound, bound, out_features).astype(np.float32), act)

    @property
    def in_features(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias, self.act)


class MLP(Module):
    """y = act(x @ w1 + b1) @ w2 + b2 as one fused_mlp kernel."""

    rowwise = True

    def __init__(self, up: Linear, down: Linear, act: str = "gelu_erf") -> None:
        if up.bias is None or down.bias is None:
            raise ValueError("MLP needs biases on both projections (fused_mlp adds them)")
        self.up, self.down = up, down
        self.act = ops.canonical_act(act)

    @classmethod
    def random(cls, d_in: int, d_hidden: int, d_out: int, act: str = "gelu_erf", seed: int = 0) -> MLP:
        return cls(Linear.random(d_in, d_hidden, seed=seed), Linear.random(d_hidden, d_out, seed=seed + 1), act)

    @property
    def in_features(self) -> int:
        return self.up.in_features

    def forward(self, x: Tensor) -> Tensor:
        return ops.fused_mlp(x, self.up.weight, self.up.bias, self.down.weight, self.down.bias, self.act)


def _kernel_eps(eps: float) -> float:
    """``eps``, or the GPU layernorm kernels' eps it is a rounding of (a config written from a float32, 1e-12 as
    9.99999996e-13): the kernels bake their eps into the source, and take only those."""
    from kernelmill.kernels.ops.layernorm import EPS_VALUES

    return next((e for e in EPS_VALUES if abs(eps - e) <= 1e-6 * e), eps)


class LayerNorm(Module):
    rowwise = True

    def __init__(self, gamma: Any, beta: Any, eps: float = 1e-12) -> None:
        self.gamma, self.beta, self.eps = _param(gamma), _param(beta), _kernel_eps(float(eps))

    @property
    def in_features(self) -> int:
        return self.gamma.shape[0]

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """LayerNorm(x), or LayerNorm(x + residual) in one kernel."""
        return ops.layernorm(x, self.gamma, self.beta, self.eps, residual)


class Activation(Module):
    rowwise = True

    def __init__(self, act: str) -> None:
        self.act = ops.canonical_act(act)

    def forward(self, x: Tensor) -> Tensor:
        return ops.activation(x, self.act)


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        self.layers = list(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Module:
        return self.layers[i]

    @property
    def rowwise(self) -> bool:
        return all(layer.rowwise for layer in self.layers)

    @property
    def in_features(self) -> int | None:
        # The first layer that fixes a width; the ones before it (activations) keep any.
        return next((layer.in_features for layer in self.layers if layer.in_features is not None), None)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MultiHeadAttention(Module):
    """Self-attention: one fused q|k|v projection, the attention kernel, the output projection."""

    def __init__(self, qkv: Linear, out: Linear, heads: int) -> None:
        ops.check_heads("MultiHeadAttention", heads)
        if qkv.out_features != 3 * out.in_features or out.in_features % heads:
            raise ValueError(f"qkv {qkv.weight.shape} / out {out.weight.shape} do not fit {heads} heads")
        self.qkv, self.out, self.heads = qkv, out, int(heads)

    @classmethod
    def from_torch(cls, wq, bq, wk, bk, wv, bv, wo, bo, heads: int) -> MultiHeadAttention:
        """From torch-layout (out, in) q, k, v and output projections (BERT's query/key/value/output.dense)."""
        w = np.concatenate([host_array(a).astype(np.float32) for a in (wq, wk, wv)], axis=0)
        b = np.concatenate([host_array(a).astype(np.float32) for a in (bq, bk, bv)])
        return cls(Linear.from_torch(w, b), Linear.from_torch(wo, bo), heads)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (batch, seq, hidden), additive key mask (batch, seq) or None."""
        return self.out(ops.attention(self.qkv(x), self.heads, mask))


class TransformerEncoderLayer(Module):
    """BERT's layer (post-LN): x = LN1(x + Attn(x)); x = LN2(x + MLP(x)), the MLP fused (GELU erf by default)."""

    def __init__(self, attn: MultiHeadAttention, ln1: LayerNorm, mlp: MLP, ln2: LayerNorm) -> None:
        self.attn, self.ln1, self.mlp, self.ln2 = attn, ln1, mlp, ln2

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.ln1(self.attn(x, mask), residual=x)
        return self.ln2(self.mlp(x), residual=x)


class Embeddings(Module):
    """word + position + token type embeddings, then LayerNorm (BERT)."""

    def __init__(self, word: Any, pos: Any, types: Any, ln: LayerNorm) -> None:
        self.word, self.pos, self.types, self.ln = _param(word), _param(pos), _param(types), ln

    def forward(self, ids: Any, type_ids: Any = None) -> Tensor:
        return self.ln(ops.embedding(ids, self.word, self.pos, self.types, type_ids))
