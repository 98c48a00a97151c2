"""Zero-copy exchange of CPU tensors with PyTorch (the GPU test does cuda ones); the torch-free basics are in
test_tensor.py, so a host without torch still runs them."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kernelmill import runtime
from kernelmill.runtime import Tensor, dlpack, from_numpy, from_torch, to_torch
from kernelmill.runtime.tensor import as_tensor

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64"])
def test_to_torch_is_zero_copy_and_keeps_the_tensor_alive(dtype):
    values = np.arange(10).reshape(2, 5)
    t = from_numpy(values, dtype=dtype)
    ptr = t.ptr
    before = dlpack.live_capsules()
    tt = to_torch(t)
    assert tt.data_ptr() == ptr and tuple(tt.shape) == (2, 5) and str(tt.dtype) == f"torch.{dtype}"
    del t
    gc.collect()
    assert tt.float().sum().item() == 45.0  # memory still valid: the capsule holds the runtime tensor
    tt[0, 0] = 7
    assert dlpack.live_capsules() == before + 1
    del tt
    gc.collect()
    assert dlpack.live_capsules() == before


def test_unconsumed_capsule_releases_its_tensor():
    before = dlpack.live_capsules()
    cap = from_numpy(np.zeros(3, np.float32)).__dlpack__()
    assert dlpack.live_capsules() == before + 1
    del cap
    gc.collect()
    assert dlpack.live_capsules() == before


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
def test_from_torch_is_zero_copy_and_round_trips(dtype):
    tt = torch.arange(6, dtype=getattr(torch, dtype)).reshape(2, 3)
    t = from_torch(tt)
    assert t.ptr == tt.data_ptr() and t.shape == (2, 3) and t.dtype == dtype
    assert np.array_equal(t.numpy().astype(np.float64), np.arange(6).reshape(2, 3))
    back = to_torch(t)
    assert back.data_ptr() == tt.data_ptr()
    tt[1, 2] = 40
    assert float(t.numpy()[1, 2]) == 40.0
    with pytest.raises(ValueError, match="contiguous"):
        from_torch(tt.t())


def test_as_tensor_accepts_torch_lists_and_tensors():
    assert as_tensor([[1.0, 2.0]]).shape == (1, 2)
    assert as_tensor(torch.ones(3)).dtype == "float32"
    x = from_numpy(np.ones(2, np.float32))
    assert as_tensor(x) is x
    # float64 comes in as float32, from torch as from NumPy (from_torch itself stays zero-copy and refuses it)
    d = as_tensor(torch.tensor([0.5, 1.5], dtype=torch.float64))
    assert d.dtype == "float32" and d.numpy().tolist() == [0.5, 1.5]
    with pytest.raises(TypeError, match="unsupported torch dtype torch.float64"):
        from_torch(torch.zeros(2, dtype=torch.float64))


def test_a_torch_tensor_that_requires_grad_is_wrapped_without_a_copy():
    grad = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    t = from_torch(grad)  # was RuntimeError: Can't call numpy() on Tensor that requires grad
    assert t.ptr == grad.data_ptr() and t.shape == (2, 3) and t.dtype == "float32"
    with torch.no_grad():
        grad[1, 2] = 40
    assert float(t.numpy()[1, 2]) == 40.0  # the same memory
    assert as_tensor(grad).ptr == grad.data_ptr()
    double = as_tensor(torch.ones(2, dtype=torch.float64, requires_grad=True))
    assert double.dtype == "float32" and double.numpy().tolist() == [1.0, 1.0]


def test_a_model_runs_on_a_torch_input_that_requires_grad():
    model = runtime.Model(runtime.nn.Sequential(runtime.nn.MLP.random(16, 48, 16, "gelu_tanh")), device="cpu")
    x = torch.randn(2, 16, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 16)
    np.testing.assert_array_equal(out.numpy(), model(x.detach().numpy()).numpy())


def test_numpy_reads_a_tensor_through_array():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor.from_numpy(a, device="cpu")
    assert np.asarray(t).shape == (2, 3) and np.asarray(t).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(t, dtype=np.float64), a)
    assert np.allclose(np.array(t), a)


def test_from_numpy_takes_numpy_dtypes_and_names_every_dtype_in_a_refusal():
    assert Tensor.from_numpy(np.ones(3), dtype=np.float16).dtype == "float16"
    with pytest.raises(TypeError, match=r"^unsupported dtype 'fp16'; use one of float32, float16, bfloat16, int32, "):
        Tensor.from_numpy(np.ones(3), dtype="fp16")


def test_reshape_refuses_dims_below_minus_one():
    with pytest.raises(ValueError, match=r"cannot reshape \(12,\) to \(-2, -6\): one dim at most may be -1"):
        Tensor.from_numpy(np.ones(12, np.float32)).reshape(-2, -6)
