"""First-use checks (runtime/check.py) without a GPU: a fake device whose "kernels" compute softmax on host
memory, rightly or wrongly as the test decides, so the registry's choices can be followed: a kernel that fails
its check is passed over, outcomes are recorded per GPU model, a fault is recorded before it is raised."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from kernelmill.kernels.compile import CompiledKernel
from kernelmill.kernels.device import Buffer, DeviceFault
from kernelmill.runtime.check import KernelCheckFault, NoVerifiedKernel
from kernelmill.runtime.registry import DEFAULT, NEAREST, TUNED, KernelRegistry

SHAPE = (64, 512)


class SoftmaxKernel:
    """Computes a row softmax of its first buffer into its second (rows, cols: its last two ints): rightly,
    off by 1% ("wrong"), or faulting ("fault")."""

    def __init__(self, device, behaviour, entry):
        self.device, self.behaviour, self.entry = device, behaviour, entry

    def launch(self, grid, block, smem, args, stream=None):
        self.device.launches.append(self.entry)
        buffers = [a for a in args if isinstance(a, Buffer)]
        again = self.device.download(buffers[1], (1,), np.uint32)[0] != 0xFFFFFFFF  # y holds the last run's values
        if self.behaviour == "hang_again" and again:
            self.device.poisoned = True
            raise DeviceFault("kernel still running after 10.0 s (hang)", poisoned=True, timed_out=True)
        launched = self.device.launches.count(self.entry)
        if self.behaviour == "stops_writing" and launched > 3:  # right while verified, then writes nothing
            return
        if self.behaviour == "drift" and again:  # a second run on the same output adds to it
            self.device.copy_in(buffers[1], self.device.download(buffers[1], (1,), np.float32) * 2)
            return
        if self.behaviour == "scribble_again" and again:  # a second run leaves its output right, its input not
            self.device.copy_in(buffers[0], np.zeros(1, np.float32))
            return
        if self.behaviour == "fault":
            self.device.poisoned = True  # as kernels.device.Device marks itself
            raise DeviceFault("an illegal memory access was encountered", poisoned=True)
        if self.entry == "softmax_split_stats":  # the two-pass family: its second launch writes y
            return
        rows, cols = [a for a in args if isinstance(a, int)][-2:]
        x = self.device.download(buffers[0], (rows, cols), np.float32).astype(np.float64)
        e = np.exp(x - x.max(axis=1, keepdims=True))
        y = e / e.sum(axis=1, keepdims=True) * (1.01 if self.behaviour == "wrong" else 1.0)
        self.device.copy_in(buffers[1], y.astype(np.float32))


class FakeDevice:
    """Host memory standing in for a GPU's; a cubin's behaviour is what ``behaviour(cubin)`` says."""

    def __init__(self, behaviour, name="NVIDIA Fake H0"):
        self.mem, self.next = np.zeros(1 << 24, np.uint8), 4096
        self.poisoned = False
        self.behaviour = behaviour
        self.launches: list[str] = []
        self.info = SimpleNamespace(arch="sm_90", sm_count=132, name=name)

    def alloc(self, nbytes):
        buf = Buffer(self.next, nbytes)
        self.next += (nbytes + 4095) // 4096 * 4096 + 4096
        assert self.next < self.mem.size
        return buf

    def fill(self, buf, byte, stream=None):
        self.mem[buf.ptr : buf.ptr + buf.nbytes] = byte

    def copy_in(self, buf, array):
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.mem[buf.ptr : buf.ptr + raw.size] = raw

    def download(self, buf, shape, dtype):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.mem[buf.ptr : buf.ptr + nbytes].view(dtype).reshape(shape).copy()

    def synchronize(self, timeout_s=None):
        pass

    def load(self, cubin, key):
        behaviour = self.behaviour(cubin)
        if behaviour == "unloadable":  # a cubin this driver rejects: no launch is made, the context lives
            raise DeviceFault("cuModuleLoadData failed: device kernel image is invalid", poisoned=False)
        return SimpleNamespace(kernel=lambda entry: SoftmaxKernel(self, behaviour, entry))


class Backend:
    def __init__(self, device):
        self.device, self.arch, self.capturing_graph = device, "sm_90", False


class FirstLineCompiler:
    """ "Compiles" a source to its first line, which names the family's template and its parameters."""

    def compile(self, source, arch):
        first = source.partition("\n")[0]
        return CompiledKernel(first.encode(), arch, key=first)

    def compile_many(self, sources, arch):
        return [self.compile(source, arch) for source in sources]


