"""embedding: BERT-style input embeddings, Y[t] = word[ids[t]] + pos[t % seq] + types[type_ids[t]].

Shape: batch x seq x hidden x vocab x type_vocab; tokens = batch * seq, positions 0..seq-1 in every
sequence. ``pos`` is the (seq, hidden) head of the position table: a model passes its whole table (the
first seq rows of a row-major table are that tensor). The LayerNorm that follows is the ``layernorm`` op.

Token ids are integers while every tensor of an op is stored in the op's dtype, so each id is held as
``ID_ELEMS`` (3) values of T: its base-256 digits plus one, least significant first (values 1..256,
exact in float32, float16 and bfloat16, never zero; ids below 256**3). ``pack_ids`` / ``unpack_ids``
convert; the kernel decodes in registers.
"""

from __future__ import annotations

import numpy as np

from kernelmill.kernels.ops.base import MAX_INDEXED_ELEMS, Family, Launch, OpSpec, Param, itemsize, numpy_dtype

#: Elements of T that hold one token id, and the base of its digits.
ID_ELEMS = 3
ID_BASE = 256
MAX_ID = ID_BASE**ID_ELEMS


def pack_ids(ids: np.ndarray, dtype: str) -> np.ndarray:
    """Integer ids (any shape) -> an array of T of shape (*ids.shape, ID_ELEMS): digits + 1."""
    ids = np.asarray(ids).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= MAX_ID):
        raise ValueError(f"token ids must be in 0..{MAX_ID - 1}")
    digits = np.stack([(ids // ID_BASE**k) % ID_BASE + 1 for k in range(ID_ELEMS)], axis=-1)
    return digits.astype(np.float32).astype(numpy_dtype(dtype))


def unpack_ids(packed: np.ndarray) -> np.ndarray:
    """The inverse of pack_ids: (..., ID_ELEMS) values of T -> integer ids of shape (...)."""
    digits = np.rint(np.asarray(packed).astype(np.float64)).astype(np.int64) - 1
    return sum(digits[..., k] * ID_BASE**k for k in range(ID_ELEMS))


class Gather(Family):
    name = "gather"
    template = "embedding/gather.cu.j2"
    pdl = True
    description = "one block per token (rows_per_block tokens), vec elements per access along hidden"
    params = (
        Param("threads", (32, 64, 128, 256), "threads per token"),
        Param("vec", (1, 2, 4, 8), "elements per vector access (at most 16 bytes)"),
        Param("tokens_per_block", (1, 2, 4), "tokens per block"),
    )

    def defaults(self, dtype):
        return {"threads": 128, "vec": 16 // itemsize(dtype), "tokens_per_block": 1}

    def check(self, params, dtype):
        if params["vec"] * itemsize(dtype) > 16:
            return f"vec={params['vec']} x {itemsize(dtype)} bytes exceeds a 16-byte access"
        return None

    def check_shape(self, shape, params, dtype):
        batch, seq, hidden, vocab, type_vocab = shape
        if max(batch * seq, vocab, type_vocab) * hidden >= MAX_INDEXED_ELEMS:
            return "a table or the output has 2**31 elements or more (32-bit offsets)"
        if max(vocab, type_vocab) > MAX_ID:  # ids travel as ID_ELEMS base-256 digits: larger ones would be cut
            return f"a vocabulary of {max(vocab, type_vocab)} > {MAX_ID} ids (three base-256 digits a token)"
        return None

    def launches(self, shape, params, dtype):
        batch, seq, hidden, vocab, type_vocab = shape
        tokens = batch * seq
        tpb = params["tokens_per_block"]
        return [
            Launch(
                "embedding_gather",
                (-(-tokens // tpb), 1, 1),
                (params["threads"], tpb, 1),
                0,
                ("ids", "type_ids", "word", "pos", "types", "Y", tokens, seq, hidden, vocab, type_vocab),
            )
        ]


class Embedding(OpSpec):
    name = "embedding"
    intermediates = False  # only the output is rounded (OpSpec.intermediates)
    dims = ("batch", "seq", "hidden", "vocab", "type_vocab")
    example_shape = "8x128x768x30522x2"
    inputs = ("ids", "type_ids", "word", "pos", "types")
    outputs = ("Y",)
    families = {"gather": Gather()}

    def tensor_shapes(self, shape):
        batch, seq, hidden, vocab, type_vocab = shape
        tokens = batch * seq
        return {
            "ids": (tokens, ID_ELEMS),
            "type_ids": (tokens, ID_ELEMS),
            "word": (vocab, hidden),
            "pos": (seq, hidden),
            "types": (type_vocab, hidden),
            "Y": (tokens, hidden),
        }

    def summed_terms(self, shape):
        return 3  # word, position and token type rows

    def make_inputs(self, shape, dtype, seed):
        batch, seq, hidden, vocab, type_vocab = shape
        rng = np.random.default_rng(seed)
        out = {}
        for name in ("word", "pos", "types"):
            rows = {"word": vocab, "pos": seq, "types": type_vocab}[name]
            out[name] = rng.uniform(-1.0, 1.0, size=(rows, hidden)).astype(np.float32).astype(numpy_dtype(dtype))
        out["ids"] = pack_ids(rng.integers(0, vocab, size=batch * seq), dtype)
        out["type_ids"] = pack_ids(rng.integers(0, type_vocab, size=batch * seq), dtype)
        return out

    def reference(self, inputs, attrs):
        ids, type_ids = (unpack_ids(inputs[n]).reshape(-1) for n in ("ids", "type_ids"))
        word, pos, types = (inputs[n].astype(np.float64) for n in ("word", "pos", "types"))
        positions = np.arange(len(ids)) % pos.shape[0]
        return {"Y": word[ids] + pos[positions] + types[type_ids]}

    def flops(self, shape):
        batch, seq, hidden, *_ = shape
        return 2.0 * batch * seq * hidden

    def min_bytes(self, shape, dtype):
        batch, seq, hidden, *_ = shape
        tokens = batch * seq
        return tokens * (4 * hidden + 2 * ID_ELEMS) * itemsize(dtype)

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch

        word, pos, types = tensors["word"], tensors["pos"], tensors["types"]
        scale = torch.tensor([ID_BASE**k for k in range(ID_ELEMS)], device=word.device)

        def decode(packed):
            return ((packed.float().round().long() - 1) * scale).sum(-1)

        ids, type_ids = decode(tensors["ids"]), decode(tensors["type_ids"])
        positions = torch.arange(ids.numel(), device=ids.device) % pos.shape[0]
        return lambda: word[ids] + pos[positions] + types[type_ids]


EMBEDDING = Embedding()
