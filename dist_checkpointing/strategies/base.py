"""Strategy interfaces and the registry of default strategies.

A *strategy* saves or loads one part of a checkpoint (the sharded tensors and
objects, or the common non-sharded state) in one on-disk format. The registry
maps ``(action, backend, version)`` to the default strategy, so that ``load``
can pick the reader from the checkpoint's ``metadata.json``.

The registry knows no strategy by import: the package that ships strategies
adds a provider (:func:`add_default_provider`) that registers its defaults with
``if_absent=True``; ``strategies/__init__.py`` does this for the built-ins.

Call sequence of ``save`` (every rank, unless noted):
    1. the commit protocol begins (:mod:`..engine.checkpoint.commit`): whole files
       written through the ``CheckpointDir`` handle are staged from now on, and
       ``owns_file(name)`` of both strategies says which files of the directory a
       save may replace or delete;
    2. ``SaveCommonStrategy.save_common(common_state_dict, dir)`` (the group's
       first rank writes);
    3. ``SaveShardedStrategy.save(sharded_state_dict, dir)`` (or ``async_save``
       for an :class:`AsyncSaveShardedStrategy`, which returns an ``AsyncRequest``
       whose finalize functions run on every rank);
    4. with ``verify_integrity``: ``files_written_by(dir, rank)`` (every rank),
       ``SaveCommonStrategy.files(dir)`` and (the coordinator) ``commit_files``
       name the files to digest;
    5. the commit (the coordinator, after every rank succeeded): ``metadata.json``
       and ``commit.json`` are written, the staged files installed.

Call sequence of ``load`` (every rank):
    1. the strategies are looked up from ``metadata.json``;
    2. ``check_backend_compatibility`` / ``check_version_compatibility``;
    3. ``LoadCommonStrategy.load_common(dir)``;
    4. with ``verify_integrity``: ``LoadShardedStrategy.metadata_files`` and
       ``LoadCommonStrategy.files(dir)`` are checked before anything is unpickled,
       ``files_holding(dir, keys)`` names the data files to check;
    5. ``LoadShardedStrategy.load(sharded_state_dict, dir)``.
"""

from __future__ import annotations

import copy
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from ..engine.async_save import AsyncCallsQueue
from ..engine.sharding_split import ValidatedStructure
from ..errors import CheckpointingException, IncompatibleStrategyError, StrategyNotFoundError
from ..mapping import ShardedStateDict, StateDict

if TYPE_CHECKING:
    from ..engine.async_save.request import AsyncRequest

logger = logging.getLogger(__name__)

_S = TypeVar("_S")
_T = TypeVar("_T")


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

# Functions that register built-in defaults (idempotently). The package that
# ships strategies adds its function here (``strategies/__init__.py``), so this
# module never imports the strategies that import it.
_DEFAULT_PROVIDERS: list[Callable[[], None]] = []

# Backends we know of but do not provide, with what to do instead.
_KNOWN_UNAVAILABLE_BACKENDS = {
    "zarr": (
        "the zarr backend is not provided by dist_checkpointing; convert the checkpoint to "
        "torch_dist with Megatron-Core (which needs `pip install zarr tensorstore`)"
    ),
}


def add_default_provider(provider: Callable[[], None]) -> None:
    """Have ``provider`` register its defaults before every lookup (idempotent).

    ``provider`` must call :func:`register_default_strategy` with
    ``if_absent=True``, so a test that emptied the registry gets the
    built-in strategies back on its first lookup.
    """
    if provider not in _DEFAULT_PROVIDERS:
        _DEFAULT_PROVIDERS.append(provider)
    provider()


def _builtin_registrations() -> None:
    for provider in _DEFAULT_PROVIDERS:
        provider()


def registered_strategies(*, load_builtins: bool = True) -> MappingProxyType[RegistryKey, Any]:
    """A read-only view of the registry: ``(action, backend, version) -> strategy``.

    With ``load_builtins`` (default) the built-in strategies are registered first.
    """
    if load_builtins:
        _builtin_registrations()
    return MappingProxyType(_REGISTRY)


def register_default_strategy(
    action: StrategyAction,
    backend: str,
    version: int,
    strategy: Any,
    clobber: bool = False,
    *,
    if_absent: bool = False,
) -> None:
    """Make ``strategy`` the default for ``(action, backend, version)``.

    Args:
        clobber: replace a strategy registered under that key.
        if_absent: do nothing if a strategy is registered under that key
            (how built-in defaults register, so user registrations win).

    Raises:
        CheckpointingException: another strategy is registered under that key and
            neither ``clobber`` nor ``if_absent`` is set.
    """
    key = (action.value, backend, int(version))
    existing = _REGISTRY.get(key)
    if existing is not None and if_absent:
        return
    if existing is not None and existing is not strategy and not clobber:
        raise CheckpointingException(
            f"A default strategy is already registered for {key}: {existing}. "
            "Pass clobber=True to replace it."
        )
    _REGISTRY[key] = strategy


