"""Device-side bookkeeping that needs no GPU: the live-buffer set the exit path frees."""

from __future__ import annotations

import gc
import weakref

import pytest

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


class HostMemory:
    """A stand-in for kernels.device.Device over one host byte array: enough for BoundVariant's buffers."""

    def __init__(self, nbytes: int = 1 << 20) -> None:
        import numpy as np

        self.mem, self.next = np.zeros(nbytes, np.uint8), 4096

    def alloc(self, nbytes):
        buf = Buffer(self.next, nbytes)
        self.next += (nbytes + 4095) // 4096 * 4096 + 4096
        return buf

    def fill(self, buf, byte, stream=None):
        self.mem[buf.ptr : buf.ptr + buf.nbytes] = byte

    def copy_in(self, buf, array):
        raw = array.reshape(-1).view("uint8")
        self.mem[buf.ptr : buf.ptr + raw.size] = raw

    def download(self, buf, shape, dtype):

        return self.mem[buf.ptr : buf.ptr + buf.nbytes].view(dtype).reshape(shape).copy()

    def synchronize(self, timeout_s=None):
        pass

    def load(self, cubin, key):
        return type("Module", (), {"kernel": lambda self, entry: None})()


def test_guard_bytes_around_every_buffer_see_writes_just_out_of_bounds():
    import numpy as np

    from kernelmill.kernels.compile import CompiledKernel
    from kernelmill.kernels.variant import GUARD_BYTES, BoundVariant, Variant

    memory = HostMemory()
    variant = Variant.create("softmax", "warp_row", "float32")
    bound = BoundVariant(memory, variant, CompiledKernel(b"", "sm_90", key="k"), (4, 10))
    bound.set_inputs({"x": np.ones((4, 10), np.float32)})
    bound.poison()
    assert bound.out_of_bounds() is None  # filling and poisoning stay inside
    y = bound.buffers["y"]
    assert y.nbytes == 160 and all(b.ptr % GUARD_BYTES == 0 for b in bound.buffers.values())
    memory.mem[y.ptr + y.nbytes + 5] = 0  # 6 bytes past the end
    assert bound.out_of_bounds() == (
        f"wrote out of bounds: 1 of the {GUARD_BYTES} guard bytes after y changed, the farthest 6 bytes after it"
    )
    memory.mem[y.ptr + y.nbytes + 5] = 0xA5
    memory.mem[bound.buffers["x"].ptr - 4 : bound.buffers["x"].ptr] = 0  # one float before x
    assert "4 of the 1024 guard bytes before x changed, the farthest 4 bytes before it" in bound.out_of_bounds()


def test_verify_fails_a_right_answer_written_with_a_stray_byte_out_of_bounds():
    from kernelmill.kernels.compile import CompiledKernel
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.variant import BoundVariant, Variant
    from kernelmill.kernels.verify import verify

    memory = HostMemory()
    bound = BoundVariant(
        memory, Variant.create("softmax", "warp_row", "float32"), CompiledKernel(b"", "sm_90", "k"), (4, 10)
    )
    y = bound.buffers["y"]

    def run(stray: bool):
        x = memory.download(bound.buffers["x"], (4, 10), "float32")
        memory.copy_in(y, get_op("softmax").reference({"x": x}, {})["y"].astype("float32"))
        if stray:
            memory.mem[y.ptr + y.nbytes] = 1

    bound.run = lambda: run(False)
    assert verify(memory, bound, seeds=2).ok
    bound.run = lambda: run(True)
    result = verify(memory, bound, seeds=2)
    assert result.status == "wrong_result" and "guard bytes after y changed" in result.reason


