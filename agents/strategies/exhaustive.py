"""Every candidate, in order, each family's defaults first."""

from __future__ import annotations

from kernelmill.agents.strategies.base import seen_keys


class Exhaustive:
    name = "exhaustive"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def propose(self, space, history, n):
        seen = seen_keys(history)
        order = [*space.defaults(), *space.candidates]
        out, picked = [], set()
        for cand in order:
            if cand.key not in seen and cand.key not in picked:
                out.append(cand)
                picked.add(cand.key)
                if len(out) == n:
                    break
        return out
