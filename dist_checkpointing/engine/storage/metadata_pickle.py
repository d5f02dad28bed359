"""``.metadata``'s pickle written straight from the objects, without ``pickle.dumps``.

``pickle.dumps(metadata)`` of 100,000 entries holds about 93 MiB while it runs and
leaves about 50 MiB behind (see :mod:`.pickle_writer`). :func:`dumps` writes the same
objects with a :class:`.pickle_writer.PickleWriter`, from the fields of the classes of a
DCP ``Metadata``; it holds little beyond the bytes it returns, and entries alike (one
chunk, shared shapes) are encoded once.

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
import pickle
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ..._torch_compat import StorageInfo
from .pickle_writer import (
    EMPTY_DICT,
    EMPTY_LIST,
    MARK,
    NEWOBJ_NO_ARGS,
    NONE,
    OBJ_END,
    PROTOCOL,
    PickleWriter,
    Unsupported,
    str_op,
)

_MAX_CACHED = 4096  # encodings of alike entries kept during one dump

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


# -- the classes of a Metadata: each returns the ops that push one instance


def _chunk(w: PickleWriter, chunk: ChunkStorageMetadata) -> bytes:
    fields = (("offsets", w.value(chunk.offsets)), ("sizes", w.value(chunk.sizes)))
    return w.instance(ChunkStorageMetadata, fields)


def _tensor(w: PickleWriter, md: TensorStorageMetadata) -> bytes:
    chunks = EMPTY_LIST + w.items([w.value(c) for c in md.chunks])
    fields = (("properties", w.pickled(md.properties)), ("size", w.value(md.size)))
    return w.instance(TensorStorageMetadata, (*fields, ("chunks", chunks)))


def _bytes_entry(w: PickleWriter, md: BytesStorageMetadata) -> bytes:
    return w.cls(BytesStorageMetadata) + NEWOBJ_NO_ARGS  # no state: no BUILD


def _index(w: PickleWriter, index: MetadataIndex) -> bytes:
    # In the order its __init__ sets them; no offset attribute where it is None.
    fields = [("fqn", w.value(index.fqn)), ("index", w.value(index.index))]
    if index.offset is not None:
        fields.append(("offset", w.value(index.offset)))
    return w.instance(MetadataIndex, fields)


def _storage_info(w: PickleWriter, info: Any) -> bytes:
    fields = []
    for key in _STORAGE_INFO_FIELDS:
        value = getattr(info, key)
        if value is None and _STORAGE_INFO_DROPS_NONE:
            continue
        ops = w.path(value) if key == "relative_path" and type(value) is str else w.value(value)
        fields.append((key, ops))
    return w.instance(StorageInfo, fields)


def _storage_meta(w: PickleWriter, meta: StorageMeta) -> bytes:
    return w.instance(StorageMeta, [(k, w.value(getattr(meta, k))) for k in _names(StorageMeta)])


_WRITERS: dict[type, Callable[[PickleWriter, Any], bytes]] = {
    TensorStorageMetadata: _tensor,
    ChunkStorageMetadata: _chunk,
    BytesStorageMetadata: _bytes_entry,
    MetadataIndex: _index,
    StorageInfo: _storage_info,
    StorageMeta: _storage_meta,
}


def _entries(w: PickleWriter, entries: dict[str, Any]) -> Any:
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


def _all_kept(w: PickleWriter, md: TensorStorageMetadata, chunk: Any) -> bool:
    """Every part of the entry is a shared object this writer keeps alive (so an id
    seen again is the same object)."""
    shared = (md.properties, md.size, chunk.offsets, chunk.sizes)
    return type(chunk) is ChunkStorageMetadata and all(id(p) in w.refs for p in shared)


def _storage(w: PickleWriter, storage: dict[Any, Any]) -> Any:
    """The ops of each (index, storage info) of ``storage_data``. The usual item (a
    string key, an offset or none already written, no transforms, a file already
    named) is what :func:`_index` and :func:`_storage_info` make of it, joined from a
    few precomputed pieces: this loop runs once per stored chunk."""
    index_head, offset, hint = w.head(MetadataIndex, "fqn"), w.name("offset"), w.name("index")
    info_head, length = w.head(StorageInfo, "relative_path"), w.name("length")
    extra = _STORAGE_INFO_FIELDS[3:]
    refs = w.refs
    for index, info in storage.items():
        at = getattr(index, "offset", None)
        at_op = b"" if at is None else refs.get(id(at))
        path_op = refs.get(("path", getattr(info, "relative_path", None)))
        if (
            type(index) is not MetadataIndex
            or type(info) is not StorageInfo
            or type(index.fqn) is not str
            or at_op is None
            or path_op is None
            or not _STORAGE_INFO_DROPS_NONE
            or any(getattr(info, k) is not None for k in extra)
        ):
            yield w.value(index) + w.value(info)  # (writes the offset and file name)
            continue
        hint_op = NONE if index.index is None else w.value(index.index)
        yield b"".join(
            (
                index_head,
                str_op(index.fqn),
                hint,
                hint_op,
                offset if at_op else b"",
                at_op,
                OBJ_END,
                info_head,
                path_op,
                offset,
                w.value(info.offset),
                length,
                w.value(info.length),
                OBJ_END,
            )
        )


def _mcore(w: PickleWriter, mcore: dict[Any, Any]) -> Any:
    """The ops of each item of Megatron-Core's ``mcore_data`` (mostly ``{}``)."""
    for key, extra in mcore.items():
        key_op = str_op(key) if type(key) is str else w.value(key)
        yield key_op + (EMPTY_DICT if type(extra) is dict and not extra else w.value(extra))


def _metadata(w: PickleWriter, metadata: Metadata) -> None:
    w.emit(w.cls(Metadata) + NEWOBJ_NO_ARGS + EMPTY_DICT + MARK)
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
    w.emit(OBJ_END)


def dumps(metadata: Metadata) -> bytes:
    """``metadata`` pickled (protocol 4), equal once unpickled to
    ``pickle.dumps(metadata, protocol=4)``; see the module docstring."""
    if not _SUPPORTED or type(metadata) is not Metadata:
        return pickle.dumps(metadata, protocol=PROTOCOL)
    writer = PickleWriter(_WRITERS)
    try:
        _metadata(writer, metadata)
        return writer.result()
    except (Unsupported, RecursionError):
        return pickle.dumps(metadata, protocol=PROTOCOL)


__all__ = ["dumps"]
