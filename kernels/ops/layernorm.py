"""LayerNorm over the last dim: ``layernorm`` and ``add_layernorm`` (post-LN residual blocks).

* ``layernorm`` (rows x cols): Y = (X - mean) / sqrt(var + eps) * gamma + beta.
* ``add_layernorm`` (rows x cols): the same of X + R, the residual add fused in (BERT's
  ``LayerNorm(x + sublayer(x))``).

``eps`` is an op attribute (baked into the source; its allowed values cover BERT's 1e-12 and the usual
1e-5 / 1e-6). One family (``row``): ``threads_per_row`` threads cooperate on a row, ``rows_per_block``
rows per block; a row of at most threads_per_row * vec * unroll elements stays in registers (read once),
a longer one is read three times (mean, centred variance, normalize). Variance is always centred.
"""

from __future__ import annotations

import numpy as np

from kernelmill.kernels.ops.base import Family, Launch, OpSpec, Param, cdiv, itemsize

#: Allowed eps values (the first is the default attribute: BERT's).
EPS_VALUES: tuple[float, ...] = (1e-12, 1e-5, 1e-6, 1e-7, 1e-8)
MAX_THREADS = 1024
#: Floats a thread holds per row (vec * unroll), so the register path never spills.
MAX_FLOATS_PER_THREAD = 32


class RowFamily(Family):
    name = "row"
    pdl = True
    description = "threads_per_row threads per row (warp or block reductions), rows_per_block rows per block"
    params = (
        Param("threads_per_row", (32, 64, 128, 256, 512, 1024), "threads that cooperate on one row"),
        Param("rows_per_block", (1, 2, 4, 8), "rows per block"),
        Param("vec", (1, 2, 4, 8), "elements per vector access (at most 16 bytes)"),
        Param("unroll", (1, 2, 4, 8), "vector accesses per thread held in registers"),
    )

    def __init__(self, template: str, entry: str, args: tuple[str, ...]) -> None:
        self.template = template
        self.entry = entry
        self._args = args

    def defaults(self, dtype):
        vec = 16 // itemsize(dtype)
        # 128 threads x 8 half / 4 float x unroll 2: rows up to 2048 (half) / 1024 (float) stay in registers.
        return {"threads_per_row": 128, "rows_per_block": 1, "vec": vec, "unroll": 2}

    def check(self, params, dtype):
        if params["vec"] * itemsize(dtype) > 16:
            return f"vec={params['vec']} x {itemsize(dtype)} bytes exceeds a 16-byte access"
        if params["vec"] * params["unroll"] > MAX_FLOATS_PER_THREAD:
            return f"vec*unroll={params['vec'] * params['unroll']} > {MAX_FLOATS_PER_THREAD} floats per thread"
        threads = params["threads_per_row"] * params["rows_per_block"]
        if threads > MAX_THREADS:
            return f"{threads} threads per block > {MAX_THREADS}"
        return None

    def check_shape(self, shape, params, dtype):
        rows, cols = shape
        if rows * cols >= 2**40:  # pragma: no cover - absurd sizes
            return "too many elements"
        if cdiv(rows, params["rows_per_block"]) > 2**31 - 1:  # pragma: no cover
            return "more row blocks than a grid's x dimension holds"
        return None

    def context(self, params, dtype, attrs):
        return {"residual": self.entry == "add_layernorm", "eps_literal": repr(float(attrs["eps"]))}

    def launches(self, shape, params, dtype):
        rows, cols = shape
        rpb, tpr = params["rows_per_block"], params["threads_per_row"]
        return [Launch(self.entry, (cdiv(rows, rpb), 1, 1), (tpr * rpb, 1, 1), 0, (*self._args, rows, cols))]


_EPS = Param("eps", EPS_VALUES, "epsilon added to the variance")