def test_verify_fails_a_right_answer_from_a_kernel_that_wrote_to_its_input():
    import numpy as np

    from kernelmill.kernels.compile import CompiledKernel
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.variant import BoundVariant, Variant
    from kernelmill.kernels.verify import verify

    memory = HostMemory()
    bound = BoundVariant(
        memory, Variant.create("softmax", "warp_row", "float16"), CompiledKernel(b"", "sm_90", "k"), (4, 10)
    )
    x_buf, y = bound.buffers["x"], bound.buffers["y"]

    def run(scratch_in_x: bool):
        x = memory.download(x_buf, (4, 10), "float16")
        memory.copy_in(y, get_op("softmax").reference({"x": x}, {})["y"].astype("float16"))
        if scratch_in_x:  # the row's max kept in its first element, as scratch
            x[2, 0] = x[2].max()
            memory.copy_in(x_buf, x)

    bound.run = lambda: run(False)
    assert verify(memory, bound, seeds=2).ok
    bound.run = lambda: run(True)
    result = verify(memory, bound, seeds=4)  # some seed's row 2 does not start with its max
    assert result.status == "wrong_result"
    assert "wrote to its input x: 1 of its 40 elements changed, the first at (2, 0)" in result.reason
    bound.set_inputs({"x": np.full((4, 10), -0.0, np.float16)})
    assert "(0 became -0)" in bound.inputs_changed({"x": np.zeros((4, 10), np.float16)})  # bits, not values


class FakeDriver:
    """pycuda.driver's Error and Event, with a context that is broken or not."""

    class Error(Exception):
        pass

    def __init__(self, broken: bool) -> None:
        driver = self

        class Event:
            def record(self, stream=None):
                if driver.broken:
                    raise driver.Error("cuEventRecord failed: unspecified launch failure")

            def query(self):
                return True

        self.broken, self.Event = broken, Event


@pytest.mark.parametrize(
    ("message", "broken", "poisoned"),
    [
        ("cuLaunchKernel failed: an illegal memory access was encountered", True, True),  # named: sticky
        ("cuMemAlloc failed: out of memory", False, False),  # the context still works
        ("cuLaunchKernel failed: a new kind of failure", True, True),  # unnamed, but the context is gone
    ],
)
def test_a_fault_poisons_the_device_when_its_context_no_longer_takes_work(message, broken, poisoned):
    from kernelmill.kernels.device import Device

    device = object.__new__(Device)
    device.cuda, device.poisoned = FakeDriver(broken), False
    fault = device._raise(device.cuda.Error(message), "launch")
    assert (fault.poisoned, device.poisoned) == (poisoned, poisoned)
    assert fault.reason == f"launch: {message}"


class FaultedDriver(FakeDriver):
    """A context a kernel faulted in: every call fails with the sticky error, recording an event as well."""

    def __init__(self) -> None:
        super().__init__(broken=True)
        driver = self

        class Module:
            def get_function(self, entry):
                raise driver.Error("cuModuleGetFunction failed: unspecified launch failure")

        self.Module = Module


def test_timing_a_kernel_that_faulted_is_a_poisoning_device_fault_not_a_raw_driver_error():
    """The fault surfaced at the timing loop's event record (the first call after the kernel died): a raw pycuda
    error got past evaluate() and the evaluator, and the device stayed unmarked for the next batch to launch on."""
    from kernelmill.kernels.bench import time_it
    from kernelmill.kernels.device import Device, DeviceFault

    device = object.__new__(Device)
    device.cuda, device.poisoned = FaultedDriver(), False
    with pytest.raises(DeviceFault) as caught:
        time_it(device, lambda: None, warmup=0, reps=3)
    assert caught.value.poisoned and device.poisoned
    assert caught.value.reason == "recording an event: cuEventRecord failed: unspecified launch failure"


def test_looking_up_an_entry_in_a_faulted_context_marks_the_device_poisoned():
    from kernelmill.kernels.device import Device, DeviceFault, Module

    device = object.__new__(Device)
    device.cuda, device.poisoned = FaultedDriver(), False
    with pytest.raises(DeviceFault) as caught:
        Module(device, device.cuda.Module()).kernel("softmax")
    assert caught.value.poisoned and device.poisoned  # LocalEvaluator._usable refuses the next batch


