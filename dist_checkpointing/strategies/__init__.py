"""Save/load strategies (Megatron-Core's ``dist_checkpointing.strategies`` path).

Importing this package registers the built-in default strategies (``torch_dist``
v1, the default, and ``raw_bytes`` v1 for the sharded part, ``torch`` v1 for the
common part) through a provider
(:func:`.base.add_default_provider`), so :mod:`.base` never imports them.
"""

from __future__ import annotations

from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    add_default_provider,
    get_default_strategy,
    register_default_strategy,
    registered_strategies,
)
from .common import register_default_common_strategies
from .raw_bytes import register_default_raw_bytes_strategies
from .torch import register_default_torch_strategies


def register_builtin_strategies() -> None:
    """Register the strategies shipped with the library (idempotent)."""
    register_default_torch_strategies()
    register_default_raw_bytes_strategies()
    register_default_common_strategies()


add_default_provider(register_builtin_strategies)

__all__ = [
    "AsyncSaveShardedStrategy",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "StrategyAction",
    "get_default_strategy",
    "register_builtin_strategies",
    "register_default_strategy",
    "registered_strategies",
]
