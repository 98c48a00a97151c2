"""Render a family's Jinja2 template into CUDA source (StrictUndefined: a missing knob fails here)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jinja2

from kernelmill.kernels.ops.base import CTYPES, Family
from kernelmill.templates import template_dir


class RenderError(ValueError):
    """A template could not be rendered (a missing variable or a template bug)."""


@lru_cache(maxsize=8)
def environment(extra_root: str | None = None) -> jinja2.Environment:
    """The shipped templates, plus a plugin family's own folder searched first when it has one."""
    roots = [extra_root, str(template_dir())] if extra_root else [str(template_dir())]
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(roots),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(family: Family, params: Mapping[str, Any], dtype: str, attrs: Mapping[str, Any] | None = None) -> str:
    """CUDA source of one variant: the family's template with params, dtype and op attributes."""
    attrs = dict(attrs or {})
    context: dict[str, Any] = {**attrs, **params, "T": CTYPES[dtype], "dtype": dtype, "attrs": attrs}
    context.update(family.context(params, dtype, attrs))
    try:
        root = getattr(family, "template_root", None)
        body = environment(str(root) if root else None).get_template(family.template).render(context)
    except jinja2.TemplateError as exc:
        raise RenderError(f"{family.template}: {exc}") from exc
    knobs = ", ".join(f"{k}={v}" for k, v in sorted({**attrs, **params}.items()))
    return f"{KNOBS_PREFIX} {family.template} dtype={dtype} {knobs}\n{body}"


#: The first line of every rendered variant: its knobs, not its code.
KNOBS_PREFIX = "// kernelmill variant:"


def code_digest(source: str) -> str:
    """sha256 of a variant's code: its rendered source without the knobs comment (the first line), which names
    a parameter the kernel predates without changing its code. Equal digests: the same kernel code."""
    first, _, body = source.partition("\n")
    return hashlib.sha256((body if first.startswith(KNOBS_PREFIX) else source).encode()).hexdigest()


#: The HTTP header in which the service's cubin route names the ``code_digest`` of the code its bytes were built
#: from, for the runtime to check against the answer it fetched them for.
CODE_HEADER = "X-Kernelmill-Code-Sha256"
