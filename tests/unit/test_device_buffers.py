"""Device-side bookkeeping that needs no GPU: the live-buffer set the exit path frees."""

from __future__ import annotations

import gc
import weakref

from kernelmill.kernels.device import Buffer


def test_buffers_are_tracked_by_identity_and_drop_out_when_released():
    live: weakref.WeakSet[Buffer] = weakref.WeakSet()
    a, b = Buffer(allocation=0x1000, nbytes=16), Buffer(allocation=0x1000, nbytes=16)
    live.add(a)
    live.add(b)
    assert a != b and len(live) == 2  # equal fields, two buffers
    del a
    gc.collect()
    assert list(live) == [b]