@contextmanager
def isolated_registry(*, empty: bool = False) -> Iterator[None]:
    """Registrations made inside the block are undone when it ends (for tests).

    With ``empty`` the block starts from an empty registry (built-in strategies
    register again on the first lookup).
    """
    saved = dict(_REGISTRY)
    if empty:
        _REGISTRY.clear()
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


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


def resolve_strategy(
    given: _S | tuple[str, int] | None, default: tuple[str, int], action: StrategyAction
) -> Any:
    """``given`` if it is a strategy; else the registered default for ``given`` (or,
    when ``given`` is None, for ``default``) as ``(backend, version)``."""
    if given is None:
        given = default
    if isinstance(given, tuple):
        return get_default_strategy(action, *given)
    return given


def expect_strategy(strategy: Any, kind: type[_T]) -> _T:
    """``strategy`` if it is a ``kind``; else a :class:`CheckpointingException` saying so."""
    if not isinstance(strategy, kind):
        raise CheckpointingException(f"{strategy!r} is not a {kind.__name__}")
    return strategy


def bind_process_group(strategy: _S, group: dist.ProcessGroup | None) -> _S:
    """``strategy`` bound to ``group`` if it has no group of its own (a copy: the
    registered defaults are shared)."""
    if group is not None and getattr(strategy, "process_group", group) is None:
        strategy = copy.copy(strategy)
        strategy.process_group = group  # type: ignore[attr-defined]
    return strategy


def allow_types(strategy: _S, allowed_types: Sequence[type]) -> _S:
    """``strategy`` (a copy) that also allows ``allowed_types`` in the pickles it loads;
    ``strategy`` itself when ``allowed_types`` is empty."""
    if not allowed_types:
        return strategy
    if not hasattr(strategy, "allowed_types"):
        raise CheckpointingException(f"{strategy!r} does not take allowed_types")
    strategy = copy.copy(strategy)
    merged = (*strategy.allowed_types, *allowed_types)
    strategy.allowed_types = tuple(dict.fromkeys(merged))
    return strategy


def check_compatibility(strategy: object, what: str, found: object, expected: object) -> None:
    if found != expected:
        raise IncompatibleStrategyError(
            f"{strategy} cannot load a checkpoint with {what} {found!r} (it supports {expected!r})"
        )


class _ActionStrategies(MutableMapping[tuple[str, int], Any]):
    """The registry's entries of one action, keyed by ``(backend, version)``."""

    def __init__(self, action: str) -> None:
        self._action = action

    def _keys(self) -> list[tuple[str, int]]:
        _builtin_registrations()
        return [(b, v) for a, b, v in _REGISTRY if a == self._action]

    def __getitem__(self, key: tuple[str, int]) -> Any:
        _builtin_registrations()
        return _REGISTRY[(self._action, key[0], key[1])]

    def __setitem__(self, key: tuple[str, int], strategy: Any) -> None:
        backend, version = key
        _REGISTRY[(self._action, backend, version)] = strategy

    def __delitem__(self, key: tuple[str, int]) -> None:
        del _REGISTRY[(self._action, key[0], key[1])]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


class _DefaultStrategies(Mapping[str, _ActionStrategies]):
    """Megatron-Core's ``default_strategies[action.value][(backend, version)]``: a live
    view of the registry (reads and writes go to it)."""

    def __getitem__(self, action: str) -> _ActionStrategies:
        action = action.value if isinstance(action, StrategyAction) else action
        if action not in {a.value for a in StrategyAction}:
            raise KeyError(action)
        return _ActionStrategies(action)

    def __iter__(self) -> Iterator[str]:
        return iter(a.value for a in StrategyAction)

    def __len__(self) -> int:
        return len(StrategyAction)


default_strategies = _DefaultStrategies()

