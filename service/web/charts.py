"""Server-side SVG charts: plain Python, no JavaScript, no CDN.

Colours come from the page's CSS through classes (``st-ok``, ``st-fault``...),
so a status has the same colour in a badge, a table and a chart. Every text
that reaches the SVG is escaped here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

W, H = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 62, 18, 14, 42
STRIP = 26  # the band under a scatter where failed trials (no time) are drawn


@dataclass(frozen=True)
class TrialPoint:
    """One trial as the job charts see it."""

    seq: int
    status: str
    ms: float | None
    title: str


@dataclass
class Scale:
    lo: float
    hi: float
    a: float  # pixel of lo
    b: float  # pixel of hi
    log: bool = False

    def _t(self, v: float) -> float:
        return math.log10(max(v, 1e-300)) if self.log else v

    def __call__(self, v: float) -> float:
        lo, hi = self._t(self.lo), self._t(self.hi)
        if hi == lo:
            return (self.a + self.b) / 2
        return self.a + (self._t(v) - lo) / (hi - lo) * (self.b - self.a)

    def ticks(self, n: int = 5) -> list[float]:
        return log_ticks(self.lo, self.hi) if self.log else linear_ticks(self.lo, self.hi, n)


def nice_step(span: float, n: int = 5) -> float:
    raw = span / max(n, 1)
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag * (1 + 1e-9):
            return m * mag
    return 10 * mag  # pragma: no cover


def nice_bounds(lo: float, hi: float, n: int = 5) -> tuple[float, float]:
    """``[lo, hi]`` widened to multiples of a round step (a flat range gets some room)."""
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step(hi - lo, n)
    return round(math.floor(lo / step + 1e-9) * step, 12), round(math.ceil(hi / step - 1e-9) * step, 12)


def linear_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = nice_step(hi - lo, n)
    first = math.ceil(lo / step - 1e-9)
    out = []
    for i in range(first, first + 2 * n + 3):
        v = i * step
        if v > hi + step * 1e-6:
            break
        out.append(round(v, 12))
    return out


def log_bounds(lo: float, hi: float) -> tuple[float, float]:
    lo, hi = max(lo, 1e-12), max(hi, 1e-12)
    if hi / lo < 3:
        mid = math.sqrt(lo * hi)
        lo, hi = mid / 2, mid * 2
    return lo / 1.25, hi * 1.25


def log_ticks(lo: float, hi: float) -> list[float]:
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1, 2, 5) if last - first <= 3 else (1,)
    out = [m * 10.0**e for e in range(first, last + 1) for m in mults]
    return [v for v in out if lo <= v <= hi]


def fmt(v: float) -> str:
    """A tick label: three significant digits, no trailing zeros."""
    if v == 0:
        return "0"
    for size, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:.3g}{unit}"
    if abs(v) < 1e-3:
        mant, exp = f"{v:.0e}".split("e")
        return f"{mant}e{int(exp)}"
    return f"{v:.3g}"


def fmt_ms(ms: float) -> str:
    if ms < 0.1:
        return f"{ms * 1000:.3g} µs"
    return f"{ms:.3g} ms"


class Svg:
    def __init__(self, label: str, w: int = W, h: int = H, css: str = "chart") -> None:
        self.label, self.w, self.h, self.css = label, w, h, css
        self.parts: list[str] = []

    def add(self, part: str) -> None:
        self.parts.append(part)

    def text(self, x: float, y: float, text: str, css: str = "", anchor: str = "start", extra: str = "") -> None:
        cls = f' class="{css}"' if css else ""
        self.add(f'<text x="{x:.1f}" y="{y:.1f}"{cls} text-anchor="{anchor}"{extra}>{escape(text)}</text>')

    def line(self, x1: float, y1: float, x2: float, y2: float, css: str) -> None:
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" class="{css}"/>')

    def circle(self, x: float, y: float, r: float, css: str, title: str | None = None) -> None:
        inner = f"<title>{escape(title)}</title>" if title else ""
        self.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" class="{css}">{inner}</circle>')

    def render(self) -> Markup:
        head = (
            f'<svg class="{self.css}" viewBox="0 0 {self.w} {self.h}" role="img" aria-label="{escape(self.label)}" '
            f'xmlns="http://www.w3.org/2000/svg" preserveAspectRatio="xMidYMid meet">'
        )
        return Markup(head + "".join(self.parts) + "</svg>")


def axes(
    svg: Svg,
    xs: Scale,
    ys: Scale,
    xlabel: str,
    ylabel: str,
    xfmt: Callable[[float], str] = fmt,
    yfmt: Callable[[float], str] = fmt,
    xticks: Sequence[float] | None = None,
) -> None:
    """Grid, ticks, labels and the frame of the plot area ``xs.a..xs.b`` x ``ys.b..ys.a``."""
    x0, x1, y0, y1 = xs.a, xs.b, ys.a, ys.b  # y0 is the bottom
    for v in ys.ticks():
        y = ys(v)
        svg.line(x0, y, x1, y, "grid")
        svg.text(x0 - 6, y + 3.5, yfmt(v), "tick", "end")
    for v in xticks if xticks is not None else xs.ticks(6):
        x = xs(v)
        svg.line(x, y1, x, y0, "grid")
        svg.text(x, svg.h - BOTTOM + 16, xfmt(v), "tick", "middle")
    svg.line(x0, y0, x1, y0, "axis")
    svg.line(x0, y1, x0, y0, "axis")
    svg.text((x0 + x1) / 2, svg.h - 6, xlabel, "axis-label", "middle")
    cy = (y0 + y1) / 2
    svg.text(14, cy, ylabel, "axis-label", "middle", f' transform="rotate(-90 14 {cy:.1f})"')


def empty_chart(label: str, message: str, h: int = 160) -> Markup:
    svg = Svg(label, h=h)
    svg.add(f'<rect x="1" y="1" width="{W - 2}" height="{h - 2}" rx="8" class="empty-frame"/>')
    svg.text(W / 2, h / 2 + 4, message, "empty-text", "middle")
    return svg.render()


def _seq_scale(points: Sequence[TrialPoint]) -> tuple[Scale, list[float]]:
    lo, hi = min(p.seq for p in points), max(p.seq for p in points)
    step = max(1.0, nice_step(max(hi - lo, 1), 6))
    ticks = [v for v in linear_ticks(lo, hi, 6) if float(v).is_integer() and v >= lo] if step >= 1 else []
    if not ticks:
        ticks = [lo, hi] if hi != lo else [lo]
    return Scale(lo - 0.5, hi + 0.5, LEFT, W - RIGHT), ticks


def _int_fmt(v: float) -> str:
    return str(int(round(v)))


def _baseline(svg: Svg, xs: Scale, ys: Scale, baseline_ms: float | None) -> None:
    if baseline_ms is None or not ys.lo <= baseline_ms <= ys.hi:
        return
    y = ys(baseline_ms)
    svg.line(xs.a, y, xs.b, y, "baseline")
    svg.text(xs.b - 4, y - 5, f"PyTorch {fmt_ms(baseline_ms)}", "baseline-label", "end")


def _time_scale(values: Sequence[float], top: float, bottom: float) -> Scale:
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > 20:
        blo, bhi = log_bounds(lo, hi)
        return Scale(blo, bhi, bottom, top, log=True)
    pad = (hi - lo) * 0.08 or hi * 0.05 or 1.0
    blo, bhi = nice_bounds(max(0.0, lo - pad), hi + pad)
    return Scale(blo, bhi, bottom, top)


def convergence_chart(points: Sequence[TrialPoint], baseline_ms: float | None, label: str = "convergence") -> Markup:
    """Best verified time so far against the trial number, with PyTorch's time as a dashed line."""
    ok = sorted((p for p in points if p.status == "ok" and p.ms is not None), key=lambda p: p.seq)
    if not ok:
        why = "no verified trial yet" if points else "no trials yet"
        return empty_chart(label, why)
    best: list[TrialPoint] = []
    for p in ok:
        if not best or p.ms < best[-1].ms:  # type: ignore[operator]
            best.append(p)
    xs, xticks = _seq_scale(points)
    values = [p.ms for p in best] + ([baseline_ms] if baseline_ms else [])
    ys = _time_scale(values, TOP, H - BOTTOM)  # type: ignore[arg-type]
    svg = Svg(label)
    axes(svg, xs, ys, "trial number", "best time so far (ms)", xfmt=_int_fmt, xticks=xticks)
    _baseline(svg, xs, ys, baseline_ms)
    last_seq = max(p.seq for p in points)
    path = f"M{xs(best[0].seq):.1f},{ys(best[0].ms):.1f}"  # type: ignore[arg-type]
    for p in best[1:]:
        path += f" H{xs(p.seq):.1f} V{ys(p.ms):.1f}"  # type: ignore[arg-type]
    path += f" H{xs(last_seq):.1f}"
    svg.add(f'<path d="{path}" class="best-line"/>')
    for p in best:
        svg.circle(xs(p.seq), ys(p.ms), 3.5, "best-point", p.title)  # type: ignore[arg-type]
    final = best[-1].ms
    note = f"best {fmt_ms(final)}"  # type: ignore[arg-type]
    if baseline_ms and final:
        note += f" · {baseline_ms / final:.2f}× PyTorch"
    svg.text(xs.b - 4, TOP + 12, note, "chart-note", "end")
    return svg.render()