def wrong_for(*templates: str, fault: tuple[str, ...] = (), again: dict[str, str] | None = None):
    """A behaviour: "fault" for cubins of the ``fault`` templates, "wrong" for those of ``templates``, what
    ``again`` maps a template to (hang_again, drift, scribble_again), "right" otherwise."""

    def behaviour(cubin: bytes) -> str:
        text = cubin.decode(errors="replace")
        if any(t in text for t in fault):
            return "fault"
        for template, what in (again or {}).items():
            if template in text:
                return what
        return "wrong" if any(t in text for t in templates) else "right"

    return behaviour


def _registry(tmp_path, behaviour, **kw):
    device = FakeDevice(behaviour)
    kw.setdefault("use_service", False)
    reg = KernelRegistry(backend=Backend(device), compiler=FirstLineCompiler(), cache_dir=tmp_path / "cache", **kw)
    return reg, device


def test_a_default_is_checked_at_first_use_and_the_outcome_recorded_per_gpu_model(tmp_path, caplog):
    reg, device = _registry(tmp_path, wrong_for())
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime"):
        entry = reg.get("softmax", SHAPE, "float32")
    assert entry.source == DEFAULT and entry.family == "warp_row"
    assert entry.checked.ok and not entry.checked.recorded and 0 < entry.checked.allowance_used < 1
    assert device.launches == ["softmax_warp_row"] * 5  # one per seed (settings.verify_seeds), two runs again
    assert "checked at first use here, its worst element at 0." in caplog.text
    row = reg.report()[0]
    assert row["checked"].startswith("here ")
    (record,) = (tmp_path / "cache" / "verified" / "nvidia-fake-h0" / "softmax").glob("*.json")
    assert json.loads(record.read_text())["ok"] is True

    # Another process on the same GPU model reads the outcome instead of checking again; another model checks.
    again, device = _registry(tmp_path, wrong_for())
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime"):
        entry = again.get("softmax", SHAPE, "float32")
    assert "checked at first use by an earlier process on this GPU model" in caplog.text
    assert entry.checked.ok and entry.checked.recorded and device.launches == []
    assert again.report()[0]["checked"].startswith("recorded ")
    other = KernelRegistry(
        backend=Backend(FakeDevice(wrong_for(), name="NVIDIA Fake H1")),
        compiler=FirstLineCompiler(),
        cache_dir=tmp_path / "cache",
        use_service=False,
    )
    assert not other.get("softmax", SHAPE, "float32").checked.recorded


def test_a_default_that_fails_gives_way_to_the_next_family(tmp_path, caplog):
    reg, device = _registry(tmp_path, wrong_for("softmax/warp_row"))
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime"):
        entry = reg.get("softmax", SHAPE, "float32")
    assert entry.family == "block_row" and entry.checked.ok
    assert "default warp_row failed its first-use check" in entry.note
    assert "warp_row" in caplog.text and "failed its first-use check (wrong result" in caplog.text
    assert "softmax_warp_row" in device.launches  # it was run, and then passed over


def test_when_every_default_fails_the_forward_gets_an_error_naming_each(tmp_path):
    reg, _ = _registry(tmp_path, wrong_for("softmax/"))
    with pytest.raises(NoVerifiedKernel, match=r"no kernel for softmax 64x512 float32 passed.*warp_row: wrong"):
        reg.get("softmax", SHAPE, "float32")


def test_a_fault_is_recorded_before_it_is_raised_and_the_next_process_passes_the_kernel_over(tmp_path):
    reg, _ = _registry(tmp_path, wrong_for(fault=("softmax/warp_row",)))
    with pytest.raises(KernelCheckFault, match="the CUDA context is lost"):
        reg.get("softmax", SHAPE, "float32")
    # Asked again in the same process (a forward after prepare() met the fault): the recorded failure passes the
    # kernel over, and the next default is not checked on the lost context, nor recorded as failed.
    with pytest.raises(KernelCheckFault, match="context was lost earlier in this process"):
        reg.get("softmax", SHAPE, "float32")
    records = [json.loads(p.read_text()) for p in (tmp_path / "cache" / "verified").rglob("*.json")]
    assert [(r["family"], r["ok"], r["status"]) for r in records] == [("warp_row", False, "fault")]
    later, device = _registry(tmp_path, wrong_for(fault=("softmax/warp_row",)))
    entry = later.get("softmax", SHAPE, "float32")
    assert entry.family == "block_row" and "softmax_warp_row" not in device.launches


def _served(kernel: dict, cubin: bytes) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/kernels/best":  # the kernel tuned on this GPU model is asked for
            assert request.url.params.get("device") == "NVIDIA Fake H0"
        if request.url.path == "/api/kernels/best" and request.url.params.get("arch") == "sm_90":
            return httpx.Response(200, json=kernel)
        if request.url.path == f"/api/kernels/{kernel['id']}/cubin":
            return httpx.Response(200, content=cubin)
        return httpx.Response(404, json={"detail": "none"})

    return httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))


def _softmax_kernel(exact: bool) -> dict:
    return {
        "id": 3,
        "op": "softmax",
        "dtype": "float32",
        "family": "block_row",
        "params": {"vec": 4, "unroll": 4, "threads": 128, "fast_exp": False},
        "shape": list(SHAPE) if exact else [64, 384],
        "arch": "sm_90",
        "exact": exact,
        "speedup": 1.4,
        "median_ms": 0.004,
    }


def test_a_nearest_kernel_that_fails_gives_way_to_the_default(tmp_path):
    client = _served(_softmax_kernel(exact=False), b"served nearest")
    reg, _ = _registry(tmp_path, wrong_for("served"), client=client, use_service=True)
    entry = reg.get("softmax", SHAPE, "float32")
    assert entry.source == DEFAULT and entry.family == "warp_row"
    assert "nearest kernel #3 block_row failed its first-use check" in entry.note
    # find() (how ops choose between a fused kernel and its parts) does not offer it either.
    fresh, _ = _registry(tmp_path / "f", wrong_for("served"), client=client, use_service=True)
    assert fresh.find("softmax", SHAPE, "float32") is None

    good, device = _registry(tmp_path / "g", wrong_for(), client=client, use_service=True)
    near = good.get("softmax", SHAPE, "float32")
    assert near.source == NEAREST and near.checked.ok and device.launches


def test_a_tuned_kernel_is_not_checked_again_but_one_rebuilt_from_this_template_is(tmp_path):
    client = _served(_softmax_kernel(exact=True), b"served tuned")
    reg, device = _registry(tmp_path, wrong_for("served"), client=client, use_service=True)
    entry = reg.get("softmax", SHAPE, "float32")
    assert entry.source == TUNED and entry.checked is None and device.launches == []
    assert reg.report()[0]["checked"] == "tuning job"

    rebuilt = {**_softmax_kernel(exact=True), "source": "// another version's code\n"}
    reg, device = _registry(tmp_path / "r", wrong_for(), client=_served(rebuilt, b"served"), use_service=True)
    entry = reg.get("softmax", SHAPE, "float32")
    assert entry.source == TUNED and entry.rebuilt and entry.checked.ok and device.launches


