import json
from types import SimpleNamespace

import pytest

from kernelmill.cli import _bench_report
from kernelmill.kernels.bench import Ceilings, Timing, allow_tf32
from kernelmill.kernels.ops import get_op


def test_allow_tf32_sets_pytorchs_matmul_precision_for_the_block_only():
    torch = pytest.importorskip("torch")
    before = torch.get_float32_matmul_precision()
    with allow_tf32(torch, True):
        assert torch.get_float32_matmul_precision() == "high"  # TF32 allowed
    with allow_tf32(torch, False):
        assert torch.get_float32_matmul_precision() == "highest"  # IEEE float32
    assert torch.get_float32_matmul_precision() == before


def _row(family, precision, ms):
    variant = SimpleNamespace(describe=lambda: family, family=SimpleNamespace(name=family), params={},
                              precision=precision)  # fmt: skip
    verification = SimpleNamespace(precision=precision, per_seed=lambda: {1: 1e-4}, allowance_used=None)
    return SimpleNamespace(variant=variant, status="ok", reason=None, verification=verification,
                           timing=Timing.from_samples([ms] * 3))  # fmt: skip


def test_bench_compares_each_variant_with_pytorch_in_its_own_precision():
    spec = get_op("matmul")
    ceil = Ceilings("GPU", copy_gbps=1e6, matrix_tflops={"float32": 50.0, "tf32": 400.0})
    rows = [_row("simt", "float32", 2.0), _row("tensorcore", "tf32", 1.0)]
    torch = {"float32": Timing.from_samples([3.0] * 3), "tf32": Timing.from_samples([0.5] * 3)}
    report = _bench_report(spec, (512, 512, 512), "float32", "GPU", ceil, 0.1, rows, torch)
    speedups = {v["family"]: v["speedup_vs_torch"] for v in report["variants"]}
    assert speedups == {"simt": pytest.approx(1.5), "tensorcore": pytest.approx(0.5)}  # not 3.0 against IEEE
    assert report["torch"]["median_ms"] == 3.0 and set(report["torch_by_precision"]) == {"float32", "tf32"}
    # Each against the matrix rate of its own precision: 2 * 512^3 flops at 50 and at 400 TFLOP/s.
    pct = {v["family"]: v["pct_of_floor"] for v in report["variants"]}
    assert pct == {"simt": pytest.approx(100 * 2 * 512**3 / 50e12 * 1e3 / 2.0),
                   "tensorcore": pytest.approx(100 * 2 * 512**3 / 400e12 * 1e3 / 1.0)}  # fmt: skip


@pytest.mark.parametrize("samples", [[1.0, 10.0], [1.0, 1.1, 1.2, 1.3, 5.0], [2.0, 1.0, 3.0], [1.0] * 50])
def test_timing_percentiles_lie_within_the_samples_however_few(samples):
    """bench_reps may be 1..8: p10 and p90 were extrapolated past the samples there (a p10 of -5.3 ms)."""
    from kernelmill.kernels.bench import Timing

    timing = Timing.from_samples(samples)
    assert min(samples) <= timing.p10_ms <= timing.median_ms <= timing.p90_ms <= max(samples)
    assert timing.n == len(samples) and 0 <= timing.spread <= (max(samples) - min(samples)) / timing.median_ms


class HangingDevice:
    """A stand-in device whose queued work never finishes once ``hang_after`` launches have run."""

    def __init__(self, hang_after: int) -> None:
        self.launches, self.hang_after, self.waits = 0, hang_after, []

    def launch(self):
        self.launches += 1

    def event(self):
        return SimpleNamespace(record=lambda: None, time_since=lambda other: 1.0)

    def synchronize(self, timeout_s=None):
        from kernelmill.kernels.device import DeviceFault

        self.waits.append(timeout_s)
        if self.launches > self.hang_after:
            if timeout_s is None:
                raise AssertionError("a wait without a timeout on a hung kernel never returns")
            raise DeviceFault(f"kernel still running after {timeout_s:.1f} s (hang)", poisoned=True, timed_out=True)


def test_timing_bounds_its_waits_so_a_kernel_hanging_on_a_later_run_is_a_timeout():
    from kernelmill.kernels.bench import time_it
    from kernelmill.kernels.device import DeviceFault

    fine = HangingDevice(hang_after=10**6)
    timing = time_it(fine, fine.launch, warmup=3, reps=5, timeout_s=2.0)
    assert timing.median_ms == 1.0 and fine.launches == 8
    assert fine.waits[0] == 2.0 and 2.0 <= fine.waits[-1] < 3.0  # 2 s, plus 3x the first run's time for each

    hangs = HangingDevice(hang_after=2)  # right in verification, hung from the third run on
    with pytest.raises(DeviceFault) as caught:
        time_it(hangs, hangs.launch, warmup=3, reps=5, timeout_s=2.0)
    assert caught.value.timed_out and caught.value.poisoned