def trials_scatter(points: Sequence[TrialPoint], baseline_ms: float | None, label: str = "all trials") -> Markup:
    """Every trial: verified ones at their time, failed ones in a band underneath, coloured by status."""
    if not points:
        return empty_chart(label, "no trials yet")
    timed = [p for p in points if p.ms is not None]
    failed = [p for p in points if p.ms is None]
    xs, xticks = _seq_scale(points)
    plot_bottom = H - BOTTOM - (STRIP + 6 if failed else 0)
    values = [p.ms for p in timed] + ([baseline_ms] if baseline_ms else [])
    svg = Svg(label)
    ys = _time_scale(values, TOP, plot_bottom) if values else Scale(0.0, 1.0, plot_bottom, TOP)  # type: ignore[arg-type]
    axes(svg, xs, ys, "trial number", "median time (ms)", xfmt=_int_fmt, xticks=xticks)
    if not values:
        svg.text((xs.a + xs.b) / 2, (TOP + plot_bottom) / 2, "no verified trial yet", "empty-text", "middle")
    if failed:
        top = plot_bottom + 8
        svg.add(
            f'<rect x="{xs.a:.1f}" y="{top:.1f}" width="{xs.b - xs.a:.1f}" height="{STRIP - 6}" class="fail-band"/>'
        )
        svg.text(xs.a - 6, top + STRIP / 2, "failed", "tick", "end")
        for p in failed:
            jitter = (p.seq * 7 % 5 - 2) * 2.2
            svg.circle(xs(p.seq), top + (STRIP - 6) / 2 + jitter, 3.5, f"pt st-{_css(p.status)}", p.title)
    _baseline(svg, xs, ys, baseline_ms)
    for p in timed:
        svg.circle(xs(p.seq), ys(p.ms), 3.5, f"pt st-{_css(p.status)}", p.title)  # type: ignore[arg-type]
    return svg.render()


