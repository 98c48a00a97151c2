# ruff: noqa: E501 - a verbatim ncu CSV header
import pytest

from kernelmill.kernels.profile import METRICS, parse_ncu_csv

CSV = """==PROF== Connected to process 1234 (/usr/bin/python3)
==PROF== Profiling "softmax_block_row": 0%....50%....100% - 9 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","launch__registers_per_thread","lts__t_sector_hit_rate.pct","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","","","","","","nsecond","%","%","%","register/thread","%","inst","inst","inst"
"0","1234","python3","127.0.0.1","softmax_block_row","1","7","91,232","71.25","18.02","83.1","39","12.5","5.31","0.42","0.88"
"1","1234","python3","127.0.0.1","km_reduce","1","7","2,001","10.0","3.0","50.0","20","90.0","n/a","0.1","0.2"
==PROF== Disconnected from process 1234
"""


def test_parse_ncu_csv_rows_metrics_and_stalls():
    profiles = parse_ncu_csv(CSV)
    assert [p.kernel for p in profiles] == ["softmax_block_row", "km_reduce"]
    main = profiles[0]
    assert main.metrics["duration_ns"] == 91232.0
    assert main.metrics["dram_pct"] == 71.25 and main.metrics["sm_pct"] == 18.02
    assert main.metrics["achieved_occupancy_pct"] == 83.1 and main.metrics["registers"] == 39
    assert main.top_stalls(2) == [("long_scoreboard", 5.31), ("wait", 0.88)]
    assert "long_scoreboard" not in profiles[1].stalls  # "n/a" is absent, not zero
    assert main.to_dict()["top_stalls"][0] == ["long_scoreboard", 5.31]


def test_parse_ncu_csv_without_rows_is_empty():
    assert parse_ncu_csv("==PROF== nothing profiled\n") == []
    assert set(METRICS.values()) >= {"dram_pct", "sm_pct", "achieved_occupancy_pct", "l2_hit_pct"}


HEADER = '"ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed"\n'
UNITS = '"","","nsecond","%"\n'


def _parsed(rows: str) -> list[tuple[str, dict]]:
    return [(p.kernel, p.metrics) for p in parse_ncu_csv(HEADER + UNITS + rows)]


@pytest.mark.parametrize(
    "cell, value",
    [
        ("91,232", 91232.0),
        ("1,234,567.5", 1234567.5),
        ("7.5e3", 7500.0),
        ("12,5", None),  # a decimal comma: not 125
        ("91,2", None),  # a cut-off "91,232": not 912
        ("1,2345", None),
        ("nan", None),  # JSON (and PostgreSQL) refuse NaN and infinities in a stored profile
        ("inf", None),
        ("-inf", None),
        ("N/A", None),
        ("", None),
        ("12 %", None),
    ],
)
def test_a_cell_is_a_finite_number_as_ncu_writes_it_or_absent(cell, value):
    """ "12,5" became 125 and "nan" a NaN that no JSON column takes."""
    assert _parsed(f'"0","k","{cell}","1"\n') == [
        ("k", {"duration_ns": value, "dram_pct": 1.0} if value else {"dram_pct": 1.0})
    ]


def test_only_whole_rows_after_the_header_are_read():
    """A row cut short, a line the variant printed before the header and a repeated header were read as kernels
    (named "?", "Kernel Name" or "") or gave invented numbers."""
    text = (
        '"the variant printed this"\n'
        + HEADER
        + UNITS
        + '"0","softmäx_行","91,232","71.25"\n'  # a kernel name is any text
        + HEADER
        + UNITS
        + '"1","km_reduce","2,001","10.0"\n'
        + '"2","cut","91,2'  # ncu killed mid-row
    )
    assert [(p.kernel, p.metrics) for p in parse_ncu_csv(text)] == [
        ("softmäx_行", {"duration_ns": 91232.0, "dram_pct": 71.25}),
        ("km_reduce", {"duration_ns": 2001.0, "dram_pct": 10.0}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "",
        HEADER,
        HEADER + UNITS,
        '"0","k","5","1"\n',  # rows without a header
        HEADER.replace('"Kernel Name",', '"Name",') + '"0","k","5","1"\n',
        HEADER[:40],  # the header itself cut short
        '"' * 1000,
    ],
)
def test_no_header_or_no_rows_is_no_profile(text):
    assert parse_ncu_csv(text) == []


def test_a_field_past_the_csv_limit_is_skipped_not_raised():
    """csv refuses a field over 128 KiB (``_csv.Error``): the parse raised."""
    assert _parsed(f'"0","{"k" * 200_000}","5","1"\n"1","k2","7","1"\n') == [
        ("k2", {"duration_ns": 7.0, "dram_pct": 1.0})
    ]
