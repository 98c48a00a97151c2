"""attention: multi-head scaled-dot-product self-attention on a packed QKV tensor; sdpa: the same on
separate q, k, v tensors of shape (batch, heads, seq, head_dim), PyTorch's layout for
``F.scaled_dot_product_attention``.

Shape: batch x heads x seq x head_dim. Inputs:

* ``qkv`` (batch, seq, 3, heads, head_dim): each token's q, k and v, heads side by side (what one
  fused Linear of [Wq | Wk | Wv] gives, viewed in 5-D: q of head h is at columns h*head_dim ..);
* ``mask`` (batch, seq): an additive mask on the keys (0 where attended, a large negative number
  where masked: BERT's attention_mask);

Output ``out`` (batch, seq, heads, head_dim) = per head softmax(q k^T / sqrt(head_dim) + mask) v,
heads side by side again: the layout the output projection reads. No transposes anywhere.

``sdpa`` takes ``q``, ``k``, ``v`` and gives ``out`` as (batch, heads, seq, head_dim) each, with the same
(batch, seq) key mask; its family renders the same template with ``layout = "bhsd"`` (the kernel's pointers
and token strides differ, nothing else).

Three families, each for both layouts:

* ``fused`` (flash-style, CUDA cores, any dtype): a block owns ``warps * rows_per_warp`` queries of one
  (batch, head); it walks the keys in tiles of ``block_kv`` staged in shared memory (fp32), keeps a running
  max and sum per query (online softmax) and accumulates P @ V in registers. head_dim up to ``max_head_dim``.
* ``mma`` (flash-attention-2 style, tensor cores, 16-bit): the same walk with Q K^T and P V on
  ``mma.m16n8k16``; head_dim a multiple of 16 up to ``max_head_dim``.
* ``wgmma`` (Hopper, sm_90a, 16-bit, head_dim 64 or 128): a warpgroup's 64 queries against each key tile in one
  wgmma chain from shared memory, P V with P from registers. The 16-bit default where it applies (on sm_90),
  then mma.
"""

from __future__ import annotations

import math

import numpy as np

from kernelmill.kernels.ops.base import MAX_SMEM_BYTES, Family, Launch, OpSpec, Param, cdiv

MAX_GRID_YZ = 65535
#: Additive mask value of a padded key, by dtype: the dtype's most negative finite number, as HF's BERT uses.
MASK_MIN = {"float32": -3.4028234663852886e38, "float16": -65504.0, "bfloat16": -3.3895313892515355e38}

#: Floats of running state a thread holds (accumulators + one tile's scores), so it does not spill.
MAX_STATE_FLOATS = 96


def smem_bytes(params, head_dim: int) -> int:
    """Dynamic shared memory: K tile (odd row stride), V tile, the block's queries and its P tile, fp32."""
    bkv, bq = params["block_kv"], params["warps"] * params["rows_per_warp"]
    ldk = head_dim | 1
    return 4 * (bkv * ldk + bkv * head_dim + bq * head_dim + bq * bkv)


class AttentionFamily(Family):
    """What the attention families share: the layout their template renders, the grid, the launch."""

    #: How q, k, v and out lie in memory (the template's ``layout``): "packed" (the attention op) or "bhsd".
    layout = "packed"

    def context(self, params, dtype, attrs):
        return {"layout": self.layout}

    def grid_check(self, shape) -> str | None:
        batch, heads = shape[:2]
        if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
            return f"batch and heads must be at most {MAX_GRID_YZ} (grid z and y)"
        return None

    def launch(self, entry: str, block_queries: int, warps: int, smem: int, shape) -> list[Launch]:
        """One launch: a block per ``block_queries`` queries of each (batch, head)."""
        batch, heads, seq, head_dim = shape
        tensors = ("qkv",) if self.layout == "packed" else ("q", "k", "v")
        grid = (cdiv(seq, block_queries), heads, batch)
        return [Launch(entry, grid, (32 * warps, 1, 1), smem, (*tensors, "mask", "out", heads, seq, head_dim))]


