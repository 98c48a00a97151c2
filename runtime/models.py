"""Models: a Module tree plus its device, dtype, kernel registry and CUDA graphs; loading from disk.

``load_model(path, device=, dtype=)`` reads

* a HuggingFace BERT checkpoint directory (config.json + model.safetensors, or pytorch_model.bin, or the shards
  either's index names; ``model_type`` bert, or none and ``architectures`` naming BERT classes only):
  ``BertModel``, whose forward gives the last hidden state. Encoders with absolute
  position embeddings only (``is_decoder``, cross-attention and relative positions are refused); every tensor is
  checked against the config's sizes at load, and tensors left unused (more layers than ``num_hidden_layers``)
  are an error, but for what HF's BertModel leaves unused too (id buffers, the pooler, task heads of a
  ``bert.``-prefixed one, or of one under any other single prefix);
* a PyTorch state_dict file (torch.load on the CPU) of an MLP: Linear weights and biases only, run in the
  state_dict's order (a module's registration order). Blocks ``nn.Sequential(nn.Linear, act, nn.Linear)``
  (keys ``<i>.0.weight``, ``<i>.2.weight``) become fused MLP layers, any other names (a flat
  ``nn.Sequential(Linear, act, ..., Linear)``, ``fc1``/``fc2``, a ModuleList of Linears and a head) one chain
  of Linear layers with the activation in their epilogue (but between Sequential indices in a row of a module
  whose indices show a gap elsewhere, where nothing sits; a module's Linears all at indices in a row take what
  ``act=`` says, 'none' or the activation between each two, and are refused where it is not said). The
  activation is ``act=`` (or an ``"act"`` entry
  next to ``"state_dict"`` in the file); other entries (LayerNorm, BatchNorm, ...) are refused by name, and
  so are layouts whose activations a state_dict cannot place (several multi-Linear modules that are not a
  Sequential of Sequentials, a block of one Linear).

``Model.forward`` on "cuda" runs the first call(s) with plain launches (kernels are resolved, compiled
and loaded then), then captures a CUDA graph per input signature and replays it; where capture fails it
logs why once and keeps plain launches. On "cpu" it runs the NumPy float32 ops.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import re
import statistics
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kernelmill.kernels.ops.base import SpecError, Tolerance, format_shape
from kernelmill.kernels.verify import compare
from kernelmill.runtime import ops
from kernelmill.runtime.backend import on_device
from kernelmill.runtime.graph import GraphUnavailable
from kernelmill.runtime.nn import (
    MLP,
    Embeddings,
    LayerNorm,
    Linear,
    Module,
    MultiHeadAttention,
    Restore,
    Sequential,
    TransformerEncoderLayer,
    bucket_for,
    host_array,
)
from kernelmill.runtime.tensor import FLOAT_DTYPES, Tensor, numpy_dtype
from kernelmill.settings import get_settings

log = logging.getLogger(__name__)


# -- BERT -------------------------------------------------------------------------------------------------


def _shaped_like(name: str, a: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A per-token input (mask, token types) as an array of input_ids' shape, or a ValueError naming both."""
    arr = host_array(a)
    if arr.shape != shape and not (arr.ndim == 1 and (1, *arr.shape) == shape):
        raise ValueError(f"{name} has shape {arr.shape}; input_ids has {shape}")
    return arr.reshape(shape)


#: Checkpoint tensors that BertModel leaves unused, as HF's BertModel does (the position and token type id
#: buffers, the pooler); with a ``bert.`` prefix, the tensors outside it (MLM / NSP heads, a classifier) too.
_BERT_UNUSED = ("embeddings.position_ids", "embeddings.token_type_ids", "pooler.")

#: The config fields that size BERT's tensors, with the tensor (and axis) each is read from where the config
#: does not give it.
_BERT_DIM_SOURCES = {
    "vocab_size": ("embeddings.word_embeddings.weight", 0),
    "hidden_size": ("embeddings.word_embeddings.weight", 1),
    "max_position_embeddings": ("embeddings.position_embeddings.weight", 0),
    "type_vocab_size": ("embeddings.token_type_embeddings.weight", 0),
    "intermediate_size": ("encoder.layer.0.intermediate.dense.weight", 0),
}


def check_bert_config(config: dict[str, Any], where: str = "config.json") -> None:
    """A ValueError for a BERT config the runtime would run as another model than HF does: a decoder (HF masks
    its attention causally), cross-attention, relative positions, an activation it has no kernel for."""
    for flag, why in (
        ("is_decoder", "a BERT decoder masks attention causally, which the runtime does not (BERT encoders only)"),
        ("add_cross_attention", "cross-attention layers are not supported (BERT encoders only)"),
    ):
        if config.get(flag):
            raise ValueError(f"{where}: {flag} is {json.dumps(config[flag])}: {why}")
    position = config.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(f"{where}: position_embedding_type {position!r} is not supported (absolute only)")
    act = config.get("hidden_act", "gelu")
    if not isinstance(act, str):  # null read as "none": the model ran without its activation
        raise ValueError(f"{where}: hidden_act must name an activation, got {json.dumps(act)}")
    try:
        ops.canonical_act(act)
    except ValueError as exc:
        raise ValueError(f"{where}: hidden_act: {exc}") from None
    eps = config.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise ValueError(f"{where}: layer_norm_eps must be a small positive number, got {eps!r}")


_WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"


def _bert_prefix(sd: dict[str, Any]) -> str:
    """What a checkpoint's BERT tensors are named under: "" for a BertModel's, "bert." for a BertForMaskedLM's,
    or whatever one prefix its word embeddings sit under (a model that holds a BERT as ``encoder``, say)."""
    found = [k[: -len(_WORD_EMBEDDINGS)] for k in sd if k == _WORD_EMBEDDINGS or k.endswith("." + _WORD_EMBEDDINGS)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"checkpoint has no {_WORD_EMBEDDINGS}, under any prefix: not a BERT checkpoint")
    raise ValueError(
        f"checkpoint holds {len(found)} BERT models ({', '.join(repr(f) for f in sorted(found)[:4])} prefixes): "
        "save the one to load on its own"
    )


def _bert_dims(config: dict[str, Any], shape_of: Callable[[str], tuple[int, ...]]) -> dict[str, tuple[int, str]]:
    """Each of ``_BERT_DIM_SOURCES``' fields as (its value, where it comes from): the config, else the
    checkpoint tensor ``shape_of`` gives the shape of."""
    dims = {}
    for field, (tensor, axis) in _BERT_DIM_SOURCES.items():
        value = config.get(field)
        if value is None:
            shape = shape_of(tensor)
            if len(shape) != 2:
                raise ValueError(f"checkpoint tensor {tensor} has shape {shape}; a matrix was expected")
            dims[field] = shape[axis], tensor
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json: {field} must be a positive whole number, got {value!r}")
        else:
            dims[field] = value, "config.json"
    hidden, heads = dims["hidden_size"][0], int(config["num_attention_heads"])
    if hidden % heads:
        raise ValueError(
            f"hidden_size {hidden} (from {dims['hidden_size'][1]}) is not a multiple of num_attention_heads {heads}"
        )
    return dims


def _type_ids(types: np.ndarray, type_vocab: int) -> np.ndarray:
    """token_type_ids as int64, or an error: whole numbers (integers, or floats without a fraction) in
    0..type_vocab-1."""
    if types.dtype.kind == "f":
        fraction = ~np.isfinite(types) | (types != np.round(types))
        if fraction.any():
            raise ValueError(
                f"token_type_ids must be whole numbers 0..{type_vocab - 1}, got {types[fraction].flat[0]:g}"
            )
    elif types.dtype.kind not in "iub":
        raise ValueError(f"token_type_ids must be integers 0..{type_vocab - 1}, got dtype {types.dtype}")
    if types.size and (types.min() < 0 or types.max() >= type_vocab):
        raise IndexError(f"token_type_ids out of range 0..{type_vocab - 1} (type_vocab_size {type_vocab})")
    return types.astype(np.int64)


