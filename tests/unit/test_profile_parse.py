# ruff: noqa: E501 - a verbatim ncu CSV header
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
