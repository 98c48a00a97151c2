"""The SVG charts and the view helpers, without a server."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from kernelmill.service.web import charts, filters, views
from kernelmill.service.web.charts import TrialPoint


def _svg(markup) -> ET.Element:
    root = ET.fromstring(str(markup))  # well-formed XML, not just text
    assert root.tag.endswith("svg") and root.get("viewBox")
    return root


def _count(root: ET.Element, tag: str, cls: str | None = None) -> int:
    return sum(
        1 for el in root.iter() if el.tag.endswith(tag) and (cls is None or cls in (el.get("class") or "").split())
    )


POINTS = [
    TrialPoint(1, "ok", 1.4, "#1"),
    TrialPoint(2, "wrong_result", None, "#2 <bad> & 'quoted'"),
    TrialPoint(3, "ok", 0.9, "#3"),
    TrialPoint(4, "ok", 1.2, "#4"),
    TrialPoint(5, "compile_error", None, "#5"),
    TrialPoint(6, "ok", 0.6, "#6"),
]


def test_convergence_is_a_step_line_through_the_improvements():
    root = _svg(charts.convergence_chart(POINTS, 1.0))
    assert _count(root, "path", "best-line") == 1
    assert _count(root, "circle", "best-point") == 3  # 1.4, 0.9, 0.6
    assert _count(root, "line", "baseline") == 1
    assert "1.67× PyTorch" in ET.tostring(root, encoding="unicode")


def test_scatter_draws_every_trial_with_failures_in_their_band():
    root = _svg(charts.trials_scatter(POINTS, 1.0))
    assert _count(root, "circle", "st-ok") == 4
    assert _count(root, "circle", "st-wrong_result") == 1 and _count(root, "circle", "st-compile_error") == 1
    assert _count(root, "rect", "fail-band") == 1
    titles = [el.text for el in root.iter() if el.tag.endswith("title")]
    assert "#2 <bad> & 'quoted'" in titles  # escaped in the markup, intact once parsed


def test_scatter_switches_to_a_log_axis_for_wide_ranges():
    wide = [TrialPoint(i, "ok", v, "") for i, v in enumerate([0.01, 0.02, 5.0, 40.0], 1)]
    text = str(charts.trials_scatter(wide, None))
    assert ">10<" in text and ">0.1<" in text


@pytest.mark.parametrize("points", [[], [TrialPoint(1, "fault", None, "")]])
def test_charts_without_data_say_so(points):
    assert "no " in str(charts.convergence_chart(points, None))
    _svg(charts.trials_scatter(points, None))


def test_roofline_with_and_without_ceilings():
    root = _svg(charts.roofline_chart(1.0, 0.12, 0.07, 3000.0, 700.0))
    assert _count(root, "path", "roof") == 2 and _count(root, "circle", "pt-kernel") == 1
    assert "memory 3000 GB/s" in ET.tostring(root, encoding="unicode")
    bare = _svg(charts.roofline_chart(50.0, 300.0, None, None, None))
    assert _count(bare, "path", "roof") == 0 and "not measured yet" in ET.tostring(bare, encoding="unicode")
    memory_only = _svg(charts.roofline_chart(1.0, 0.5, None, 2000.0, None))
    assert _count(memory_only, "path", "roof") == 1


def test_timing_bars():
    root = _svg(charts.timing_bars(0.5, 1.0, 0.02))
    assert _count(root, "rect") == 3


def test_ticks_and_labels():
    assert charts.linear_ticks(0, 1, 5) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert charts.nice_bounds(0.43, 1.37) == (0.4, 1.4)
    assert charts.log_ticks(0.05, 200) == pytest.approx([0.1, 1, 10, 100])
    assert charts.log_ticks(0.3, 40) == pytest.approx([0.5, 1, 2, 5, 10, 20])
    assert [charts.fmt(v) for v in (0, 0.5, 12, 1500, 2e6, 1e-4)] == ["0", "0.5", "12", "1.5k", "2M", "1e-4"]
    assert charts.fmt_ms(0.0123) == "12.3 µs" and charts.fmt_ms(1.5) == "1.5 ms"


def test_filters():
    assert filters.ms(None) == "—" and filters.ms(0.05) == "50 µs" and filters.ms(12.345) == "12.3 ms"
    assert filters.speedup(1.234) == "1.23×"
    assert filters.speedup(0.0123) == "0.012×" and filters.speedup(0.004) == "0.004×"  # not "0.00×"
    assert filters.num(3000.0) == "3,000" and filters.num(0.5) == "0.5" and filters.num(1e-6, 2) == "1.0e-06"
    assert filters.nbytes(0) == "0" and filters.nbytes(49152) == "48 KiB"
    assert filters.duration(75) == "1 min 15 s" and filters.duration(4000) == "1 h 06 min"
    assert filters.query({"a": 1, "b": None}, c="x y") == "?a=1&c=x+y"


def test_speedup_colours_diverge_around_one():
    assert "hsl(142" in views.speedup_style(2.0) and "hsl(0" in views.speedup_style(0.5)
    assert views.speedup_style(None) == ""
    strong = re.search(r"(\d+)%\)", views.speedup_style(4.0)).group(1)
    weak = re.search(r"(\d+)%\)", views.speedup_style(1.1)).group(1)
    assert int(strong) < int(weak)  # darker the further from 1x


def test_sort_rows_puts_empty_cells_last():
    class T:
        def __init__(self, seq, ms):
            self.seq, self.median_ms, self.params, self.status = seq, ms, {"x": seq % 2}, "ok"

    rows = [views.TrialRow(T(i, ms), None, None, None, None) for i, ms in enumerate([0.5, None, 0.2, 0.9], 1)]
    assert [r.trial.seq for r in views.sort_rows(rows, "median_ms", False)] == [3, 1, 4, 2]
    assert [r.trial.seq for r in views.sort_rows(rows, "median_ms", True)] == [4, 1, 3, 2]
    assert [r.trial.seq for r in views.sort_rows(rows, "p:x", False)] == [2, 4, 1, 3]


def test_flatten_profile():
    assert views.flatten({"a": 1, "b": {"c": 2, "d": {"e": 3}}}) == [("a", 1), ("b.c", 2), ("b.d.e", 3)]
