"""Loading checkpoint files without executing code stored in them.

A checkpoint holds two kinds of pickles, and both are read here:

* ``.metadata``: a pickled :class:`torch.distributed.checkpoint.metadata.Metadata`.
  torch's own reader unpickles it with plain :mod:`pickle`, which runs any callable
  the file names. :func:`load_metadata` admits an explicit allowlist of plain data
  types instead (see :func:`allowed_metadata_globals`) and restores Megatron-Core
  0.13's ``MCoreSavePlan`` as :class:`LegacyMCoreSavePlan` without importing Megatron.
* ``torch.save`` payloads (``common.pt``, ShardedObject bytes): :func:`safe_torch_load`
  uses ``torch.load(weights_only=True)`` unless the caller trusts the file.

``.metadata`` is read by one of two unpicklers over the same allowlist:

* the *fast* one, pickle's C unpickler, whose ``find_class`` hands out only objects
  that a file cannot use to run code or to change anything outside this load;
* the *checked* one, pickle's pure-Python unpickler with every opcode that creates,
  calls or mutates objects gated. It decides every file the fast one declines (any
  error other than a refused global, or a result that is not plain allowed data),
  and so gives the precise refusal message.

Why the fast unpickler is safe. Its opcodes can only call, build or fill objects the
file can reach: literals, what ``find_class`` returns, and what calling those returns.

* Allowlisted dataclasses are handed out as private subclasses ("shadows") made for
  this load: BUILD on a class object (``Metadata.__repr__ = ...``) changes only the
  shadow, which is discarded; shadows refuse ``setattr`` (no BUILD slot state, so no
  ``__class__``/``__dict__`` swaps), and all but ``SavePlan`` take no constructor
  arguments. After the load every shadow instance is switched to its real class.
* Every other allowlisted callable is a sealed wrapper (no ``__dict__``, no settable
  attribute) that validates its arguments; shared singletons it would return (enum
  members, paths) come back as sealed tokens, replaced after the load.
  ``torch.Size``, ``OrderedDict``, ``set``, ``frozenset`` and dtypes are immutable
  built-in types and values, handed out as they are.
* So everything a file can call is allowlisted code that only builds data, and
  everything it can reach and mutate was created by this load. Persistent ids are
  refused; copyreg extension codes would bypass ``find_class`` through pickle's
  process-wide extension cache, so the fast path is skipped while any is registered.
* The result is then walked: only plain data, containers and allowlisted instances
  whose attribute names are plain (no dunder) strings are accepted; a shadow that was
  changed during the load makes the checked unpickler decide instead.

Example:
    >>> import io, pickle
    >>> from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
    >>> raw = pickle.dumps(Metadata({"obj": BytesStorageMetadata()}))
    >>> load_metadata(io.BytesIO(raw), source="ckpt/.metadata").state_dict_metadata
    {'obj': BytesStorageMetadata()}
"""

from __future__ import annotations

import _compat_pickle
import copyreg
import dataclasses
import functools
import io
import logging
import os
import pathlib
import pickle
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from itertools import chain, repeat
from types import MappingProxyType
from typing import Any, BinaryIO, cast

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
from dist_checkpointing.engine.process import gc_paused
from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "MCORE_SAVE_PLAN_GLOBAL",
    "LegacyMCoreSavePlan",
    "allowed_metadata_globals",
    "is_allowed_metadata_global",
    "load_metadata",
    "safe_torch_load",
]

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


# --------------------------------------------------------------------------- sealed objects


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


# --------------------------------------------------------------------------- allowlist

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
            raise pickle.UnpicklingError(f"{cls.__name__} parts must be str, got {parts!r:.200}")
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


# --------------------------------------------------------------------------- checked unpickler


def _is_dunder(key: object) -> bool:
    return isinstance(key, str) and key.startswith("__") and key.endswith("__")