class BertModel(Module):
    """BERT's encoder (HF BertModel without the pooler): forward(input_ids, attention_mask=None,
    token_type_ids=None) -> last hidden state (batch, seq, hidden)."""

    def __init__(self, embeddings: Embeddings, layers: list[TransformerEncoderLayer], config: dict[str, Any]) -> None:
        self.embeddings = embeddings
        self.layers = list(layers)
        self.config = dict(config)

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    def prepare(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> tuple:
        ids = host_array(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integers of shape (batch, seq), got {ids.dtype} {ids.shape}")
        if not ids.shape[1]:
            raise ValueError(f"input_ids has no tokens (shape {ids.shape}): a sequence needs at least one")
        vocab = self.embeddings.word.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise IndexError(f"input_ids out of range 0..{vocab - 1}")
        types = None
        if token_type_ids is not None:
            types = _type_ids(_shaped_like("token_type_ids", token_type_ids, ids.shape), self.embeddings.types.shape[0])
        device, dtype = self.device, self.dtype
        mask = None
        if attention_mask is not None:
            # Any nonzero value keeps its token, as HF reads the mask (a 2 here once overflowed the softmax). A
            # masked key scores -inf, as transformers' default (sdpa) attention masks: a sequence with no real
            # token then gives 0 from attention, as there, not the even average of its eager attention's
            # lowest-value mask, and padding keys to a bucket changes nothing in it either.
            masked = _shaped_like("attention_mask", attention_mask, ids.shape) == 0
            mask = np.where(masked, -np.inf, 0.0).astype(numpy_dtype(dtype))
        if device == "cpu":
            ids_t = Tensor.from_numpy(ids.astype(np.int64))
            types_t = None if types is None else Tensor.from_numpy(types.astype(np.int64))
            mask_t = None if mask is None else Tensor.from_numpy(mask, "cpu", dtype)
            return ids_t, types_t, mask_t
        ids_t = ops.device_ids(ids, dtype)
        types_t = None if types is None else ops.device_ids(types, dtype)
        mask_t = None if mask is None else Tensor.from_numpy(mask, "cuda", dtype)
        return ids_t, types_t, mask_t

    pads_inputs = True

    def prepare_padded(
        self, buckets: Sequence[int], input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None
    ) -> tuple[tuple, Restore | None]:
        """``prepare`` with the sequence padded up to the smallest of ``buckets`` that holds it (at most the
        position embeddings): padded tokens are masked out as keys, so no real token's output changes, and the
        output is cut back to the real tokens. A sequence that fills its bucket gets a mask too (all ones), so
        it replays the bucket's graph."""
        ids = host_array(input_ids)
        ids = ids[None] if ids.ndim == 1 else ids
        seq = ids.shape[-1] if ids.ndim == 2 else 0
        size = bucket_for(seq, buckets)
        unpadded = ids.ndim != 2 or not seq or ids.dtype.kind not in "iu"  # wrong: prepare says so, of the ids given
        if unpadded or size not in buckets or size > self.embeddings.pos.shape[0]:
            return self.prepare(input_ids, attention_mask, token_type_ids), None  # which says what is wrong
        pad = ((0, 0), (0, size - seq))
        mask = np.ones(ids.shape)
        if attention_mask is not None:
            mask = _shaped_like("attention_mask", attention_mask, ids.shape)
        types = None
        if token_type_ids is not None:
            types = np.pad(_shaped_like("token_type_ids", token_type_ids, ids.shape), pad)
        prepared = self.prepare(np.pad(ids, pad), np.pad(mask, pad), types)
        return prepared, None if size == seq else lambda out: ops.narrow(out, seq)

    def resize_inputs(
        self, size: int, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None
    ) -> tuple[tuple, dict[str, Any]] | None:
        """An example request's inputs with the sequence made ``size`` long (tokens repeated or cut), the batch
        and the optional inputs as they were; None past the position embeddings (not padded)."""
        if size > self.embeddings.pos.shape[0]:
            return None
        ids = host_array(input_ids)
        ids = ids[None] if ids.ndim == 1 else ids
        if ids.ndim != 2 or not ids.shape[1]:
            raise ValueError(f"input_ids must be of shape (batch, seq) with seq >= 1, got {ids.shape}")
        cols = np.arange(size) % ids.shape[1]
        given = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
        extra = {k: _shaped_like(k, v, ids.shape)[:, cols] for k, v in given.items() if v is not None}
        return (ids[:, cols],), extra

    def forward_prepared(self, ids: Tensor, type_ids: Tensor | None, mask: Tensor | None) -> Tensor:
        x = self.embeddings(ids, type_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def forward(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> Tensor:
        return self.forward_prepared(*self.prepare(input_ids, attention_mask, token_type_ids))

    @classmethod
    def from_state_dict(cls, sd: dict[str, np.ndarray], config: dict[str, Any]) -> BertModel:
        """BERT from a HF checkpoint's tensors (``bert.``-prefixed ones too, as a BertForMaskedLM's). Every
        tensor is checked against the shape the config gives it; a tensor left unused (another layer, say)
        is an error, except those HF's BertModel leaves unused too (see ``_BERT_UNUSED``)."""
        check_bert_config(config)
        prefix = _bert_prefix(sd)
        layer_re = re.compile(rf"{re.escape(prefix)}encoder\.layer\.(\d+)\.")
        held = {int(m.group(1)) for k in sd if (m := layer_re.match(k))}
        if config.get("num_hidden_layers") is None:  # transformers would take 12; the tensors say how many
            if not held:
                raise ValueError(
                    f"checkpoint has no {prefix}encoder.layer.* tensors and config.json no num_hidden_layers"
                )
            config = {**config, "num_hidden_layers": max(held) + 1}
        used: set[str] = set()

        def key_of(name: str) -> str:
            for key in (prefix + name, prefix + name.replace(".weight", ".gamma").replace(".bias", ".beta")):
                if key in sd:
                    return key
            if (m := layer_re.match(prefix + name)) and int(m.group(1)) not in held:
                raise ValueError(
                    f"checkpoint has no encoder layer {m.group(1)}: it holds {len(held)} "
                    f"(num_hidden_layers is {config['num_hidden_layers']} in config.json)"
                )
            raise ValueError(f"checkpoint has no {prefix + name}")

        dims = _bert_dims(config, lambda name: tuple(np.shape(sd[key_of(name)])))

        def get(name: str, *fields: str) -> np.ndarray:
            key = key_of(name)
            arr = np.asarray(sd[key])
            if _not_weights(arr):
                raise ValueError(
                    f"checkpoint tensor {key} holds {arr.dtype} values; the model needs floating-point weights "
                    "(quantized checkpoints are not supported)"
                )
            arr = arr.astype(np.float32)
            want = tuple(dims[f][0] for f in fields)
            if arr.shape != want:
                sources = ", ".join(
                    f"{f}={dims[f][0]} {'in' if dims[f][1] == 'config.json' else 'as'} {dims[f][1]}"
                    for f in dict.fromkeys(fields)
                )
                raise ValueError(f"checkpoint tensor {key} has shape {arr.shape}; the model needs {want} ({sources})")
            used.add(key)
            return arr

        eps = float(config.get("layer_norm_eps", 1e-12))
        heads = int(config["num_attention_heads"])
        act = ops.canonical_act(config.get("hidden_act", "gelu"))
        h, inter = "hidden_size", "intermediate_size"

        def ln(name: str) -> LayerNorm:
            return LayerNorm(get(f"{name}.weight", h), get(f"{name}.bias", h), eps)

        def dense(name: str, out_f: str, in_f: str) -> tuple[np.ndarray, np.ndarray]:
            return get(f"{name}.weight", out_f, in_f), get(f"{name}.bias", out_f)

        emb = Embeddings(
            get("embeddings.word_embeddings.weight", "vocab_size", h),
            get("embeddings.position_embeddings.weight", "max_position_embeddings", h),
            get("embeddings.token_type_embeddings.weight", "type_vocab_size", h),
            ln("embeddings.LayerNorm"),
        )
        layers = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            attn = MultiHeadAttention.from_torch(
                *(a for n in ("query", "key", "value") for a in dense(f"{p}attention.self.{n}", h, h)),
                *dense(f"{p}attention.output.dense", h, h),
                heads,
            )
            up = Linear.from_torch(*dense(f"{p}intermediate.dense", inter, h))
            down = Linear.from_torch(*dense(f"{p}output.dense", h, inter))
            layers.append(
                TransformerEncoderLayer(
                    attn, ln(f"{p}attention.output.LayerNorm"), MLP(up, down, act), ln(f"{p}output.LayerNorm")
                )
            )
        unused = [
            k for k in sd if k.startswith(prefix) and k not in used and not k[len(prefix) :].startswith(_BERT_UNUSED)
        ]
        if unused:
            more = f" and {len(unused) - 4} more" if len(unused) > 4 else ""
            deeper = {int(m.group(1)) for k in unused if (m := layer_re.match(k))}
            why = ""
            if deeper and max(deeper) >= len(layers):
                why = f" (it has {max(deeper) + 1} encoder layers; num_hidden_layers is {len(layers)})"
            raise ValueError(f"checkpoint tensors the model does not use{why}: {', '.join(unused[:4])}{more}")
        return cls(emb, layers, config)

    @classmethod
    def random(cls, config: dict[str, Any], seed: int = 0) -> BertModel:
        """Random weights of BERT's shapes (benchmarks): N(0, 0.02) like HF's init, LayerNorm 1 / 0."""
        rng = np.random.default_rng(seed)
        h, inter = int(config["hidden_size"]), int(config["intermediate_size"])
        sd: dict[str, np.ndarray] = {}

        def normal(*shape):
            return rng.normal(0.0, 0.02, shape).astype(np.float32)

        sd["embeddings.word_embeddings.weight"] = normal(int(config["vocab_size"]), h)
        sd["embeddings.position_embeddings.weight"] = normal(int(config["max_position_embeddings"]), h)
        sd["embeddings.token_type_embeddings.weight"] = normal(int(config.get("type_vocab_size", 2)), h)
        names = [("attention.self.query", h, h), ("attention.self.key", h, h), ("attention.self.value", h, h)]
        names += [("attention.output.dense", h, h), ("intermediate.dense", inter, h), ("output.dense", h, inter)]
        lns = ["embeddings.LayerNorm"]
        for i in range(int(config["num_hidden_layers"])):
            for name, out_f, in_f in names:
                sd[f"encoder.layer.{i}.{name}.weight"] = normal(out_f, in_f)
                sd[f"encoder.layer.{i}.{name}.bias"] = normal(out_f)
            lns += [f"encoder.layer.{i}.attention.output.LayerNorm", f"encoder.layer.{i}.output.LayerNorm"]
        for name in lns:
            sd[f"{name}.weight"] = np.ones(h, np.float32)
            sd[f"{name}.bias"] = np.zeros(h, np.float32)
        return cls.from_state_dict(sd, {"layer_norm_eps": 1e-12, "hidden_act": "gelu", **config})


# -- MLPs from torch state dicts -----------------------------------------------------------------------


def _key(name: str, leaf: str) -> str:
    return f"{name}.{leaf}" if name else leaf


def _not_weights(arr: np.ndarray) -> bool:
    """Whether an array holds what no layer's weights are: integers or booleans (a quantized checkpoint's, ids,
    counters), or complex numbers (cast to float, their imaginary parts were dropped)."""
    return arr.dtype.kind in "biucOSUV" and arr.dtype != numpy_dtype("bfloat16")


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        if getattr(value, "is_meta", False):
            return f"shape {tuple(shape)} on the meta device, without values"
        dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
        floating = dtype.startswith(("float", "bfloat", "half", "double"))
        return f"shape {tuple(shape)}" + ("" if floating or not dtype else f" of {dtype}")
    return "a dict" if isinstance(value, dict) else f"not a tensor: {type(value).__name__}"


def _float_array(value: Any) -> np.ndarray | None:
    """A state_dict entry as a float32 array, or None where it is not an array of floating-point numbers (an
    integer, boolean or complex tensor, or one on torch's meta device, which holds no values)."""
    if isinstance(value, dict | str | bytes) or value is None or getattr(value, "is_meta", False):
        return None
    try:
        arr = np.asarray(host_array(value))
    except (TypeError, ValueError):
        return None
    return None if _not_weights(arr) else arr.astype(np.float32)


def _sequential_blocks(names: list[str]) -> dict[str, list[str]] | None:
    """Linears named ``<prefix>.<i>.<j>`` or ``<prefix>.<i>`` (one prefix, at least one ``<i>.<j>``): a
    Sequential of Sequential blocks and lone Linears, as {block: its linears}; None for other names."""
    blocks: dict[str, list[str]] = {}
    prefixes = set()
    for name in names:
        parts = name.split(".")
        if not parts[-1].isdigit():
            return None
        nested = len(parts) >= 2 and parts[-2].isdigit()
        block = parts[:-1] if nested else parts
        prefixes.add(tuple(block[:-1]))
        blocks.setdefault(".".join(block), []).append(name)
    if len(prefixes) != 1 or all(len(linears) == 1 and linears[0] == block for block, linears in blocks.items()):
        return None
    return blocks


def _refuse_ambiguous_blocks(linears: list[str], blocks: dict[str, list[str]] | None, act: str | None) -> None:
    """A ValueError where a state_dict cannot say where the activations go: a Sequential block holding one
    Linear (``Sequential(Linear, act)`` or ``Sequential(Linear)``?), Linears grouped in several modules
    that are not a Sequential of Sequentials (a ModuleList of blocks, blocks and a head: an activation
    between blocks or not?), or, where ``act`` was not said (None), a module's Linears at indices in a row
    with no gap among them (a Sequential of Linears alone, or a ModuleList of Linears with the activation run
    between them in a loop?)."""
    how = (
        "save the stack as one flat nn.Sequential (act after every Linear but the last) or as an nn.Sequential "
        "of nn.Sequential(Linear, act, Linear) blocks and lone Linears (no activation between blocks), or "
        "rename the state_dict's keys to one of those layouts"
    )
    if blocks is not None:
        lone = [b for b, names in blocks.items() if len(names) == 1 and names[0] != b]
        if lone:
            raise ValueError(
                f"block {lone[0]} holds one Linear ({blocks[lone[0]][0]}.weight): whether an activation follows "
                f"it cannot be read from a state_dict; {how}"
            )
        return
    parents = collections.Counter(name.rpartition(".")[0] for name in linears)
    grouped = [p or "(top level)" for p, n in parents.items() if n > 1]
    if len(grouped) > 1:
        raise ValueError(
            f"the Linear layers sit in several modules ({', '.join(grouped[:4])}"
            f"{', ...' if len(grouped) > 4 else ''}): whether an activation runs between them cannot be read "
            f"from a state_dict; {how}"
        )
    if act is not None:  # said: 'none' runs nothing between Linears in a row, another runs it between each two
        return
    for parent in parents:
        indices = [name.rpartition(".")[2] for name in linears if name.rpartition(".")[0] == parent]
        numbered = len(indices) > 1 and all(i.isdigit() for i in indices)
        if numbered and all(int(b) - int(a) == 1 for a, b in itertools.pairwise(indices)):
            keys = ", ".join(_key(f"{parent}.{i}" if parent else i, "weight") for i in indices[:4])
            raise ValueError(
                f"{keys}{', ...' if len(indices) > 4 else ''} are Linears at indices in a row: an nn.Sequential "
                "of them has nothing between them, a ModuleList run in a loop an activation between each two, and "
                "a state_dict cannot say which: give act='none' (--act none) for the first, or the loop's "
                "activation (act='relu', --act relu, ...) for the second"
            )


#: What mlp_from_state_dict reads, for its errors.
_MLP_LAYOUT = (
    "an MLP state_dict holds Linear layers only, '<name>.weight' (2-D, out x in) and optionally '<name>.bias' "
    "(1-D), floating point, in the order they run (a module's state_dict order); the activation is act= (or an "
    "'act' entry next to 'state_dict' in the file), applied after every Linear but the last (of each block)"
)


def mlp_from_state_dict(sd: dict[str, Any], act: str | None = "relu") -> Sequential:
    """An MLP stack from a torch state_dict: its Linear layers run in the dict's order (a module's
    state_dict lists them in registration order). Linears named ``<i>.<j>`` (``nn.Sequential`` of
    ``nn.Sequential(Linear, act, Linear)`` blocks, lone Linears ``<i>`` among them) become one fused MLP
    layer per block, with no activation between blocks; any other names (a flat Sequential, fc1/fc2, a
    ModuleList of Linears and a head) are one chain with ``act`` after every Linear but the last; Sequential
    indices in a row (``0`` and ``1``) have no activation between them where a gap elsewhere among the
    module's Linears shows its activations are listed (``0``, ``1``, ``3``), and a gap has one (_acts_between);
    a module's Linears all at indices in a row are a Sequential of Linears alone or a ModuleList run in a loop:
    ``act`` decides ('none': nothing between them; another: it runs between each two; None, not said: relu
    elsewhere, and those a ValueError). Where the reading is a guess (_refuse_ambiguous_blocks), a ValueError.
    Entries that are not a Linear's 2-D weight or 1-D bias (LayerNorm, BatchNorm, other keys) are a
    ValueError."""
    said = act is not None
    act = ops.canonical_act(act or "relu")
    if names := [k for k in sd if not isinstance(k, str)]:
        raise ValueError(
            f"the state_dict has keys that are not names: {', '.join(map(repr, names[:4]))}; {_MLP_LAYOUT}"
        )
    arrays = {k: _float_array(v) for k, v in sd.items()}
    linears = []  # in the state_dict's order
    for key, a in arrays.items():
        name, _, leaf = key.rpartition(".")
        if leaf == "weight" and a is not None and a.ndim == 2:
            linears.append(name)
    names = set(linears)
    unknown = [
        f"{k} ({_describe(sd[k])})"
        for k, a in arrays.items()
        if not (a is not None and (k.rpartition(".")[0] in names and k.rpartition(".")[2] in ("weight", "bias")))
    ]
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ValueError(
            f"the state_dict has entries an MLP cannot run: {shown}; {_MLP_LAYOUT} "
            "(LayerNorm, BatchNorm, embeddings and other layers are not supported)"
        )
    if not linears:
        raise ValueError(f"the state_dict has no 2-D '<name>.weight' entries (Linear layers); {_MLP_LAYOUT}")
    # An nn.Embedding's table is a 2-D weight without a bias, as a bias-free Linear's is; a square one chains
    # and would run as a matrix product. Its name gives it away.
    for name in linears:
        last = name.rpartition(".")[2].lower()
        if _key(name, "bias") not in arrays and ("emb" in last or last in ("wte", "wpe")):
            raise ValueError(
                f"{_key(name, 'weight')} looks like an embedding table (module {name!r}, no bias), not a Linear; "
                f"{_MLP_LAYOUT} (an MLP fed token ids is not; a bias-free Linear so named: rename its key)"
            )
    for name in linears:
        weight, bias = arrays[_key(name, "weight")], arrays.get(_key(name, "bias"))
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(f"{_key(name, 'bias')} has shape {bias.shape} for {_key(name, 'weight')} {weight.shape}")
    for prev, cur in itertools.pairwise(linears):
        gives, takes = arrays[_key(prev, "weight")].shape[0], arrays[_key(cur, "weight")].shape[1]
        if takes != gives:
            raise ValueError(
                f"{_key(cur, 'weight')} takes {takes} inputs but {_key(prev, 'weight')} gives {gives}: the layers "
                f"do not chain (they run in the state_dict's order: {', '.join(_key(n, 'weight') for n in linears)})"
            )

    def make(name: str, layer_act: str) -> Linear:
        w = arrays[_key(name, "weight")]
        b = arrays.get(_key(name, "bias"))
        return Linear.from_torch(w, np.zeros(w.shape[0], np.float32) if b is None else b, layer_act)

    def chain(names: list[str]) -> list[Module]:
        if len(names) == 2:
            return [MLP(make(names[0], "none"), make(names[1], "none"), act)]
        return [make(n, act if i < len(names) - 1 else "none") for i, n in enumerate(names)]

    blocks = _sequential_blocks(linears)
    _refuse_ambiguous_blocks(linears, blocks, act if said else None)
    if act == "none":  # nothing runs between any two Linears
        return Sequential(*(make(name, "none") for name in linears))
    layers: list[Module] = []
    run = linears[:1]  # Linears with the activation between each two
    for cur, act_between in zip(linears[1:], _acts_between(linears, blocks), strict=True):
        if not act_between:
            layers += chain(run)
            run = []
        run.append(cur)
    return Sequential(*layers, *chain(run))


def _acts_between(linears: list[str], blocks: dict[str, list[str]] | None) -> list[bool]:
    """Whether the activation runs between each two Linears in a row. An nn.Sequential numbers every module,
    those without parameters too: where a module's Linears show a gap (0, 2, 3: its activations are listed),
    Linears at indices i and i + 1 have nothing between them (a Sequential(Linear, ReLU, Linear, Linear) ran
    with an activation added), and a gap holds a module without parameters, taken to be the activation, between
    blocks as inside one. Indices all in a row (a ModuleList's as well: act= decided, _refuse_ambiguous_blocks),
    Linears of different modules, and names that are not indices: the activation runs between every two."""
    if blocks is None:  # the index rule within a module whose Linears' indices show a gap (its activations listed)
        flat = [name.rpartition(".") for name in linears]
        listed = {
            parent
            for parent in {p for p, _, _ in flat}
            if all(i.isdigit() for p, _, i in flat if p == parent)
            and any(int(b[2]) - int(a[2]) > 1 for a, b in itertools.pairwise(flat) if a[0] == b[0] == parent)
        }
        return [
            not (a[0] == b[0] and a[0] in listed) or int(b[2]) - int(a[2]) != 1 for a, b in itertools.pairwise(flat)
        ]
    block_of = {name: block for block, names in blocks.items() for name in names}
    between = []
    for a, b in itertools.pairwise(linears):
        if block_of[a] == block_of[b]:  # <prefix>.<i>.<j>: the gap in j
            gap = int(b.rpartition(".")[2]) - int(a.rpartition(".")[2])
        else:  # the gap in i between the blocks (or lone Linears) holding them
            gap = int(block_of[b].rpartition(".")[2]) - int(block_of[a].rpartition(".")[2])
        between.append(gap != 1)
    return between


# -- the Model ---------------------------------------------------------------------------------------------

_NO_GRAPH = object()
#: A graph with some kernels launched on plain edges replaces the one kept so far only when it replays at
#: least this much faster (timing noise of a few replays is below it).
_EDGE_MIN_GAIN = 0.01
#: A stand-in for a default kernel replaces it only if the forward replays this much faster with it.
_KERNEL_MIN_GAIN = 0.02
#: Seconds each graph replays before a timing (after a capture or compile the GPU may idle at low clocks).
_WARMUP_S = 0.05
#: The least time each graph's turn of timed replays lasts (more replays for a fast forward).
_TURN_S = 0.002
#: Kernel and edge choices are remembered for later captures on the GPU model only where every graph timed for
#: them replayed within this share of its median from round to round. A choice timed while other work loaded
#: the GPU (an H200 beside a test suite: a batch-256 MLP's replays at 4x their time) was remembered, and every
#: later process ran its 0.89x-eager forward; such a choice now holds for its own process only. Measured on an
#: H200 (docs/PERFORMANCE.md): 1.8-7.7% on an idle GPU (the batch-256 MLP the widest), 25% beside a matmul loop.
_REMEMBER_MAX_SPREAD = 0.15


def _knobs(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def _buckets(buckets: Sequence[int] | None) -> tuple[int, ...] | None:
    if buckets is None:
        return None
    if isinstance(buckets, Iterator):  # a generator: read once, here (the check below consumed it)
        buckets = list(buckets)
    # A string is a sequence of digits ("32" gave buckets 2 and 3) and int() cuts 7.9 to 7: neither is taken.
    whole = isinstance(buckets, Iterable) and not isinstance(buckets, (str, bytes))
    whole = whole and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in buckets)
    if not whole:
        raise ValueError(f"buckets must be positive integers, got {buckets!r}")
    sizes = sorted({int(b) for b in buckets})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"buckets must be positive integers, got {buckets!r}")
    return tuple(sizes)


def _input_shapes(key: tuple) -> str:
    """A graph key's input shapes, for log lines."""
    return ", ".join("-" if k is None else format_shape(k[0]) for k in key[:-1])


def _host_output(graph: Any, prepared: tuple) -> np.ndarray:
    """The graph's output for ``prepared`` in float64 on the host."""
    return np.asarray(graph.replay(prepared, copy_output=False).numpy(), dtype=np.float64)


def _device_and_dtype(device: Any, dtype: str | None) -> tuple[str, str]:
    """("cpu" or "cuda", a float dtype: float16 on cuda, float32 on cpu by default), or a ValueError. Only
    cuda:0 is served, as by Tensor."""
    name = str(device)  # a torch.device too
    if name == "cuda:0":
        name = "cuda"
    elif name.startswith("cuda:") and name[5:].isdigit():
        raise ValueError(f"only cuda:0 is supported by the runtime for now, got {name!r}")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; use 'cpu' or 'cuda'")
    if dtype is None:
        dtype = "float16" if name == "cuda" else "float32"
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(FLOAT_DTYPES)}")
    return name, dtype


def _modules(module: Module) -> Iterator[Module]:
    """The module and every module inside it."""
    yield module
    for value in vars(module).values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, Module):
                yield from _modules(item)


def _check_gpu_eps(module: Module) -> None:
    """A ValueError where a LayerNorm's eps is none of the GPU layernorm kernels' (the eps is baked into
    their source); NumPy on the CPU takes any."""
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.ops.layernorm import EPS_VALUES

    for layer in _modules(module):
        if not isinstance(layer, LayerNorm):
            continue
        try:
            get_op("layernorm").resolve_attrs({"eps": layer.eps})
        except SpecError:
            what = "config.json's layer_norm_eps" if isinstance(module, BertModel) else "a LayerNorm's eps"
            allowed = ", ".join(f"{e:g}" for e in EPS_VALUES)
            raise ValueError(
                f"{what} is {layer.eps!r}, which the GPU's layernorm kernels do not take (they take {allowed}); "
                "device='cpu' runs any eps"
            ) from None


class Model:
    """A Module on a device with its dtype, kernel registry and (on the GPU) CUDA graphs.

    ``forward(*inputs)`` returns a Tensor on the model's device. ``kernel_report()`` lists the kernels
    its problems got (tuned / nearest / default)."""

    def __init__(
        self,
        module: Module,
        device: str = "cuda",
        dtype: str | None = None,
        *,
        registry: Any = None,
        server: str | None = None,
        graphs: bool = True,
        warmup: int = 1,
        pdl: bool | None = None,
        tune_kernels: bool | None = None,
        max_graphs: int | None = None,
        buckets: Sequence[int] | None = None,
    ) -> None:
        device, dtype = _device_and_dtype(device, dtype)
        #: The dtype asked for, which the CPU path computes in float32: what tune_model tunes kernels of.
        self.requested_dtype = dtype
        if device == "cpu" and dtype != "float32":
            log.info("runtime: the CPU path computes in float32 (asked for %s)", dtype)
            dtype = "float32"
        self.device, self.dtype = device, dtype
        self.backend = None
        if device == "cuda":
            _check_gpu_eps(module)
            from kernelmill.kernels.device import GpuUnavailable
            from kernelmill.runtime.backend import get_backend
            from kernelmill.runtime.registry import KernelRegistry

            try:
                self.backend = get_backend()
            except GpuUnavailable as exc:
                raise GpuUnavailable(f"{exc}; device='cpu' runs the model on NumPy") from None
            if registry is None:
                registry = KernelRegistry(server, backend=self.backend)
        self.registry = registry
        #: Sizes the module's variable dimension is padded up to (BERT: the sequence; row-wise modules: the
        #: rows), so inputs of many sizes share a few shapes, kernels and graphs; None: exact shapes.
        self.buckets = _buckets(buckets)
        if self.buckets and not module.pads_inputs:
            raise ValueError(
                f"buckets: {type(module).__name__} has no dimension to pad (BERT pads its sequence; Linear, MLP, "
                "LayerNorm and Sequentials of them their rows)"
            )
        self.module = module.to(device, dtype)
        self.graphs_enabled = graphs and device == "cuda"
        #: Graphs launch PDL kernels early (runtime/graph.py); default KERNELMILL_PDL. A graph is captured per
        #: input signature and setting, so flipping it between forwards compares the two.
        self.pdl = get_settings().pdl if pdl is None else bool(pdl)
        #: With ``pdl``, choose per kernel whether it launches early: capture the forward again with each
        #: kernel's edges plain, time a few replays (taking turns) and keep what is faster (``_tune_edges``);
        #: default KERNELMILL_PDL_TUNE.
        self.tune_pdl = get_settings().pdl_tune
        #: Before that, choose among the defaults' runners-up for each untuned kernel that has them: capture the
        #: forward with each in its place, check the output, time replays and keep the faster
        #: (``_tune_kernels``; the choice is recorded per GPU model and reused); default KERNELMILL_KERNEL_TUNE (on).
        self.tune_kernels = get_settings().kernel_tune if tune_kernels is None else bool(tune_kernels)
        self.warmup = max(1, int(warmup))
        #: CUDA graphs kept, one per input signature (each holds its forward's buffers); capturing one more
        #: releases the least recently replayed. Default KERNELMILL_MAX_GRAPHS.
        self.max_graphs = max(1, int(get_settings().max_graphs if max_graphs is None else max_graphs))
        self._graphs: OrderedDict[tuple, Any] = OrderedDict()  # least recently used first
        self._released = 0  # graphs closed to keep max_graphs
        self._timing_spread = 0.0  # the widest round-to-round spread of the replays timed for this capture
        self._calls: dict[tuple, int] = {}
        self._planned: set[tuple] = set()  # input signatures whose kernels the registry has resolved
        # The GPU parameters the graphs were captured with, watched: a graph launches its kernels on their
        # addresses, so once one is freed (a weight assigned anew, module.to()) the graphs are dropped.
        self._watched: list[weakref.ref] = []
        self._parameters_gone = threading.Event()  # set from a weakref callback, which may run on any thread
        self.problems: list[tuple] = []
        self.last_run = "none"  # "graph", "plain" or "cpu": how the last forward ran

    def __repr__(self) -> str:
        return f"Model({type(self.module).__name__}, device={self.device}, dtype={self.dtype})"

    def __call__(self, *inputs: Any, **kwargs: Any) -> Tensor:
        return self.forward(*inputs, **kwargs)

    def prepare(self, *inputs: Any, **kwargs: Any) -> tuple[tuple, Restore | None]:
        """The module's tensors for these inputs (padded up to a bucket where ``buckets`` is set), and what
        takes the padding off the output (None where nothing was padded)."""
        if self.buckets:
            return self.module.prepare_padded(self.buckets, *inputs, **kwargs)
        return self.module.prepare(*inputs, **kwargs), None

    @on_device
    def forward(self, *inputs: Any, **kwargs: Any) -> Tensor:
        """The module's output for these inputs, on the model's device. Any thread may call it (one forward runs
        at a time, ``on_device``)."""
        prepared, restore = self.prepare(*inputs, **kwargs)
        out = self._forward(prepared)
        return out if restore is None else restore(out)

    def capture_buckets(self, *inputs: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """Captures now, for each bucket, the CUDA graph that requests like this example (its batch, dtypes
        and optional inputs) replay once padded to that bucket, so that no request pays a capture (seconds
        each). The example's padded dimension (BERT's sequence, an MLP's rows) is repeated or cut to each
        bucket's size. Every bucket's kernels are planned first and compiled in one round (the defaults, then
        the runners-up that captures time). Returns a row per bucket: its size, the input shapes, how its
        forward now runs ("graph", or "plain" where capture failed) and the seconds its forwards took (the
        round of compiles is logged apart). A CPU model captures nothing."""
        if not self.buckets:
            raise ValueError("capture_buckets needs buckets: load_model(..., buckets=[...])")
        if len(self.buckets) > self.max_graphs:
            raise ValueError(
                f"capture_buckets: {len(self.buckets)} buckets but max_graphs={self.max_graphs}: the last captures "
                "would release the first (raise max_graphs or use fewer buckets)"
            )
        if self.device == "cpu":
            log.info("runtime: a CPU model has no CUDA graphs to capture")
            return []
        buckets = {}  # size -> (the example's input shapes, its tensors as a request of that size gets them)
        for size in self.buckets:
            resized = self.module.resize_inputs(size, *inputs, **kwargs)
            if resized is None:
                log.info("runtime: bucket %d skipped: %s does not pad to it", size, type(self.module).__name__)
                continue
            args, kw = resized
            shapes = ", ".join(format_shape(np.shape(a)) for a in (*args, *kw.values()))
            buckets[size] = shapes, self.prepare(*args, **kw)[0]
        self._compile_ahead([prepared for _, prepared in buckets.values()])
        rows = []
        for i, (size, (shapes, prepared)) in enumerate(buckets.items(), 1):
            start = time.perf_counter()
            out = self._until_captured(prepared)
            seconds = time.perf_counter() - start
            rows.append({"size": size, "inputs": shapes, "run": self.last_run, "seconds": seconds})
            log.info(
                "runtime: bucket %d/%d (%d): inputs %s, output %s, %s in %.2f s",
                i,
                len(buckets),
                size,
                shapes,
                format_shape(out.shape),
                self.last_run,
                seconds,
            )
        return rows

    @on_device
    def _until_captured(self, prepared: tuple) -> Tensor:
        """Forwards of these prepared inputs until one replays their graph (one where graphs are off); the last
        output, once the GPU is done."""
        for _ in range(self.warmup + 1 if self.graphs_enabled else 1):
            out = self._forward(prepared)
        self.backend.synchronize()
        return out

    @on_device
    def _compile_ahead(self, inputs: list[tuple]) -> None:
        """Plans the forwards of these prepared inputs and compiles what they need in one round: the missing
        defaults (``KernelRegistry.prepare``), then, where captures choose kernels, the runners-up of every
        default without a recorded choice (``compile_alternatives``)."""
        start = time.perf_counter()
        with ops.using_registry(self.registry):
            planned = self._plan(inputs)
            self.registry.prepare(planned)
            if self.tune_kernels and self.graphs_enabled:
                entries = {id(e): e for e in (self.registry.resolved(*p) for p in planned) if e is not None}
                self.registry.compile_alternatives(
                    [e for e in entries.values() if self.registry.remembered_choice(e) is None]
                )
        log.info(
            "runtime: kernels of %d input shapes planned and compiled in %.1f s",
            len(inputs),
            time.perf_counter() - start,
        )

    def _plan(self, inputs: list[tuple]) -> list:
        """The problems whose kernels the forwards of these prepared inputs launch, from a forward of each that
        launches nothing (``ops.planning``); inputs planned before are left out (their kernels are resolved)."""
        planned: list = []
        for prepared in inputs:
            key = self._key(prepared)
            if key not in self._planned:
                with ops.planning() as more:
                    self.module.forward_prepared(*prepared)
                planned += more
                self._planned.add(key)
        return planned

    def _key(self, prepared: tuple) -> tuple:
        """The graph key of prepared inputs: their shapes and dtypes, and the PDL setting."""
        return (*(None if t is None else (t.shape, t.dtype) for t in prepared), self.pdl)

    def _forward(self, prepared: tuple) -> Tensor:
        if self.device == "cpu":
            with ops.recording() as seen:
                out = self.module.forward_prepared(*prepared)
            self._remember(seen)
            self.last_run = "cpu"
            return out
        if self._parameters_gone.is_set():
            log.info(
                "runtime: the module's parameters were replaced since its CUDA graphs were captured: dropping them"
            )
            self.reset_graphs()
        key = self._key(prepared)
        graph = self._graphs.get(key)
        if graph is not None and graph is not _NO_GRAPH:
            self._graphs.move_to_end(key)
            try:
                out = graph.replay(prepared)
            except GraphUnavailable as exc:
                log.warning("runtime: dropping the CUDA graph for these inputs (%s); plain launches from now on", exc)
                graph.close()
                self._graphs[key] = graph = _NO_GRAPH
            else:
                self.last_run = "graph"
                return out
        with ops.using_registry(self.registry):
            self._calls[key] = self._calls.get(key, 0) + 1
            if key not in self._planned:  # a released graph's inputs come back with their kernels resolved
                # Before the first forward of these inputs the registry resolves the kernels it needs, compiling the
                # missing defaults together.
                self.registry.prepare(self._plan([prepared]))
            if graph is None and self.graphs_enabled and self._calls[key] > self.warmup:
                graph = self._capture(key, prepared)
                if graph is not _NO_GRAPH:
                    self.last_run = "graph"
                    return graph.replay(prepared)
            with ops.recording() as seen:
                out = self.module.forward_prepared(*prepared)
            self._remember(seen)
            self.last_run = "plain"
            return out

    def _capture(self, key: tuple, prepared: tuple) -> Any:
        from kernelmill.runtime.graph import CapturedForward

        shapes = _input_shapes(key)
        if not self._watched:
            gone = self._parameters_gone
            self._watched = [
                weakref.ref(t, lambda _ref: gone.set()) for _, t in self.module.named_tensors() if t.device == "cuda"
            ]
        graph, failures = None, []
        for pdl in (True, False) if self.pdl else (False,):
            try:
                with ops.recording() as problems:
                    graph = CapturedForward(
                        self.backend, self.module.forward_prepared, prepared, pdl=pdl, constants=self._constants()
                    )
                break
            except Exception as exc:  # noqa: BLE001 - any failure means plain launches, said once
                failures.append(f"{'with' if pdl else 'without'} PDL: {exc}")
        if failures:
            log.warning("runtime: CUDA graph capture failed for inputs %s (%s)", shapes, "; ".join(failures))
        if graph is None:
            log.warning("runtime: running plain launches for inputs %s", shapes)
            self._graphs[key] = _NO_GRAPH
            return _NO_GRAPH
        tuning = ""
        self._timing_spread = 0.0
        if self.tune_kernels:
            start = time.perf_counter()
            graph, picked = self._tune_kernels(graph, prepared, problems)
            tuning += f"; {picked} (chosen in {time.perf_counter() - start:.2f} s)" if picked else ""
        if self.tune_pdl and graph.pdl_entries:
            start = time.perf_counter()
            graph, edges = self._tune_edges(graph, prepared, problems)
            tuning += f"{edges} (chosen in {time.perf_counter() - start:.2f} s)" if edges else ""
        if not self._steady_timing():
            tuning += (
                f"; replay times varied by {self._timing_spread:.0%} from round to round (other work on this GPU?): "
                "these choices hold for this process and are not remembered"
            )
        log.info(
            "runtime: captured a CUDA graph of %d nodes (%d programmatic edges, %.1f MiB of buffers) for inputs %s%s",
            graph.nodes,
            graph.programmatic_edges,
            graph.nbytes / 2**20,
            shapes,
            tuning,
        )
        self._graphs[key] = graph
        self._release_old_graphs()
        return graph

    def _release_old_graphs(self) -> None:
        """Closes the least recently replayed graphs beyond ``max_graphs`` (their buffers go back to the pool);
        their inputs are captured again, after a plain forward, when they come back."""
        kept = [k for k, g in self._graphs.items() if g is not _NO_GRAPH]
        for key in kept[: max(0, len(kept) - self.max_graphs)]:
            graph = self._graphs.pop(key)
            self._calls.pop(key, None)
            self._released += 1
            log.info(
                "runtime: released the CUDA graph for inputs %s (%.1f MiB; the least recently used of more than "
                "max_graphs=%d)",
                _input_shapes(key),
                graph.nbytes / 2**20,
                self.max_graphs,
            )
            graph.close()
            if self._released == self.max_graphs and not self.buckets:
                log.warning(
                    "runtime: %d CUDA graphs released to keep max_graphs=%d: inputs of many sizes pay a capture "
                    "each (seconds) and replay it seldom; Model(..., buckets=[...]) pads them to a few sizes",
                    self._released,
                    self.max_graphs,
                )

    def _constants(self) -> frozenset[int]:
        """Addresses of the module's parameters on the GPU: no kernel of a forward writes them, so kernels
        that read weights before their PDL wait (Family.pdl_early_reads) may launch early on them."""
        return frozenset(t.ptr for _, t in self.module.named_tensors() if t.device == "cuda")

    def _tune_edges(self, graph: Any, prepared: tuple, problems: list) -> tuple[Any, str]:
        """PDL per kernel: for each kernel entry whose launches got programmatic edges, capture the forward
        again with that entry's edges plain and keep the graph if it replays faster (taking turns with the
        graph kept so far). Early launch helps where a kernel sets up while the one before finishes, and
        can hurt where the early blocks change how the kernel before them runs (measured: docs/PERFORMANCE.md).

        One entry at a time misses choices that pay only together, and at the power cap a replay's time drifts
        from one round of turns to the next. So, with more than one entry, the choice then takes turns with
        the two corners, PDL everywhere and plain edges everywhere, in one last round; a corner replaces it
        only when faster by ``_EDGE_MIN_GAIN``, and the times logged all come from that round.
        The outcome is recorded per GPU model and forward (``registry.remember_edges``); a later capture of
        the same forward on the same GPU model takes it without timing."""
        from kernelmill.runtime.graph import CapturedForward

        def plain_into(more: set[int]) -> Any:
            """The forward captured again with PDL, the kernels in ``more`` (ids) on plain edges as well."""
            return CapturedForward(
                self.backend,
                self.module.forward_prepared,
                prepared,
                pdl=True,
                plain=graph.plain | more,
                constants=graph.constants,
            )

        entries = list(graph.pdl_entries)

        def named(indices: set[int]) -> str:
            return ", ".join(f"{entries[i].op} {format_shape(entries[i].shape)}" for i in sorted(indices))

        remembered = self.registry.remembered_edges(entries, problems)
        if remembered is not None:
            if not remembered:
                return graph, "; PDL for every kernel that has it (remembered)"
            try:
                trial = plain_into({id(entries[i]) for i in remembered})
            except Exception as exc:  # noqa: BLE001 - time the choice again
                log.info("runtime: capture with the remembered plain edges failed (%s)", exc)
            else:
                graph.close()
                return trial, f"; plain edges into {named(remembered)} (remembered)"
        first = graph  # PDL everywhere: kept open for the last round
        first_ms = kept_ms = None
        plain, complete = set(), True
        for index, entry in enumerate(entries):
            try:
                trial = plain_into({id(entry)})
            except Exception as exc:  # noqa: BLE001 - keep what was captured
                log.info("runtime: capture with plain edges into %s failed (%s)", entry.op, exc)
                continue
            try:
                times = self._time_graphs({"kept": graph, "trial": trial}, prepared)
            except GraphUnavailable as exc:  # a replay the driver refused: keep the graph as it is
                log.info("runtime: timing the graph with plain edges into %s failed (%s)", entry.op, exc)
                trial.close()
                complete = False
                break
            first_ms = first_ms or times["kept"]
            if times["trial"] < times["kept"] * (1 - _EDGE_MIN_GAIN):
                if graph is not first:
                    graph.close()
                graph, kept_ms = trial, times["trial"]
                plain.add(index)
            else:
                trial.close()
                kept_ms = times["kept"]
        if first_ms is None:
            return graph, ""
        corners = ""
        if complete and len(entries) > 1:
            graph, plain, complete, corners = self._edge_corners(graph, first, plain, entries, prepared, plain_into)
        if graph is not first:
            first.close()
        if complete and self._steady_timing():
            self.registry.remember_edges(entries, problems, plain)
        which = f"plain edges into {named(plain)}" if plain else "PDL for every kernel that has it"
        timing = corners or f"{kept_ms:.3f} ms ({first_ms:.3f} with PDL everywhere)"
        return graph, f"; a replay {timing}: {which}"

    def _edge_corners(
        self, chosen: Any, first: Any, plain: set[int], entries: list, prepared: tuple, plain_into: Any
    ) -> tuple[Any, set[int], bool, str]:
        """The last round of ``_tune_edges``: the choice so far (``chosen``, plain edges into ``plain``) takes
        turns with PDL everywhere (``first``) and plain edges everywhere. Returns the graph kept, its plain
        entries (indices), whether the round was timed, and the round's times for the log ("" if untimed).
        Closes the graphs it does not keep, except ``first`` (the caller's)."""
        everywhere = set(range(len(entries)))
        graphs = {"chosen": chosen}
        if chosen is not first:
            graphs["pdl"] = first
        if plain != everywhere:
            try:
                graphs["plain"] = plain_into({id(entry) for entry in entries})
            except Exception as exc:  # noqa: BLE001 - that corner is not a candidate
                log.info("runtime: capture with plain edges everywhere failed (%s)", exc)
        try:
            times = self._time_graphs(graphs, prepared)
        except GraphUnavailable as exc:  # keep the choice, untimed against the corners
            log.info("runtime: timing the choice against PDL everywhere and plain everywhere failed (%s)", exc)
            times = None
        best = "chosen"
        if times is not None:
            faster = [name for name in times if times[name] < times["chosen"] * (1 - _EDGE_MIN_GAIN)]
            best = min(faster, key=times.__getitem__, default="chosen")
        for name, candidate in graphs.items():
            if name != best and candidate is not first:
                candidate.close()
        if times is None:
            return chosen, plain, False, ""
        pdl_ms = times.get("pdl", times["chosen"])
        plain_ms = times.get("plain", times["chosen"])
        line = f"{times[best]:.3f} ms ({pdl_ms:.3f} with PDL everywhere, {plain_ms:.3f} with plain edges everywhere)"
        kept_plain = {"chosen": plain, "pdl": set(), "plain": everywhere}[best]
        return graphs[best], kept_plain, True, line

    def _tune_kernels(self, graph: Any, prepared: tuple, problems: list) -> tuple[Any, str]:
        """For each problem of the forward whose kernel is an untuned default, try the stand-ins the registry
        compiles for it (``KernelRegistry.alternatives``): capture the forward with one in its place, check the
        output against the first graph's (within the dtype's verification tolerance), time replays taking turns
        and keep the faster by more than ``_KERNEL_MIN_GAIN``. The registry keeps the choice for later
        captures.

        Stand-ins and the kernels they would replace are timed in graphs with plain edges on both sides. Early
        launch moves some kernels' times a lot (an H200's batch-64 MLP: 0.232 ms with plain edges into its down
        projections, 0.297 ms with PDL everywhere; docs/PERFORMANCE.md), so graphs with PDL everywhere would
        pick tiles by how they bear early launch rather than by their speed; ``_tune_edges`` chooses the edges
        afterwards, for the kernels kept. The graph returned launches as ``graph`` did (its ``pdl``)."""
        from kernelmill.runtime.graph import CapturedForward

        def capture(pdl: bool) -> Any:
            return CapturedForward(
                self.backend, self.module.forward_prepared, prepared, pdl=pdl, constants=graph.constants
            )

        kept = graph
        if graph.pdl:
            try:
                kept = capture(False)
            except Exception as exc:  # noqa: BLE001 - compare under the first graph's edges instead
                log.info("runtime: capturing the forward with plain edges failed (%s)", exc)
        reference = None

        def same_output(trial: Any, what: str) -> bool:
            nonlocal reference
            if reference is None:
                reference = _host_output(graph, prepared)
            tolerance = Tolerance.of(self.dtype)
            diff = compare(_host_output(trial, prepared), reference, 0, "output", tolerance).rel_err
            if not diff <= tolerance.norm:
                log.warning("runtime: %s changed the forward's output by %.3g; not used", what, diff)
                return False
            return True

        picked, pending, remembered = [], [], []
        # Choices an earlier capture on this GPU model made (registry.remembered_choice) hold without timing.
        for problem in problems:
            entry = self.registry.resolved(*problem)
            if entry is None or entry.chosen:  # None: e.g. a fused_mlp that ran as its two linears
                continue
            params = self.registry.remembered_choice(entry)
            if params == entry.params:  # the default won that time
                continue
            stand_in = None if params is None else self.registry.stand_in(entry, params)
            if stand_in is None:  # nothing recorded, or it no longer compiles: time the runners-up
                pending.append(problem)
                continue
            stand_in.chosen = True
            stand_in.note = f"chosen at an earlier capture on this GPU over {entry.family} {_knobs(entry.params)}"
            self.registry.put(stand_in)
            remembered.append((problem, entry, stand_in))
        if remembered:
            trial = None
            try:
                trial = capture(kept.pdl)
                usable = same_output(trial, "the remembered kernel choices")
            except Exception as exc:  # noqa: BLE001 - back to the defaults, timed below
                log.info("runtime: capturing the forward with the remembered kernel choices failed (%s)", exc)
                usable = False
            if usable:
                if kept is not graph:
                    kept.close()
                kept = trial
                picked += [
                    f"{s.op} {format_shape(s.shape)}: {s.family} {_knobs(s.params)} (remembered)"
                    for _, _, s in remembered
                ]
            else:
                if trial is not None:
                    trial.close()
                for problem, entry, _stand_in in remembered:
                    self.registry.put(entry)
                    pending.append(problem)
        self.registry.compile_alternatives([self.registry.resolved(*problem) for problem in pending])
        for problem in pending:
            entry = original = self.registry.resolved(*problem)
            timed = False
            for stand_in in self.registry.alternatives(entry):
                what = f"{entry.op} {format_shape(entry.shape)} {stand_in.family} {_knobs(stand_in.params)}"
                self.registry.put(stand_in)
                trial = times = None
                try:
                    trial = capture(kept.pdl)
                    if same_output(trial, what):
                        times = self._time_graphs({"kept": kept, "trial": trial}, prepared)
                except GraphUnavailable as exc:  # a replay the driver refused: keep the graph as it is
                    log.info("runtime: timing the forward with %s failed (%s)", what, exc)
                except Exception as exc:  # noqa: BLE001 - the stand-in is not used; the kept graph stays
                    log.info("runtime: capturing the forward with %s failed (%s)", what, exc)
                timed = timed or times is not None
                if times is not None and times["trial"] < times["kept"] * (1 - _KERNEL_MIN_GAIN):
                    stand_in.chosen = True
                    stand_in.note = f"chosen at capture over {original.family} {_knobs(original.params)}"
                    if kept is not graph:
                        kept.close()
                    kept, entry = trial, stand_in
                else:
                    if trial is not None:
                        trial.close()
                    self.registry.put(entry)
            if timed and self._steady_timing():
                self.registry.remember_choice(original, entry)
            if entry is not original:
                picked.append(f"{entry.op} {format_shape(entry.shape)}: {entry.family} {_knobs(entry.params)}")
        if not picked:
            if kept is not graph:
                kept.close()
            return graph, ""
        if kept.pdl != graph.pdl:
            try:
                final = capture(graph.pdl)
            except Exception as exc:  # noqa: BLE001 - the plain-edged graph serves
                log.info("runtime: capturing the forward with PDL failed (%s); plain edges kept", exc)
            else:
                kept.close()
                kept = final
        graph.close()
        return kept, "runners-up kept: " + ", ".join(picked)

    def _time_graphs(self, graphs: dict, prepared: tuple, rounds: int = 5, replays: int = 10) -> dict:
        """Milliseconds per replay of each graph, back to back, median of ``rounds`` (the graphs take turns),
        after each graph has replayed for ``_WARMUP_S`` (clocks that dropped while compiles ran come back up).
        A turn is at least ``replays`` replays and lasts at least ``_TURN_S`` (by the warm-up's pace): ten
        replays of a small forward took a few hundred us, which the host's own jitter spread by 15% and more."""
        per_replay = math.inf  # the fastest graph's: every turn lasts _TURN_S
        for graph in graphs.values():
            start, done = time.perf_counter(), 0
            while time.perf_counter() - start < _WARMUP_S:
                for _ in range(replays):
                    graph.replay(prepared, copy_output=False)
                self.backend.synchronize()
                done += replays
            per_replay = min(per_replay, (time.perf_counter() - start) / done)
        if 0 < per_replay < math.inf:
            replays = max(replays, math.ceil(_TURN_S / per_replay - 1e-6))  # 0.002 / 0.0002 is 10.000000000000002
        samples: dict = {name: [] for name in graphs}
        for _ in range(rounds):
            for name, graph in graphs.items():
                self.backend.synchronize()
                start = time.perf_counter()
                for _ in range(replays):
                    graph.replay(prepared, copy_output=False)
                self.backend.synchronize()
                samples[name].append((time.perf_counter() - start) * 1e3 / replays)
        medians = {name: statistics.median(times) for name, times in samples.items()}
        spread = max((max(times) - min(times)) / medians[name] for name, times in samples.items())
        self._timing_spread = max(self._timing_spread, spread)
        return medians

    def _steady_timing(self) -> bool:
        """Whether this capture's timings were steady enough to remember what they chose
        (``_REMEMBER_MAX_SPREAD``)."""
        return self._timing_spread <= _REMEMBER_MAX_SPREAD

    def _remember(self, seen: list) -> None:
        for problem in seen:
            if problem not in self.problems:
                self.problems.append(problem)

    @on_device
    def synchronize(self) -> None:
        if self.backend is not None:
            self.backend.synchronize()

    @on_device
    def reset_graphs(self) -> None:
        """Closes every CUDA graph (their buffers go back to the pool); inputs are captured again after a plain
        forward. Dropped by the model itself where a parameter it captured was freed; call it after changing
        parameters in place any other way (a module replaced in a list)."""
        for graph in self._graphs.values():
            if graph is not _NO_GRAPH:
                graph.close()
        self._graphs.clear()
        self._calls.clear()
        self._watched = []
        self._parameters_gone.clear()

    def _launch_modes(self) -> dict[int, str]:
        """By kernel entry id, how the model's CUDA graphs launch it: "early" (a programmatic edge, PDL) or
        "plain" (a PDL kernel kept on plain edges because that replayed faster)."""
        modes: dict[int, str] = {}
        for graph in self._graphs.values():
            for entry in getattr(graph, "pdl_entries", ()):
                plain = id(entry) in graph.plain
                if modes.get(id(entry)) != "early":
                    modes[id(entry)] = "plain" if plain else "early"
        return modes

    def kernel_report(self) -> list[dict[str, Any]]:
        """One row per problem this model met: op, shape, dtype, attrs, family, params, source
        (tuned / nearest / default; "numpy" on the CPU), the speedup the service recorded, who verified it at
        its shape ("checked": KernelEntry.verified_by) and how its graphs launch it ("launch": early / plain,
        None where no graph has a choice to make)."""
        modes = self._launch_modes()
        rows = []
        by_key = {}
        if self.registry is not None:
            for entry in self.registry.entries():
                by_key[(entry.op, entry.shape, entry.dtype, json.dumps(entry.attrs, sort_keys=True, default=str))] = (
                    entry
                )
        for op, shape, dtype, attrs in self.problems:
            entry = None
            if by_key:  # none on the CPU, whose attributes (an eps no kernel takes, say) need not resolve
                try:
                    canonical = json.dumps(_canonical_attrs(op, attrs), sort_keys=True, default=str)
                except SpecError:  # no kernel takes these attributes
                    canonical = None
                entry = by_key.get((op, shape, dtype, canonical))
            if entry is not None:
                rows.append({**entry.row(), "launch": modes.get(id(entry))})
            else:
                # No kernel of its own: the CPU path, or (fused_mlp, nothing tuned) its two linears' rows.
                split = self.device != "cpu" and op == "fused_mlp"
                rows.append(
                    {
                        "op": op,
                        "shape": format_shape(shape),
                        "dtype": dtype,
                        "attrs": attrs,
                        "family": None,
                        "params": {},
                        "source": "numpy" if self.device == "cpu" else ("default" if split else "unresolved"),
                        "served_shape": None,
                        "kernel_id": None,
                        "speedup": None,
                        "calls": None,
                        "checked": None,
                        "note": "nothing tuned: ran as its two linears" if split else "",
                        "launch": None,
                    }
                )
        return rows

    def format_kernel_report(self) -> str:
        """The report as a text table."""
        rows = self.kernel_report()
        header = ("op", "shape", "dtype", "source", "family", "speedup", "checked", "launch", "note")
        lines = [
            (
                r["op"] + "".join(f" {k}={v}" for k, v in sorted((r["attrs"] or {}).items())),
                r["shape"] + (f" (tuned {r['served_shape']})" if r.get("source") == "nearest" else ""),
                r["dtype"],
                r["source"],
                r["family"] or "-",
                f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
                r.get("checked") or "-",
                r.get("launch") or "-",
                r.get("note") or "",
            )
            for r in rows
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=False)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join(fmt.format(*row) for row in (header, *lines))


def _canonical_attrs(op: str, attrs: dict[str, Any]) -> dict[str, Any]:
    from kernelmill.kernels.ops import get_op

    return get_op(op).resolve_attrs(attrs)


# -- loading -----------------------------------------------------------------------------------------------


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except SafetensorError as exc:  # truncated, empty, not safetensors at all
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path} is not a readable safetensors file ({first})") from None
    except (TypeError, ValueError) as exc:  # e.g. bfloat16 tensors, which NumPy has no name for
        try:
            import torch  # noqa: F401
            from safetensors.torch import load_file as load_torch
        except ImportError:
            raise ValueError(f"cannot read {path} with NumPy ({exc}) and torch is not installed") from None
        return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in load_torch(str(path)).items()}