def _css(status: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in status)


def roofline_chart(
    ai: float,
    kernel_tflops: float,
    torch_tflops: float | None,
    copy_gbps: float | None,
    peak_tflops: float | None,
    label: str = "roofline",
) -> Markup:
    """Log-log roofline: the memory roof (copy bandwidth) and the matrix rate, with the kernel's point."""
    h = 320
    bottom, top = h - BOTTOM, TOP
    ridge = peak_tflops * 1e3 / copy_gbps if copy_gbps and peak_tflops else None
    xs_needed = [ai] + ([ridge] if ridge else [])
    xlo, xhi = min(xs_needed) / 10, max(xs_needed) * 10
    ys_needed = [kernel_tflops] + ([torch_tflops] if torch_tflops else [])
    if peak_tflops:
        ys_needed.append(peak_tflops)
    if copy_gbps:
        ys_needed.append(ai * copy_gbps / 1e3)
    ylo, yhi = min(ys_needed) / 4, max(ys_needed) * 3
    xs = Scale(xlo, xhi, LEFT, W - RIGHT, log=True)
    ys = Scale(ylo, yhi, bottom, top, log=True)
    svg = Svg(label, h=h)
    axes(svg, xs, ys, "arithmetic intensity (FLOP / byte, at the minimum DRAM traffic)", "TFLOP/s")
    if copy_gbps:
        x_end = ridge if ridge else xs.hi
        x_start = max(xs.lo, ys.lo * 1e3 / copy_gbps)
        if x_start < x_end:
            svg.add(
                f'<path d="M{xs(x_start):.1f},{ys(x_start * copy_gbps / 1e3):.1f} '
                f'L{xs(x_end):.1f},{ys(x_end * copy_gbps / 1e3):.1f}" class="roof"/>'
            )
        lx = max(x_start, xs.lo) * 3
        ly = lx * copy_gbps / 1e3
        svg.text(
            xs(lx),
            ys(ly) - 8,
            f"memory {copy_gbps:.0f} GB/s",
            "roof-label",
            "start",
            _rotate_along(xs, ys, lx, ly, copy_gbps),
        )
    if peak_tflops:
        x_start = ridge if ridge else xs.lo
        y = ys(peak_tflops)
        svg.add(f'<path d="M{xs(x_start):.1f},{y:.1f} L{xs.b:.1f},{y:.1f}" class="roof"/>')
        svg.text(xs.b - 4, y - 6, f"matrix {peak_tflops:.0f} TFLOP/s", "roof-label", "end")
    x = xs(ai)
    svg.line(x, ys.a, x, ys(kernel_tflops), "ai-guide")
    if torch_tflops:
        svg.circle(x, ys(torch_tflops), 5, "pt-torch", f"PyTorch: {torch_tflops:.3g} TFLOP/s")
        svg.text(x + 9, ys(torch_tflops) + 4, f"PyTorch {torch_tflops:.3g}", "pt-label", "start")
    svg.circle(x, ys(kernel_tflops), 6, "pt-kernel", f"this kernel: {kernel_tflops:.3g} TFLOP/s at {ai:.3g} FLOP/B")
    dy = -9 if not torch_tflops or kernel_tflops >= torch_tflops else 14
    svg.text(x + 9, ys(kernel_tflops) + dy, f"kernel {kernel_tflops:.3g}", "pt-label strong", "start")
    if not copy_gbps and not peak_tflops:
        svg.text((xs.a + xs.b) / 2, top + 16, "device ceilings not measured yet", "chart-note", "middle")
    return svg.render()