class _RestrictedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every opcode that resolves or calls objects gated.

    The pure-Python implementation lets each opcode be checked; it decides every file
    the fast unpickler declines, and gives the precise reason for a refusal.
    """

    # Set by pickle's load() and methods of pickle._Unpickler; declared for type checkers.
    stack: list[Any]
    metastack: list[list[Any]]
    proto: int
    append: Callable[[Any], None]
    readline: Callable[[], bytes]
    pop_mark: Callable[[], list[Any]]

    def __init__(self, fileobj: BinaryIO, source: str) -> None:
        super().__init__(fileobj)
        self._source = source
        self._allow = _allowlist()

    def _refuse(self, what: str) -> UnsafeCheckpointError:
        return _refusal(self._source, what)

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:
            # Protocols 0-2 write Python 2 names (__builtin__, copy_reg): rename, as pickle
            # does, by a fixed table; nothing is imported.
            module, name = _py3_name(module, name)
        return _find_allowed(self._allow.globals, self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse(f"persistent id {pid!r:.200} is not allowed")

    def _call(self, func: Any, args: Any) -> Any:
        arity = self._allow.callables.get(id(func))
        if arity is None:
            raise self._refuse(f"calling {_describe(func)} is not allowed")
        if type(args) is not tuple or not arity[0] <= len(args) <= arity[1]:
            raise self._refuse(f"unexpected arguments for {_describe(func)}: {args!r:.200}")
        if func is _reconstruct_placeholder:
            return self._reconstruct(*args)
        return func(*args)

    def _reconstruct(self, cls: Any, base: Any, state: Any) -> Any:
        # Protocols 0 and 1 create plain objects as copyreg._reconstructor(cls, object, None).
        if base is not object or state is not None:
            raise self._refuse(f"copyreg._reconstructor with base {_describe(base)}")
        return self._instance(cls)

    def _instance(self, cls: Any) -> Any:
        if not isinstance(cls, type) or id(cls) not in self._allow.state_types:
            raise self._refuse(f"creating {_describe(cls)} is not allowed")
        return cast(Any, cls).__new__(cls)

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def _load_inst(self) -> None:
        module = self.readline()[:-1].decode("ascii")
        name = self.readline()[:-1].decode("ascii")
        func = self.find_class(module, name)
        self.append(self._call(func, tuple(self.pop_mark())))

    def _load_obj(self) -> None:
        args = self.pop_mark()
        func = args.pop(0)
        self.append(self._call(func, tuple(args)))

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        if (
            type(args) is not tuple
            or args
            or (kwargs is not None and (type(kwargs) is not dict or kwargs))
        ):
            raise self._refuse(f"constructor arguments for {_describe(cls)} are not allowed")
        self.append(self._instance(cls))

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        self._new(self.stack.pop(), args, None)

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self._new(self.stack.pop(), args, kwargs)

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        # type(inst) must be allowlisted: this also refuses BUILD on a class object,
        # which would set attributes on that class for the whole process.
        if id(cls) not in self._allow.state_types:
            raise self._refuse(f"setting the state of {_describe(inst)} is not allowed")
        # Looked up on the class, never on the instance dict an earlier BUILD may have filled.
        setstate = getattr(cls, "__setstate__", None)
        if setstate is not None:
            setstate(inst, state)
            return
        if isinstance(state, tuple) and len(state) == 2 and state[1] is not None:
            raise self._refuse(f"slot state for {_describe(inst)} is not allowed")
        if isinstance(state, tuple) and len(state) == 2:
            state = state[0]
        if state is None:
            return
        if type(state) is not dict:
            raise self._refuse(f"state of type {type(state).__name__} for {_describe(inst)}")
        bad = [k for k in state if type(k) is not str or _is_dunder(k)]
        if bad:
            raise self._refuse(f"attribute names {bad!r:.200} for {_describe(inst)}")
        inst.__dict__.update(state)

    def _refuse_extension(self) -> None:
        raise self._refuse("copyreg extension codes are not allowed")

    def _checked_container_op(self, name: str, container_types: tuple[type, ...]) -> None:
        opcode: bytes = getattr(pickle, name)
        if opcode in (pickle.SETITEM, pickle.APPEND):
            target = self.stack[-3 if opcode == pickle.SETITEM else -2]
        else:  # SETITEMS / APPENDS / ADDITEMS: the target sits below the mark
            target = self.metastack[-1][-1]
        if type(target) not in container_types:
            raise self._refuse(f"{name} on {_describe(target)} is not allowed")
        _PLAIN_DISPATCH[opcode[0]](self)


_PLAIN_DISPATCH: Mapping[int, Callable[[Any], None]] = MappingProxyType(pickle._Unpickler.dispatch)


def _gated_dispatch() -> dict[int, Callable[[Any], None]]:
    """pickle's opcode table with every opcode that creates, calls or mutates gated."""
    table: dict[int, Callable[[Any], None]] = dict(_PLAIN_DISPATCH)
    cls = _RestrictedUnpickler
    table[pickle.REDUCE[0]] = cls._load_reduce
    table[pickle.INST[0]] = cls._load_inst
    table[pickle.OBJ[0]] = cls._load_obj
    table[pickle.NEWOBJ[0]] = cls._load_newobj
    table[pickle.NEWOBJ_EX[0]] = cls._load_newobj_ex
    table[pickle.BUILD[0]] = cls._load_build
    for ext in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        table[ext[0]] = cls._refuse_extension
    # Container opcodes call .append / .extend / __setitem__ / .add on their target:
    # only real containers may be targets, not objects whose attributes came from the file.
    for name, types in (
        ("SETITEM", (dict, OrderedDict)),
        ("SETITEMS", (dict, OrderedDict)),
        ("APPEND", (list,)),
        ("APPENDS", (list,)),
        ("ADDITEMS", (set,)),
    ):
        opcode: bytes = getattr(pickle, name)
        table[opcode[0]] = functools.partial(
            cls._checked_container_op, name=name, container_types=types
        )
    return table


