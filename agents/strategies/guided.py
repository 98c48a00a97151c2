"""Profile-guided search: read what ptxas and ncu say about the best trials, move the knobs that address it.

Diagnosis of the fastest verified candidate, first match wins:
- it spills registers -> shrink tiles / unrolling (fewer live values per thread);
- ncu says memory-bound (DRAM % above SM %) with DRAM under 80 % -> more bytes in flight
  (wider vectors, more unrolling, deeper pipelines) or more parallelism (split-K);
- ncu says compute-bound with low achieved occupancy and many registers -> smaller tiles;
- without a profile, a low share of the roofline (< 60 %) -> more in flight;
- otherwise refine locally around the best few.
Every proposal carries its reason (stored with the trial). A share of each batch
explores at random so one wrong diagnosis cannot trap the search.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kernelmill.agents.space import Candidate, Observation, Space
from kernelmill.agents.strategies.base import seen_keys, unseen

#: Knob names by what raising them does (families name their knobs consistently).
IN_FLIGHT = {"vec", "unroll", "stages"}
PARALLELISM = {"split_k", "k_splits", "blocks_per_row", "rows_per_block"}
TILE = {"BM", "BN", "BK", "TM", "TN", "WM", "WN", "unroll", "hidden_per_block", "max_batch", "vec"}


def diagnose(best: Observation) -> tuple[str, dict[str, int], str]:
    """(goal, knob -> preferred direction, reason) for the best trial."""
    facts = best.facts or {}
    profile = facts.get("profile") or {}
    if facts.get("spill_bytes"):
        return "shrink", {k: -1 for k in TILE}, f"best spills {facts['spill_bytes']} B: smaller tiles"
    dram, sm = profile.get("dram_pct"), profile.get("sm_pct")
    if dram is not None and sm is not None and "error" not in profile:
        if dram >= sm and dram < 80:
            wants = {k: +1 for k in IN_FLIGHT | PARALLELISM}
            return "in_flight", wants, f"memory-bound at {dram:.0f}% of DRAM peak: more loads in flight"
        occupancy, registers = profile.get("achieved_occupancy_pct"), profile.get("registers")
        if sm > dram and occupancy is not None and occupancy < 30 and (registers or 0) > 128:
            wants = {k: -1 for k in TILE}
            return "occupancy", wants, f"occupancy {occupancy:.0f}% with {registers:.0f} registers: smaller tiles"
    roofline = facts.get("roofline_pct")
    if roofline is not None and roofline < 60:
        wants = {k: +1 for k in IN_FLIGHT | PARALLELISM}
        return "in_flight", wants, f"at {roofline:.0f}% of the roofline: more work in flight"
    return "refine", {}, "refine around the best"


def _move(parent: Candidate, child: Candidate) -> tuple[str, int]:
    a, b = parent.params, child.params
    for knob in a:
        if a[knob] != b[knob]:
            try:
                return knob, (1 if b[knob] > a[knob] else -1)
            except TypeError:
                return knob, 0
    return "", 0


class Guided:
    name = "guided"
    profiles_best = 1  # the leader's ncu profile, taken between batches whenever the leader changes

    def __init__(self, seed: int = 0, explore: float = 0.15, parents: int = 3) -> None:
        self.rng = random.Random(seed)
        self.explore = explore
        self.parents = parents

    def propose(self, space: Space, history: Sequence[Observation], n: int) -> list[Candidate]:
        seen = seen_keys(history)
        out = [c.because("family default") for c in space.defaults() if c.key not in seen][:n]
        picked = seen | {c.key for c in out}
        ranked = sorted((o for o in history if o.ok), key=lambda o: o.median_ms)
        budget = n - len(out) - max(0, round(n * self.explore) if ranked else 0)
        scored: list[tuple[float, float, Candidate]] = []
        for rank, parent in enumerate(ranked[: self.parents]):
            goal, wants, reason = diagnose(parent)
            for child in space.neighbours(parent.candidate):
                if child.key in picked:
                    continue
                knob, direction = _move(parent.candidate, child)
                score = (1.0 if wants.get(knob) == direction else 0.0) - 0.3 * rank
                note = f"{reason}: {knob} {parent.candidate.params[knob]}->{child.params[knob]}"
                note += f" from #{rank + 1} ({parent.median_ms * 1e3:.1f} us)"
                scored.append((score, self.rng.random(), child.because(note)))
        for _, _, child in sorted(scored, key=lambda s: (-s[0], s[1])):
            if budget <= 0:
                break
            if child.key not in picked:
                out.append(child)
                picked.add(child.key)
                budget -= 1
        rest = [c for c in unseen(space, history) if c.key not in picked]
        extra = self.rng.sample(rest, min(n - len(out), len(rest)))
        out += [c.because("explore: random pick") for c in extra]
        return out
