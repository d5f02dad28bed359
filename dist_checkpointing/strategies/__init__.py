"""Save/load strategies and the registry of default strategies."""

from __future__ import annotations

from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
    registered_strategies,
)

__all__ = [
    "AsyncSaveShardedStrategy",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "StrategyAction",
    "get_default_strategy",
    "register_default_strategy",
    "registered_strategies",
]
