"""The JSON index of a ``torch_dist`` checkpoint's ``.metadata``: the same facts, no pickle.

``.metadata`` is a pickle (the on-disk format Megatron-Core and plain DCP read). Parsing
a crafted pickle can take unbounded CPU time inside one opcode, so every load parses it
twice: once in a forked child under a CPU-time limit, then for real (:mod:`..safety.metadata`).
For a checkpoint of many tensors that is most of the load's fixed cost.

So the coordinator of a ``torch_dist`` save also writes :data:`INDEX_NAME`, a JSON
document of exactly what it pickled (built from the same ``Metadata`` object, staged and
recorded by the commit protocol like ``.metadata``), and a load builds its ``Metadata``
from the index: a linear parse with no object the file chooses. Megatron-Core and plain
DCP ignore the file. The index names the size and CRC32C of the ``.metadata`` it
describes; where they differ (a tool rewrote ``.metadata`` and left the index), the
index is ignored and ``.metadata`` parsed as before. A ``Metadata`` the index cannot
express exactly (non-default tensor properties, planner data, transform descriptors,
attributes this module does not know) gets no index.

Layout (``docs/format.rst``)::

    {"format": FORMAT, "version": 1,
     "metadata": {"size": int, "crc32c": int},      # the .metadata it describes
     "dcp_version": str | null,
     "storage_meta": null | {"checkpoint_id": str | null, "save_id": str | null,
                             "load_id": str | null, "modules": [str]},
     "entries": [[key, dtype, [size...], [[offsets..., sizes...], ...]] | [key]],
     "files": [relative_path, ...],
     "items": [[fqn, [offset...] | null, index | null, file, byte_offset, length]],
     "mcore_data": null | {key: {} | {"nd_reformulated_orig_global_shape": [int...]}}}

``entries`` keep the order of ``state_dict_metadata``: a tensor (dtype by torch name,
global size, per chunk its offsets then its sizes) or a byte entry (a key alone).
``items`` keep the order of ``storage_data``.

Example:
    >>> from torch.distributed.checkpoint.metadata import Metadata
    >>> md = Metadata(state_dict_metadata={}, storage_data={})
    >>> blob = b"not a pickle"
    >>> decode_index(encode_index(md, blob), blob, "x") == md
    True
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable
from itertools import repeat
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

from ..._torch_compat import StorageInfo
from ...errors import CorruptCheckpointError
from .. import knobs
from ..process import gc_paused
from ..safety.metadata_check import CheckTooCostly, check_metadata
from .checksums import crc
from .location import CheckpointDir
from .metadata_blob import derived_from_structure
from .metadata_parts import SharedParts, index_at

logger = logging.getLogger(__name__)

INDEX_NAME = ".metadata_index.json"
FORMAT = "dist_checkpointing.torch_dist.metadata_index"
VERSION = 1
_RESHAPE_KEY = "nd_reformulated_orig_global_shape"  # Megatron-Core's mcore_data field
_FIELDS = frozenset(
    {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}
)
_MAX_DIMS = 64
_MAX_SHARED_SHAPES = 64  # distinct shapes a reader shares (see metadata_parts)

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_DTYPE_NAMES = {d: n for n, d in DTYPES.items()}


class _Inexpressible(Exception):
    """The Metadata holds something the index does not express."""


# --------------------------------------------------------------------------- encode


def encode_index(metadata: Metadata, metadata_bytes: bytes) -> bytes | None:
    """The index of ``metadata`` (pickled as ``metadata_bytes``), or None when it holds
    something the index cannot express exactly (logged at debug level) or the
    ``METADATA_INDEX`` knob is off.

    The entries part is kept with the pickle template of ``metadata``
    (:func:`.metadata_blob.derived_from_structure`): a save that reuses the previous
    structure re-encodes only the header.
    """
    if not knobs.METADATA_INDEX.get():
        return None
    attrs = vars(metadata)
    try:
        unknown = set(attrs) - _FIELDS - {"mcore_data"}
        if unknown or metadata.planner_data is not None:
            raise _Inexpressible(f"attributes {sorted(unknown)} or planner data")
        version = attrs.get("version")
        if version is not None and type(version) is not str:
            raise _Inexpressible("a version that is not a string")
        head = {
            "format": FORMAT,
            "version": VERSION,
            "metadata": {"size": len(metadata_bytes), "crc32c": crc(metadata_bytes)},
            "dcp_version": version,
            "storage_meta": _storage_meta(metadata.storage_meta),
        }
        body = _cached_body(metadata)
    except _Inexpressible as exc:
        logger.debug("no %s: %s", INDEX_NAME, exc)
        return None
    return (json.dumps(head, separators=_SEPARATORS)[:-1] + "," + body + "}").encode()


_SEPARATORS = (",", ":")


def _cached_body(metadata: Metadata) -> str:
    """``"entries":...,"files":...,"items":...,"mcore_data":...`` of ``metadata``, kept
    with its pickle template (a save that reuses its structure encodes only the header)."""
    return derived_from_structure(metadata, "json index body", lambda: _body(metadata))


def _body(metadata: Metadata) -> str:
    attrs = vars(metadata)
    files: dict[str, int] = {}
    storage = (metadata.storage_data or {}).items()
    items = _json_list(_item(index, info, files) for index, info in storage)  # fills files
    entries = _json_list(_entry(k, md) for k, md in metadata.state_dict_metadata.items())
    mcore = _mcore(attrs.get("mcore_data", None), "mcore_data" in attrs)
    dump = functools.partial(json.dumps, separators=_SEPARATORS)
    return f'"entries":{entries},"files":{dump(list(files))},"items":{items},"mcore_data":{dump(mcore)}'


_JSON_BATCH = 4096  # elements encoded per json.dumps call


def _json_list(values: Iterable[Any]) -> str:
    """``json.dumps(list(values))`` (compact), encoded a batch at a time: never a Python
    list of every element at once (100,000 entries: about 50 MiB less at the peak)."""
    parts: list[str] = []
    batch: list[Any] = []
    for value in values:
        batch.append(value)
        if len(batch) == _JSON_BATCH:
            parts.append(json.dumps(batch, separators=_SEPARATORS)[1:-1])
            batch = []
    if batch:
        parts.append(json.dumps(batch, separators=_SEPARATORS)[1:-1])
    return "[" + ",".join(parts) + "]"


def _entry(key: str, md: object) -> list[Any]:
    if type(md) is BytesStorageMetadata:
        return [key]
    if type(md) is not TensorStorageMetadata:
        raise _Inexpressible(f"entry {key!r} of type {type(md).__name__}")
    props = vars(md.properties)
    name = _DTYPE_NAMES.get(props["dtype"])
    if name is None or props != _default_properties(props["dtype"]):
        raise _Inexpressible(f"tensor {key!r} has properties {props}")
    chunks = [[*chunk.offsets, *chunk.sizes] for chunk in md.chunks]
    return [key, name, list(md.size), chunks]


@functools.cache
def _default_properties(dtype: torch.dtype) -> dict[str, Any]:
    return dict(vars(TensorProperties(dtype=dtype)))


def _item(index: MetadataIndex, info: Any, files: dict[str, int]) -> list[Any]:
    if getattr(info, "transform_descriptors", None) or type(info) is not StorageInfo:
        raise _Inexpressible(f"storage of {index.fqn!r} is {info}")
    file = files.setdefault(info.relative_path, len(files))
    offset = None if index.offset is None else list(index.offset)
    return [index.fqn, offset, index.index, file, info.offset, info.length]


def _storage_meta(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    checkpoint_id = meta.checkpoint_id
    if checkpoint_id is not None and type(checkpoint_id) is not str:
        raise _Inexpressible(f"checkpoint_id {checkpoint_id!r}")
    return {
        "checkpoint_id": checkpoint_id,
        "save_id": meta.save_id,
        "load_id": meta.load_id,
        "modules": meta.modules,
    }


def _mcore(mcore: object, present: bool) -> dict[str, Any] | None:
    if not present:
        return None
    if type(mcore) is not dict:
        raise _Inexpressible(f"mcore_data of type {type(mcore).__name__}")
    out: dict[str, Any] = {}
    for key, extra in mcore.items():
        if type(extra) is not dict or set(extra) - {_RESHAPE_KEY}:
            raise _Inexpressible(f"mcore_data[{key!r}] = {extra!r}")
        shape = extra.get(_RESHAPE_KEY)
        if shape is None:
            out[key] = {}
        elif type(shape) is tuple and all(type(d) is int for d in shape):
            out[key] = {_RESHAPE_KEY: list(shape)}
        else:
            raise _Inexpressible(f"mcore_data[{key!r}] = {extra!r}")
    return out


# --------------------------------------------------------------------------- decode

# Pair comparisons per chunk the overlap check may make on an index (a grid needs
# none, flat ranges about one); a file that needs more is parsed the guarded way.
CHECK_BUDGET = 64


def metadata_from_index(location: CheckpointDir, metadata_bytes: bytes) -> Metadata | None:
    """The checked ``Metadata`` of the checkpoint at ``location`` built from its index,
    or None where ``.metadata`` (``metadata_bytes``) must be parsed instead: no index,
    the ``METADATA_INDEX`` knob off, an index of another ``.metadata``, or chunks too
    costly to check outside the parse guard.

    Raises:
        CorruptCheckpointError: the index is malformed or describes a corrupt
            checkpoint (naming the index file and the key).
    """
    if not knobs.METADATA_INDEX.get() or not location.has(INDEX_NAME):
        return None
    source = location.path(INDEX_NAME)
    with gc_paused():  # ~10 objects per tensor, none of them garbage
        metadata = decode_index(location.read_bytes(INDEX_NAME), metadata_bytes, source)
        if metadata is None:
            return None
        try:
            check_metadata(metadata, source, budget=CHECK_BUDGET)
        except CheckTooCostly as exc:
            logger.info("%s: %s; parsing .metadata instead", source, exc)
            return None
    return metadata


def decode_index(data: bytes, metadata_bytes: bytes, source: str) -> Metadata | None:
    """The ``Metadata`` the index ``data`` describes, or None when it describes another
    ``.metadata`` than ``metadata_bytes`` (then parse those).

    The JSON must have the right shape; the types and ranges of the values are then
    checked by :func:`..safety.metadata_check.check_metadata`, as for a parsed pickle
    (the caller runs it).

    Raises:
        CorruptCheckpointError: naming ``source``, when the index is malformed.
    """
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source}: not a JSON index ({str(exc)[:200]})") from None
    reader = _Reader(source)
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise reader.fail("is not a torch_dist metadata index")
    if doc.get("version") != VERSION or type(doc.get("version")) is not int:
        raise reader.fail(f"has version {str(doc.get('version'))[:40]}, this library reads 1")
    described = doc.get("metadata")
    if type(described) is not dict or described != {
        "size": len(metadata_bytes),
        "crc32c": crc(metadata_bytes),
    }:
        logger.info("%s describes another .metadata than the one present: ignored", source)
        return None
    return reader.metadata(doc)


class _Reader:
    """Builds the objects; types and ranges are left to ``check_metadata`` where it
    checks them anyway (keys, dims, byte counts), wrong shapes of JSON fail here."""

    def __init__(self, source: str) -> None:
        self.source = source
        # Shapes and dtypes as one object each (the metadata of 100,000 tensors: about
        # 45 MiB less), and each item's key the entry's own string.
        self.parts = SharedParts(max_shapes=_MAX_SHARED_SHAPES)
        self.keys: dict[str, str] = {}

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: {what}")

    def metadata(self, doc: dict[str, Any]) -> Metadata:
        entries, items, files = doc.get("entries"), doc.get("items"), doc.get("files")
        if type(entries) is not list or type(items) is not list or type(files) is not list:
            raise self.fail("entries, files and items must be lists")
        if not all(type(f) is str for f in files):
            raise self.fail("a file name is not a string")
        version = doc.get("dcp_version")
        if version is not None and type(version) is not str:
            raise self.fail("dcp_version is not a string")
        try:
            state_dict_metadata = dict(map(self.entry, entries))
            self.keys = {key: key for key in state_dict_metadata}
            metadata = Metadata(
                state_dict_metadata=state_dict_metadata,
                storage_data=dict(map(self.item, items, repeat(files))),
                storage_meta=self.storage_meta(doc.get("storage_meta")),
                version=version,
            )
        except (TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError) as e:
            # The entry at fault is named by the checks below where they can; this is
            # JSON of the wrong shape (a string for a list, an unknown dtype, ...).
            raise self.fail(f"malformed entry ({type(e).__name__}: {str(e)[:200]})") from None
        mcore = doc.get("mcore_data")
        if mcore is not None:
            metadata.mcore_data = self.mcore(mcore)  # type: ignore[attr-defined]
        self.keys = {}
        return metadata

    # Keys are checked to be strings before they go into a dict: str hashes are
    # randomized per process, ints (and MetadataIndex of ints) can be made to collide.

    def entry(self, entry: list[Any]) -> tuple[str, Any]:
        if type(entry[0]) is not str:
            raise ValueError(f"a key is {type(entry[0]).__name__}, not a string")
        if len(entry) == 1:
            return entry[0], BytesStorageMetadata()
        key, dtype, size, boxes = entry
        n = len(size)
        if n > _MAX_DIMS or type(boxes) is not list:
            raise ValueError(f"tensor {str(key)[:200]!r}: malformed size or chunks")
        shape = self.parts.size
        chunks = [ChunkStorageMetadata(shape(box[:n]), shape(box[n:])) for box in boxes]
        properties = self.parts.properties(DTYPES[dtype])
        return key, TensorStorageMetadata(properties, shape(size), chunks)

    def item(self, item: list[Any], files: list[str]) -> tuple[MetadataIndex, Any]:
        fqn, offset, index, file, start, length = item
        if type(fqn) is not str:
            raise ValueError(f"an item's key is {type(fqn).__name__}, not a string")
        if type(file) is not int or file < 0 or (index is not None and type(index) is not int):
            raise ValueError(f"storage of {str(fqn)[:200]!r}: malformed file or index")
        info = StorageInfo(files[file], start, length)
        shared = None if offset is None else self.parts.size(offset)
        return index_at(self.keys.get(fqn, fqn), shared, index), info

    def storage_meta(self, meta: object) -> StorageMeta | None:
        if meta is None:
            return None
        if type(meta) is not dict:
            raise self.fail("storage_meta is not an object")
        ids = [meta.get(name) for name in ("checkpoint_id", "save_id", "load_id")]
        modules = meta.get("modules")
        if type(modules) is not list or not all(
            type(v) is str for v in [*ids, *modules] if v is not None
        ):
            raise self.fail("storage_meta holds something other than strings")
        return StorageMeta(checkpoint_id=ids[0], save_id=ids[1], load_id=ids[2], modules=modules)

    def mcore(self, mcore: object) -> dict[str, dict[str, tuple[int, ...]]]:
        if type(mcore) is not dict:
            raise self.fail("mcore_data is not an object")
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for key, extra in mcore.items():
            shape = extra.get(_RESHAPE_KEY) if type(extra) is dict else None
            if (
                type(extra) is not dict
                or set(extra) - {_RESHAPE_KEY}
                or not (
                    shape is None or (type(shape) is list and all(type(d) is int for d in shape))
                )
            ):
                raise self.fail(f"mcore_data[{key[:200]!r}] is malformed")
            shared: str = self.keys.get(key) or key  # the entry's own string where it has one
            out[shared] = {} if shape is None else {_RESHAPE_KEY: tuple(shape)}
        return out


__all__ = [
    "CHECK_BUDGET",
    "DTYPES",
    "FORMAT",
    "INDEX_NAME",
    "VERSION",
    "decode_index",
    "encode_index",
    "metadata_from_index",
]
