"""What a checkpoint's pickles may name: the allowlist and the policy.

``.metadata`` may reference only plain data types of PyTorch DCP (and Megatron-Core
0.13's ``MCoreSavePlan``, restored as :class:`LegacyMCoreSavePlan` without importing
Megatron). Each allowed global maps to what an unpickler hands out for it: the class
itself for immutable built-ins, a sealed wrapper (:class:`_Call`) that validates its
arguments for everything else, and sealed tokens for shared singletons (enum members,
paths), replaced after the load.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import functools
import os
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dist_checkpointing._torch_compat import StorageInfo, StoragePrefix
from dist_checkpointing.errors import UnsafeCheckpointError

from .bounded import short_repr

MCORE_SAVE_PLAN_GLOBAL = "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan"


"""The name under which Megatron-Core 0.13 pickles each entry of ``Metadata.all_local_plans``."""


@dataclasses.dataclass(frozen=True)
class LegacyMCoreSavePlan(SavePlan):
    """Stand-in for Megatron-Core 0.13's ``MCoreSavePlan`` (a frozen ``SavePlan`` subclass).

    It holds the same fields, so the plans of a 0.13 checkpoint load without Megatron.
    The plans only feed Megatron's plan cache; loading never needs them.
    """

    mcore_data: dict[str, dict[str, Any]] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled again as torch's own SavePlan, so the bytes load without Megatron and
        # without this library. ``mcore_data`` is dropped: Megatron keeps the same dict in
        # ``Metadata.mcore_data``.
        return (SavePlan, (self.items, self.storage_data, self.planner_data, self.usable))


class _Sealed:
    """An object a pickle may hold but never change: no ``__dict__``, and every
    ``setattr`` fails, so BUILD on it fails. Shared by all loads, hence sealed."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} objects are read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} objects are read-only")


class _Token(_Sealed):
    """Stands in, during a fast load, for a result the file must not hold itself (a
    process-wide enum member, a path); the load replaces it by ``value`` afterwards."""

    __slots__ = ("value",)
    value: object

    def __init__(self, value: object) -> None:
        object.__setattr__(self, "value", value)


class _Call(_Sealed):
    """A sealed callable: what the fast unpickler gets for an allowlisted function."""

    __slots__ = ("_func",)
    _func: Callable[..., object]

    def __init__(self, func: Callable[..., object]) -> None:
        object.__setattr__(self, "_func", func)

    def __call__(self, *args: object) -> object:
        return self._func(*args)


# The fast unpickler's ``builtins.object`` (only ever the ``base`` of copyreg._reconstructor).
_OBJECT_BASE = _Sealed()


_DCP = "torch.distributed.checkpoint"


# The enum TensorProperties pickles its memory format as (torch's private
# _MEM_FORMAT_ENCODING), found through its public __getstate__ rather than by name.
_MEM_FORMAT_ENUM: type[Enum] = type(TensorProperties().__getstate__()[3])


def _state_classes() -> dict[str, type]:
    """Dataclasses pickled as NEWOBJ (no constructor call) then BUILD (their fields).

    Keys are the names pickles use; values the classes restored for them.
    """
    return {
        f"{_DCP}.metadata.Metadata": Metadata,
        f"{_DCP}.metadata.TensorStorageMetadata": TensorStorageMetadata,
        f"{_DCP}.metadata.TensorProperties": TensorProperties,
        f"{_DCP}.metadata.ChunkStorageMetadata": ChunkStorageMetadata,
        f"{_DCP}.metadata.BytesStorageMetadata": BytesStorageMetadata,
        f"{_DCP}.metadata.MetadataIndex": MetadataIndex,
        f"{_DCP}.metadata.StorageMeta": StorageMeta,
        f"{_DCP}.filesystem._StorageInfo": StorageInfo,
        f"{_DCP}.filesystem._StoragePrefix": StoragePrefix,
        f"{_DCP}.planner.SavePlan": SavePlan,
        f"{_DCP}.planner.WriteItem": WriteItem,
        f"{_DCP}.planner.TensorWriteData": TensorWriteData,
        f"{_DCP}.planner.BytesIOWriteData": BytesIOWriteData,
        MCORE_SAVE_PLAN_GLOBAL: LegacyMCoreSavePlan,
    }


