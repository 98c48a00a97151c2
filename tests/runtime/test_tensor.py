"""Tensor basics and zero-copy exchange with PyTorch (CPU tensors; the GPU test does cuda ones)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kernelmill import runtime
from kernelmill.runtime import Tensor, dlpack, from_numpy, from_torch, to_torch
from kernelmill.runtime.tensor import as_tensor, numpy_dtype


def test_from_numpy_shares_and_converts():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = from_numpy(a)
    assert t.shape == (3, 4) and t.dtype == "float32" and t.device == "cpu" and t.strides == (4, 1)
    assert t.numpy() is a and t.ptr == a.ctypes.data
    h = from_numpy(a, dtype="float16")
    assert h.dtype == "float16" and h.numpy().dtype == np.float16 and h.nbytes == 24
    b = from_numpy(a, dtype="bfloat16")
    assert b.numpy().dtype == numpy_dtype("bfloat16")
    assert from_numpy(np.zeros(3)).dtype == "float32"  # float64 comes in as float32
    assert from_numpy(np.arange(3)).dtype == "int64"


def test_a_0d_array_stays_0d():
    """np.ascontiguousarray made it (1,): the round trip changed its shape, and ops met a dim it lacked."""
    t = from_numpy(np.array(2.5, np.float32))
    assert t.shape == () and t.ndim == 0 and t.numel == 1 and t.numpy().shape == () and float(t.numpy()) == 2.5
    assert from_numpy(np.float64(-1.0), dtype="float16").numpy().shape == ()
    back = to_torch(t)
    assert tuple(back.shape) == () and float(back) == 2.5
    strided = np.arange(12, dtype=np.float32).reshape(3, 4).T  # not C-contiguous: copied into a new array
    c = from_numpy(strided)
    assert c.strides == (3, 1) and np.array_equal(c.numpy(), strided)


def test_read_only_memory_is_copied_not_shared():
    """Shared, a torch tensor made of it by to_torch wrote into a bytes object (or a read-only memory map:
    a segmentation fault)."""
    frozen = bytes(16)
    t = from_numpy(np.frombuffer(frozen, np.float32))
    to_torch(t).fill_(1.0)
    assert frozen == bytes(16) and t.numpy().tolist() == [1.0] * 4
    writable = np.zeros(4, np.float32)
    assert from_numpy(writable).numpy() is writable  # still shared where it may be written


def test_the_wrong_kind_of_input_is_named():
    import torch

    with pytest.raises(TypeError, match="from_torch takes a torch.Tensor, not a ndarray"):
        from_torch(np.ones(3))  # AttributeError: no attribute 'detach'
    with pytest.raises(TypeError, match="from_numpy takes a NumPy array; a torch tensor goes through"):
        from_numpy(torch.ones(3, requires_grad=True))
    scalar = from_numpy(np.array(1.0, np.float32))
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(scalar)
    with pytest.raises(ValueError, match="rows of a 0-d tensor"):
        scalar.rows(0, 1)


def test_reshape_rows_clone_copy():
    t = from_numpy(np.arange(24, dtype=np.float32))
    v = t.reshape(2, -1, 3)
    assert v.shape == (2, 4, 3) and v.ptr == t.ptr
    r = v.rows(1, 2)
    assert r.shape == (1, 4, 3) and r.numpy()[0, 0, 0] == 12
    c = t.clone()
    assert c.ptr != t.ptr and np.array_equal(c.numpy(), t.numpy())
    c.copy_(from_numpy(np.ones(24, np.float32)))
    assert c.numpy().sum() == 24
    with pytest.raises(ValueError):
        t.reshape(5, 5)


def test_cpu_tensor_has_no_cuda_array_interface():
    assert not hasattr(from_numpy(np.zeros(2, np.float32)), "__cuda_array_interface__")


def test_bad_device_and_dtype():
    with pytest.raises(ValueError):
        Tensor.empty((2,), "float32", "tpu")
    with pytest.raises(TypeError):
        from_numpy(np.zeros(2, dtype=np.complex64))


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