class Fused(AttentionFamily):
    name = "fused"
    template = "attention/fused.cu.j2"
    pdl = True
    description = "one kernel: K/V tiles in shared memory, online softmax, P @ V in registers (CUDA cores)"
    params = (
        Param("warps", (1, 2, 4, 8), "warps per block"),
        Param("rows_per_warp", (1, 2, 4, 8), "queries each warp owns"),
        Param("block_kv", (32, 64, 128), "keys per shared-memory tile"),
        Param("max_head_dim", (32, 64, 128, 256), "largest head_dim the variant serves (accumulators per lane)"),
    )

    def defaults(self, dtype):
        return {"warps": 4, "rows_per_warp": 4, "block_kv": 64, "max_head_dim": 128}

    def shape_defaults(self, shape, dtype):
        """The defaults, with accumulators for head_dim up to 256 where 128 is too few."""
        params = dict(self.defaults(dtype))
        if shape[3] > params["max_head_dim"]:
            params["max_head_dim"] = 256
        return params

    def check(self, params, dtype):
        state = params["rows_per_warp"] * (params["max_head_dim"] + params["block_kv"]) // 32
        if state > MAX_STATE_FLOATS:
            return f"rows_per_warp*(max_head_dim+block_kv)/32 = {state} floats per lane > {MAX_STATE_FLOATS}"
        smem = smem_bytes(params, params["max_head_dim"])
        if smem > MAX_SMEM_BYTES:
            return f"{smem} bytes of shared memory at head_dim {params['max_head_dim']} > {MAX_SMEM_BYTES}"
        return None

    def check_shape(self, shape, params, dtype):
        batch, heads, seq, head_dim = shape
        if head_dim > params["max_head_dim"]:
            return f"head_dim {head_dim} > max_head_dim {params['max_head_dim']} of this variant"
        why = self.grid_check(shape)
        if why:
            return why
        if batch * seq * 3 * heads * head_dim >= 2**40:  # pragma: no cover - absurd sizes
            return "too many elements"
        return None

    def launches(self, shape, params, dtype):
        bq = params["warps"] * params["rows_per_warp"]
        return self.launch("attention_fused", bq, params["warps"], smem_bytes(params, shape[3]), shape)


class FusedBhsd(Fused):
    """The fused family on separate (batch, heads, seq, head_dim) q, k, v and out (the sdpa op)."""

    layout = "bhsd"
    description = "the attention op's fused kernel on separate q, k, v (batch, heads, seq, head_dim) tensors"


#: Registers a lane of the mma family may hold across a key tile (S, O and Q fragments; Mma.check).
MMA_MAX_STATE = 160


