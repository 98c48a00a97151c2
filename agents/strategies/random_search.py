"""Uniform sampling without replacement, after each family's defaults."""

from __future__ import annotations

import random

from kernelmill.agents.strategies.base import seen_keys, unseen


class RandomSearch:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def propose(self, space, history, n):
        seen = seen_keys(history)
        first = [c for c in space.defaults() if c.key not in seen][:n]
        rest = [c for c in unseen(space, history) if c not in first]
        return first + self.rng.sample(rest, min(n - len(first), len(rest)))