# pickle looks every opcode up in this class-level table (built once, never changed).
_RestrictedUnpickler.dispatch = _gated_dispatch()


def _describe(obj: object) -> str:
    if isinstance(obj, type):
        return f"class '{obj.__module__}.{obj.__qualname__}'"
    if callable(obj):
        module = getattr(obj, "__module__", "?")
        return f"callable '{module}.{getattr(obj, '__qualname__', repr(obj))}'"
    return f"an object of type '{type(obj).__module__}.{type(obj).__qualname__}'"


def _load_checked(data: bytes, source: str) -> object:
    try:
        return _RestrictedUnpickler(io.BytesIO(data), source).load()
    except (UnsafeCheckpointError, MemoryError):
        raise
    except Exception as exc:  # any other failure means the bytes are not valid metadata
        raise CorruptCheckpointError(
            f"{source}: checkpoint metadata is truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from exc


# --------------------------------------------------------------------------- fast unpickler


def _refuse_setattr(self: object, name: str, value: object) -> None:
    raise AttributeError(f"cannot set {name!r} while unpickling {type(self).__qualname__}")


def _refuse_delattr(self: object, name: str) -> None:
    raise AttributeError(f"cannot delete {name!r} while unpickling {type(self).__qualname__}")


def _setstate_via_real(real: type, setstate: Callable[[Any, Any], None]) -> Callable[..., None]:
    """A shadow's ``__setstate__``: tokens resolved, the real ``__setstate__`` run on a
    scratch instance of the real class (shadows refuse setattr), its fields copied over."""

    def __setstate__(self: object, state: object) -> None:
        if type(state) is tuple:
            state = tuple([v.value if type(v) is _Token else v for v in state])
        scratch: Any = object.__new__(real)
        setstate(scratch, state)
        vars(self).update(vars(scratch))

    return __setstate__


def _make_shadow(real: type, constructible: bool) -> type:
    """A private subclass of ``real`` for one load; see the module docstring."""
    namespace: dict[str, object] = {
        "__slots__": (),
        "__module__": real.__module__,
        "__qualname__": real.__qualname__,
        "__setattr__": _refuse_setattr,
        "__delattr__": _refuse_delattr,
    }
    if not constructible:
        # object's own __init__ makes object.__new__ refuse arguments: NEWOBJ and REDUCE
        # with arguments fail, as the checked unpickler requires.
        namespace["__init__"] = object.__init__
    setstate = getattr(real, "__setstate__", None)
    if setstate is not None and setstate is not getattr(object, "__setstate__", None):
        namespace["__setstate__"] = _setstate_via_real(real, setstate)
    return type(real)(real.__name__, (real,), namespace)


@dataclasses.dataclass(frozen=True)
class _Shadows:
    """This load's shadow classes, and what they looked like when made."""

    real_of: Mapping[type, type]  # shadow -> real class
    by_name: Mapping[str, type]  # pickle name -> shadow
    made: Mapping[type, tuple[dict[str, object], tuple[type, ...], str, str]]
    field_names: Mapping[type, frozenset[str]]  # real class -> dataclass field names
    adopted: frozenset[type]  # the real classes

    @classmethod
    def create(cls, allow: _Allowlist) -> _Shadows:
        by_real = {
            real: _make_shadow(real, constructible=id(real) in allow.callables)
            for real in set(allow.shadowed.values())
        }
        return cls(
            real_of={shadow: real for real, shadow in by_real.items()},
            by_name={name: by_real[real] for name, real in allow.shadowed.items()},
            made={
                s: (dict(vars(s)), s.__bases__, s.__name__, s.__qualname__)
                for s in by_real.values()
            },
            field_names={
                real: frozenset(f.name for f in dataclasses.fields(real)) for real in by_real
            },
            adopted=frozenset(by_real),
        )

    def repair(self) -> str | None:
        """Undo what the pickle changed on a shadow (BUILD on a class object), so that
        nothing it set (``__del__``, ...) outlives the load; the class's name, if any."""
        changed = None
        for shadow, (attrs, bases, name, qualname) in self.made.items():
            now = vars(shadow)
            if (
                shadow.__bases__ is bases
                and shadow.__name__ == name
                and shadow.__qualname__ == qualname
                and len(now) == len(attrs)
                and all(now.get(key, _NOT_FOUND) is value for key, value in attrs.items())
            ):
                continue
            changed = qualname
            shadow.__bases__, shadow.__name__, shadow.__qualname__ = bases, name, qualname
            for key in [key for key in now if key not in attrs]:
                delattr(shadow, key)
            for key, value in attrs.items():
                if now.get(key, _NOT_FOUND) is not value:
                    setattr(shadow, key, value)
        return changed


def _reconstruct_shadow(
    allowed: frozenset[int], cls: object, base: object, state: object
) -> object:
    """The fast unpickler's ``copyreg._reconstructor``: an empty instance of a shadow."""
    if id(cls) not in allowed or base is not _OBJECT_BASE or state is not None:
        raise pickle.UnpicklingError("copyreg._reconstructor outside (shadow, object, None)")
    return object.__new__(cast(type, cls))


class _FastUnpickler(pickle.Unpickler):
    """pickle's C unpickler, resolving globals in this load's table only."""

    def __init__(
        self, fileobj: BinaryIO, *, source: str, table: Mapping[str, object], py2_names: bool
    ) -> None:
        super().__init__(fileobj)
        self._source = source
        self._table = table
        self._py2_names = py2_names

    def find_class(self, module: str, name: str) -> Any:
        if self._py2_names:  # protocols 0-2; the C default does this renaming too
            module, name = _py3_name(module, name)
        return _find_allowed(self._table, self._source, module, name)

    def persistent_load(self, pid: Any) -> Any:
        # Declined rather than refused here: the checked unpickler builds the message.
        raise pickle.UnpicklingError("persistent ids are not allowed")


# Leaves of a metadata pickle: values that hold no object references to check.
_ATOMIC: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
    | {torch.dtype, torch.layout, torch.memory_format, torch.Size}
)
_CONTAINERS: frozenset[type] = frozenset({dict, OrderedDict, list, tuple, set, frozenset})
_BATCH = 4096  # objects handled together; small enough to stay in the CPU caches