def mma_smem_bytes(params) -> int:
    """Dynamic shared memory of the mma family: a Q tile and `stages` K and V tiles (kv_groups * block_kv keys)
    of 16-bit rows padded by 8 elements, and `stages` tiles of the key mask in fp32; with key groups, at least
    room after Q for groups 1.. to hand their fp32 state (m, l and O a lane) to group 0."""
    bq, maxd = 16 * params["m_tiles"] * params["warps"], params["max_head_dim"]
    tile = params["kv_groups"] * params["block_kv"]
    ring = (bq + 2 * params["stages"] * tile) * (maxd + 8) * 2 + 4 * params["stages"] * tile
    state = params["m_tiles"] * (4 + maxd // 2) * 32 * 4  # bytes of a warp's state
    merge = bq * (maxd + 8) * 2 + (params["kv_groups"] - 1) * params["warps"] * state
    return max(ring, merge)


class Mma(AttentionFamily):
    """Flash-attention-2 style on tensor cores (templates/attention/mma.cu.j2): a warp owns 16 or 32 queries,
    S = Q K^T and O += P V are mma.m16n8k16 with fp32 accumulators, the online softmax runs on S's fragments
    (unmasked tiles take a shorter copy of it), K, V and the mask's tiles come through a cp.async ring, and Q's
    fragments stay in registers or are re-read from shared memory each tile (q_regs). With kv_groups > 1 that
    many groups of warps split each key tile, every group owning the block's queries, and merge their softmax
    states at the end: more warps an SM where the queries alone give few. head_dim is a multiple of
    16 up to max_head_dim; at max_head_dim itself a separate entry runs with the loops over it unrolled."""

    name = "mma"
    template = "attention/mma.cu.j2"
    dtypes = ("float16", "bfloat16")
    pdl = True
    description = "tensor cores: mma.m16n8k16 for Q K^T and P V, online softmax on the fragments, K/V in shared"
    params = (
        Param("warps", (2, 4, 8), "query warps per block (times kv_groups warps in all)"),
        Param("m_tiles", (1, 2), "16-query m tiles per warp (each K / V fragment from shared memory serves them all)"),
        Param("block_kv", (32, 64, 128), "keys per shared-memory tile"),
        Param("stages", (1, 2, 3), "K/V tiles in shared memory: 1 loads then computes, 2-3 prefetch (cp.async)"),
        Param("max_head_dim", (64, 128), "largest head_dim the variant serves (a multiple of 16)"),
        Param("q_regs", (True, False), "Q's fragments held in registers (else re-read from shared memory a tile)"),
        Param("kv_groups", (1, 2, 4), "groups of warps that split each key tile between them, merged at the end"),
    )

    def defaults(self, dtype):
        return {
            "warps": 4,
            "m_tiles": 1,
            "block_kv": 128,
            "stages": 2,
            "max_head_dim": 64,
            "q_regs": True,
            "kv_groups": 1,
        }

    def shape_defaults(self, shape, dtype, sm_count: int = 132):
        """The measured best by shape (benchmarks/attention_sweep.py over the whole space on an H200, 2026-11-27,
        docs/PERFORMANCE.md "Attention on tensor cores", "Attention: fewer instructions a key tile" and
        "Attention: key groups and wgmma"), by how many blocks of 64 queries the shape makes against the SMs,
        and how long a block's walk over the keys is:

        * many blocks (3 a SM or more): two m tiles a warp, half the blocks (64-key tiles at head_dim 64; at
          head_dim 128 32-key tiles with Q re-read from shared memory, its registers going to the second m
          tile);
        * head_dim 128 otherwise: one m tile, 128-key tiles, Q in registers (1 x 16 x 512 x 128: 18.5 us
          against 26.9 for two m tiles);
        * head_dim 64, a wave or more of blocks and 512+ keys: two key groups of 4 warps of two m tiles
          (1 x 16 x 1024 x 64: 25.6 us against 27.6);
        * under a wave, 256-511 keys: two key groups of 2 warps, 128-key tiles (1 x 12 x 256 x 64: 7.5 against
          8.7 us); up to 128 keys and under a quarter wave: two key groups of 2 warps, 64 keys each (BERT at
          batch 1, 1 x 12 x 128 x 64: 6.2 against 7.1 us);
        * else 4 warps of one m tile, 128-key tiles (64-key tiles where the sequence fits one)."""
        batch, heads, seq, head_dim = shape
        params = dict(self.defaults(dtype))
        blocks = batch * heads * cdiv(seq, 64)  # blocks of the default 64 queries
        if head_dim > 64:
            params["max_head_dim"] = 128
            if blocks >= 3 * sm_count:
                params.update(m_tiles=2, block_kv=32, q_regs=False)
        elif blocks >= 3 * sm_count:
            params.update(m_tiles=2, block_kv=64)
        elif seq <= 64:
            params.update(block_kv=64)
        elif blocks >= sm_count and seq >= 512:
            params.update(m_tiles=2, block_kv=64, kv_groups=2)
        elif blocks < sm_count and 256 <= seq < 512:
            params.update(warps=2, kv_groups=2)
        elif 4 * blocks < sm_count and seq <= 128:
            params.update(warps=2, block_kv=64, kv_groups=2)
        return params

    def check(self, params, dtype):
        # Registers per lane held across a key tile: S (block_kv / 2 floats), O (max_head_dim / 2) and, with
        # q_regs, Q's fragments (max_head_dim / 4), per m tile. Up to 160 every point compiles without spills
        # (nvcc 13.0, at most 255 registers a thread).
        q = params["max_head_dim"] // 4 if params["q_regs"] else 0
        state = params["m_tiles"] * (params["block_kv"] // 2 + params["max_head_dim"] // 2 + q)
        if state > MMA_MAX_STATE:
            return f"{state} registers of S, O and Q a lane > {MMA_MAX_STATE}"
        if params["warps"] * params["kv_groups"] > 8:
            # 256 threads leave each up to 255 registers; at 512 ptxas holds them to 128 and spills.
            return f"{params['warps']} warps x {params['kv_groups']} key groups > 8 warps a block"
        smem = mma_smem_bytes(params)
        if smem > MAX_SMEM_BYTES:
            return f"{smem} bytes of shared memory > {MAX_SMEM_BYTES}"
        return None

    def check_shape(self, shape, params, dtype):
        head_dim = shape[3]
        if head_dim % 16 or head_dim > params["max_head_dim"]:
            return f"head_dim {head_dim}: the mma family takes multiples of 16 up to {params['max_head_dim']}"
        return self.grid_check(shape)

    def launches(self, shape, params, dtype):
        bq = 16 * params["m_tiles"] * params["warps"]
        # head_dim == max_head_dim has its own entry, with the loops over head_dim unrolled (the template).
        entry = "attention_mma_full" if shape[3] == params["max_head_dim"] else "attention_mma"
        return self.launch(entry, bq, params["warps"] * params["kv_groups"], mma_smem_bytes(params), shape)


class MmaBhsd(Mma):
    """The mma family on separate (batch, heads, seq, head_dim) q, k, v and out (the sdpa op)."""

    layout = "bhsd"


def wgmma_smem_bytes(params) -> int:
    """Dynamic shared memory of the wgmma family: 1024 bytes to align the base, Q (64 queries a warpgroup) and
    `stages` K and V tiles of head_dim 16-bit columns, and max(stages, 2) tiles of the key mask in fp32."""
    d, bkv, stages = params["max_head_dim"], params["block_kv"], params["stages"]
    return 1024 + 64 * params["warpgroups"] * d * 2 + stages * 2 * bkv * d * 2 + max(stages, 2) * 4 * bkv


class Wgmma(AttentionFamily):
    """Hopper's warpgroup MMA (templates/attention/wgmma.cu.j2, sm_90a): a warpgroup owns 64 queries; S = Q K^T
    is one wgmma m64n{block_kv} chain from shared memory, the online softmax runs on its accumulators (the mma
    family's code), and O += P V takes P from registers. K and V come through a cp.async ring in wgmma's
    128-byte swizzled layout. head_dim 64 or 128 exactly (max_head_dim)."""

    name = "wgmma"
    template = "attention/wgmma.cu.j2"
    dtypes = ("float16", "bfloat16")
    arch_suffix = "a"
    pdl = True
    description = "Hopper wgmma: S = Q K^T from shared memory, P V with P in registers (sm_90a; head_dim 64 / 128)"
    params = (
        Param("warpgroups", (1, 2), "warpgroups per block, 64 queries each"),
        Param("block_kv", (64, 128), "keys per shared-memory tile (the wgmma N of Q K^T)"),
        Param(
            "stages",
            (1, 2, 3),
            "K/V tiles in shared memory: 2-3 a cp.async ring; 1 one K and one V slot, loads staggered by half a tile",
        ),
        Param("max_head_dim", (64, 128), "the head_dim the variant serves"),
        Param("overlap", (False, True), "a tile's softmax runs while the last tile's P V does (two slots)"),
    )

    def defaults(self, dtype):
        return {"warpgroups": 1, "block_kv": 128, "stages": 2, "max_head_dim": 64, "overlap": False}

    def shape_defaults(self, shape, dtype, sm_count: int = 132):
        """The measured best by shape (benchmarks/attention_sweep.py over the family's space on an H200,
        2026-11-27, docs/PERFORMANCE.md "Attention: a third of the wgmma kernel's instructions"): one warpgroup a
        block, 128-key tiles, two slots; where a shape makes 3 blocks of 64 queries an SM or more, one K and one
        V slot (stages 1: four blocks an SM fit), with 64-key tiles at head_dim 128 (4 x 16 x 512 x 128: 28.6 us
        against 34.1 and up for 128-key tiles; 4 x 16 x 1024 x 64: 52.3 us against 55.2 for two slots)."""
        batch, heads, seq, head_dim = shape
        params = {**self.defaults(dtype), "max_head_dim": 128 if head_dim > 64 else 64}
        if batch * heads * cdiv(seq, 64) >= 3 * sm_count:
            params.update(stages=1, block_kv=64 if head_dim > 64 else 128)
        return params

    def check(self, params, dtype):
        # With the overlap a lane also holds the last tile's P (16-bit pairs) while S and O are live.
        state = (
            params["block_kv"] // 2
            + params["max_head_dim"] // 2
            + (params["block_kv"] // 4 if params["overlap"] else 0)
        )
        if state > MMA_MAX_STATE:
            return f"{state} registers of S, P and O a lane > {MMA_MAX_STATE}"
        if params["overlap"] and params["stages"] != 2:
            return "the overlap runs K and V each through two slots (stages 2)"
        smem = wgmma_smem_bytes(params)
        if smem > MAX_SMEM_BYTES:
            return f"{smem} bytes of shared memory > {MAX_SMEM_BYTES}"
        return None

    def check_shape(self, shape, params, dtype):
        if shape[3] != params["max_head_dim"]:
            return f"head_dim {shape[3]}: the wgmma family takes head_dim == max_head_dim ({params['max_head_dim']})"
        return self.grid_check(shape)

    def launches(self, shape, params, dtype):
        wg = params["warpgroups"]
        return self.launch("attention_wgmma", 64 * wg, 4 * wg, wgmma_smem_bytes(params), shape)


class WgmmaBhsd(Wgmma):
    """The wgmma family on separate (batch, heads, seq, head_dim) q, k, v and out (the sdpa op)."""

    layout = "bhsd"


def attention64(qkv: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The float64 reference: qkv (batch, seq, 3, heads, head_dim) and mask (batch, seq) give
    (batch, seq, heads, head_dim)."""
    batch, seq, _three, heads, head_dim = qkv.shape
    x = qkv.astype(np.float64).transpose(2, 0, 3, 1, 4)
    q, k, v = x[0], x[1], x[2]  # (batch, heads, seq, head_dim)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim) + mask.astype(np.float64)[:, None, None, :]
    return (masked_softmax(scores) @ v).transpose(0, 2, 1, 3)


def masked_softmax(scores: np.ndarray) -> np.ndarray:
    """softmax over the last axis, where a row whose every score is -inf (every key masked) gives 0, as
    torch's scaled_dot_product_attention does, not NaN; NaN scores still give NaN."""
    if not scores.size:  # no rows, or rows of no key: max() has no identity
        return scores.copy()
    top = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - np.where(top == -np.inf, 0.0, top))
    total = p.sum(axis=-1, keepdims=True)
    return p / np.where(total == 0.0, 1.0, total)


class Attention(OpSpec):
    name = "attention"
    matrix_bound = True
    input_kinds = ("random", "zero", "padding")
    dims = ("batch", "heads", "seq", "head_dim")
    example_shape = "8x12x128x64"
    inputs = ("qkv", "mask")
    outputs = ("out",)
    # 16-bit defaults take mma where head_dim allows (kernels/defaults.py), fused otherwise.
    families = {"fused": Fused(), "mma": Mma(), "wgmma": Wgmma()}

    def tensor_shapes(self, shape):
        batch, heads, seq, head_dim = shape
        return {
            "qkv": (batch, seq, 3, heads, head_dim),
            "mask": (batch, seq),
            "out": (batch, seq, heads, head_dim),
        }

    def summed_terms(self, shape):
        _batch, _heads, seq, head_dim = shape
        return seq + head_dim  # a score's products, then the keys' weighted values

    def input_scale(self, name, shape):
        return 2.0  # peaked enough that the softmax is not nearly uniform

    def make_inputs(self, shape, dtype, seed):
        """Uniform inputs; the mask by the seed's kind: random in [-2, 2] (every key tile masked), all zero
        (the path the mma and wgmma families take for tiles without a mask: BERT without padding), or padding
        (0, then on each sequence's last keys BERT's mask value, the dtype's lowest, or -inf as torch code
        masks with, by turns over the batch: at least one key kept, and whole key tiles of -inf; from batch 3, a
        sequence whose every key is -inf)."""
        out = super().make_inputs(shape, dtype, seed)
        kind = self.input_kind(seed)
        if kind != "random":
            batch, _heads, seq, _head_dim = shape
            mask = np.zeros((batch, seq), np.float32)
            if kind == "padding":
                rng = np.random.default_rng([seed, 1])
                keep = rng.integers(1, seq + 1, size=batch)
                keep[:2] = max(1, seq // 2)  # padded for sure, wherever the keys' tiles split: one of each value
                first = (seed // len(self.input_kinds)) % 2  # which value the first sequence takes
                value = np.where((np.arange(batch) + first) % 2, -np.inf, MASK_MIN[dtype])
                if batch > 2:  # every key masked with -inf: the output is 0, as torch's sdpa gives
                    keep[2], value[2] = 0, -np.inf
                padded = np.arange(seq)[None, :] >= keep[:, None]
                mask = np.where(padded, value[:, None], mask)
            out["mask"] = mask.astype(out["mask"].dtype)
        return out

    def reference(self, inputs, attrs):
        return {"out": attention64(inputs["qkv"], inputs["mask"])}

    def flops(self, shape):
        batch, heads, seq, head_dim = shape
        return 4.0 * batch * heads * seq * seq * head_dim

    def min_bytes(self, shape, dtype):
        from kernelmill.kernels.ops.base import itemsize

        batch, heads, seq, head_dim = shape
        return (4 * batch * seq * heads * head_dim + batch * seq) * itemsize(dtype)

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch.nn.functional as F

        qkv, mask = tensors["qkv"], tensors["mask"]

        def run():
            x = qkv.permute(2, 0, 3, 1, 4)  # (3, batch, heads, seq, head_dim)
            o = F.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=mask[:, None, None, :])
            return o.transpose(1, 2)

        return run


ATTENTION = Attention()


def sdpa64(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The float64 reference of sdpa: q, k, v (batch, heads, seq, head_dim), key mask (batch, seq)."""
    qkv = np.stack([q, k, v]).transpose(1, 3, 0, 2, 4)  # (batch, seq, 3, heads, head_dim)
    return attention64(qkv, mask).transpose(0, 2, 1, 3)


class Sdpa(Attention):
    """softmax(q k^T / sqrt(head_dim) + mask) v on (batch, heads, seq, head_dim) tensors (PyTorch's layout)."""

    name = "sdpa"
    inputs = ("q", "k", "v", "mask")
    families = {"fused": FusedBhsd(), "mma": MmaBhsd(), "wgmma": WgmmaBhsd()}

    def tensor_shapes(self, shape):
        batch, heads, seq, head_dim = shape
        each = (batch, heads, seq, head_dim)
        return {"q": each, "k": each, "v": each, "mask": (batch, seq), "out": each}

    def reference(self, inputs, attrs):
        return {"out": sdpa64(inputs["q"], inputs["k"], inputs["v"], inputs["mask"])}

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch.nn.functional as F

        q, k, v, mask = (tensors[n] for n in ("q", "k", "v", "mask"))
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])


SDPA = Sdpa()