def test_every_timed_repetition_starts_after_an_l2_flush_and_only_the_kernel_is_between_its_events():
    from kernelmill.kernels.bench import time_it

    log = []

    class Event:
        def record(self):
            log.append("record")

        def time_since(self, start):
            return 1.0

    device = SimpleNamespace(event=Event, synchronize=lambda timeout_s=None: log.append("wait"))
    flusher = SimpleNamespace(flush=lambda: log.append("flush"))
    timing = time_it(device, lambda: log.append("run"), warmup=2, reps=3, flusher=flusher)
    assert timing.n == 3
    assert log == ["run", "wait", "run"] + ["flush", "record", "run", "record"] * 3 + ["wait"]


def test_a_hang_while_timed_is_recorded_as_a_timeout_of_that_trial(monkeypatch):
    import kernelmill.kernels.evaluate as ev
    from kernelmill.kernels.device import DeviceFault
    from kernelmill.kernels.variant import Variant
    from kernelmill.kernels.verify import VerifyResult

    def hang(*args, **kwargs):
        raise DeviceFault("kernel still running after 9.0 s (hang)", poisoned=True, timed_out=True)

    monkeypatch.setattr(Variant, "compile", lambda self, compiler=None, arch=None: "cubin")
    bound = SimpleNamespace(run=None, out_of_bounds=lambda: None, set_inputs=lambda inputs: None)
    monkeypatch.setattr(ev, "BoundVariant", lambda *args: bound)
    monkeypatch.setattr(ev, "verify", lambda *args, **kwargs: VerifyResult(True, "ok", "float32", 1e-5, (4, 10)))
    monkeypatch.setattr(ev, "time_it", hang)
    result = ev.evaluate(Variant.create("softmax", "warp_row", "float32"), (4, 10), device=None)
    assert (result.status, result.poisoned) == ("timeout", True)
    assert result.reason == "kernel still running after 9.0 s (hang) while timed"


def test_a_kernel_wrong_after_its_timed_launches_is_a_wrong_result(monkeypatch):
    """One that stops writing once launched enough (split-k counts left non-zero) passed: its outputs still
    held the verified values. It is verified once more after timing, on the last seed, outputs poisoned; and
    it is timed on seed 0's inputs, as PyTorch is."""
    import kernelmill.kernels.evaluate as ev
    from kernelmill.kernels.bench import Timing
    from kernelmill.kernels.variant import Variant
    from kernelmill.kernels.verify import VerifyResult

    timed_on, asked = [], []

    def verify(device, bound, seeds, **kwargs):
        asked.append(list(seeds) if not isinstance(seeds, int) else seeds)
        ok = len(asked) == 1
        result = VerifyResult(ok, "ok" if ok else "wrong_result", "float32", 1e-5, (4, 10))
        result.checks = [SimpleNamespace(seed=3), SimpleNamespace(seed=7)]  # evaluate reads the last seed
        result.reason = None if ok else "wrong result at 4x10: y: 40 non-finite elements"
        return result

    bound = SimpleNamespace(run=None, out_of_bounds=lambda: None, set_inputs=timed_on.append)
    monkeypatch.setattr(Variant, "compile", lambda self, compiler=None, arch=None: "cubin")
    monkeypatch.setattr(ev, "BoundVariant", lambda *args: bound)
    monkeypatch.setattr(ev, "verify", verify)
    monkeypatch.setattr(ev, "time_it", lambda *args, **kwargs: Timing.from_samples([1.0] * 3))
    variant = Variant.create("softmax", "warp_row", "float32")
    result = ev.evaluate(variant, (4, 10), device=None, warmup=2, reps=3)
    assert asked == [3, [7]]  # the verification seeds, then the last of them again
    assert result.status == "wrong_result"
    assert result.reason == "after 5 timed launches: wrong result at 4x10: y: 40 non-finite elements"
    (inputs,) = timed_on
    assert inputs.keys() == variant.op.make_inputs((4, 10), "float32", seed=0).keys()
    assert all((inputs[k] == v).all() for k, v in variant.op.make_inputs((4, 10), "float32", seed=0).items())


