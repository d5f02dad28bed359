"""Strategy interfaces and the registry of default strategies.

A *strategy* saves or loads one part of a checkpoint (the sharded tensors and
objects, or the common non-sharded state) in one on-disk format. The registry
maps ``(action, backend, version)`` to the default strategy, so that ``load``
can pick the reader from the checkpoint's ``metadata.json``.

Call sequence of ``save`` (every rank, unless noted):
    1. ``SaveShardedStrategy.save(sharded_state_dict, dir)`` (or ``async_save``
       for an :class:`AsyncSaveShardedStrategy`, which returns an ``AsyncRequest``);
    2. ``SaveCommonStrategy.save_common(common_state_dict, dir)`` (rank 0 writes);
    3. ``metadata.json`` is written last (rank 0), after every rank succeeded.

Call sequence of ``load`` (every rank):
    1. the strategies are looked up from ``metadata.json``;
    2. ``check_backend_compatibility`` / ``check_version_compatibility``;
    3. ``LoadCommonStrategy.load_common(dir)``;
    4. ``LoadShardedStrategy.load(sharded_state_dict, dir)``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointingException, IncompatibleStrategyError, StrategyNotFoundError
from ..mapping import ShardedStateDict, StateDict

if TYPE_CHECKING:
    from ..engine.async_save.calls import AsyncRequest

logger = logging.getLogger(__name__)


class StrategyAction(Enum):
    """What a registered strategy does."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


RegistryKey = tuple[str, str, int]

# The only mutable module state of the library: the default strategies, keyed by
# (action value, backend, version). Read it through `registered_strategies()`.
_REGISTRY: dict[RegistryKey, Any] = {}

# Backends we know of but do not provide, with what to do instead.
_KNOWN_UNAVAILABLE_BACKENDS = {
    "zarr": (
        "the zarr backend is not provided by dist_checkpointing; convert the checkpoint to "
        "torch_dist with Megatron-Core (which needs `pip install zarr tensorstore`)"
    ),
}


def _builtin_registrations() -> None:
    """Register the strategies shipped with the library (idempotent)."""
    from .common import register_default_common_strategies
    from .torch import register_default_torch_strategies

    register_default_torch_strategies()
    register_default_common_strategies()


def registered_strategies() -> MappingProxyType[RegistryKey, Any]:
    """A read-only view of the registry: ``(action, backend, version) -> strategy``."""
    _builtin_registrations()
    return MappingProxyType(_REGISTRY)


def register_default_strategy(
    action: StrategyAction, backend: str, version: int, strategy: Any, clobber: bool = False
) -> None:
    """Make ``strategy`` the default for ``(action, backend, version)``.

    Raises:
        CheckpointingException: another strategy is registered under that key and
            ``clobber`` is False.
    """
    key = (action.value, backend, int(version))
    existing = _REGISTRY.get(key)
    if existing is not None and existing is not strategy and not clobber:
        raise CheckpointingException(
            f"A default strategy is already registered for {key}: {existing}. "
            "Pass clobber=True to replace it."
        )
    _REGISTRY[key] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The default strategy for ``(action, backend, version)``.

    Raises:
        StrategyNotFoundError: nothing is registered under that key; the message
            lists what is registered (and how to get a known optional backend).
    """
    _builtin_registrations()
    key = (action.value, backend, int(version))
    try:
        return _REGISTRY[key]
    except KeyError:
        pass
    available = sorted(f"{b} v{v}" for a, b, v in _REGISTRY if a == action.value)
    hint = _KNOWN_UNAVAILABLE_BACKENDS.get(backend)
    msg = (
        f"No default {action.value} strategy for backend {backend!r} version {version}. "
        f"Registered for {action.value}: {', '.join(available) or 'none'}."
    )
    if hint:
        msg += f" Note: {hint}."
    raise StrategyNotFoundError(msg)


def check_compatibility(strategy: object, what: str, found: object, expected: object) -> None:
    if found != expected:
        raise IncompatibleStrategyError(
            f"{strategy} cannot load a checkpoint with {what} {found!r} (it supports {expected!r})"
        )


class LoadStrategyBase(ABC):
    """Base of the load strategies: checks that a checkpoint's backend/version fit."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise :class:`IncompatibleStrategyError` if the backend is not supported."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise :class:`IncompatibleStrategyError` if the version is not supported."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy also loads ShardedObjects."""
        return False

    def __str__(self) -> str:
        return type(self).__name__


class SaveStrategyBase(ABC):  # noqa: B024 - abstract by role, like Megatron-Core's
    """Base of the save strategies: the backend name and version they write."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy also saves ShardedObjects."""
        return False

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (non-sharded) part of a checkpoint."""

    @abstractmethod
    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        """The common state dict saved by :meth:`SaveCommonStrategy.save_common`."""

    @abstractmethod
    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> StateDict:
        """Fill the requested ShardedObjects (only if :attr:`can_handle_sharded_objects`)."""

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Data-less ShardedObjects stored in the checkpoint, by key."""
        if not self.can_handle_sharded_objects:
            return {}
        raise NotImplementedError


class LoadShardedStrategy(LoadStrategyBase):
    """Loads ShardedTensors (and, if it can, ShardedObjects)."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """Fill every ShardedTensor of the request; returns the loaded state dict."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Data-less ShardedTensors describing every stored tensor (global shape and
        dtype), keyed by ShardedTensor key."""

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Like :meth:`load_tensors_metadata`, plus ShardedObjects if supported."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError

    def remove_sharded_tensors(self, checkpoint_dir: str | Path, key_prefix: str) -> None:
        """Remove the tensors whose key starts with ``key_prefix`` from the checkpoint."""
        raise NotImplementedError(f"{self} cannot remove sharded tensors")


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (non-sharded) part of a checkpoint."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: str | Path) -> None:
        """Save the common state dict (called on every rank; rank 0 writes)."""

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> None:
        """Save ShardedObjects (only if :attr:`can_handle_sharded_objects`)."""
        raise NotImplementedError(f"{self} cannot save sharded objects")


class SaveShardedStrategy(SaveStrategyBase):
    """Saves ShardedTensors (and, if it can, ShardedObjects)."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Save every rank's shards (collective: called on every rank)."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save strategy whose writes can run in the background."""

    @abstractmethod
    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> AsyncRequest:
        """Stage the data and return the request that writes and finalizes it."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Synchronous save: the async request, executed in this process."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()


__all__ = [
    "StrategyAction",
    "register_default_strategy",
    "get_default_strategy",
    "registered_strategies",
    "LoadStrategyBase",
    "SaveStrategyBase",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "AsyncSaveShardedStrategy",
]
