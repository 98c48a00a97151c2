"""Search strategies, one per module; ``get_strategy`` builds one by name."""

from kernelmill.agents.strategies.base import Strategy
from kernelmill.agents.strategies.evolutionary import Evolutionary
from kernelmill.agents.strategies.exhaustive import Exhaustive
from kernelmill.agents.strategies.guided import Guided
from kernelmill.agents.strategies.llm import LlmProposer
from kernelmill.agents.strategies.random_search import RandomSearch

STRATEGIES = {cls.name: cls for cls in (Exhaustive, RandomSearch, Evolutionary, Guided, LlmProposer)}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy called ``name``; a ValueError naming the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None


def get_strategy(name: str, seed: int = 0) -> Strategy:
    return strategy_class(name)(seed=seed)


__all__ = ["STRATEGIES", "Strategy", "get_strategy", "strategy_class"]
