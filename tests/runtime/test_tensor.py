"""Tensor basics and zero-copy exchange with PyTorch (CPU tensors; the GPU test does cuda ones)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kernelmill.runtime import Tensor, from_numpy, from_torch, to_torch
from kernelmill.runtime.tensor import numpy_dtype


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
    empty = from_numpy(np.zeros((0, 3), np.float32))
    assert empty.reshape(3, 0).shape == (3, 0) and empty.reshape(-1).shape == (0,)
    with pytest.raises(ValueError, match=r"cannot reshape \(0, 3\) to \(0, -1\): the -1 is ambiguous"):
        empty.reshape(0, -1)  # it gave (0, 0); torch refuses it


def test_cpu_tensor_has_no_cuda_array_interface():
    assert not hasattr(from_numpy(np.zeros(2, np.float32)), "__cuda_array_interface__")


def test_bad_device_and_dtype():
    with pytest.raises(ValueError):
        Tensor.empty((2,), "float32", "tpu")
    with pytest.raises(TypeError):
        from_numpy(np.zeros(2, dtype=np.complex64))


def test_shapes_are_whole_numbers_and_an_int_is_a_1d_shape():
    """int() cut a 2.5 to 2 and read "3" as 3 (torch and NumPy refuse both), and Tensor.zeros(5) failed with
    "'int' object is not iterable" where torch.zeros(5) and np.zeros(5) give 5 zeros."""
    assert Tensor.zeros(5).shape == (5,) and Tensor.empty(np.int64(2)).shape == (2,)
    assert Tensor.zeros([2, np.int32(3)]).shape == (2, 3) and Tensor.zeros(()).shape == ()
    for shape in ((2.5,), ("3",), (True,), None):
        with pytest.raises(TypeError, match=r"^Tensor.zeros: a shape is whole numbers, got "):
            Tensor.zeros(shape)
    with pytest.raises(ValueError, match=r"^Tensor.empty: a shape's dims must be at least 0, got \(2, -1\)$"):
        Tensor.empty((2, -1))  # before any allocation, on either device
    t = from_numpy(np.arange(6, dtype=np.float32))
    assert t.reshape(np.int64(2), 3).shape == (2, 3) and t.reshape([3, -1]).shape == (3, 2)
    for dims in ((2.9, 3), ("2", 3), (True, 6)):
        with pytest.raises(TypeError, match=r"^cannot reshape \(6,\): a shape is whole numbers, got "):
            t.reshape(*dims)


def test_to_torch_without_torch_says_what_to_install_and_what_works_instead(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError, as where it is missing
    with pytest.raises(ModuleNotFoundError, match=r"to_torch needs PyTorch \(pip install torch\); .*\.numpy\(\)"):
        to_torch(from_numpy(np.zeros(2, np.float32)))


@pytest.mark.parametrize(("stream", "waits"), [(None, False), (1, False), (2, True), (0x7F00, True)])
def test_a_cuda_tensors_dlpack_waits_for_the_runtimes_work_unless_the_consumer_is_ordered_with_it(
    monkeypatch, stream, waits
):
    """The per-thread default stream (2) is not ordered with the runtime's blocking stream, as the legacy
    default stream (1, or None) is: a consumer on it (CuPy in per-thread mode) could read before the writes."""
    from types import SimpleNamespace

    from kernelmill.kernels.device import Buffer
    from kernelmill.runtime import tensor as tensor_module

    waited = []
    monkeypatch.setattr(tensor_module, "_backend", lambda: SimpleNamespace(synchronize=lambda: waited.append(1)))
    t = Tensor((4,), "float32", "cuda", buffer=Buffer(0x10000, 16))
    assert t.__dlpack__(stream=stream) is not None
    assert bool(waited) == waits