def _rotate_along(xs: Scale, ys: Scale, x: float, y: float, gbps: float) -> str:
    """A transform that lays a label along the memory roof."""
    x2 = x * 10
    dx, dy = xs(x2) - xs(x), ys(x2 * gbps / 1e3) - ys(y)
    angle = math.degrees(math.atan2(dy, dx))
    return f' transform="rotate({angle:.1f} {xs(x):.1f} {ys(y) - 8:.1f})"'


def timing_bars(
    kernel_ms: float, baseline_ms: float | None, floor_ms: float | None = None, label: str = "time against PyTorch"
) -> Markup:
    """Horizontal bars on one scale: this kernel's median time, PyTorch's, and the roofline floor when known."""
    rows = [("this kernel", kernel_ms, "bar-kernel")]
    if baseline_ms:
        rows.append(("PyTorch", baseline_ms, "bar-torch"))
    if floor_ms:
        rows.append(("roofline floor", floor_ms, "bar-floor"))
    h = 28 + 34 * len(rows)
    svg = Svg(label, h=h, css="chart bars")
    left, right = 110, W - 110
    top_ms = max(ms for _, ms, _ in rows)
    for i, (name, ms, css) in enumerate(rows):
        y = 14 + i * 34
        width = max(2.0, (right - left) * ms / top_ms)
        svg.text(left - 8, y + 16, name, "bar-name", "end")
        svg.add(f'<rect x="{left}" y="{y}" width="{width:.1f}" height="22" rx="4" class="{css}"/>')
        svg.text(left + width + 8, y + 16, fmt_ms(ms), "bar-value", "start")
    return svg.render()
