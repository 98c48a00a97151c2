"""benchmarks/forward.py without a GPU: its options and the table it prints."""

import time

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def forward():
    return load_benchmark("forward")


def _row(batch, runtime, eager, defaults=None):
    row = {
        "case": "mlp 4x(4096-11008-4096)",
        "batch": batch,
        "runtime": {"median_ms": runtime},
        "runtime_no_pdl": {"median_ms": runtime},
        "eager": {"median_ms": eager},
        "rel_err_vs_eager": 3.4e-4,
        "runtime_run": "graph",
    }
    if defaults is not None:
        row["runtime_defaults"] = {"median_ms": defaults}
    return row


def test_batches_option_parses_and_rejects_with_a_reason(forward):
    assert forward._batches("1,16,256") == (1, 16, 256)
    for bad, reason in (("1,x", "comma-separated"), ("0", "positive"), ("", "comma-separated")):
        with pytest.raises(Exception, match=reason):
            forward._batches(bad)


def test_table_has_the_shape_defaults_columns_only_when_a_row_has_them(forward, capsys):
    forward.print_table([_row(1, 0.2, 0.24)])
    plain = capsys.readouterr().out.splitlines()
    assert "defaults ms" not in plain[0] and "1.20x" in plain[2]
    forward.print_table([_row(256, 0.373, 0.397, defaults=0.405), _row(1, 0.2, 0.24)])
    header, _rule, both, one = capsys.readouterr().out.splitlines()
    assert header.rstrip().endswith("defaults ms  vs eager")
    assert both.rstrip().endswith("0.405     0.98x") and "1.06x" in both
    assert one.rstrip().endswith("-         -")


class _FakeTorch:
    """What time_ms touches of torch: synchronize, and the device properties GpuSampler reads."""

    class cuda:  # noqa: N801 - mirrors torch.cuda
        syncs = 0

        @classmethod
        def synchronize(cls):
            cls.syncs += 1

        @staticmethod
        def current_device():
            return 0

        @staticmethod
        def get_device_properties(_index):
            return object()  # no uuid: nvidia-smi reads the default GPU


def test_timing_turns_take_iters_calls_or_a_minimum_time(forward, monkeypatch):
    def no_sampling(torch):
        raise AssertionError("sampled without sample=True")

    monkeypatch.setattr(forward, "GpuSampler", no_sampling)
    calls = {"a": 0, "b": 0}

    def counter(name):
        def fn():
            calls[name] += 1

        return fn

    fns = {"a": counter("a"), "b": counter("b")}
    _FakeTorch.cuda.syncs = 0
    out = forward.time_ms(_FakeTorch, fns, warmup=2, iters=5, repeats=3)
    assert calls == {"a": 2 + 15, "b": 2 + 15}
    assert _FakeTorch.cuda.syncs == 1 + 3 * 2  # after the warm-up, then after each turn
    assert len(out["a"]["samples_ms"]) == 3 and "power_w" not in out["a"]

    calls.update(a=0, b=0)
    out = forward.time_ms(_FakeTorch, fns, warmup=0, iters=5, repeats=1, seconds=0.05)
    assert calls["a"] > 5 and calls["a"] % 5 == 0  # back to back for 50 ms, synchronising every 5 calls
    assert "power_w" not in out["a"]


def test_sustained_turns_report_clock_power_and_energy(forward, monkeypatch, capsys):
    # turns alternate: runtime, eager, runtime, eager
    readings = iter([(1560.0, 690.0), (1470.0, 691.0), (1540.0, 688.0), (1480.0, 689.0)])

    class Sampler:
        def __init__(self, torch):
            pass

        def stop(self):
            return next(readings)

    monkeypatch.setattr(forward, "GpuSampler", Sampler)
    fns = {"runtime": lambda: None, "eager": lambda: None}
    out = forward.time_ms(_FakeTorch, fns, 0, 1, 2, seconds=0.01, sample=True)
    assert out["runtime"]["sm_mhz"] == 1550 and out["runtime"]["power_w"] == 689
    assert out["eager"]["sm_mhz"] == 1475 and out["eager"]["power_w"] == 690
    assert out["runtime"]["mj_per_call"] == 689 * out["runtime"]["median_ms"]

    row = _row(1024, 1.249, 1.256)
    row["runtime"].update(sm_mhz=1560, power_w=689, mj_per_call=860.5)
    row["eager"].update(sm_mhz=1478, power_w=691, mj_per_call=867.5)
    forward.print_power([row])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("sustained turns") and lines[2].endswith(
        "runtime 1560 / 689 / 860.5; eager 1478 / 691 / 867.5"
    )
    forward.print_power([_row(1, 0.2, 0.24)])  # no readings: nothing printed
    assert capsys.readouterr().out == ""