def test_a_tuned_kernel_whose_cubin_does_not_load_gives_way_to_the_default(tmp_path, caplog):
    """Not checked (a tuning job verified it), it used to reach the forward, which failed on loading it."""
    client = _served(_softmax_kernel(exact=True), b"served tuned")
    for check in (True, False):
        reg, device = _registry(
            tmp_path / str(check), wrong_for(again={"served": "unloadable"}), client=client, use_service=True,
            check=check,
        )  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="kernelmill.runtime"):
            entry = reg.get("softmax", SHAPE, "float32")
        assert entry.source == DEFAULT and "tuned kernel #3 block_row does not load" in entry.note
        assert "tuned kernel #3 not used: its cubin does not load (cuModuleLoadData failed" in caplog.text


def test_stand_ins_that_fail_are_not_offered(tmp_path):
    reg, _ = _registry(tmp_path, wrong_for("threads=128"))
    entry = reg.get("softmax", SHAPE, "float32")
    params = {"vec": 4, "unroll": 8, "rows_per_block": 8, "fast_exp": False}
    assert reg.stand_in(entry, params).checked.ok
    wrong = _registry(tmp_path / "w", wrong_for("rows_per_block=2"))[0]
    assert wrong.stand_in(wrong.get("softmax", SHAPE, "float32"), {**params, "rows_per_block": 2}) is None


def test_checks_off_or_inside_a_capture_run_nothing(tmp_path, caplog):
    reg, device = _registry(tmp_path, wrong_for("softmax/"), check=False)
    assert reg.get("softmax", SHAPE, "float32").checked is None and device.launches == []
    assert reg.report()[0]["checked"] is None

    reg, device = _registry(tmp_path / "c", wrong_for("softmax/"))
    reg.backend.capturing_graph = True
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime"):
        assert reg.get("softmax", SHAPE, "float32").checked is None
    assert "first met inside a CUDA graph capture: not checked" in caplog.text and device.launches == []


def test_a_service_that_predates_device_queries_is_asked_without(tmp_path):
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/kernels/best":
            asked.append(dict(request.url.params))
            if "device" in request.url.params:  # as services before device= answered
                return httpx.Response(422, json={"detail": "unknown query parameter 'device'; give op attributes ..."})
            if request.url.params.get("arch") == "sm_90":
                return httpx.Response(200, json=_softmax_kernel(exact=True))
        if request.url.path == "/api/kernels/3/cubin":
            return httpx.Response(200, content=b"served")
        return httpx.Response(404, json={"detail": "none"})

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg, _ = _registry(tmp_path, wrong_for(), client=client, use_service=True)
    assert reg.get("softmax", SHAPE, "float32").source == TUNED
    assert reg.get("softmax", (32, 512), "float32").kernel_id == 3
    assert sum("device" in a for a in asked) == 1  # refused once, then never sent again


def test_a_kernel_that_fails_only_when_run_again_is_passed_over(tmp_path):
    # Verified on poisoned outputs it is right; run again on its last output it drifts: the next family runs.
    reg, _ = _registry(tmp_path, wrong_for(again={"softmax/warp_row": "drift"}))
    entry = reg.get("softmax", SHAPE, "float32")
    assert entry.family == "block_row" and "default warp_row failed its first-use check" in entry.note
    (failed,) = [r for r in map(json.loads, _texts(tmp_path)) if not r["ok"]]
    assert failed["reason"].startswith("wrong result when run again: y:")
    # One that hangs when run again loses the context: recorded as a timeout, then KernelCheckFault.
    hangs, _ = _registry(tmp_path / "h", wrong_for(again={"softmax/warp_row": "hang_again"}))
    with pytest.raises(KernelCheckFault, match=r"run again: kernel still running after 10.0 s \(hang\)"):
        hangs.get("softmax", SHAPE, "float32")
    (record,) = map(json.loads, _texts(tmp_path / "h"))
    assert record["status"] == "timeout" and not record["ok"]


