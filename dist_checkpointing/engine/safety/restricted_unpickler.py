"""The checked unpickler: pickle's pure-Python unpickler with every opcode that
creates, calls or mutates objects gated by the allowlist.

It decides every ``.metadata`` file the fast unpickler declines and gives the precise
refusal message.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, BinaryIO, cast

from dist_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError

from .allowlist import (
    _allowlist,
    _find_allowed,
    _is_dunder,
    _py3_name,
    _reconstruct_placeholder,
    _refusal,
)
from .bounded import short_repr


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
        raise self._refuse(f"persistent id {short_repr(pid)} is not allowed")

    def _call(self, func: Any, args: Any) -> Any:
        arity = self._allow.callables.get(id(func))
        if arity is None:
            raise self._refuse(f"calling {_describe(func)} is not allowed")
        if type(args) is not tuple or not arity[0] <= len(args) <= arity[1]:
            raise self._refuse(f"unexpected arguments for {_describe(func)}: {short_repr(args)}")
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
            raise self._refuse(f"attribute names {short_repr(bad)} for {_describe(inst)}")
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
            f"{source}: checkpoint metadata is truncated or corrupt "
            f"({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc
