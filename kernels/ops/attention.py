"""attention: multi-head scaled-dot-product self-attention on a packed QKV tensor.

Shape: batch x heads x seq x head_dim. Inputs:

* ``qkv`` (batch, seq, 3, heads, head_dim): each token's q, k and v, heads side by side (what one
  fused Linear of [Wq | Wk | Wv] gives, viewed in 5-D: q of head h is at columns h*head_dim ..);
* ``mask`` (batch, seq): an additive mask on the keys (0 where attended, a large negative number
  where masked: BERT's attention_mask);

Output ``out`` (batch, seq, heads, head_dim) = per head softmax(q k^T / sqrt(head_dim) + mask) v,
heads side by side again: the layout the output projection reads. No transposes anywhere.

One family, ``fused`` (flash-style, CUDA cores): a block owns ``warps * rows_per_warp`` queries of one
(batch, head); it walks the keys in tiles of ``block_kv`` staged in shared memory (fp32), keeps a running
max and sum per query (online softmax) and accumulates P @ V in registers. head_dim up to ``max_head_dim``.
"""

from __future__ import annotations

import math

import numpy as np

from kernelmill.kernels.ops.base import MAX_SMEM_BYTES, Family, Launch, OpSpec, Param, cdiv

MAX_GRID_YZ = 65535
#: Floats of running state a thread holds (accumulators + one tile's scores), so it does not spill.
MAX_STATE_FLOATS = 96


def smem_bytes(params, head_dim: int) -> int:
    """Dynamic shared memory: K tile (odd row stride), V tile, the block's queries and its P tile, fp32."""
    bkv, bq = params["block_kv"], params["warps"] * params["rows_per_warp"]
    ldk = head_dim | 1
    return 4 * (bkv * ldk + bkv * head_dim + bq * head_dim + bq * bkv)


class Fused(Family):
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
        if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
            return f"batch and heads must be at most {MAX_GRID_YZ} (grid z and y)"
        if batch * seq * 3 * heads * head_dim >= 2**40:  # pragma: no cover - absurd sizes
            return "too many elements"
        return None

    def launches(self, shape, params, dtype):
        batch, heads, seq, head_dim = shape
        bq = params["warps"] * params["rows_per_warp"]
        return [
            Launch(
                "attention_fused",
                (cdiv(seq, bq), heads, batch),
                (32 * params["warps"], 1, 1),
                smem_bytes(params, head_dim),
                ("qkv", "mask", "out", heads, seq, head_dim),
            )
        ]


def attention64(qkv: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The float64 reference: qkv (batch, seq, 3, heads, head_dim) and mask (batch, seq) give
    (batch, seq, heads, head_dim)."""
    batch, seq, _three, heads, head_dim = qkv.shape
    x = qkv.astype(np.float64).transpose(2, 0, 3, 1, 4)
    q, k, v = x[0], x[1], x[2]  # (batch, heads, seq, head_dim)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim) + mask.astype(np.float64)[:, None, None, :]
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3)


class Attention(OpSpec):
    name = "attention"
    matrix_bound = True
    dims = ("batch", "heads", "seq", "head_dim")
    inputs = ("qkv", "mask")
    outputs = ("out",)
    families = {"fused": Fused()}

    def tensor_shapes(self, shape):
        batch, heads, seq, head_dim = shape
        return {
            "qkv": (batch, seq, 3, heads, head_dim),
            "mask": (batch, seq),
            "out": (batch, seq, heads, head_dim),
        }

    def input_scale(self, name, shape):
        return 2.0  # peaked enough that the softmax is not nearly uniform

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