def _bad_names(attrs: Mapping[Any, object]) -> list[object]:
    return [key for key in attrs if type(key) is not str or _is_dunder(key)]


def _without_tokens(values: list[Any]) -> list[Any]:
    # Token values are the process's own objects (enum members, fresh paths): not walked.
    return [value for value in values if type(value) is not _Token]


def _resolve_tokens(mapping: dict[Any, Any]) -> None:
    mapping.update({key: value.value for key, value in mapping.items() if type(value) is _Token})


class _Adoption:
    """Turns the fast unpickler's result into plain allowed data, or says why not.

    Every shadow instance is switched to its real class, and every token is replaced by
    its value where it sits in a list, a dict value or an attribute. The walk is
    breadth-first and handles a level's objects of one type in batches with C-level
    map()s: a large Metadata has ~10 objects per tensor, and per-object Python code
    would cost as much as the unpickling itself.
    """

    def __init__(self, shadows: _Shadows, budget: int) -> None:
        self._shadows = shadows
        # Objects are queued once per reference. A legitimate pickle spends at least a
        # byte per reference; one that shares objects beyond that is left to the checked
        # unpickler rather than walked (sharing could make the walk exponential).
        self._budget = budget
        self._seen: set[int] = set()  # ids of containers walked (instances change type)
        self._queued: dict[type, list[Any]] = {}

    def run(self, root: object) -> str | None:
        """Adopt everything reachable from ``root``; None, or why it is not plain data."""
        reason = self._queue([root])
        while reason is None and self._queued:
            level, self._queued = self._queued, {}
            for kind, objs in level.items():
                reason = self._adopt(kind, objs)
                if reason is not None:
                    break
        return reason

    def _adopt(self, kind: type, objs: list[Any]) -> str | None:
        real = self._shadows.real_of.get(kind)
        if real is not None:
            batches = (objs[i : i + _BATCH] for i in range(0, len(objs), _BATCH))
            return next(filter(None, (self._instances(real, batch) for batch in batches)), None)
        if kind in _CONTAINERS:
            unique = dict(zip(map(id, objs), objs))
            fresh = [obj for key, obj in unique.items() if key not in self._seen]
            self._seen.update(unique)
            batches = (fresh[i : i + _BATCH] for i in range(0, len(fresh), _BATCH))
            return next(filter(None, (self._containers(kind, batch) for batch in batches)), None)
        if kind in self._shadows.adopted:  # reached again after its adoption
            return None
        return f"an object of type {kind.__qualname__}"

    def _queue(self, values: list[Any]) -> str | None:
        """Queue the non-atomic ``values``; ``"token"`` (nothing queued) if one is a token."""
        self._budget -= len(values)
        if self._budget < 0:
            return "objects shared more often than the file has bytes"
        present = set(map(type, values))
        kinds = present - _ATOMIC
        if not kinds:
            return None
        if _Token in kinds:
            return "token"
        if len(kinds) > 1:
            for value in values:
                if type(value) not in _ATOMIC:
                    self._queued.setdefault(type(value), []).append(value)
            return None
        (kind,) = kinds
        if len(present) > 1:
            values = [value for value in values if type(value) is kind]
        self._queued.setdefault(kind, []).extend(values)
        return None

    def _instances(self, real: type, objs: list[Any]) -> str | None:
        attrs: list[dict[str, Any]] = list(map(vars, objs))
        fields = self._shadows.field_names[real]
        if all(map(fields.issuperset, attrs)):
            names: Iterable[str] = fields
        else:  # extra attributes (Megatron's on Metadata): names must be plain, as in BUILD
            bad = [name for names in map(_bad_names, attrs) for name in names]
            if bad:
                return f"attribute names {bad!r:.200} on {real.__qualname__}"
            names = {name for instance_attrs in attrs for name in instance_attrs}
        for name in names:
            values = list(map(dict.get, attrs, repeat(name)))
            reason = self._queue(values)
            if reason == "token":
                for instance_attrs, value in zip(attrs, values):
                    if type(value) is _Token:
                        instance_attrs[name] = value.value
                reason = self._queue(_without_tokens(values))
            if reason is not None:
                return reason
        deque(map(object.__setattr__, objs, repeat("__class__"), repeat(real)), maxlen=0)
        return None

    def _containers(self, kind: type, objs: list[Any]) -> str | None:
        if kind is dict or kind is OrderedDict:
            reason = self._queue(list(chain.from_iterable(map(dict.keys, objs))))
            if reason == "token":
                return "a dict key that is an enum member or a path"
            values = list(chain.from_iterable(map(dict.values, objs)))
            if reason is None:
                reason = self._queue(values)
            if reason == "token":
                deque(map(_resolve_tokens, objs), maxlen=0)
                reason = self._queue(_without_tokens(values))
            attrs = [vars(obj) for obj in objs if kind is OrderedDict and vars(obj)]
            if reason is None and attrs:  # BUILD set attributes on an OrderedDict
                bad = [name for names in map(_bad_names, attrs) for name in names]
                reason = f"attribute names {bad!r:.200}" if bad else self._containers(dict, attrs)
            return reason
        items = list(chain.from_iterable(objs))
        reason = self._queue(items)
        if reason == "token" and kind is list:
            for obj in objs:
                obj[:] = [item.value if type(item) is _Token else item for item in obj]
            reason = self._queue(_without_tokens(items))
        return "an enum member or a path inside a tuple or set" if reason == "token" else reason