def layer_norm64(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


#: Variances of the uniform kind's odd rows (by turns): 3 eps for each of EPS_VALUES, where a kernel baking in another
#: eps is off by 7% or more (a row of variance 1.3 told 1e-12 from 1e-5 by 4e-6, inside every tolerance).
SMALL_VARIANCES: tuple[float, ...] = tuple(3.0 * eps for eps in sorted(EPS_VALUES, reverse=True))

#: A row's mean over its spread (half-width) on the "offset" kind's seeds, per storage type: as large as keeps a
#: centred float32 variance well inside the type's allowance, and the row's values many steps of the type apart.
OFFSET_RATIO = {"float32": 16.0, "float16": 256.0, "bfloat16": 16.0}


class LayerNorm(OpSpec):
    name = "layernorm"
    intermediates = False  # only the output is rounded (OpSpec.intermediates)
    input_kinds = ("uniform", "offset")
    dims = ("rows", "cols")
    example_shape = "1024x768"
    inputs = ("X", "gamma", "beta")
    outputs = ("Y",)
    attributes = (_EPS,)
    families = {"row": RowFamily("layernorm/row.cu.j2", "layernorm", ("X", "gamma", "beta", "Y"))}

    def tensor_shapes(self, shape):
        rows, cols = shape
        return {"X": (rows, cols), "R": (rows, cols), "gamma": (cols,), "beta": (cols,), "Y": (rows, cols)}

    def summed_terms(self, shape):
        return shape[1]  # the row's mean and variance

    def input_scale(self, name, shape):
        return 2.0

    def make_inputs(self, shape, dtype, seed):
        """Uniform in [-2, 2]; on the "offset" kind's seeds each row is M + (M / r) U(-1, 1), |M| in 100..1000 and
        r = OFFSET_RATIO[dtype] (with the row's first two elements at its extremes). The variance of such a row
        taken as E[x^2] - E[x]^2 in float32 loses most of its digits: that fails float32 and float16 by several
        times their allowance, while a centred variance uses a small share of it
        (tests/unit/test_layernorm_spec.py). bfloat16 holds too few digits to tell the two apart. Every eighth
        row of those seeds is constant (M; for add_layernorm, R zero there), whose output is beta exactly: a
        mean an ulp off, over sqrt(eps), gave about +-gamma. On the uniform kind's seeds the odd rows are scaled
        to the SMALL_VARIANCES by turns, so that the output tells the eps of the attribute from the others."""
        out = super().make_inputs(shape, dtype, seed)
        rows, cols = shape
        if self.input_kind(seed) == "uniform":
            odd = np.arange(1, rows, 2)
            variance = np.asarray(SMALL_VARIANCES)[(odd // 2) % len(SMALL_VARIANCES)]
            scale = np.sqrt(variance / (self.input_scale("X", shape) ** 2 / 3.0))  # U(-s, s) has variance s^2 / 3
            for name in ("X", "R"):  # add_layernorm: X and R alike (their sum has twice the variance)
                if name in out:
                    values = out[name].astype(np.float32)
                    values[odd] *= scale[:, None].astype(np.float32)
                    out[name] = values.astype(out[name].dtype)
        if self.input_kind(seed) == "offset":
            rng = np.random.default_rng([seed, 1])
            spread = 1.0 / OFFSET_RATIO[dtype]
            mean = rng.uniform(100.0, 1000.0, size=(rows, 1)) * rng.choice([-1.0, 1.0], size=(rows, 1))
            noise = rng.uniform(-1.0, 1.0, size=(rows, cols))
            noise[:, :2] = (1.0, -1.0)[:cols]
            x = mean + mean * spread * noise
            constant = np.arange(rows) % 8 == 7
            x = np.where(constant[:, None], mean, x)
            if "R" in self.inputs:  # X + R is the row normalized: the offset rides on X, R is spread like it
                residual = mean * spread * rng.uniform(-1.0, 1.0, size=(rows, cols))
                residual[constant] = 0.0
                out["R"] = residual.astype(np.float32).astype(out["R"].dtype)
                x -= residual
            out["X"] = x.astype(np.float32).astype(out["X"].dtype)
        return out

    def _x(self, inputs):
        return inputs["X"].astype(np.float64)

    def reference(self, inputs, attrs):
        gamma, beta = (inputs[n].astype(np.float64) for n in ("gamma", "beta"))
        return {"Y": layer_norm64(self._x(inputs), gamma, beta, float(attrs.get("eps", EPS_VALUES[0])))}

    def flops(self, shape):
        rows, cols = shape
        return 8.0 * rows * cols

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch.nn.functional as F

        x, g, b = tensors["X"], tensors["gamma"], tensors["beta"]
        eps = float(attrs.get("eps", EPS_VALUES[0]))
        return lambda: F.layer_norm(x, (x.shape[-1],), g, b, eps)


class AddLayerNorm(LayerNorm):
    name = "add_layernorm"
    inputs = ("X", "R", "gamma", "beta")
    families = {"row": RowFamily("layernorm/row.cu.j2", "add_layernorm", ("X", "R", "gamma", "beta", "Y"))}

    def _x(self, inputs):
        return inputs["X"].astype(np.float64) + inputs["R"].astype(np.float64)

    def flops(self, shape):
        rows, cols = shape
        return 9.0 * rows * cols

    def torch_reference(self, tensors, attrs):  # pragma: no cover - GPU
        import torch.nn.functional as F

        x, r, g, b = tensors["X"], tensors["R"], tensors["gamma"], tensors["beta"]
        eps = float(attrs.get("eps", EPS_VALUES[0]))
        return lambda: F.layer_norm(x + r, (x.shape[-1],), g, b, eps)


LAYERNORM = LayerNorm()
ADD_LAYERNORM = AddLayerNorm()
