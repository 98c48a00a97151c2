"""A small evolutionary search: mutate and cross the fastest verified candidates."""

from __future__ import annotations

import random

from kernelmill.agents.space import Candidate
from kernelmill.agents.strategies.base import seen_keys, unseen


class Evolutionary:
    name = "evolutionary"

    def __init__(self, seed: int = 0, population: int = 8, explore: float = 0.2) -> None:
        self.rng = random.Random(seed)
        self.population = population
        self.explore = explore  # share of each batch drawn at random, against premature convergence

    def propose(self, space, history, n):
        seen = seen_keys(history)
        out: list[Candidate] = [c for c in space.defaults() if c.key not in seen][:n]
        picked = seen | {c.key for c in out}
        parents = [o.candidate for o in sorted((o for o in history if o.ok), key=lambda o: o.median_ms)]
        parents = parents[: self.population]
        # The batch's room past the defaults: an ``explore`` share of it drawn at random, children fill the
        # rest (a coin per child stopped at the first tails: ~35% random picks, not 20%).
        room = n - len(out)
        goal = len(out) + room - round(room * self.explore)
        tries = 0
        while parents and len(out) < goal and tries < 50 * n:
            tries += 1
            child = self._child(space, parents)
            if child is not None and child.key not in picked:
                out.append(child)
                picked.add(child.key)
        rest = [c for c in unseen(space, history) if c.key not in picked]
        out += self.rng.sample(rest, min(n - len(out), len(rest)))
        return out

    def _child(self, space, parents: list[Candidate]) -> Candidate | None:
        a = self.rng.choice(parents)
        # Of the same knobs: a trial recorded before an upgrade changed its family's knobs has others
        mates = [p for p in parents if p.family == a.family and p != a and p.params.keys() == a.params.keys()]
        if mates and self.rng.random() < 0.5:
            b = self.rng.choice(mates)
            pa, pb = a.params, b.params
            child = space.valid(a.family, {k: self.rng.choice((pa[k], pb[k])) for k in pa})
            if child is not None:
                return child
        moves = space.neighbours(a)
        return self.rng.choice(moves) if moves else None
