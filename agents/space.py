"""The search space of a job: every valid (family, params) of an op for one dtype."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernelmill.kernels.ops.base import Family, OpSpec, SpecError


@dataclass(frozen=True)
class Candidate:
    """One point of the space: a family and its parameter values."""

    family: str
    params_json: str  # canonical JSON (sorted keys): hashable and storable
    note: str = field(default="", compare=False, hash=False)  # why a strategy proposed it

    @classmethod
    def of(cls, family: str, params: Mapping[str, Any], note: str = "") -> Candidate:
        return cls(family, json.dumps(dict(params), sort_keys=True), note)

    def because(self, note: str) -> Candidate:
        return Candidate(self.family, self.params_json, note)

    @property
    def params(self) -> dict[str, Any]:
        return json.loads(self.params_json)

    @property
    def key(self) -> str:
        return f"{self.family}:{self.params_json}"


@dataclass(frozen=True)
class Observation:
    """What the loop learned about a candidate at one shape (a trial, reduced)."""

    candidate: Candidate
    status: str
    median_ms: float | None = None
    #: What is known beyond the time: registers, spills, roofline_pct, profile (ncu metrics).
    facts: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.median_ms is not None


def default_families(op: OpSpec, dtype: str) -> list[Family]:
    """The families a search of ``op`` in ``dtype`` covers unless it names its own: those that support the
    dtype and compute in it. A float32 search is IEEE float32; a family computing float32 as TF32 is searched
    only when named (and then compared with PyTorch in TF32)."""
    return [f for f in op.families.values() if dtype in f.dtypes and f.precision(dtype) == dtype]


def search_precision(op: OpSpec, dtype: str, families: Iterable[str] | None = None) -> str:
    """The one arithmetic precision the families of a search compute ``dtype`` in; SpecError if they differ
    (their kernels could not be compared with one PyTorch baseline)."""
    if not families:
        return dtype
    by_family = {name: op.family(name).precision(dtype) for name in families}
    if len(set(by_family.values())) > 1:
        shown = ", ".join(f"{name} as {precision}" for name, precision in by_family.items())
        raise SpecError(
            f"families compute {dtype} in different precisions ({shown}): search them in separate jobs, so that "
            "each is compared with PyTorch in its own precision"
        )
    return next(iter(by_family.values()))


class Space:
    """Valid candidates of ``op`` for ``dtype``, with each family's knobs for mutation."""

    def __init__(self, op: OpSpec, dtype: str, families: Iterable[str] | None = None) -> None:
        self.op = op
        self.dtype = dtype
        names = list(families) if families else [f.name for f in default_families(op, dtype)]
        self.precision = search_precision(op, dtype, names)
        self.families = {name: op.family(name) for name in names}
        self.candidates: list[Candidate] = [
            Candidate.of(name, params) for name, fam in self.families.items() for params in fam.space(dtype)
        ]
        self._index = {c.key: c for c in self.candidates}

    def for_shape(self, shape: tuple[int, ...]) -> Space:
        """The candidates whose family accepts ``shape`` (``Family.check_shape``): the rest could only be
        recorded as unsupported trials, so a search at one shape never spends its budget on them."""
        return self._view(lambda c: self.families[c.family].check_shape(shape, c.params, self.dtype) is None)

    def for_arch(self, arch: str) -> Space:
        """The candidates that have a target on GPU ``arch`` (``Family.target``): wgmma runs on sm_90 alone, so
        on another GPU its candidates are left out, not tried and recorded as unsupported."""

        def runs(c: Candidate) -> bool:
            try:
                self.families[c.family].target(arch, c.params)
            except SpecError:
                return False
            return True

        return self._view(runs)

    def _view(self, keep: Callable[[Candidate], bool]) -> Space:
        view = object.__new__(Space)
        view.op, view.dtype, view.families, view.precision = self.op, self.dtype, self.families, self.precision
        view.candidates = [c for c in self.candidates if keep(c)]
        view._index = {c.key: c for c in view.candidates}
        return view

    @staticmethod
    def refuses(op: OpSpec, dtype: str, shape: tuple[int, ...], families: Iterable[str] | None = None) -> str | None:
        """None where some variant of ``op`` in ``dtype`` (of ``families``, default the defaults) accepts
        ``shape`` (what ``for_shape`` keeps), else why not: the first variant's reason, given for the variant
        whose limit in it is loosest ("head_dim 257 > max_head_dim 256", not the first variant's 32). Walks the
        families' spaces only until one accepts, building no Space (a whole matmul space takes a quarter of a
        second)."""
        loosest, wording, limit = None, None, 0  # the reason kept, its words without numbers, its last number
        searched = [op.family(name) for name in families] if families else default_families(op, dtype)
        for fam in searched:
            for params in fam.space(dtype):
                reason = fam.check_shape(shape, params, dtype)
                if reason is None:
                    return None
                words = _NUMBER.sub("#", reason)
                if wording is None or (words == wording and _last_number(reason) > limit):
                    loosest, wording, limit = reason, words, _last_number(reason)
        return loosest or f"no {op.name} family supports {dtype}"

    def __len__(self) -> int:
        return len(self.candidates)

    def __contains__(self, candidate: Candidate) -> bool:
        return candidate.key in self._index

    def defaults(self) -> list[Candidate]:
        """Each family's default point that is in the space: where every search starts."""
        points = [Candidate.of(name, fam.defaults(self.dtype)) for name, fam in self.families.items()]
        return [c for c in points if c in self]

    def valid(self, family: str, params: Mapping[str, Any]) -> Candidate | None:
        """The candidate for these params if it is in the space, else None."""
        cand = Candidate.of(family, params)
        return cand if cand in self else None

    def neighbours(self, candidate: Candidate) -> list[Candidate]:
        """Valid points that differ from ``candidate`` by one knob moved one step (none from a point of a knob set
        the family no longer has: a trial recorded before an upgrade)."""
        fam = self.families.get(candidate.family)
        if fam is None:  # a family since renamed or removed
            return []
        params = candidate.params
        out = []
        for knob in fam.params:
            values = list(knob.values)
            if params.get(knob.name) not in values:  # recorded before the knob changed (an upgrade): no step from it
                continue
            i = values.index(params[knob.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(values):
                    moved = self.valid(candidate.family, {**params, knob.name: values[j]})
                    if moved is not None:
                        out.append(moved)
        return out


_NUMBER = re.compile(r"\d+")


def _last_number(text: str) -> int:
    numbers = _NUMBER.findall(text)
    return int(numbers[-1]) if numbers else 0