def _extensions_registered() -> bool:
    """Whether copyreg extension codes exist in this process. The C unpickler resolves
    a cached code without ``find_class``, so the fast path must not run then."""
    registry = getattr(copyreg, "_inverted_registry", None)
    cache = getattr(copyreg, "_extension_cache", None)
    return registry is None or cache is None or bool(registry) or bool(cache)


def _load_fast(data: bytes, source: str) -> tuple[object, str | None]:
    """``(result, None)``, or ``(None, why)`` when the checked unpickler must decide.

    Raises:
        UnsafeCheckpointError: the pickle names a global that is not allowed.
    """
    if _extensions_registered():
        return None, "copyreg extension codes are registered in this process"
    allow = _allowlist()
    shadows = _Shadows.create(allow)
    table = {**allow.fast_globals, **shadows.by_name}
    allowed = frozenset(id(shadow) for shadow in shadows.real_of)
    table[_RECONSTRUCTOR_GLOBAL] = _Call(functools.partial(_reconstruct_shadow, allowed))
    py2_names = not (data[:1] == pickle.PROTO and len(data) > 1 and data[1] >= 3)
    unpickler = _FastUnpickler(io.BytesIO(data), source=source, table=table, py2_names=py2_names)
    try:
        result = unpickler.load()
    except (UnsafeCheckpointError, MemoryError):
        raise
    except Exception as exc:  # the checked unpickler says precisely what is wrong
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        changed = shadows.repair()
    if changed is not None:
        return None, f"the pickle changed class {changed}"
    reason = _Adoption(shadows, budget=len(data)).run(result)
    if reason is not None:
        return None, f"the result holds {reason}"
    return result, None


