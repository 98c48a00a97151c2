"""The benchmarks' command lines without a GPU: bad arguments are a one-line usage error (exit 2), a missing GPU
or database a one-line message (exit 3), before any work; their JSON states the date and the command."""

import json
import re

import pytest

from tests.benchmark_scripts import load_benchmark


def _no_gpu(monkeypatch):
    from kernelmill.kernels import device

    def no_gpu(ordinal=0):
        raise device.GpuUnavailable("no CUDA device is visible")

    monkeypatch.setattr(device, "get_device", no_gpu)


@pytest.mark.parametrize(
    ("script", "argv", "reason"),
    [
        ("attention_sweep", ["--shapes", "8x12x128"], "--shapes: sdpa takes a shape of 4 dims"),
        ("attention_sweep", ["--ops", "sdpa,softmax"], "--ops: 'sdpa,softmax': expected comma-separated ops"),
        ("attention_sweep", ["--families", "fused,bogus"], "--families: 'fused,bogus'"),
        ("kernels", ["--only", "nope"], "no case matches --only 'nope'"),
        ("kernels", ["--cases", "1x1x1"], "no case matches"),
        ("kernels", ["--budget", "0"], "--budget: '0': at least 1"),
        ("kernels", ["--strategy", "bogus"], "--strategy: invalid choice"),
        ("kernels", ["--json", "/nonexistent-kernelmill/kernels.json"], "--json: no folder"),
        ("search", ["replay", "--json", "/nonexistent-kernelmill/search.json"], "--json: no folder"),
        ("read_patterns", ["--mb", "0"], "--mb: '0': from 1"),
        ("read_patterns", ["--mb", "1e6"], "--mb: '1e6': from 1"),
        ("read_patterns", ["--reps", "-1"], "--reps: '-1': at least 1"),
        ("forward", ["--repeats", "0"], "--repeats: '0': at least 1"),
        ("forward", ["--out", "/nonexistent-kernelmill/forward.json"], "--out: no folder"),
        ("load", ["--lookup-rps", "0"], "--lookup-rps: '0': above 0"),
        ("load", ["--connections", "0"], "--connections: '0': at least 1"),
        ("load", ["--lookup-rps", "0.01"], "each phase must send a request"),
        ("load", ["--out", "/nonexistent-kernelmill/load.json"], "--out: no folder"),
    ],
)
def test_bad_arguments_are_a_one_line_usage_error(script, argv, reason, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _no_gpu(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        load_benchmark(script).main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and reason in err.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("attention_sweep", ["--shapes", "1x2x64x64"]),
        ("kernels", ["--only", "softmax"]),
        ("read_patterns", []),
        ("search", ["collect", "--db", "sqlite:///search.db"]),
    ],
)
def test_without_a_gpu_it_says_so_in_one_line_and_leaves_no_database(script, argv, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _no_gpu(monkeypatch)
    assert load_benchmark(script).main(argv) == 3
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU: no CUDA device is visible" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []  # kernels.py and search.py collect opened no store


@pytest.mark.parametrize(
    ("url", "code", "reason"),
    [("sqlite:////nonexistent-kernelmill/x.db", 3, "cannot open the database"), ("foo://x", 2, "database URL")],
)
def test_search_replay_on_a_bad_database_is_one_line(url, code, reason, capsys):
    assert load_benchmark("search").main(["replay", "--db", url]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"search.py: {reason}") and "\n" not in err


def test_search_replay_json_states_date_and_command(monkeypatch, tmp_path, capsys):
    search = load_benchmark("search")
    result = {"measured_on": ["NVIDIA H200"], "rows": [], "median_pct_of_space": {}, "seeds": 5, "within": 0.05}
    monkeypatch.setattr(search, "run_replay", lambda db: dict(result))
    monkeypatch.setattr(search, "print_table", lambda result: None)
    out = tmp_path / "search.json"
    assert search.main(["replay", "--db", "sqlite:///s.db", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["command"] == f"python benchmarks/search.py replay --db sqlite:///s.db --json {out}"
    assert written["date"].endswith("+00:00") and written["measured_on"] == ["NVIDIA H200"]


def test_load_report_states_its_command(monkeypatch, tmp_path, capsys):
    load = load_benchmark("load")

    async def run(args):
        return {"started": "2026-11-30T00:00:00Z", "submissions": {"missing": [], "changed": [], "errors": 0},
                "lookups": {"errors": 0}}  # fmt: skip

    monkeypatch.setattr(load, "run", run)
    monkeypatch.setattr(load, "print_table", lambda report: None)
    out = tmp_path / "load.json"
    assert load.main(["--lookup-s", "1", "--submit-s", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"] == f"python benchmarks/load.py --lookup-s 1 --submit-s 1 --out {out}"
    assert report["started"]


def test_read_patterns_compiles_for_the_gpu_it_runs_on(monkeypatch, capsys):
    from types import SimpleNamespace

    from kernelmill.kernels import compile as compile_mod
    from kernelmill.kernels import device

    fake = SimpleNamespace(
        info=SimpleNamespace(name="NVIDIA A100", sm_count=2, arch="sm_80"),
        alloc=lambda nbytes: object(),
        copy_in=lambda buf, array: None,
    )
    monkeypatch.setattr(device, "get_device", lambda ordinal=0: fake)
    archs = []

    def compile_(self, source, arch, **kwargs):
        archs.append(arch)
        raise RuntimeError("stop after the first compile")

    monkeypatch.setattr(compile_mod.Compiler, "compile", compile_)
    with pytest.raises(RuntimeError, match="stop after"):
        load_benchmark("read_patterns").main(["--mb", "1"])
    assert archs == ["sm_80"]
    head = capsys.readouterr().out.splitlines()[0]  # what the output is, where and when: device, date, command
    assert re.fullmatch(r"NVIDIA A100, \d{4}-\d\d-\d\d \d\d:\d\d UTC: python3 benchmarks/read_patterns.py --mb 1", head)


def test_attention_sweep_states_device_date_and_command_first(monkeypatch, capsys):
    from types import SimpleNamespace

    from kernelmill.kernels import bench, device

    monkeypatch.setattr(
        device, "get_device", lambda ordinal=0: SimpleNamespace(info=SimpleNamespace(name="NVIDIA H200"))
    )

    def no_flusher(device):
        raise RuntimeError("stop before any GPU work")

    monkeypatch.setattr(bench, "L2Flusher", no_flusher)
    with pytest.raises(RuntimeError, match="stop before"):
        load_benchmark("attention_sweep").main(["--ops", "sdpa", "--mask", "zero"])
    head = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(
        r"NVIDIA H200, \d{4}-\d\d-\d\d \d\d:\d\d UTC: python3 benchmarks/attention_sweep.py --ops sdpa --mask zero",
        head,
    )


def test_forward_json_states_device_date_and_command(monkeypatch, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    forward = load_benchmark("forward")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    for name in ("mlp_cases", "bert_cases"):  # no forward runs: what is timed is not the point here
        monkeypatch.setattr(forward, name, lambda *a: [])
    for name in ("print_table", "print_power"):
        monkeypatch.setattr(forward, name, lambda rows: None)
    monkeypatch.setattr(forward, "targets", lambda rows: [])
    out = tmp_path / "forward.json"
    assert forward.main(["--out", str(out), "--only", "mlp"]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "NVIDIA H200" and result["date"].endswith("+00:00")
    assert result["command"] == f"python benchmarks/forward.py --out {out} --only mlp"


def test_kernels_json_states_device_date_and_command(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    from kernelmill.agents import evaluator

    bench = load_benchmark("kernels")
    ceilings = SimpleNamespace(copy_gbps=4000.0, matrix_tflops={"float16": 700.0})
    fake = SimpleNamespace(device=SimpleNamespace(info=SimpleNamespace(name="NVIDIA H200")), ceilings=lambda: ceilings)
    monkeypatch.setattr(evaluator, "LocalEvaluator", lambda *a, **k: fake)
    monkeypatch.setattr(bench, "tune", lambda *a, **k: 7)  # no tuning or timing: the JSON's header is the point
    monkeypatch.setattr(bench, "measure", lambda case, *a: {"case": case.name, "status": "no verified kernel"})
    out = tmp_path / "kernels.json"
    argv = ["--db", f"sqlite:///{tmp_path}/k.db", "--cases", "softmax 1x32000 float16", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "NVIDIA H200" and result["date"].endswith("+00:00")
    assert result["command"] == "python benchmarks/kernels.py " + " ".join(f"'{a}'" if " " in a else a for a in argv)
    assert [r["case"] for r in result["rows"]] == ["softmax 1x32000 float16"]
