"""Search strategies, one per module; ``get_strategy`` builds one by name."""

from kernelmill.agents.strategies.base import Strategy
from kernelmill.agents.strategies.evolutionary import Evolutionary
from kernelmill.agents.strategies.exhaustive import Exhaustive
from kernelmill.agents.strategies.guided import Guided
from kernelmill.agents.strategies.llm import LlmProposer
from kernelmill.agents.strategies.random_search import RandomSearch

STRATEGIES = {cls.name: cls for cls in (Exhaustive, RandomSearch, Evolutionary, Guided, LlmProposer)}


def get_strategy(name: str, seed: int = 0) -> Strategy:
    try:
        return STRATEGIES[name](seed=seed)
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "Strategy", "get_strategy"]