def test_a_kernel_that_writes_to_its_input_when_run_again_is_passed_over(tmp_path):
    reg, _ = _registry(tmp_path, wrong_for(again={"softmax/warp_row": "scribble_again"}))
    assert reg.get("softmax", SHAPE, "float32").family == "block_row"
    (failed,) = [r for r in map(json.loads, _texts(tmp_path)) if not r["ok"]]
    assert failed["reason"].startswith("run again: wrote to its input x: 1 of its 32768 elements changed, the first")


def test_a_kernel_that_stops_writing_once_launched_enough_is_passed_over(tmp_path):
    """Right for the 3 seeds, then it writes nothing (split-k arrival counts left non-zero do that): its runs
    again found the right values of the launch before in its output, and it passed."""
    reg, _ = _registry(tmp_path, wrong_for(again={"softmax/warp_row": "stops_writing"}))
    entry = reg.get("softmax", SHAPE, "float32")
    assert entry.family == "block_row" and "default warp_row failed its first-use check" in entry.note
    (failed,) = [r for r in map(json.loads, _texts(tmp_path)) if not r["ok"]]
    assert failed["reason"].startswith("wrong result when run again: y: 32768 non-finite elements (unwritten")


def test_a_cubin_the_driver_cannot_load_is_recorded_and_passed_over(tmp_path):
    reg, device = _registry(tmp_path, wrong_for(again={"softmax/warp_row": "unloadable"}))
    entry = reg.get("softmax", SHAPE, "float32")
    assert entry.family == "block_row" and "softmax_warp_row" not in device.launches
    (failed,) = [r for r in map(json.loads, _texts(tmp_path)) if not r["ok"]]
    assert failed["status"] == "unloadable"
    assert failed["reason"] == "not loadable: cuModuleLoadData failed: device kernel image is invalid"


def test_a_check_that_cannot_be_recorded_still_serves_and_runs_again_next_time(tmp_path, monkeypatch, caplog):
    from kernelmill.runtime import check as check_module

    def read_only(path, data):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(check_module, "write_atomically", read_only)
    reg, device = _registry(tmp_path, wrong_for())
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime"):
        assert reg.get("softmax", SHAPE, "float32").family == "warp_row"
    assert "could not record a first-use check" in caplog.text and not _texts(tmp_path)
    again, device_again = _registry(tmp_path, wrong_for())  # another process: nothing recorded, so it checks
    assert again.get("softmax", SHAPE, "float32").family == "warp_row" and device_again.launches


def _texts(root):
    return [p.read_text() for p in (root / "cache" / "verified").rglob("*.json")]


def test_write_atomically_is_whole_for_two_writers_of_one_process_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """Its temporary file was named after the process: two threads writing one path (two registries' served
    entries, a check recorded twice) shared it, so one read an empty or half-written file or renamed the other's
    away (FileNotFoundError: a lost write); a failed write (a full disk) left the file behind for good."""
    import os

    from kernelmill.runtime import check as check_module

    path = tmp_path / "served" / "op" / "k.cubin"
    replace = os.replace
    nested: list[bool] = []

    def another_thread_between(src, dst):  # the second writer runs between the first's write and its rename
        if not nested:
            nested.append(True)
            check_module.write_atomically(path, b"second")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", another_thread_between)
    check_module.write_atomically(path, b"first")
    assert path.read_bytes() == b"first" and sorted(p.name for p in path.parent.iterdir()) == ["k.cubin"]

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        check_module.write_atomically(path, b"third")
    assert path.read_bytes() == b"first" and sorted(p.name for p in path.parent.iterdir()) == ["k.cubin"]


def test_write_atomically_makes_the_data_durable_before_the_rename(tmp_path, monkeypatch):
    """Renamed before its data reached the disk, a record could survive a power loss as an empty file in the
    old one's place: the cached kernel was lost (a file system may persist the rename first)."""
    import os

    from kernelmill.runtime import check as check_module

    path = tmp_path / "served" / "op" / "k.json"
    events: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append("replace"), replace(src, dst))[1])
    check_module.write_atomically(path, b"record")
    assert events == ["fsync", "replace"] and path.read_bytes() == b"record"
