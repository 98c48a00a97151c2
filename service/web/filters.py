"""Jinja2 filters: how numbers, times and sizes read on every page."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment

from kernelmill.service.db.models import utcnow
from kernelmill.service.web.views import shape_label, speedup_style


def ms(value: float | None) -> str:
    """A time in milliseconds, three significant digits (µs below 0.1 ms)."""
    if value is None:
        return "—"
    if value < 0.1:
        return f"{value * 1000:.3g} µs"
    return f"{value:.3g} ms" if value < 1000 else f"{value:,.0f} ms"


def speedup(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 0.1:  # far slower than PyTorch, as early trials of a search are: two figures, never "0.00×"
        return f"{value:.2g}×"
    return f"{value:.2f}×" if value < 100 else f"{value:.0f}×"


def num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e9):
            return f"{value:.{digits - 1}e}"
        if abs(value) >= 10**digits:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def nbytes(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{int(value)} B"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def ago(when: datetime | None) -> str:
    if when is None:
        return "—"
    delta = (utcnow() - when).total_seconds()
    if delta < 5:
        return "just now"
    if delta < 60:
        return f"{delta:.0f} s ago"
    if delta < 3600:
        return f"{delta // 60:.0f} min ago"
    if delta < 86400:
        return f"{delta // 3600:.0f} h ago"
    return when.strftime("%Y-%m-%d")


def utc(when: datetime | None) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC") if when else "—"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def query(params: dict[str, Any], **changes: Any) -> str:
    """A query string: ``params`` with ``changes`` (None drops a key)."""
    merged = {**{k: v for k, v in params.items() if v is not None}, **changes}
    return "?" + urlencode({k: v for k, v in merged.items() if v is not None and v != ""})


def first_line(text: str | None, limit: int = 200) -> str:
    """The first non-empty line of a message (a job's error), cut at ``limit`` characters."""
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def css_name(value: str | None) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in (value or "none"))


def register(env: Environment) -> None:
    env.filters.update(
        ms=ms,
        speedup=speedup,
        num=num,
        nbytes=nbytes,
        duration=duration,
        ago=ago,
        utc=utc,
        pct=pct,
        shape=shape_label,
        speedup_style=speedup_style,
        css=css_name,
        first_line=first_line,
    )
    env.globals.update(query=query)