def _enum_classes() -> dict[str, type[Enum]]:
    """Enums pickled as REDUCE(cls, (value,)): a member lookup, nothing else."""
    return {
        f"{_MEM_FORMAT_ENUM.__module__}.{_MEM_FORMAT_ENUM.__qualname__}": _MEM_FORMAT_ENUM,
        f"{_DCP}.planner.WriteItemType": WriteItemType,
    }


_LAYOUT_GLOBAL = "torch.serialization._get_layout"


_MAX_PATH_PARTS = 4096


@functools.lru_cache(maxsize=1)
def _layouts_by_name() -> Mapping[str, torch.layout]:
    return MappingProxyType(
        {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    )


def _layout_from_name(name: str) -> torch.layout:
    """Replaces ``torch.serialization._get_layout``: a lookup in a fixed table."""
    if type(name) is not str or name not in _layouts_by_name():
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _layouts_by_name()[name]


def _reconstruct_placeholder(cls: type, base: type, state: object) -> object:
    """Never called: stands for ``copyreg._reconstructor`` (protocols 0 and 1) in the table.

    The checked unpickler handles that name itself (``_RestrictedUnpickler._reconstruct``),
    the fast one with ``_reconstruct_shadow``.
    """
    raise pickle.UnpicklingError("copyreg._reconstructor is handled by the unpickler")


_RECONSTRUCTOR_GLOBAL = "copyreg._reconstructor"


def _path_factory(cls: type[pathlib.PurePath]) -> Callable[..., pathlib.PurePath]:
    """A pathlib class restricted to string parts (DCP pickles ``checkpoint_id`` as given,
    and callers often pass a ``Path``). Building a path object touches no file."""

    def make_path(*parts: object) -> pathlib.PurePath:
        texts = [part for part in parts if isinstance(part, str)]
        if len(texts) != len(parts):
            raise pickle.UnpicklingError(
                f"{cls.__name__} parts must be str, got {short_repr(parts)}"
            )
        return cls(*texts)

    return make_path


def _path_classes() -> dict[str, type[pathlib.PurePath]]:
    # A concrete path of the other OS cannot be instantiated here: use its pure flavour.
    on_windows = os.name == "nt"
    return {
        "pathlib.PurePath": pathlib.PurePath,
        "pathlib.PurePosixPath": pathlib.PurePosixPath,
        "pathlib.PureWindowsPath": pathlib.PureWindowsPath,
        "pathlib.Path": pathlib.Path,
        "pathlib.PosixPath": pathlib.PurePosixPath if on_windows else pathlib.PosixPath,
        "pathlib.WindowsPath": pathlib.WindowsPath if on_windows else pathlib.PureWindowsPath,
    }


def _returning_token(func: Callable[..., object]) -> _Call:
    """``func`` for the fast unpickler: its result comes back wrapped in a :class:`_Token`."""
    return _Call(lambda *args: _Token(func(*args)))


def _member_lookup(enum_cls: type[Enum]) -> Callable[[object], Enum]:
    """``enum_cls(value)`` restricted to a member lookup by int or str value."""

    def member(value: object) -> Enum:
        if type(value) not in (int, str):
            raise pickle.UnpicklingError(f"{enum_cls.__name__} value must be int or str")
        return enum_cls(value)

    return member


_IMMUTABLE_TYPE_FLAG = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: the type's attributes cannot be set


def _shared_or_sealed(value: Any) -> object:
    """What the fast unpickler gets for an allowlisted value: the value itself if BUILD
    cannot change it (immutable types, and their instances without ``__dict__``), else a
    sealed wrapper (should a torch upgrade make it mutable)."""
    if isinstance(value, type):
        frozen = bool(value.__flags__ & _IMMUTABLE_TYPE_FLAG)
    else:
        frozen = bool(type(value).__flags__ & _IMMUTABLE_TYPE_FLAG)
        frozen = frozen and not hasattr(value, "__dict__")
    if frozen:
        return value
    return _Call(value) if callable(value) else _Token(value)


@dataclasses.dataclass(frozen=True)
class _Allowlist:
    """The objects a metadata pickle may reference, and what it may do with them."""

    # "module.name" -> the object GLOBAL / STACK_GLOBAL pushes (checked unpickler).
    globals: Mapping[str, object]
    # id(cls) of classes that NEWOBJ may create (without arguments) and BUILD may fill.
    state_types: frozenset[int]
    # id(callable) -> (min, max) number of positional arguments REDUCE may pass.
    callables: Mapping[int, tuple[int, int]]
    # The fast unpickler's view of the same names: sealed wrappers and immutable values,
    # except ``shadowed`` classes and copyreg._reconstructor, which each load makes anew.
    fast_globals: Mapping[str, object]
    shadowed: Mapping[str, type]


@functools.lru_cache(maxsize=1)
def _allowlist() -> _Allowlist:
    found: dict[str, object] = {}
    fast: dict[str, object] = {}
    state_types: set[int] = set()
    callables: dict[int, tuple[int, int]] = {}
    shadowed = _state_classes()
    for qualname, cls in shadowed.items():
        found[qualname] = cls
        state_types.add(id(cls))
    for qualname, enum_cls in _enum_classes().items():
        found[qualname] = enum_cls
        callables[id(enum_cls)] = (1, 1)
        fast[qualname] = _returning_token(_member_lookup(enum_cls))
    # LegacyMCoreSavePlan pickles as a SavePlan(...) call; its __init__ only assigns fields.
    callables[id(SavePlan)] = (1, 4)
    # Plain data constructors; BUILD on an OrderedDict only fills its instance dict.
    for qualname, func, arity in (
        ("torch.Size", torch.Size, (0, 1)),
        ("collections.OrderedDict", OrderedDict, (0, 1)),
        ("builtins.set", set, (0, 1)),
        ("builtins.frozenset", frozenset, (0, 1)),
        (_LAYOUT_GLOBAL, _layout_from_name, (1, 1)),
        (_RECONSTRUCTOR_GLOBAL, _reconstruct_placeholder, (3, 3)),
    ):
        found[qualname] = func
        callables[id(func)] = arity
        if isinstance(func, type):
            fast[qualname] = _shared_or_sealed(func)
    fast[_LAYOUT_GLOBAL] = _Call(_layout_from_name)
    state_types.add(id(OrderedDict))
    for qualname, path_cls in _path_classes().items():
        found[qualname] = make_path = _path_factory(path_cls)
        callables[id(make_path)] = (0, _MAX_PATH_PARTS)
        fast[qualname] = _returning_token(make_path)
    # Only ever the ``base`` argument of copyreg._reconstructor; never called or built.
    found["builtins.object"] = object
    fast["builtins.object"] = _OBJECT_BASE
    # dtypes are values (pickled by name), never called.
    for attr, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            found[f"torch.{attr}"] = value
            fast[f"torch.{attr}"] = _shared_or_sealed(value)
    return _Allowlist(
        MappingProxyType(found),
        frozenset(state_types),
        MappingProxyType(callables),
        MappingProxyType(fast),
        MappingProxyType(shadowed),
    )


def allowed_metadata_globals() -> tuple[str, ...]:
    """Every ``module.name`` that :func:`load_metadata` accepts, sorted."""
    return tuple(sorted(_allowlist().globals))


def is_allowed_metadata_global(qualified_name: str) -> bool:
    """Whether a ``.metadata`` pickle may reference the global ``module.name``."""
    return qualified_name in _allowlist().globals


def _refusal(source: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source}: refusing to unpickle checkpoint metadata: {what}. Only plain "
        "torch.distributed.checkpoint metadata types are allowed (nothing from the file "
        "is executed); the file is malicious or not a DCP .metadata file"
    )


def _find_allowed(table: Mapping[str, object], source: str, module: str, name: str) -> object:
    qualname = f"{module}.{name}"
    found = table.get(qualname, _NOT_FOUND)
    if found is _NOT_FOUND:
        raise _refusal(source, f"global '{qualname}' is not allowed")
    return found


_NOT_FOUND = object()


def _is_dunder(key: object) -> bool:
    return isinstance(key, str) and key.startswith("__") and key.endswith("__")


def _py3_name(module: str, name: str) -> tuple[str, str]:
    """Python 3 spelling of a global that protocols 0-2 wrote with its Python 2 name."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name
