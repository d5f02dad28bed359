"""Protocol-4 pickles written opcode by opcode, for objects whose shape is known.

``pickle.dumps`` of a large tree of small objects keeps every object it writes in its
memo until the end (and, for ``torch.Size``, the tuples its ``__reduce__`` makes), and
reads each instance's ``__dict__``, which CPython then creates and keeps (instances
store their attributes without one until then). :class:`PickleWriter` writes the ops of
a known object shape from its fields instead (the caller gives a writer per class,
see :mod:`.metadata_pickle`), memoizing only what is shared: classes, field names, one
``torch.Size`` per object, file names. Each shared value is written once where first
met, memoized and dropped from the stack (``MEMOIZE``, ``POP``), then pushed by its
memo index wherever it is used, so the ops of an object depend only on its own values
and the ids of its shared parts. Values of no known shape are pickled by pickle itself
without a memo (no memo index to clash with) and spliced in. The output is framed
(protocol-4 frames of about 64 KiB) and unpickles, with any unpickler, as the same
objects would from ``pickle.dumps``; :class:`Unsupported` tells the caller to fall back
to it.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable, Iterable
from typing import Any

import torch

PROTOCOL = 4
_FRAME_TARGET = 64 * 1024  # bytes per frame (pickle's own target)
_BATCH = 1000  # dict items per SETITEMS / list items per APPENDS, as pickle does
_MAX_DEPTH = 64  # nesting of plain containers before falling back to pickle

# Protocol opcodes (see pickletools).
MARK, _STOP, NONE, _TRUE, _FALSE = b"(", b".", b"N", b"\x88", b"\x89"
EMPTY_DICT, EMPTY_LIST, _EMPTY_TUPLE = b"}", b"]", b")"
_SETITEMS, _APPEND, _APPENDS, _TUPLE = b"u", b"a", b"e", b"t"
_TUPLES = (_EMPTY_TUPLE, b"\x85", b"\x86", b"\x87")  # TUPLE1..3 after the items
NEWOBJ_NO_ARGS, _BUILD, _REDUCE = b")\x81", b"b", b"R"
_STACK_GLOBAL, _MEMOIZE, _FRAME, _POP = b"\x93", b"\x94", b"\x95", b"0"
OBJ_END = b"ub"  # SETITEMS of an instance's state dict, then BUILD
_BINFLOAT = b"G"


class Unsupported(Exception):
    """Something a :class:`PickleWriter` does not write: pickle the whole object."""


def str_op(text: str) -> bytes:
    """The opcode (protocol 4) that pushes ``text``."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) < 256:
        return b"\x8c" + bytes((len(data),)) + data  # SHORT_BINUNICODE
    if len(data) < 2**32:
        return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE
    raise Unsupported("a string over 4 GiB")


def int_op(value: int) -> bytes:
    """The opcode that pushes the int ``value`` (the shortest pickle itself uses)."""
    if 0 <= value < 256:
        return b"K" + bytes((value,))  # BININT1
    if 0 <= value < 65536:
        return b"M" + value.to_bytes(2, "little")  # BININT2
    if -(2**31) <= value < 2**31:
        return b"J" + value.to_bytes(4, "little", signed=True)  # BININT
    data = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
    if len(data) < 256:
        return b"\x8a" + bytes((len(data),)) + data  # LONG1
    raise Unsupported("an int of over 255 bytes")


class PickleWriter:
    """Writes one pickle; see the module docstring. One per dump.

    ``writers`` maps a class to the function that returns the ops pushing one of its
    instances (given this writer); :meth:`value` uses them before its own cases.
    """

    def __init__(self, writers: dict[type, Callable[[PickleWriter, Any], bytes]]) -> None:
        self.writers = writers
        self.out: list[bytes] = [b"\x80\x04"]  # PROTO 4, then frames
        self.frame: list[bytes] = []
        self.frame_bytes = 0
        self.memo_count = 0
        self.refs: dict[Any, bytes] = {}  # shared value's key -> the op that pushes it
        self.keep: list[Any] = []  # objects whose ids are keys of refs

    # -- output

    def emit(self, data: bytes) -> None:
        self.frame.append(data)
        self.frame_bytes += len(data)

    def end_frame(self) -> None:
        """Close the current frame if it reached its target size (between items only)."""
        if self.frame_bytes >= _FRAME_TARGET:
            self._flush()

    def _flush(self) -> None:
        body = b"".join(self.frame)
        self.out.append(_FRAME + len(body).to_bytes(8, "little") + body)
        self.frame, self.frame_bytes = [], 0

    def result(self) -> bytes:
        self.emit(_STOP)
        self._flush()
        return b"".join(self.out)

    # -- shared values: written once, then pushed by memo index

    def ref(self, key: Any, write: Callable[[], None]) -> bytes:
        """The op that pushes the value known by ``key``; the first time, ``write``
        pushes it here and it is memoized and popped (so any position is fine)."""
        got = self.refs.get(key)
        if got is None:
            write()
            index = self.memo_count
            self.memo_count += 1
            got = b"h" + bytes((index,)) if index < 256 else b"j" + index.to_bytes(4, "little")
            self.emit(_MEMOIZE + _POP)
            self.refs[key] = got
        return got

    def cls(self, cls: type) -> bytes:
        def write() -> None:
            self.emit(str_op(cls.__module__) + str_op(cls.__qualname__) + _STACK_GLOBAL)

        return self.ref(("class", cls), write)

    def name(self, text: str) -> bytes:
        return self.ref(("str", text), lambda: self.emit(str_op(text)))

    def path(self, path: str) -> bytes:
        """A file name: one string, however many items lie in the file."""
        return self.ref(("path", path), lambda: self.emit(str_op(path)))

    def size(self, size: torch.Size) -> bytes:
        """A ``torch.Size``: one memo entry per object (shared shapes stay shared)."""
        return self._object(size, lambda: self.cls(torch.Size) + ints(size) + b"\x85" + _REDUCE)

    def pickled(self, value: Any) -> bytes:
        """``value`` as pickle writes it, without a memo (so no memo indices to clash
        with this writer's), shared when the same object comes again."""
        return self._object(value, lambda: _pickle_body(value))

    def _object(self, obj: Any, ops: Callable[[], bytes]) -> bytes:
        """The op that pushes ``obj`` (by identity), written by ``ops`` the first time."""
        got = self.refs.get(id(obj))
        if got is None:
            got = self.ref(id(obj), lambda: self.emit(ops()))
            self.keep.append(obj)  # alive while its id is a key
        return got

    def head(self, cls: type, first: str) -> bytes:
        """The ops that make an instance of ``cls`` and open its state at ``first``."""
        return self.cls(cls) + NEWOBJ_NO_ARGS + EMPTY_DICT + MARK + self.name(first)

    def instance(self, cls: type, fields: Iterable[tuple[str, bytes]]) -> bytes:
        """The ops that make an instance of ``cls`` with ``fields`` (name, ops of the
        value) as its state: NEWOBJ of no arguments, then BUILD."""
        state = b"".join(self.name(key) + ops for key, ops in fields)
        return self.cls(cls) + NEWOBJ_NO_ARGS + EMPTY_DICT + MARK + state + OBJ_END

    # -- values

    def value(self, value: Any, depth: int = 1) -> bytes:
        """The ops that push ``value``: known shapes here, the rest by pickle."""
        kind = type(value)
        write = self.writers.get(kind)
        if write is not None:
            return write(self, value)
        if value is None:
            return NONE
        if kind is bool:
            return _TRUE if value else _FALSE
        if kind is int:
            return int_op(value)
        if kind is str:
            return str_op(value)
        if kind is float:
            return _BINFLOAT + struct.pack(">d", value)
        if kind is torch.Size:
            return self.size(value)
        if depth > _MAX_DEPTH:
            raise Unsupported("nesting too deep")
        if kind is tuple:
            ops = b"".join(self.value(v, depth + 1) for v in value)
            return ops + _TUPLES[len(value)] if len(value) < 4 else MARK + ops + _TUPLE
        if kind is list:
            return EMPTY_LIST + self.items([self.value(v, depth + 1) for v in value])
        if kind is dict:
            return EMPTY_DICT + b"".join(
                MARK
                + b"".join(self.value(k, depth + 1) + self.value(v, depth + 1) for k, v in batch)
                + _SETITEMS
                for batch in _batches(list(value.items()))
            )
        return self.pickled(value)

    @staticmethod
    def items(ops: list[bytes]) -> bytes:
        """Ops that append the pushed ``ops`` to the list on top of the stack."""
        if len(ops) == 1:
            return ops[0] + _APPEND
        return b"".join(MARK + b"".join(batch) + _APPENDS for batch in _batches(ops))

    def big_dict(self, pairs: Any, count: int) -> None:
        """A dict of ``count`` items from ``pairs`` (an iterator of the ops of a key
        and its value), written straight into frames, a batch at a time."""
        self.emit(EMPTY_DICT)
        for _ in range(0, count, _BATCH):
            self.emit(MARK)
            for _, ops in zip(range(_BATCH), pairs):
                self.emit(ops)
            self.emit(_SETITEMS)
            self.end_frame()


def _batches(items: list[Any]) -> list[list[Any]]:
    return [items[i : i + _BATCH] for i in range(0, len(items), _BATCH)]


def ints(values: Any) -> bytes:
    """The ops that push a tuple of ints."""
    ops = b"".join(map(int_op, values))
    if len(values) < 4:
        return ops + _TUPLES[len(values)]
    return MARK + ops + _TUPLE


def _pickle_body(value: Any) -> bytes:
    """The opcodes of ``value``'s protocol-4 pickle made without a memo (no PUT or
    MEMOIZE: nothing to clash with), without PROTO, FRAME and STOP."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=PROTOCOL)
    pickler.fast = True
    try:
        pickler.dump(value)
    except (pickle.PicklingError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise Unsupported(f"{type(value).__name__}: {exc}") from None
    blob = buffer.getvalue()
    if blob[:2] != b"\x80\x04" or blob[-1:] != _STOP:
        raise Unsupported("not a protocol-4 pickle")
    if blob[2:3] != _FRAME:  # pickle frames all but the tiniest bodies
        return blob[2:-1]
    if int.from_bytes(blob[3:11], "little") != len(blob) - 11:
        raise Unsupported("a pickle of more than one frame")
    return blob[11:-1]


__all__ = [
    "EMPTY_DICT",
    "EMPTY_LIST",
    "MARK",
    "NEWOBJ_NO_ARGS",
    "NONE",
    "OBJ_END",
    "PROTOCOL",
    "PickleWriter",
    "Unsupported",
    "int_op",
    "ints",
    "str_op",
]