# Megatron-Core's module-level queue for async saves (scheduled by the caller).
async_calls = AsyncCallsQueue()


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

    def owns_file(self, name: str) -> bool:
        """Whether a file called ``name`` is one this strategy writes (a directory
        holding such files but no commit marker is an incomplete checkpoint)."""
        return False

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (non-sharded) part of a checkpoint."""

    @abstractmethod
    def load_common(self, checkpoint_dir: str | os.PathLike[str]) -> StateDict:
        """The common state dict saved by :meth:`SaveCommonStrategy.save_common`."""

    @abstractmethod
    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> StateDict:
        """Fill the requested ShardedObjects (only if :attr:`can_handle_sharded_objects`)."""

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> ShardedStateDict:
        """Data-less ShardedObjects stored in the checkpoint, by key."""
        if not self.can_handle_sharded_objects:
            return {}
        raise NotImplementedError

    def files(self, checkpoint_dir: str | os.PathLike[str]) -> list[str]:
        """Names of the files :meth:`load_common` reads (for integrity checks)."""
        return []


class LoadShardedStrategy(LoadStrategyBase):
    """Loads ShardedTensors (and, if it can, ShardedObjects)."""

    @abstractmethod
    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> StateDict:
        """Fill every ShardedTensor of the request; returns the loaded state dict."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> ShardedStateDict:
        """Data-less ShardedTensors describing every stored tensor (global shape and
        dtype), keyed by ShardedTensor key."""

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> ShardedStateDict:
        """Like :meth:`load_tensors_metadata`, plus ShardedObjects if supported."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError

    def remove_sharded_tensors(
        self, checkpoint_dir: str | os.PathLike[str], key_prefix: str
    ) -> None:
        """Remove the tensors whose key starts with ``key_prefix`` from the checkpoint."""
        raise NotImplementedError(f"{self} cannot remove sharded tensors")

    #: The format's own metadata files (read before the data; covered by integrity).
    metadata_files: tuple[str, ...] = ()

    def files_holding(self, checkpoint_dir: str | os.PathLike[str], keys: set[str]) -> set[str]:
        """Names of the files that hold the given keys (ShardedTensor keys and
        ShardedObject unique keys); for integrity checks of exactly what is read."""
        return set()


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (non-sharded) part of a checkpoint."""

    #: :meth:`save_common` writes on its group's first rank only (no-op elsewhere): a
    #: save then calls it there before its first vote, whose verdict covers it.
    saves_on_coordinator_only = False

    @abstractmethod
    def save_common(
        self, common_state_dict: StateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Save the common state dict (called on every rank; rank 0 writes)."""

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Save ShardedObjects (only if :attr:`can_handle_sharded_objects`)."""
        raise NotImplementedError(f"{self} cannot save sharded objects")

    def files(self, checkpoint_dir: str | os.PathLike[str]) -> list[str]:
        """Names of the files :meth:`save_common` wrote on this rank."""
        return []


class SaveShardedStrategy(SaveStrategyBase):
    """Saves ShardedTensors (and, if it can, ShardedObjects)."""

    #: The format's own metadata files (written by the coordinator at finalize).
    commit_files: tuple[str, ...] = ()
    #: The digest of this rank's shard records at the last save whose sharding every
    #: rank validated (:mod:`..engine.sharding_split`): while no rank's records change,
    #: the sharding check of ``save`` is one all-reduce. Each instance has its own (a
    #: copy bound to another process group shares it: the digest names the group); set
    #: it to None to check every save.
    validated_structure: ValidatedStructure | None = None

    def __init__(self, backend: str, version: int) -> None:
        super().__init__(backend, version)
        self.validated_structure = ValidatedStructure()

    @abstractmethod
    def save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Save every rank's shards (collective: called on every rank)."""

    def files_written_by(self, checkpoint_dir: str | os.PathLike[str], rank: int) -> list[str]:
        """Names of the data files that group rank ``rank`` wrote (for integrity)."""
        return []

    def owns_file(self, name: str) -> bool:
        return name in self.commit_files


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save strategy whose writes can run in the background."""

    @abstractmethod
    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> AsyncRequest:
        """Stage the data and return the request that writes and finalizes it."""

    def save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike[str]
    ) -> None:
        """Synchronous save: the async request, executed in this process."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()


class CachedStructureOption:
    """A save strategy's ``cached_metadata`` option under Megatron-Core's other name,
    ``use_cached_ckpt_structure``: Megatron-LM (``--ckpt-assume-constant-structure``)
    and NeMo turn caching on by setting it on a strategy after building it."""

    cached_metadata: bool = False

    @property
    def use_cached_ckpt_structure(self) -> bool:
        return self.cached_metadata

    @use_cached_ckpt_structure.setter
    def use_cached_ckpt_structure(self, value: bool) -> None:
        self.cached_metadata = bool(value)


__all__ = [
    "StrategyAction",
    "register_default_strategy",
    "get_default_strategy",
    "registered_strategies",
    "add_default_provider",
    "isolated_registry",
    "resolve_strategy",
    "bind_process_group",
    "expect_strategy",
    "LoadStrategyBase",
    "SaveStrategyBase",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "AsyncSaveShardedStrategy",
    "CachedStructureOption",
    "async_calls",
    "default_strategies",
]