def test_the_module_cache_keeps_the_most_recently_used_and_lets_the_others_go(monkeypatch):
    import threading
    from collections import OrderedDict

    from kernelmill.kernels import device as device_module

    class Loaded:  # a pycuda module: unloaded when the last reference goes
        pass

    class FakeCuda:
        Error = RuntimeError

        def __init__(self):
            self.loads = 0

        def module_from_buffer(self, cubin):
            self.loads += 1
            return Loaded()

    monkeypatch.setattr(device_module, "MODULE_CACHE_SIZE", 3)
    dev = object.__new__(device_module.Device)  # no GPU: just the cache's bookkeeping
    dev.cuda, dev._modules, dev._modules_lock = FakeCuda(), OrderedDict(), threading.Lock()

    first = {key: weakref.ref(dev.load(b"cubin", key)._module) for key in "abc"}
    assert dev.load(b"cubin", "a") is dev._modules["a"] and dev.cuda.loads == 3  # a hit, now the most recent
    held = dev.load(b"cubin", "d")  # over the bound: b, the least recently used, goes
    gc.collect()
    assert list(dev._modules) == ["c", "a", "d"] and first["b"]() is None and first["a"]() is not None
    dev.load(b"cubin", "b")
    assert dev.cuda.loads == 5 and list(dev._modules) == ["a", "d", "b"]
    # Dropped from the cache, a module something still holds (a runtime's bound kernel) stays loaded.
    d = weakref.ref(held._module)
    for key in "efg":
        dev.load(b"cubin", key)
    gc.collect()
    assert "d" not in dev._modules and d() is not None
    del held
    gc.collect()
    assert d() is None
    unkeyed = dev.load(b"cubin")  # no key: loaded, never cached
    assert unkeyed not in dev._modules.values() and len(dev._modules) == 3


def _softmax_kernel(memory, tamper):
    """A float32 softmax "kernel" on host memory that writes the right answer, then lets ``tamper(out, call,
    y)`` change it before the write (``call``: 1 for the first run)."""
    from kernelmill.kernels.compile import CompiledKernel
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.variant import BoundVariant, Variant

    bound = BoundVariant(
        memory, Variant.create("softmax", "warp_row", "float32"), CompiledKernel(b"", "sm_90", "k"), (4, 10)
    )
    y, calls = bound.buffers["y"], []

    def run():
        calls.append(1)
        x = memory.download(bound.buffers["x"], (4, 10), "float32")
        out = get_op("softmax").reference({"x": x}, {})["y"].astype("float32")
        tamper(out, len(calls), y)
        memory.copy_in(y, out)

    bound.run = run
    return bound


def test_verify_fails_a_kernel_wrong_on_a_later_seed_only():
    from kernelmill.kernels.verify import verify

    def second_run_off(out, call, y):
        if call == 2:
            out[3, 7] *= 1.5

    memory = HostMemory()
    result = verify(memory, _softmax_kernel(memory, second_run_off), seeds=[11, 12, 13])
    assert result.status == "wrong_result" and result.reason.endswith("> tolerance 1e-05 (seed 12)")
    assert [c.seed for c in result.checks] == [11, 12, 13]
    assert [c.failure() is None for c in result.checks] == [True, False, True]


def test_verify_with_no_seeds_is_an_error_not_a_pass():
    """An empty seed list ran nothing and passed (a kernel writing only NaN verified "ok")."""
    from kernelmill.kernels.verify import verify

    memory = HostMemory()
    bound = _softmax_kernel(memory, lambda out, call, y: out.fill(float("nan")))
    with pytest.raises(ValueError, match="^verify needs at least one seed$"):
        verify(memory, bound, seeds=[])
    assert verify(memory, bound, seeds=0).status == "wrong_result"  # a count: at least one per kind of input


