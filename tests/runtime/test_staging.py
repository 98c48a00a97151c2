"""Uploads through page-locked staging (no GPU: a fake driver whose stream runs its copies when told): the host
array may change as soon as upload returns, a staging buffer is taken again only after its copy ran, and at most
``limit`` bytes are held."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kernelmill.runtime.backend import Staging


class FakeStream:
    """Queued work runs when ``run`` is called (the GPU catching up)."""

    def __init__(self):
        self.queue, self.device = [], {}

    def run(self, count=None):
        for _ in range(len(self.queue) if count is None else count):
            self.queue.pop(0)()


def fake_cuda(stream):
    class Event:
        def __init__(self, flags=None):
            self.passed = True

        def record(self, s):
            self.passed = False
            s.queue.append(lambda: setattr(self, "passed", True))

        def query(self):
            return self.passed

        def synchronize(self):
            while not self.passed:
                stream.run(1)

    def memcpy_htod_async(ptr, src, s):
        assert isinstance(src, np.ndarray) and src.base is not None  # a view of a staging buffer
        s.queue.append(lambda: s.device.__setitem__(ptr, bytes(src)))

    allocated = []

    def pagelocked_empty(size, dtype):
        allocated.append(size)
        return np.zeros(size, dtype)

    return SimpleNamespace(
        Event=Event,
        event_flags=SimpleNamespace(DISABLE_TIMING=2),
        memcpy_htod_async=memcpy_htod_async,
        pagelocked_empty=pagelocked_empty,
        allocated=allocated,
    )


def test_the_host_array_may_change_at_once_and_buffers_wait_for_their_copies():
    stream = FakeStream()
    cuda = fake_cuda(stream)
    staging = Staging(cuda, limit=1 << 20)
    host = np.arange(10, dtype=np.int32)
    for ptr in range(3):
        staging.upload(ptr, host, stream)
        host += 100  # the caller's array changes before the GPU copies
    assert not stream.device and cuda.allocated == [4096] * 3  # three copies pending: three buffers
    stream.run()
    for ptr in range(3):
        assert np.frombuffer(stream.device[ptr], np.int32).tolist() == list(range(100 * ptr, 100 * ptr + 10))
    staging.upload(3, np.ones(5000, np.uint8), stream)  # a larger size class
    staging.upload(4, host, stream)  # the copies are done: a buffer of its size is taken again
    assert cuda.allocated == [4096] * 3 + [8192] and staging.held == 3 * 4096 + 8192
    stream.run()
    assert stream.device[3] == b"\1" * 5000 and np.frombuffer(stream.device[4], np.int32)[0] == 300


def test_past_the_limit_an_upload_waits_for_the_copies_under_way():
    stream = FakeStream()
    cuda = fake_cuda(stream)
    staging = Staging(cuda, limit=2 * 4096)
    for ptr in range(2):
        staging.upload(ptr, np.full(16, ptr, np.uint8), stream)
    assert len(stream.queue) == 4 and staging.held == 2 * 4096  # two copies and their events
    staging.upload(2, np.full(16, 2, np.uint8), stream)  # waited: the GPU ran both, a buffer came back
    assert cuda.allocated == [4096, 4096] and stream.device[0] == b"\0" * 16 and stream.device[1] == b"\1" * 16
    staging.upload(3, np.full(6000, 3, np.uint8), stream)  # another size: the free 4 KiB buffers make room
    assert staging.held <= 2 * 4096 + 8192 and cuda.allocated[-1] == 8192
    staging.close()  # waits for what is under way
    assert stream.device[2] == b"\2" * 16 and stream.device[3] == b"\3" * 6000 and staging.held == 0