@pytest.mark.parametrize(
    ("while_timed", "status", "reason"),
    [
        ("stray", "wrong_result", "wrote out of bounds: 4 of the 1024 guard bytes after y changed while timed"),
        ("fault", "fault", "an illegal memory access was encountered while timed"),
    ],
)
def test_what_goes_wrong_while_timed_is_that_trials_own_status(monkeypatch, while_timed, status, reason):
    """A write out of bounds in a timed launch (a race, say) is as wrong as one while verified; a fault while
    timed is a fault, not a hang."""
    import kernelmill.kernels.evaluate as ev
    from kernelmill.kernels.bench import Timing
    from kernelmill.kernels.device import DeviceFault
    from kernelmill.kernels.variant import Variant
    from kernelmill.kernels.verify import VerifyResult

    def time_it(*args, **kwargs):
        if while_timed == "fault":
            raise DeviceFault("an illegal memory access was encountered", poisoned=True)
        return Timing.from_samples([1.0] * 3)

    verified = VerifyResult(True, "ok", "float32", 1e-5, (4, 10))
    verified.checks = [SimpleNamespace(seed=7)]
    stray = "wrote out of bounds: 4 of the 1024 guard bytes after y changed"
    bound = SimpleNamespace(run=None, out_of_bounds=lambda: stray, set_inputs=lambda inputs: None)
    monkeypatch.setattr(Variant, "compile", lambda self, compiler=None, arch=None: "cubin")
    monkeypatch.setattr(ev, "BoundVariant", lambda *args: bound)
    monkeypatch.setattr(ev, "verify", lambda *args, **kwargs: verified)  # verify() checks the guards itself
    monkeypatch.setattr(ev, "time_it", time_it)
    result = ev.evaluate(Variant.create("softmax", "warp_row", "float32"), (4, 10), device=None)
    assert (result.status, result.reason) == (status, reason)
    assert result.poisoned == (while_timed == "fault")


def test_bench_reports_a_variant_that_poisoned_the_context_without_launching_pytorch_there(monkeypatch):
    """`kernelmill bench` stopped at the faulting variant, then timed PyTorch in the poisoned context anyway:
    torch's CUDA error came out as a traceback instead of the table with the fault in it."""
    from typer.testing import CliRunner

    import kernelmill.kernels.bench as bench
    import kernelmill.kernels.evaluate as ev
    from kernelmill.cli import app
    from kernelmill.kernels import device as device_module

    info = SimpleNamespace(name="FakeGPU", arch="sm_90", sm_count=132)
    device = SimpleNamespace(poisoned=False, info=info)

    def faults(variant, shape, device, compiler, **kwargs):
        device.poisoned = True
        return ev.Evaluation(variant, shape, ev.FAULT, "an illegal memory access was encountered", poisoned=True)

    def torch_in_a_poisoned_context():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(device_module, "get_device", lambda ordinal=0: device)
    monkeypatch.setattr(bench, "L2Flusher", lambda device: None)
    monkeypatch.setattr(bench, "ceilings", lambda device, dtypes=(): Ceilings("FakeGPU", 3000.0, {}))
    monkeypatch.setattr(ev, "evaluate", faults)
    monkeypatch.setattr(bench, "_torch", torch_in_a_poisoned_context)
    result = CliRunner().invoke(app, ["bench", "softmax", "-s", "64x64", "-d", "float32", "-f", "warp_row", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1  # nothing verified
    report = json.loads(result.stdout)
    assert report["torch"] is None and [v["status"] for v in report["variants"]] == ["fault"]


def test_bench_table_shows_how_much_of_its_allowance_the_worst_element_used(capsys, monkeypatch):
    from rich.console import Console

    from kernelmill import cli
    from kernelmill.cli import _print_bench

    # As wide as a piped table, whatever COLUMNS the test runner has (at 80 the table is cut).
    monkeypatch.setattr(cli, "console", Console(width=cli.PIPED_WIDTH))
    spec = get_op("matmul")
    ceil = Ceilings("GPU", copy_gbps=3000.0, matrix_tflops={"float32": 50.0})
    row = _row("simt", "float32", 2.0)
    row.verification.allowance_used = 0.31
    report = _bench_report(
        spec, (512, 512, 512), "float32", "GPU", ceil, 0.1, [row], {"float32": Timing.from_samples([3.0] * 3)}
    )
    assert report["variants"][0]["allowance_used"] == 0.31
    _print_bench(report)
    out = capsys.readouterr().out
    assert "worst elem" in out and "31%" in out and "1.50x" in out
