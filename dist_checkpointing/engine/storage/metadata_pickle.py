"""``.metadata``'s pickle written straight from the objects, without ``pickle.dumps``.

``pickle.dumps(metadata)`` of 100,000 entries holds about 93 MiB while it runs (its memo
keeps every object it wrote, and the tuples ``torch.Size.__reduce__`` makes for each
shape) and leaves about 50 MiB behind: it reads each dataclass instance's ``__dict__``,
which CPython creates on first access and keeps (instances store their attributes
without one until then). :func:`dumps` writes the same opcodes for the classes of a
DCP ``Metadata`` from their fields, memoizing only what is shared (classes, field
names, one ``torch.Size`` object per shape, file names), in protocol-4 frames; it holds
little beyond the bytes it returns. Each shared object is written once where first met
and dropped from the stack (``MEMOIZE``, ``POP``), then pushed by its memo index
wherever it is used, so the bytes of an entry depend only on its own values and the
ids of its shared parts: entries alike (one chunk, shared shapes) are encoded once.

The result is not byte-identical to ``pickle.dumps`` but unpickles, with any
unpickler, to equal objects: the same classes built the same way (``NEWOBJ`` and
``BUILD`` with the instance's fields, ``torch.Size`` by ``REDUCE``). A property test
compares both unpickled results. Values outside the known shapes (``planner_data``,
``TensorProperties`` and anything unusual) are pickled by pickle itself, without a memo,
and spliced in; anything pickle would not write the same way, a class whose pickling
this torch changed, or a value too large for one frame makes :func:`dumps` fall back
to ``pickle.dumps``.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ..._torch_compat import StorageInfo

PROTOCOL = 4
_FRAME_TARGET = 64 * 1024  # bytes per frame (pickle's own target)
_BATCH = 1000  # dict items per SETITEMS / list items per APPENDS, as pickle does
_MAX_DEPTH = 64  # nesting of plain containers before falling back to pickle

# Protocol opcodes (see pickletools).
_MARK, _STOP, _NONE, _TRUE, _FALSE = b"(", b".", b"N", b"\x88", b"\x89"
_EMPTY_DICT, _EMPTY_LIST, _EMPTY_TUPLE = b"}", b"]", b")"
_SETITEMS, _APPEND, _APPENDS, _TUPLE = b"u", b"a", b"e", b"t"
_TUPLES = (_EMPTY_TUPLE, b"\x85", b"\x86", b"\x87")  # TUPLE1..3 after the items
_NEWOBJ_NO_ARGS, _BUILD, _REDUCE = b")\x81", b"b", b"R"
_STACK_GLOBAL, _MEMOIZE, _FRAME, _POP = b"\x93", b"\x94", b"\x95", b"0"
_OBJ_END = b"ub"  # SETITEMS of the state dict, BUILD
_MAX_CACHED = 4096  # encodings of alike entries kept during one dump
_BINFLOAT = b"G"


class Unsupported(Exception):
    """Something :func:`dumps` does not write itself: pickle the whole object."""


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


_DEFAULT_GETSTATE = getattr(object, "__getstate__", None)  # Python 3.11+


def _default_pickling(cls: type) -> bool:
    """Pickle writes instances of ``cls`` as NEWOBJ of no arguments and BUILD of their
    ``__dict__``: no reduce, state or slots of their own."""
    return (
        dataclasses.is_dataclass(cls)
        and cls.__reduce_ex__ is object.__reduce_ex__
        and cls.__reduce__ is object.__reduce__
        and getattr(cls, "__getstate__", _DEFAULT_GETSTATE) is _DEFAULT_GETSTATE
        and not hasattr(cls, "__setstate__")
        and "__slots__" not in vars(cls)
    )


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# Torch versions where these classes pickle some other way get pickle.dumps.
_PLAIN = (
    TensorStorageMetadata,
    ChunkStorageMetadata,
    BytesStorageMetadata,
    MetadataIndex,
    StorageMeta,
    Metadata,
)
_STORAGE_INFO_FIELDS = _names(StorageInfo)


def _storage_info_pickling() -> bool | None:
    """How pickle writes a ``StorageInfo``: its fields (False), its fields that are not
    None (True, torch 2.4 on), or some other way (None: pickle.dumps throughout)."""
    if not dataclasses.is_dataclass(StorageInfo) or _STORAGE_INFO_FIELDS[:3] != (
        "relative_path",
        "offset",
        "length",
    ):
        return None
    state = StorageInfo("f", 0, 1).__reduce_ex__(PROTOCOL)[2]
    if state == dict(zip(_STORAGE_INFO_FIELDS, ("f", 0, 1, None, None, None, None))):
        return False
    return True if state == {"relative_path": "f", "offset": 0, "length": 1} else None


_STORAGE_INFO_DROPS_NONE = bool(_storage_info_pickling())
_SUPPORTED = all(map(_default_pickling, _PLAIN)) and _storage_info_pickling() is not None


class _Writer:
    """Writes one pickle; see the module docstring. One per dump."""

    def __init__(self) -> None:
        self.out: list[bytes] = [b"\x80\x04"]  # PROTO 4, then frames
        self.frame: list[bytes] = []
        self.frame_bytes = 0
        self.memo_count = 0
        self.refs: dict[Any, bytes] = {}  # shared value's key -> the op that pushes it
        self.keep: list[Any] = []  # objects whose ids are keys of refs
        self.paths: dict[str, bytes] = {}  # file names (a few, each used by many items)

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
        got = self.paths.get(path)
        if got is None:
            got = self.paths[path] = self.ref(("path", path), lambda: self.emit(str_op(path)))
        return got

    def size(self, size: torch.Size) -> bytes:
        """A ``torch.Size``: one memo entry per object (shared shapes stay shared)."""
        got = self.refs.get(id(size))
        if got is None:
            reduce = self.cls(torch.Size)  # before the REDUCE's own bytes
            got = self.ref(id(size), lambda: self.emit(reduce + ints(size) + b"\x85" + _REDUCE))
            self.keep.append(size)
        return got

    def pickled(self, value: Any) -> bytes:
        """``value`` as pickle writes it, without a memo (so no memo indices to clash
        with this writer's), shared when the same object comes again."""
        got = self.refs.get(id(value))
        if got is None:
            got = self.ref(id(value), lambda: self.emit(_pickle_body(value)))
            self.keep.append(value)
        return got

    def head(self, cls: type, first: str) -> bytes:
        """The ops that make an instance of ``cls`` and open its state at ``first``."""
        return self.cls(cls) + _NEWOBJ_NO_ARGS + _EMPTY_DICT + _MARK + self.name(first)

    # -- values

    def value(self, value: Any, depth: int = 1) -> bytes:
        """The ops that push ``value``: known shapes here, the rest by pickle."""
        kind = type(value)
        write = _WRITERS.get(kind)
        if write is not None:
            return write(self, value)
        if value is None:
            return _NONE
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
            return ops + _TUPLES[len(value)] if len(value) < 4 else _MARK + ops + _TUPLE
        if kind is list:
            return _EMPTY_LIST + self.items([self.value(v, depth + 1) for v in value])
        if kind is dict:
            return _EMPTY_DICT + b"".join(
                _MARK
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
        return b"".join(_MARK + b"".join(batch) + _APPENDS for batch in _batches(ops))

    def big_dict(self, pairs: Any, count: int) -> None:
        """A dict of ``count`` items from ``pairs`` (an iterator of the ops of a key
        and its value), written straight into frames, a batch at a time."""
        self.emit(_EMPTY_DICT)
        for _ in range(0, count, _BATCH):
            self.emit(_MARK)
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
    return _MARK + ops + _TUPLE


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


# -- the classes of a Metadata: each returns the ops that push one instance


def _chunk(w: _Writer, chunk: ChunkStorageMetadata) -> bytes:
    return (
        w.head(ChunkStorageMetadata, "offsets")
        + w.value(chunk.offsets)
        + w.name("sizes")
        + w.value(chunk.sizes)
        + _OBJ_END
    )


def _tensor(w: _Writer, md: TensorStorageMetadata) -> bytes:
    chunks = [_chunk(w, c) if type(c) is ChunkStorageMetadata else w.value(c) for c in md.chunks]
    return (
        w.head(TensorStorageMetadata, "properties")
        + w.pickled(md.properties)
        + w.name("size")
        + w.value(md.size)
        + w.name("chunks")
        + _EMPTY_LIST
        + w.items(chunks)
        + _OBJ_END
    )


def _bytes_entry(w: _Writer, md: BytesStorageMetadata) -> bytes:
    return w.cls(BytesStorageMetadata) + _NEWOBJ_NO_ARGS  # no state: no BUILD


def _index(w: _Writer, index: MetadataIndex) -> bytes:
    # In the order its __init__ sets them; no offset attribute where it is None.
    at = b"" if index.offset is None else w.name("offset") + w.value(index.offset)
    head = w.head(MetadataIndex, "fqn")
    return head + w.value(index.fqn) + w.name("index") + w.value(index.index) + at + _OBJ_END


def _storage_info(w: _Writer, info: Any) -> bytes:
    ops = [w.cls(StorageInfo), _NEWOBJ_NO_ARGS, _EMPTY_DICT, _MARK]
    for key in _STORAGE_INFO_FIELDS:
        value = getattr(info, key)
        if value is None and _STORAGE_INFO_DROPS_NONE:
            continue
        ops.append(w.name(key))
        if key == "relative_path" and type(value) is str:
            ops.append(w.path(value))
        else:
            ops.append(w.value(value))
    ops.append(_OBJ_END)
    return b"".join(ops)


def _storage_meta(w: _Writer, meta: StorageMeta) -> bytes:
    ops = [w.cls(StorageMeta), _NEWOBJ_NO_ARGS, _EMPTY_DICT, _MARK]
    for key in _names(StorageMeta):
        ops += (w.name(key), w.value(getattr(meta, key)))
    return b"".join([*ops, _OBJ_END])


_WRITERS: dict[type, Callable[[_Writer, Any], bytes]] = {
    TensorStorageMetadata: _tensor,
    ChunkStorageMetadata: _chunk,
    BytesStorageMetadata: _bytes_entry,
    MetadataIndex: _index,
    StorageInfo: _storage_info,
    StorageMeta: _storage_meta,
}


def _entries(w: _Writer, entries: dict[str, Any]) -> Any:
    """The ops of each (key, entry) of ``state_dict_metadata``; a tensor of one chunk
    whose parts were all seen before costs one lookup."""
    cache: dict[tuple[int, ...], bytes] = {}
    for key, md in entries.items():
        if type(md) is TensorStorageMetadata and len(md.chunks) == 1:
            chunk = md.chunks[0]
            alike = (id(md.properties), id(md.size), id(chunk.offsets), id(chunk.sizes))
            ops = cache.get(alike)
            if ops is None:
                ops = _tensor(w, md)
                if len(cache) < _MAX_CACHED and _all_kept(w, md, chunk):
                    cache[alike] = ops
            yield (str_op(key) if type(key) is str else w.value(key)) + ops
        else:
            yield w.value(key) + w.value(md)


def _all_kept(w: _Writer, md: TensorStorageMetadata, chunk: Any) -> bool:
    """Every part of the entry is a shared object this writer keeps alive (so an id
    seen again is the same object)."""
    shared = (md.properties, md.size, chunk.offsets, chunk.sizes)
    return type(chunk) is ChunkStorageMetadata and all(id(p) in w.refs for p in shared)


def _storage(w: _Writer, storage: dict[Any, Any]) -> Any:
    """The ops of each (index, storage info) of ``storage_data``: the usual item (a
    string key, a shared or no offset, no transforms) from a few precomputed pieces."""
    index_head, offset, hint = w.head(MetadataIndex, "fqn"), w.name("offset"), w.name("index")
    info_head, length = w.head(StorageInfo, "relative_path"), w.name("length")
    usual = _STORAGE_INFO_FIELDS[:3] == ("relative_path", "offset", "length")
    extra = _STORAGE_INFO_FIELDS[3:] if _STORAGE_INFO_DROPS_NONE else ("-",)
    shapes, paths = w.refs, w.paths
    for index, info in storage.items():
        at, path = index.offset, getattr(info, "relative_path", None)
        at_op = b"" if at is None else shapes.get(id(at))
        path_op = paths.get(path) if type(path) is str else None
        if (
            type(index) is not MetadataIndex
            or type(info) is not StorageInfo
            or type(index.fqn) is not str
            or at_op is None
            or path_op is None
            or not usual
            or any(getattr(info, k, "-") is not None for k in extra)
        ):
            if type(info) is StorageInfo and type(path) is str:
                w.path(path)
            yield w.value(index) + w.value(info)
            continue
        hint_op = _NONE if index.index is None else w.value(index.index)
        yield b"".join(
            (
                index_head,
                str_op(index.fqn),
                hint,
                hint_op,
                offset if at_op else b"",
                at_op,
                _OBJ_END,
                info_head,
                path_op,
                offset,
                w.value(info.offset),
                length,
                w.value(info.length),
                _OBJ_END,
            )
        )


def _mcore(w: _Writer, mcore: dict[Any, Any]) -> Any:
    """The ops of each item of Megatron-Core's ``mcore_data`` (mostly ``{}``)."""
    for key, extra in mcore.items():
        key_op = str_op(key) if type(key) is str else w.value(key)
        yield key_op + (_EMPTY_DICT if type(extra) is dict and not extra else w.value(extra))


def _metadata(w: _Writer, metadata: Metadata) -> None:
    w.emit(w.cls(Metadata) + _NEWOBJ_NO_ARGS + _EMPTY_DICT + _MARK)
    for key, value in vars(metadata).items():
        w.emit(w.name(key))
        if key == "state_dict_metadata" and type(value) is dict:
            w.big_dict(_entries(w, value), len(value))
        elif key == "storage_data" and type(value) is dict:
            w.big_dict(_storage(w, value), len(value))
        elif key == "mcore_data" and type(value) is dict:
            w.big_dict(_mcore(w, value), len(value))
        else:
            w.emit(w.value(value))
    w.emit(_OBJ_END)


def dumps(metadata: Metadata) -> bytes:
    """``metadata`` pickled (protocol 4), equal once unpickled to
    ``pickle.dumps(metadata, protocol=4)``; see the module docstring."""
    if not _SUPPORTED or type(metadata) is not Metadata:
        return pickle.dumps(metadata, protocol=PROTOCOL)
    writer = _Writer()
    try:
        _metadata(writer, metadata)
        return writer.result()
    except (Unsupported, RecursionError):
        return pickle.dumps(metadata, protocol=PROTOCOL)


__all__ = ["PROTOCOL", "Unsupported", "dumps", "int_op", "str_op"]
