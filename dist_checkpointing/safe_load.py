"""Loading checkpoint files without executing code stored in them.

A checkpoint holds two kinds of pickles, and both are read here:

* ``.metadata``: a pickled :class:`torch.distributed.checkpoint.metadata.Metadata`.
  torch's own reader unpickles it with plain :mod:`pickle`, which runs any callable
  the file names. :func:`load_metadata` reads it with a restricted unpickler that
  admits an explicit allowlist of plain data types (see :func:`allowed_metadata_globals`)
  and restores Megatron-Core 0.13's ``MCoreSavePlan`` as :class:`LegacyMCoreSavePlan`
  without importing Megatron.
* ``torch.save`` payloads (``common.pt``, ShardedObject bytes): :func:`safe_torch_load`
  uses ``torch.load(weights_only=True)`` unless the caller trusts the file.

Example:
    >>> import io, pickle
    >>> from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
    >>> raw = pickle.dumps(Metadata({"obj": BytesStorageMetadata()}))
    >>> load_metadata(io.BytesIO(raw), source="ckpt/.metadata").state_dict_metadata
    {'obj': BytesStorageMetadata()}
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import functools
import io
import logging
import os
import pathlib
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
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

    The unpickler handles that name itself, see ``_RestrictedUnpickler._reconstruct``.
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


@dataclasses.dataclass(frozen=True)
class _Allowlist:
    """The objects a metadata pickle may reference, and what it may do with them."""

    # "module.name" -> the object GLOBAL / STACK_GLOBAL pushes.
    globals: Mapping[str, object]
    # id(cls) of classes that NEWOBJ may create (without arguments) and BUILD may fill.
    state_types: frozenset[int]
    # id(callable) -> (min, max) number of positional arguments REDUCE may pass.
    callables: Mapping[int, tuple[int, int]]


@functools.lru_cache(maxsize=1)
def _allowlist() -> _Allowlist:
    found: dict[str, object] = {}
    state_types: set[int] = set()
    callables: dict[int, tuple[int, int]] = {}
    for qualname, cls in _state_classes().items():
        found[qualname] = cls
        state_types.add(id(cls))
    for qualname, enum_cls in _enum_classes().items():
        found[qualname] = enum_cls
        callables[id(enum_cls)] = (1, 1)
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
    state_types.add(id(OrderedDict))
    for qualname, path_cls in _path_classes().items():
        found[qualname] = make_path = _path_factory(path_cls)
        callables[id(make_path)] = (0, _MAX_PATH_PARTS)
    # Only ever the ``base`` argument of copyreg._reconstructor; never called or built.
    found["builtins.object"] = object
    # dtypes are values (pickled by name), never called.
    for attr, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            found[f"torch.{attr}"] = value
    return _Allowlist(MappingProxyType(found), frozenset(state_types), MappingProxyType(callables))


def allowed_metadata_globals() -> tuple[str, ...]:
    """Every ``module.name`` that :func:`load_metadata` accepts, sorted."""
    return tuple(sorted(_allowlist().globals))


def is_allowed_metadata_global(qualified_name: str) -> bool:
    """Whether a ``.metadata`` pickle may reference the global ``module.name``."""
    return qualified_name in _allowlist().globals


# --------------------------------------------------------------------------- unpickler


def _is_dunder(key: object) -> bool:
    return isinstance(key, str) and key.startswith("__") and key.endswith("__")


class _RestrictedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every opcode that resolves or calls objects gated.

    The pure-Python implementation is used because only it lets each opcode be checked:
    the C unpickler would, e.g., let BUILD set attributes on an allowlisted *class*.
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
        return UnsafeCheckpointError(
            f"{self._source}: refusing to unpickle checkpoint metadata: {what}. Only plain "
            "torch.distributed.checkpoint metadata types are allowed (nothing from the file "
            "is executed); the file is malicious or not a DCP .metadata file"
        )

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:
            # Protocols 0-2 write Python 2 names (__builtin__, copy_reg): rename, as pickle
            # does, by a fixed table; nothing is imported.
            module, name = _py3_name(module, name)
        qualname = f"{module}.{name}"
        try:
            return self._allow.globals[qualname]
        except KeyError:
            raise self._refuse(f"global '{qualname}' is not allowed") from None

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse(f"persistent id {pid!r} is not allowed")

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


def load_metadata(fileobj: BinaryIO, *, source: str = "<.metadata>") -> Metadata:
    """Read a DCP ``.metadata`` pickle without executing anything from it.

    1. Every global the pickle names must be on the allowlist
       (:func:`allowed_metadata_globals`); Megatron-Core 0.13's ``MCoreSavePlan``
       becomes :class:`LegacyMCoreSavePlan`. Nothing is imported.
    2. Only allowlisted constructors are called, only allowlisted instances get
       their state set, and container opcodes only touch real containers.
    3. The result must be a ``Metadata``; extra attributes Megatron pickles on it
       (``mcore_data``, ``all_local_plans``) are kept.

    Raises:
        UnsafeCheckpointError: the pickle references or calls something not allowed;
            the message names the global and ``source``.
        CorruptCheckpointError: the bytes are truncated or are not a ``Metadata`` pickle.
    """
    unpickler = _RestrictedUnpickler(fileobj, source)
    try:
        result = unpickler.load()
    except (UnsafeCheckpointError, MemoryError):
        raise
    except Exception as exc:  # any other failure means the bytes are not valid metadata
        raise CorruptCheckpointError(
            f"{source}: checkpoint metadata is truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(result, Metadata) or not isinstance(result.state_dict_metadata, dict):
        raise CorruptCheckpointError(
            f"{source}: expected a pickled torch.distributed.checkpoint Metadata, "
            f"found {_describe(result)}"
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
