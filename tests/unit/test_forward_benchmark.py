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