def load_metadata(fileobj: BinaryIO, *, source: str = "<.metadata>") -> Metadata:
    """Read a DCP ``.metadata`` pickle without executing anything from it.

    1. Every global the pickle names must be on the allowlist
       (:func:`allowed_metadata_globals`); Megatron-Core 0.13's ``MCoreSavePlan``
       becomes :class:`LegacyMCoreSavePlan`. Nothing is imported.
    2. Only allowlisted constructors are called, only objects created by this load
       get their state set, and only with plain (non-dunder) attribute names. The fast
       C unpickler reads the file; any file it declines is decided by the checked
       pure-Python one (see the module docstring).
    3. The result must be a ``Metadata``; extra attributes Megatron pickles on it
       (``mcore_data``, ``all_local_plans``) are kept.

    Raises:
        UnsafeCheckpointError: the pickle references or calls something not allowed;
            the message names the global and ``source``.
        CorruptCheckpointError: the bytes are truncated or are not a ``Metadata`` pickle.
    """
    try:
        data = fileobj.read()
    except OSError as exc:
        raise CorruptCheckpointError(f"{source}: cannot read checkpoint metadata ({exc})") from exc
    with gc_paused():
        result, declined = _load_fast(data, source)
        if declined is not None:
            logger.debug("%s: checked unpickling of .metadata (%s)", source, declined)
            result = _load_checked(data, source)
    if not isinstance(result, Metadata):
        raise CorruptCheckpointError(
            f"{source}: expected a pickled torch.distributed.checkpoint Metadata, "
            f"found {_describe(result)}"
        )
    entries = vars(result).get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise CorruptCheckpointError(
            f"{source}: the pickled Metadata has no state_dict_metadata dict, found "
            f"{_describe(entries)}"
        )
    return result


# --------------------------------------------------------------------------- torch.load

_WO_UNSAFE_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_WO_BLOCKED_GLOBAL = re.compile(r"GLOBAL (\S+) whose module (\S+) is blocked")
_WO_REFUSALS = (
    "Trying to call reduce for unrecognized function",
    "Can only ",
    "must be imported to load",
)


