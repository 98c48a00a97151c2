"""benchmarks/forward.py without a GPU: its options and the table it prints."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "forward.py"


@pytest.fixture(scope="module")
def forward():
    spec = importlib.util.spec_from_file_location("bench_forward", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _row(batch, runtime, eager, tuned=None):
    row = {
        "case": "mlp 4x(4096-11008-4096)",
        "batch": batch,
        "runtime": {"median_ms": runtime},
        "runtime_no_pdl": {"median_ms": runtime},
        "eager": {"median_ms": eager},
        "rel_err_vs_eager": 3.4e-4,
        "runtime_run": "graph",
    }
    if tuned is not None:
        row["runtime_tuned"] = {"median_ms": tuned}
    return row


def test_batches_option_parses_and_rejects_with_a_reason(forward):
    assert forward._batches("1,16,256") == (1, 16, 256)
    for bad, reason in (("1,x", "comma-separated"), ("0", "positive"), ("", "comma-separated")):
        with pytest.raises(Exception, match=reason):
            forward._batches(bad)


def test_table_has_the_tuned_columns_only_when_a_row_has_them(forward, capsys):
    forward.print_table([_row(1, 0.2, 0.24)])
    plain = capsys.readouterr().out.splitlines()
    assert "tuned ms" not in plain[0] and "1.20x" in plain[2]
    forward.print_table([_row(256, 0.405, 0.397, tuned=0.373), _row(1, 0.2, 0.24)])
    header, _rule, tuned, untuned = capsys.readouterr().out.splitlines()
    assert header.rstrip().endswith("tuned ms  vs eager")
    assert tuned.rstrip().endswith("0.373     1.06x") and "0.98x" in tuned
    assert untuned.rstrip().endswith("-         -")
