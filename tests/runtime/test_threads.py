"""Runtime calls from other threads (no GPU: a fake context stack): the device's context is pushed around a
call made off the thread that created the device and popped after, once however deep the calls nest, and calls
hold the backend's lock, so one runs at a time."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kernelmill.kernels.device import Device
from kernelmill.runtime import backend as backend_module
from kernelmill.runtime.backend import on_device


@pytest.fixture
def device(monkeypatch):
    stacks: dict[int, list] = {}  # pycuda's context stack, per thread

    def push():
        stacks.setdefault(threading.get_ident(), []).append("ctx")

    def pop():
        stacks[threading.get_ident()].pop()

    dev = object.__new__(Device)
    dev._owner, dev._local = threading.get_ident(), threading.local()
    dev._ctx = SimpleNamespace(push=push)
    dev.cuda = SimpleNamespace(Context=SimpleNamespace(pop=pop))
    dev.stacks = stacks
    monkeypatch.setitem(backend_module._backends, 0, SimpleNamespace(device=dev, lock=threading.RLock()))
    return dev


def in_thread(fn):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_another_thread_pushes_the_context_around_a_call_and_pops_it_after(device):
    @on_device
    def outer():
        return inner() + [len(device.stacks.get(threading.get_ident(), []))]

    @on_device
    def inner():
        return [len(device.stacks.get(threading.get_ident(), []))]

    assert outer() == [0, 0]  # the creating thread has it already (pycuda pushed it there)
    assert in_thread(outer) == [1, 1]  # pushed once, nested calls included
    assert all(stack == [] for stack in device.stacks.values())  # nothing left when the thread ends
    assert len(device.stacks) == 1

    @on_device
    def fails():
        raise RuntimeError("a kernel failed")

    with pytest.raises(RuntimeError):
        in_thread(fails)
    assert all(stack == [] for stack in device.stacks.values())  # popped on the way out as well


def test_calls_from_two_threads_run_one_at_a_time(device):
    order = []

    @on_device
    def work(name):
        order.append(f"{name} in")
        time.sleep(0.05)
        order.append(f"{name} out")

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # Whichever thread came first (a loaded machine may start b before a), one call ran whole, then the other.
    first, second = sorted(("a", "b"), key=lambda name: order.index(f"{name} in"))
    assert order == [f"{first} in", f"{first} out", f"{second} in", f"{second} out"]


def test_without_a_backend_calls_pass_straight_through(monkeypatch):
    monkeypatch.delitem(backend_module._backends, 0, raising=False)
    assert in_thread(on_device(lambda: 7)) == 7
    assert backend_module.empty_cache() == 0  # no pool to empty


def test_a_device_made_on_a_thread_that_ends_leaves_that_threads_stack_empty(device):
    from kernelmill.kernels.device import _PopAtThreadEnd

    device._local = threading.local()
    seen = {}

    def make_device_here():  # what Device.__init__ does off the main thread
        device._ctx.push()
        device._owner = threading.get_ident()
        device._local.pop_at_end = _PopAtThreadEnd(device)
        seen["ident"] = threading.get_ident()
        return "made"

    assert in_thread(make_device_here) == "made"
    # The thread's locals were cleared as it ended, in that thread: its push popped, the device left to others.
    assert device.stacks[seen["ident"]] == [] and device._owner is None
    assert in_thread(on_device(lambda: len(device.stacks[threading.get_ident()]))) == 1  # others push for a call


def test_cpu_tensor_work_does_not_wait_for_another_threads_forward(device):
    import numpy as np

    from kernelmill.runtime import Tensor

    cpu = Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    held, release = threading.Event(), threading.Event()

    @on_device
    def forward():  # a long forward (or capture) in another thread holds the lock
        held.set()
        release.wait(10)

    worker = threading.Thread(target=forward)
    worker.start()
    assert held.wait(10)
    try:
        start = time.perf_counter()
        copy = cpu.clone().to(dtype="float16")
        assert Tensor.zeros((2, 3)).numpy().sum() == 0 and copy.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
        assert time.perf_counter() - start < 5  # did not wait for the forward
        # A call that names the GPU waits for it.
        cuda = on_device(cuda_args_only=True)(lambda device: device)
        result = {}
        waiting = threading.Thread(target=lambda: result.setdefault("value", cuda("cuda")))
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive() and not result
    finally:
        release.set()
        worker.join(10)
    waiting.join(10)
    assert result == {"value": "cuda"}
    assert backend_module._names_cuda((cpu,), {"device": "cuda:0"}) and not backend_module._names_cuda((cpu,), {})