def _bin_state_dict(path: Path) -> dict[str, np.ndarray]:
    """A HuggingFace ``pytorch_model.bin``: a state_dict of tensors by name (as ``save_pretrained`` writes it,
    or wrapped in {"state_dict": ...}), as float32 arrays; ValueError naming what it holds instead."""
    loaded = _torch_load(path, _BIN_FILE)
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state_dict of tensors")
    wrong = [
        f"{k!r} ({_describe(v)})"
        for k, v in loaded.items()
        if not isinstance(k, str) or not hasattr(v, "float") or getattr(v, "is_meta", False)
    ]
    if wrong:
        raise ValueError(f"{path} holds entries that are not named tensors: {', '.join(wrong[:4])}")
    # Integer tensors kept as they are: a weight of them is refused by name, not cast (BertModel.from_state_dict).
    return {k: host_array(v.float() if v.is_floating_point() else v) for k, v in loaded.items()}


#: What _torch_load's callers expect a file to hold, for its error.
_MLP_FILE = "expected an MLP state_dict (torch.save(module.state_dict(), path)) or a HuggingFace directory"
_BIN_FILE = "expected the state_dict save_pretrained writes"


def _torch_load(path: Path, expected: str = _MLP_FILE) -> Any:
    try:
        import torch
    except ImportError:
        raise ValueError(f"reading {path} needs torch (a PyTorch state_dict file)") from None
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except OSError:
        raise  # unreadable (permissions, I/O): say so as it is
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError... for bad files
        raise ValueError(f"{path} {_unloadable(exc)}; {expected}") from None


