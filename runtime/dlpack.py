"""A DLPack producer in ctypes: ``__dlpack__`` for runtime Tensors on the CPU and on the GPU.

The capsule ("dltensor", DLPack 0.x layout, which every consumer takes) points at the tensor's memory;
the tensor (and through it the device buffer or NumPy array, or a foreign owner) stays alive until the
consumer calls the deleter, or until the capsule is dropped unconsumed.
"""

from __future__ import annotations

import ctypes
from typing import Any

KDL_CPU, KDL_CUDA = 1, 2
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4

#: (type code, bits) per runtime dtype.
DL_TYPES: dict[str, tuple[int, int]] = {
    "float32": (KDL_FLOAT, 32),
    "float16": (KDL_FLOAT, 16),
    "bfloat16": (KDL_BFLOAT, 16),
    "int32": (KDL_INT, 32),
    "int64": (KDL_INT, 64),
}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

#: Everything a live capsule points at, by the address of its DLManagedTensor.
_alive: dict[int, tuple[Any, ...]] = {}


@_Deleter
def _deleter(managed) -> None:  # called by the consumer when its tensor dies
    _alive.pop(ctypes.cast(managed, ctypes.c_void_p).value, None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule) -> None:  # the capsule was dropped: free it only if nobody consumed it
    if _api.PyCapsule_IsValid(capsule, b"dltensor"):
        _alive.pop(_api.PyCapsule_GetPointer(capsule, b"dltensor"), None)


def capsule(owner: Any, data_ptr: int, shape: tuple[int, ...], dtype: str, device_type: int, device_id: int):
    """A "dltensor" capsule over ``data_ptr`` (compact row-major); ``owner`` lives as long as it is used."""
    code, bits = DL_TYPES[dtype]
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*reversed(strides))
    managed = DLManagedTensor()
    managed.dl_tensor.data = data_ptr or None
    managed.dl_tensor.device = DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = DLDataType(code, bits, 1)
    managed.dl_tensor.shape = shape_arr
    managed.dl_tensor.strides = strides_arr
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    _alive[address] = (managed, shape_arr, strides_arr, owner)
    return _api.PyCapsule_New(address, b"dltensor", ctypes.cast(_capsule_destructor, ctypes.c_void_p))


def live_capsules() -> int:
    """How many capsules still hold their tensor (tests)."""
    return len(_alive)