def test_verify_poisons_outputs_so_an_element_left_from_the_last_run_fails():
    """The same seed twice: a kernel that skips an element on the second run leaves the first run's right value
    there, which only the poison (NaN) between runs exposes."""
    from kernelmill.kernels.verify import verify

    memory = HostMemory()

    def skips_an_element(out, call, y):
        if call > 1:  # element (1, 2) not written: whatever the buffer holds stays
            out[1, 2] = memory.download(y, (4, 10), "float32")[1, 2]

    bound = _softmax_kernel(memory, skips_an_element)
    result = verify(memory, bound, seeds=[5, 5])
    assert (
        result.status == "wrong_result"
        and "non-finite elements (unwritten or overflow), first at (1, 2)" in result.reason
    )


def test_poison_fills_outputs_and_workspaces_with_nan_and_leaves_the_counters_zero(monkeypatch):
    """A kernel that reads a workspace before writing it (a split-k partial) must see NaN there on every run, not
    what the last run left; the counters are the kernel's to leave zero."""
    import numpy as np

    from kernelmill.kernels.compile import CompiledKernel
    from kernelmill.kernels.variant import BoundVariant, Variant

    variant = Variant.create("softmax", "warp_row", "float32")
    monkeypatch.setattr(variant.family, "workspace", lambda shape, params, dtype: {"ws": 64, "flags": 16})
    monkeypatch.setattr(variant.family, "counter_workspaces", ("flags",))
    memory = HostMemory()
    memory.mem[:] = 0x77  # what the pool's memory held before: the counters are zeroed once, when allocated
    bound = BoundVariant(memory, variant, CompiledKernel(b"", "sm_90", "k"), (4, 10))
    bound.poison()
    for name, nbytes in (("y", 160), ("ws", 64)):
        assert (memory.download(bound.buffers[name], (nbytes,), np.uint8) == 0xFF).all(), name
    assert not memory.download(bound.buffers["flags"], (16,), np.uint8).any()


def test_a_kernel_the_drivers_watchdog_killed_is_a_timeout_not_a_fault():
    """A GPU driving a display kills a kernel after a few seconds: that hang was recorded as a "fault"."""
    import kernelmill.kernels.evaluate as ev
    from kernelmill.kernels.device import Device
    from kernelmill.kernels.verify import verify

    device = object.__new__(Device)
    device.cuda, device.poisoned = FakeDriver(broken=True), False
    fault = device._raise(device.cuda.Error("cuCtxSynchronize failed: the launch timed out and was terminated"), "x")
    assert (fault.timed_out, fault.poisoned, device.poisoned) == (True, True, True)
    assert not device._raise(device.cuda.Error("cuMemAlloc failed: out of memory"), "x").timed_out

    def killed():
        raise fault

    memory = HostMemory()
    bound = _softmax_kernel(memory, lambda out, call, y: None)
    bound.run = killed
    result = verify(memory, bound, seeds=1)
    assert (result.status, result.poisoned) == (ev.TIMEOUT, True)


def test_a_kernel_still_running_past_the_timeout_is_a_hang_that_poisons_the_device():
    from kernelmill.kernels.device import Device, DeviceFault

    class Driver(FakeDriver):
        def __init__(self):
            super().__init__(broken=False)
            self.Event = type("Event", (), {"record": lambda self, stream=None: None, "query": lambda self: False})

    device = object.__new__(Device)
    device.cuda, device.poisoned = Driver(), False
    with pytest.raises(DeviceFault) as caught:
        device.synchronize(0.01)
    assert (caught.value.timed_out, caught.value.poisoned, device.poisoned) == (True, True, True)
    assert caught.value.reason == "kernel still running after 0.0 s (hang)"


def test_a_poisoned_device_is_never_handed_out_again(monkeypatch):
    from types import SimpleNamespace

    from kernelmill.kernels import device as device_module

    monkeypatch.setattr(device_module, "_devices", {0: SimpleNamespace(poisoned=True)})
    with pytest.raises(device_module.DeviceFault, match="poisoned by an earlier fault; restart the process"):
        device_module.get_device(0)
    # Also no usable GPU, for callers that say so in one line (it escaped them as a traceback).
    said = "the CUDA context is poisoned by an earlier fault; restart the process"
    assert device_module.gpu_available() == (False, said)