def _unloadable(exc: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, in a clause: torch's message opens with paragraphs on
    weights_only=False (which the loader never uses: it runs the file's code) and terminal escapes, and
    names the cause after "WeightsUnpickler error:"."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    _, found, cause = text.partition("WeightsUnpickler error:")
    cause = " ".join(cause.split()) if found else ""
    if cause:
        cause = cause.split(" Check the documentation")[0]
        if m := re.search(r"Unsupported global: GLOBAL ([\w.]+)", cause):
            name = m.group(1)
            if name.startswith("torch.nn.modules."):
                return f"holds a pickled module ({name.rsplit('.', 1)[1]}), not a state_dict: save module.state_dict()"
            return f"holds a {name} object, which loading without running the file's code refuses"
        cause = cause.split(". ")[0].rstrip(".")
    else:
        cause = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return f"is not a PyTorch file that torch.load reads with weights_only=True ({cause})"


#: HF's BERT classes, as a config's ``architectures`` names them (BertGeneration* is another model type).
_BERT_ARCHITECTURE = re.compile(r"Bert(Model|LMHeadModel|For[A-Za-z]+)")


def _model_type_of_architectures(config: dict[str, Any], path: Path) -> str:
    """The model type "bert" for a config without ``model_type`` whose ``architectures`` names BERT classes
    only, or a ValueError: such a config was read as BERT whatever it was (a RoBERTa's has BERT's tensor names
    and ran silently, its positions offset by two)."""
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and all(isinstance(a, str) and _BERT_ARCHITECTURE.fullmatch(a) for a in archs):
        return "bert"
    named = f"architectures {json.dumps(archs)}, not BERT classes alone" if archs else "no architectures"
    raise ValueError(
        f"{path} has no model_type and {named}: the model is not known to be a BERT (BERT only; "
        'add "model_type": "bert" if it is one)'
    )


def _read_config(path: Path) -> dict[str, Any]:
    """A HuggingFace config.json, or ValueError naming the file and what is wrong with it."""
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object")
    model_type = config["model_type"] if "model_type" in config else _model_type_of_architectures(config, path)
    if model_type != "bert":  # before the other checks, which name BERT's fields
        raise ValueError(f"{path}: model_type {model_type!r} is not supported (BERT only)")
    if "num_attention_heads" not in config:
        raise ValueError(f"{path}: num_attention_heads is missing (the tensors cannot say how many heads)")
    for key in ("num_attention_heads", "num_hidden_layers"):
        value = config.get(key)
        if key == "num_hidden_layers" and value is None:
            continue  # read from the tensors
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: {key} must be a positive whole number, got {value!r}")
    return config


#: A HuggingFace directory's weights, in the order save_pretrained prefers them: one file, or an index of shards,
#: each with the reader of its (shards') format.
_CHECKPOINT_FILES = (
    ("model.safetensors", _load_safetensors),
    ("model.safetensors.index.json", _load_safetensors),
    ("pytorch_model.bin", _bin_state_dict),
    ("pytorch_model.bin.index.json", _bin_state_dict),
)


def _checkpoint_state_dict(folder: Path) -> dict[str, np.ndarray]:
    """The tensors of a HuggingFace checkpoint directory: its one weights file, or the shards its index names
    (``save_pretrained`` shards a model larger than ``max_shard_size``, 5 GB by default)."""
    for name, read in _CHECKPOINT_FILES:
        path = folder / name
        if not path.exists():
            continue
        if not name.endswith(".index.json"):
            return read(path)
        sd: dict[str, np.ndarray] = {}
        for shard in _shards(path):
            sd.update(read(folder / shard))
        return sd
    raise ValueError(f"{folder} holds no weights: none of {', '.join(name for name, _ in _CHECKPOINT_FILES)}")


def _shards(index: Path) -> list[str]:
    """The shard files a ``*.index.json`` names in its weight_map, each once, in their first tensor's order."""
    try:
        loaded = json.loads(index.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{index} is not valid JSON ({exc})") from None
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map of tensor names to shard files")
    shards = list(dict.fromkeys(weight_map.values()))
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(f"{index} names {shard!r} as a shard: expected a file name in {index.parent}")
        if not (index.parent / shard).is_file():
            raise ValueError(f"{index} names the shard {shard}, which {index.parent} does not hold")
    return shards


#: Keys of a file's dict that hold the state_dict itself, next to other entries.
_STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model")


def load_module(path: str | Path, act: str | None = None) -> Module:
    """The Module stored at ``path`` (a HF BERT directory or an MLP state_dict file), on the CPU in float32."""
    path = Path(path)
    if path.is_dir():
        if act is not None:
            raise ValueError(
                f"act={act!r} is for an MLP state_dict file; a BERT checkpoint's activation is hidden_act in "
                f"{path / 'config.json'}"
            )
        config_path = path / "config.json"
        if not config_path.exists():
            raise ValueError(f"{path} has no config.json (expected a HuggingFace checkpoint directory)")
        config = _read_config(config_path)
        check_bert_config(config, str(config_path))
        return BertModel.from_state_dict(_checkpoint_state_dict(path), config)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model (a checkpoint directory or a state_dict file)")
    if path.suffix in (".json", ".bin", ".safetensors") and (path.parent / "config.json").is_file():
        raise ValueError(
            f"{path} is a file of the HuggingFace checkpoint directory {path.parent}: pass the directory instead"
        )
    if path.suffix == ".safetensors":
        # safetensors stores its keys sorted ("0, 10, 2, ..."), and an MLP runs its layers in key order: the
        # file cannot say which layer comes first, and a wrong order runs silently.
        raise ValueError(
            f"{path}: an MLP is read from a torch.save(module.state_dict(), path) file, whose key order is the "
            "layers' order; a safetensors file keeps its keys sorted as text, so the layer order is lost"
        )
    loaded = _torch_load(path)
    # {"state_dict": ..., "act": ...}, or a training checkpoint: {"model_state_dict": ..., "optimizer...": ...}
    wrapper = next(
        (k for k in _STATE_DICT_WRAPPERS if isinstance(loaded, dict) and isinstance(loaded.get(k), dict)), None
    )
    if wrapper is not None:
        act = act or loaded.get("act")
        loaded = loaded[wrapper]
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state_dict")
    model = mlp_from_state_dict(loaded, act)
    # A state_dict holds no activation: say which one the model assumes where it runs one, since a wrong one runs
    # silently (said before the loading, it came ahead of a refusal to guess, and for a model that runs none).
    if act is None and any(getattr(layer, "act", "none") != "none" for layer in model.layers):
        log.warning("%s names no activation: the MLP uses relu (give act=..., or --act, if it is another)", path)
    return model


def load_model(
    path: str | Path,
    device: str = "cuda",
    dtype: str | None = None,
    *,
    act: str | None = None,
    server: str | None = None,
    registry: Any = None,
    graphs: bool = True,
    pdl: bool | None = None,
    tune_kernels: bool | None = None,
    max_graphs: int | None = None,
    buckets: Sequence[int] | None = None,
) -> Model:
    """Loads a model for ``device`` ("cuda" or "cpu"); dtype defaults to float16 on cuda, float32 on cpu
    (the CPU always computes in float32). ``act``: an MLP file's activation (default relu). ``pdl``: graphs
    launch PDL kernels early (default KERNELMILL_PDL, on); ``tune_kernels``: graphs choose among the defaults'
    runners-up by replay time, once per shape and GPU model (default KERNELMILL_KERNEL_TUNE, on);
    ``max_graphs``: CUDA graphs kept, one per input shape (default KERNELMILL_MAX_GRAPHS, 16); ``buckets``:
    sizes BERT's sequence (an MLP's rows) is padded up to, so inputs of many sizes share a few graphs."""
    device, dtype = _device_and_dtype(device, dtype)  # before reading a checkpoint of maybe gigabytes
    return Model(
        load_module(path, act),
        device,
        dtype,
        registry=registry,
        server=server,
        graphs=graphs,
        pdl=pdl,
        tune_kernels=tune_kernels,
        max_graphs=max_graphs,
        buckets=buckets,
    )