def _py3_name(module: str, name: str) -> tuple[str, str]:
    """Python 3 spelling of a global that protocols 0-2 wrote with its Python 2 name."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _global_name(reported: str) -> str:
    # torch drops the "builtins." prefix from the names it reports, and torch.save's
    # protocol 2 writes some stdlib globals under Python 2 names (subprocess -> commands).
    module, _, name = reported.rpartition(".")
    return ".".join(_py3_name(module or "builtins", name))


def _unsafe_load_error(message: str, source: str) -> UnsafeCheckpointError | None:
    """The error for a weights_only refusal, or None if ``message`` is not one."""
    blocked = _WO_BLOCKED_GLOBAL.search(message)
    if blocked:
        name = _global_name(blocked.group(1))
        return UnsafeCheckpointError(
            f"{source}: refusing to load: the pickle references '{name}', from module "
            f"'{blocked.group(2)}', which weights_only loading never allows (unpickling it "
            "could execute code). Only trusted=True loads it; pass it only if you trust "
            "the file."
        )
    unsafe = _WO_UNSAFE_GLOBAL.search(message)
    if unsafe and not unsafe.group(1).rsplit(".", 1)[-1][:1].isupper():
        # Not named like a class (e.g. builtins.exec): never suggest allowing it.
        name = _global_name(unsafe.group(1))
        return UnsafeCheckpointError(
            f"{source}: refusing to load: the pickle references '{name}', a function that "
            "weights_only loading does not allow (unpickling it could execute code). Only "
            "trusted=True loads it; pass it only if you trust the file."
        )
    if unsafe:
        name = _global_name(unsafe.group(1))
        return UnsafeCheckpointError(
            f"{source}: refusing to load: the pickle references '{name}', which is not "
            "allowed with weights_only loading (unpickling arbitrary types can execute "
            f"code). If you trust this file, pass allowed_types=[{name}] to allow just "
            "that type, or trusted=True to load it without restrictions."
        )
    reason = next(
        (line for line in message.splitlines() if any(p in line for p in _WO_REFUSALS)), None
    )
    if reason is not None:
        return UnsafeCheckpointError(
            f"{source}: refusing to load with weights_only: {reason.strip()}. If you trust "
            "this file, pass the types it needs in allowed_types=[...], or trusted=True."
        )
    return None


def _new_safe_globals(
    allowed_types: Sequence[type],
) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """The ``allowed_types`` that torch does not already allow.

    Leaving out those the user registered keeps ``safe_globals.__exit__`` from
    removing them again.
    """
    for allowed in allowed_types:
        if not isinstance(allowed, type):
            raise TypeError(f"allowed_types must hold classes, found {allowed!r}")
    registered = torch.serialization.get_safe_globals()
    return [t for t in dict.fromkeys(allowed_types) if t not in registered]


def safe_torch_load(
    data: bytes | bytearray | memoryview | BinaryIO,
    *,
    source: str,
    trusted: bool = False,
    allowed_types: Sequence[type] = (),
) -> Any:
    """Load a ``torch.save`` payload (``common.pt``, ShardedObject bytes) onto the CPU.

    1. Unless ``trusted``, load with ``weights_only=True``: tensors, containers and
       primitives only, plus the classes in ``allowed_types`` for this call (torch's
       ``safe_globals`` context; note that torch keeps that list process-wide while
       the call runs).
    2. With ``trusted=True``, load with plain pickle: only for files you wrote.

    Raises:
        UnsafeCheckpointError: the payload needs a type that is not allowed; the
            message names it, names ``source`` and says how to allow it.
        CorruptCheckpointError: the payload is truncated or not a ``torch.save`` file.
    """
    stream: BinaryIO = (
        io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
    )
    if trusted:
        return _torch_load(stream, source, weights_only=False)
    with torch.serialization.safe_globals(_new_safe_globals(allowed_types)):
        return _torch_load(stream, source, weights_only=True)


def _torch_load(stream: BinaryIO, source: str, *, weights_only: bool) -> Any:
    try:
        return torch.load(stream, map_location="cpu", weights_only=weights_only)
    except MemoryError:
        raise
    except pickle.UnpicklingError as exc:
        unsafe = _unsafe_load_error(str(exc), source) if weights_only else None
        if unsafe is not None:
            raise unsafe from None
        raise _corrupt(source, exc) from exc
    except Exception as exc:  # torch raises RuntimeError, EOFError, ... for bad bytes
        raise _corrupt(source, exc) from exc


def _corrupt(source: str, exc: BaseException) -> CorruptCheckpointError:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CorruptCheckpointError(
        f"{source}: cannot load torch.save payload, it is truncated or corrupt "
        f"({type(exc).__name__}: {detail})"
    )
