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
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..._torch_compat import StorageInfo
from .. import knobs
from ..process import gc_paused
from ..safety.metadata_check import CheckTooCostly, check_metadata
from .checksums import crc
from .location import CheckpointDir
from .metadata_blob import derived_from_structure
from .metadata_index_items import PendingItems
from .metadata_index_reader import (
    DTYPES,
    FORMAT,
    RESHAPE_KEY,
    VERSION,
    read_index,
)

logger = logging.getLogger(__name__)

INDEX_NAME = ".metadata_index.json"
_FIELDS = frozenset(
    {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}
)
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
        if type(extra) is not dict or set(extra) - {RESHAPE_KEY}:
            raise _Inexpressible(f"mcore_data[{key!r}] = {extra!r}")
        shape = extra.get(RESHAPE_KEY)
        if shape is None:
            out[key] = {}
        elif type(shape) is tuple and all(type(d) is int for d in shape):
            out[key] = {RESHAPE_KEY: list(shape)}
        else:
            raise _Inexpressible(f"mcore_data[{key!r}] = {extra!r}")
    return out


# --------------------------------------------------------------------------- decode

# Pair comparisons per chunk the overlap check may make on an index (a grid needs
# none, flat ranges about one); a file that needs more is parsed the guarded way.
CHECK_BUDGET = 64


def metadata_from_index(
    location: CheckpointDir, metadata_bytes: bytes, keys: Collection[str] | None = None
) -> Metadata | None:
    """The checked ``Metadata`` of the checkpoint at ``location`` built from its index,
    or None where ``.metadata`` (``metadata_bytes``) must be parsed instead: no index,
    the ``METADATA_INDEX`` knob off, an index of another ``.metadata``, or chunks too
    costly to check outside the parse guard. With ``keys``, only the entries, items
    and ``mcore_data`` of those keys (see :func:`decode_index`).

    Raises:
        CorruptCheckpointError: the index is malformed or describes a corrupt
            checkpoint (naming the index file and the key).
    """
    if not knobs.METADATA_INDEX.get() or not location.has(INDEX_NAME):
        return None
    source = location.path(INDEX_NAME)
    with gc_paused():  # ~10 objects per tensor, none of them garbage
        metadata = decode_index(location.read_bytes(INDEX_NAME), metadata_bytes, source, keys)
        if metadata is None:
            return None
        try:
            pending = isinstance(metadata.storage_data, PendingItems)  # checked when built
            check_metadata(metadata, source, budget=CHECK_BUDGET, storage=not pending)
        except CheckTooCostly as exc:
            logger.info("%s: %s; parsing .metadata instead", source, exc)
            return None
    return metadata


def decode_index(
    data: bytes, metadata_bytes: bytes, source: str, keys: Collection[str] | None = None
) -> Metadata | None:
    """The ``Metadata`` the index ``data`` describes, or None when it describes another
    ``.metadata`` than ``metadata_bytes`` (then parse those). Read a value at a time
    (:mod:`.metadata_index_reader`).

    ``keys``: build only the entries, items and ``mcore_data`` of these keys (a load
    that requests some of the checkpoint's tensors); the other elements are checked
    to be JSON and stepped over. The result then describes part of the checkpoint.

    The JSON must have the right shape; the types and ranges of the values are then
    checked by :func:`..safety.metadata_check.check_metadata`, as for a parsed pickle
    (the caller runs it).

    Raises:
        CorruptCheckpointError: naming ``source``, when the index is malformed.
    """
    return read_index(data, metadata_bytes, source, keys)


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
