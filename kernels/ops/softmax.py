"""softmax over the last dim of a rows x cols matrix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kernelmill.kernels.ops.base import Family, Launch, OpSpec, Param, cdiv, itemsize

_VEC = Param("vec", (1, 2, 4, 8), "elements per vector access (at most 16 bytes)")
_UNROLL = Param("unroll", (1, 2, 4, 8, 16), "vector accesses per thread held in registers per pass")
_FAST_EXP = Param("fast_exp", (False, True), "__expf instead of expf")

#: Registers a thread may spend on one pass of the row (floats), so a pass never spills.
_MAX_FLOATS_PER_THREAD = 64


def _check_vec_unroll(params: Mapping[str, Any], dtype: str) -> str | None:
    if params["vec"] * itemsize(dtype) > 16:
        return f"vec={params['vec']} x {itemsize(dtype)} bytes exceeds a 16-byte access"
    if params["vec"] * params["unroll"] > _MAX_FLOATS_PER_THREAD:
        return f"vec*unroll={params['vec'] * params['unroll']} > {_MAX_FLOATS_PER_THREAD} floats per thread"
    return None


class WarpRow(Family):
    name = "warp_row"
    template = "softmax/warp_row.cu.j2"
    description = "one warp per row, several rows per block; best for short rows"
    params = (_VEC, _UNROLL, Param("rows_per_block", (1, 2, 4, 8, 16), "warps (rows) per block"), _FAST_EXP)

    def defaults(self, dtype: str) -> dict[str, Any]:
        return {"vec": 16 // itemsize(dtype), "unroll": 4, "rows_per_block": 4, "fast_exp": False}

    def check(self, params, dtype):
        return _check_vec_unroll(params, dtype)

    def launches(self, shape, params, dtype):
        rows, cols = shape
        rpb = params["rows_per_block"]
        return [Launch("softmax_warp_row", (cdiv(rows, rpb), 1, 1), (32 * rpb, 1, 1), 0, ("x", "y", rows, cols))]


class BlockRow(Family):
    name = "block_row"
    template = "softmax/block_row.cu.j2"
    description = "one block per row with block-wide reductions; best for long rows"
    params = (_VEC, _UNROLL, Param("threads", (64, 128, 256, 512, 1024), "threads per block (per row)"), _FAST_EXP)

    def defaults(self, dtype: str) -> dict[str, Any]:
        return {"vec": 16 // itemsize(dtype), "unroll": 2, "threads": 256, "fast_exp": False}

    def check(self, params, dtype):
        return _check_vec_unroll(params, dtype)

    def launches(self, shape, params, dtype):
        rows, cols = shape
        return [Launch("softmax_block_row", (rows, 1, 1), (params["threads"], 1, 1), 0, ("x", "y", rows, cols))]

    def check_shape(self, shape, params, dtype):
        if shape[0] > 2**31 - 1:
            return "more rows than a grid's x dimension holds"
        return None


class Softmax(OpSpec):
    name = "softmax"
    dims = ("rows", "cols")
    inputs = ("x",)
    outputs = ("y",)
    families = {f.name: f for f in (WarpRow(), BlockRow())}

    def tensor_shapes(self, shape):
        return {"x": shape, "y": shape}

    def input_scale(self, name, shape):
        return 8.0  # a wide range so exp() and the max subtraction matter

    def reference(self, inputs, attrs):
        x = inputs["x"].astype(np.float64)
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return {"y": e / e.sum(axis=-1, keepdims=True)}

    def flops(self, shape):
        rows, cols = shape
        return 4.0 * rows * cols  # max, subtract+exp, sum, scale

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch

        x = tensors["x"]
        return lambda: torch.softmax(x, dim=-1)


SOFTMAX = Softmax()
