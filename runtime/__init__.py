"""kernelmill.runtime: a small tensor runtime whose models run on kernelmill's tuned kernels.

    model = runtime.load_model("bert-dir", device="cuda", dtype="float16")
    out = model.forward(input_ids, attention_mask)       # a runtime Tensor; .numpy(), runtime.to_torch(out)
    print(model.format_kernel_report())                   # which kernel each op got: tuned / nearest / default

Without a GPU the same models run on NumPy float32 (device="cpu"). The runtime imports ``kernels``
(and the settings) and talks to the service over HTTP only.
"""

from kernelmill.runtime import nn, ops
from kernelmill.runtime.backend import empty_cache
from kernelmill.runtime.models import BertModel, Model, load_model, load_module, mlp_from_state_dict
from kernelmill.runtime.registry import KernelRegistry
from kernelmill.runtime.tensor import Tensor, as_tensor, from_numpy, from_torch, to_torch
from kernelmill.runtime.tune import TuneError, model_problems, tune_model

__all__ = [
    "BertModel",
    "KernelRegistry",
    "Model",
    "Tensor",
    "TuneError",
    "as_tensor",
    "empty_cache",
    "from_numpy",
    "from_torch",
    "load_model",
    "load_module",
    "mlp_from_state_dict",
    "model_problems",
    "nn",
    "ops",
    "to_torch",
    "tune_model",
]