def test_nvidia_smi_samples_skip_the_first_third_and_bad_lines(forward):
    text = "1980, 300.0\n1980, 320.0\n[N/A], [N/A]\n1500, 690.5\n1480, 689.5\n1490, 691.0\n1485, 690.0\n"
    assert forward.parse_samples(text) == (1487.5, 690.25)  # six readings, the first two left out
    assert forward.parse_samples("") is None and forward.parse_samples("No devices were found") is None


def test_turn_options_take_a_duration_with_a_reason(forward):
    assert forward._seconds("2") == 2.0 and forward._seconds("0") == 0.0
    assert forward._turn_ms("100") == 100.0 and forward._turn_ms("0") == 0.0
    cases = [
        (forward._seconds, bad, reason)
        for bad, reason in (("x", "expected seconds"), ("-1", "from 0"), ("61", "to 60"))
    ]
    cases += [(forward._turn_ms, bad, reason) for bad, reason in (("x", "expected milliseconds"), ("-5", "from 0"))]
    for parse, bad, reason in cases:
        with pytest.raises(Exception, match=reason):
            parse(bad)


def test_gpu_sampler_reads_nvidia_smi_or_gives_none(forward, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    assert forward.GpuSampler(_FakeTorch).stop() is None
    smi = tmp_path / "nvidia-smi"
    ready = tmp_path / "ready"
    smi.write_text(
        f'#!/bin/sh\nprintf "1980, 300.0\\n1500, 690.0\\n1490, 692.0\\n1480, 691.0\\n"\ntouch {ready}\nexec sleep 30\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    sampler = forward.GpuSampler(_FakeTorch)
    deadline = time.monotonic() + 20
    while not ready.exists():  # the fake has printed its samples and waits to be stopped (a fixed sleep raced it)
        assert time.monotonic() < deadline, "the fake nvidia-smi never ran"
        time.sleep(0.01)
    assert sampler.stop() == (1490.0, 691.0)


def test_targets_say_met_or_missed_against_the_issue_bars(forward):
    rows = [_row(1, 0.266, 0.333), _row(256, 0.385, 0.417)]
    assert forward.targets(rows) == [
        "MLP batch 1 vs eager 1.25x (target >= 1.30x): missed",
        "slowest vs eager 1.08x (mlp 4x(4096-11008-4096), batch 256; target >= 1.00x): met",
    ]
    rows = [_row(1, 0.19, 0.30), {**_row(8, 1.0, 0.98), "case": "bert-base seq 128"}]
    assert forward.targets(rows) == [
        "MLP batch 1 vs eager 1.58x (target >= 1.30x): met",
        "slowest vs eager 0.98x (bert-base seq 128, batch 8; target >= 1.00x): missed",
    ]
    assert forward.targets([]) == []


def test_batch1_verdict_says_what_eager_paid(forward):
    """The batch-1 ratio rewards eager's launch gaps: the verdict shows eager against its own CUDA graph and
    the runtime against eager's fastest turn, so a "met" that rests on those gaps reads as such."""
    row = _row(1, 0.263, 0.362)
    row["eager"]["min_ms"] = 0.319
    row["eager_graph"] = {"median_ms": 0.289}
    assert forward.targets([row])[0] == (
        "MLP batch 1 vs eager 1.38x (target >= 1.30x): met "
        "(eager 0.362 ms, 1.25x its CUDA graph; 1.21x eager's fastest turn)"
    )
