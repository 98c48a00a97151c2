"""The Strategy protocol: one method."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kernelmill.agents.space import Candidate, Observation, Space


class Strategy(Protocol):
    name: str
    #: How many of the fastest verified trials the strategy reads ncu profiles of while it searches: the loop
    #: profiles them (as they change) between batches. 0 (the default, read with getattr): none until the end.
    profiles_best: int

    def propose(self, space: Space, history: Sequence[Observation], n: int) -> list[Candidate]:
        """Up to ``n`` candidates not yet in ``history``; an empty list means the strategy is done."""
        ...


def unseen(space: Space, history: Sequence[Observation]) -> list[Candidate]:
    seen = {obs.candidate.key for obs in history}
    return [c for c in space.candidates if c.key not in seen]


def seen_keys(history: Sequence[Observation]) -> set[str]:
    return {obs.candidate.key for obs in history}
