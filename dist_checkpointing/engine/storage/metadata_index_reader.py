"""Reading the JSON index of ``.metadata`` (:mod:`.metadata_index`) into DCP's
``Metadata``, a value at a time.

The index of 100,000 tensors is about 8.5 MB of JSON; ``json.loads`` of it makes about
90 MiB of lists, strings and ints that become other objects and are then dropped, and
a load's memory stays at that peak. A document laid out as this library writes it
(the header, then ``entries``, ``files``, ``items``, ``mcore_data``) is read with a
:class:`.json_stream.JsonCursor` instead: each entry and item is built as it is
parsed. Any other layout (keys in another order, a member of the wrong type) is
parsed whole, as before, with the same result and the same errors.

A reader given the keys a load requests (``keys``) builds only their entries, items
and ``mcore_data``. Of every other element only the key is read (by ``json``'s string
scanner); a regular expression of the exact compact JSON that follows a key in this
library's index (:data:`_SKIP_ENTRY`, :data:`.metadata_index_items.SKIP_ITEM`) steps
over the rest, and an element spelled otherwise is parsed and dropped. Every element is
still checked to be JSON; the values of the skipped ones are not checked as metadata
(they are not used). Where the requested keys have several chunks each, their items
are built later, those the load reads (:class:`.metadata_index_items.PendingItems`).
A rank of four pipeline stages over 100,000 tensors reads the index in about half the
time of a whole read (``bench/metadata_read.py``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from functools import partial
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ...errors import CorruptCheckpointError
from .checksums import crc
from .json_stream import JsonCursor, json_text
from .metadata_index_items import (
    INTS,
    MALFORMED,
    SELECTIVE,
    SKIP_ITEM,
    PendingItems,
    build_item,
    items_end,
    malformed,
)
from .metadata_parts import SharedParts

logger = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = "dist_checkpointing.torch_dist.metadata_index"
VERSION = 1
RESHAPE_KEY = "nd_reformulated_orig_global_shape"  # Megatron-Core's mcore_data field
MAX_DIMS = 64
MAX_SHARED_SHAPES = 64  # distinct shapes a reader shares (see metadata_parts)
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_HEAD = frozenset({"format", "version", "metadata"})
_BODY = frozenset({"entries", "files", "items", "mcore_data"})
WHOLE = object()  # see _Reader.stream

# What follows the key of an entry in the exact compact JSON the index writer makes
# (an element spelled otherwise is parsed instead of skipped); items: SKIP_ITEM.
_SKIP_ENTRY = re.compile(rf'(?:,"[a-z0-9_]++",{INTS},\[(?:{INTS}(?:,{INTS})*+)?\])?\]')


def read_index(
    data: bytes, metadata_bytes: bytes, source: str, keys: Collection[str] | None = None
) -> Metadata | None:
    """See :func:`.metadata_index.decode_index`."""
    reader = _Reader(source, metadata_bytes, keys)
    try:
        text = json_text(data)
        metadata = reader.stream(JsonCursor(text))
        if metadata is WHOLE:
            reader = _Reader(source, metadata_bytes, keys)
            doc = json.loads(text)
            if type(doc) is not dict:
                raise reader.fail("is not a torch_dist metadata index")
            metadata = reader.metadata(doc) if reader.header(doc) else None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CorruptCheckpointError(f"{source}: not a JSON index ({str(exc)[:200]})") from None
    assert metadata is None or isinstance(metadata, Metadata)
    return metadata


class _Reader:
    """Builds the objects; types and ranges are left to ``check_metadata`` where it
    checks them anyway (keys, dims, byte counts), wrong shapes of JSON fail here."""

    def __init__(
        self, source: str, metadata_bytes: bytes, wanted: Collection[str] | None = None
    ) -> None:
        self.source = source
        self.metadata_bytes = metadata_bytes
        self.wanted = wanted  # None: every key
        # Shapes and dtypes as one object each (the metadata of 100,000 tensors: about
        # 45 MiB less), and each item's key the entry's own string.
        self.parts = SharedParts(max_shapes=MAX_SHARED_SHAPES)
        self.keys: dict[str, str] = {}

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: {what}")

    def metadata(self, doc: dict[str, Any]) -> Metadata:
        """The Metadata of a whole parsed document (whose header was checked)."""
        entries, items, files = doc.get("entries"), doc.get("items"), doc.get("files")
        if type(entries) is not list or type(items) is not list:
            raise self.fail("entries, files and items must be lists")
        self.check_files(files)
        state_dict_metadata = self.converted(self.entries, self.kept(entries))
        storage_data = self.converted(self.items, self.kept(items), files)
        mcore = doc.get("mcore_data")
        if mcore is not None and type(mcore) is not dict:
            raise self.fail("mcore_data is not an object")
        mcore_data = None if mcore is None else self.mcore(mcore.items())
        return self.build(doc, state_dict_metadata, storage_data, mcore_data)

    def stream(self, cursor: JsonCursor) -> Metadata | None | object:
        """The Metadata of the document at ``cursor``, read a value at a time; None
        where the header describes another ``.metadata``; :data:`WHOLE` where the
        document is not laid out as this library writes it (the caller parses it
        whole: the same result, the same errors)."""
        if cursor.peek() != "{":
            return WHOLE
        head: dict[str, Any] = {}
        members = cursor.members()
        key = next(members, None)
        while key is not None and key not in _BODY:
            head[key] = cursor.value()
            key = next(members, None)
        if not head.keys() >= _HEAD or key != "entries" or cursor.peek() != "[":
            return WHOLE
        if not self.header(head):
            return None
        entries = self.converted(self.entries, cursor.elements(self.select(_SKIP_ENTRY)))
        lazy = self.wanted is not None  # a load's part (see PendingItems)
        if not cursor.dropped:
            self.wanted = None  # every entry was wanted: so is every item (no filtering)
        if next(members, None) != "files":
            return WHOLE
        files = cursor.value()
        self.check_files(files)
        if next(members, None) != "items" or cursor.peek() != "[":
            return WHOLE
        items = self.items_at(cursor, files, entries if lazy else None)
        key = next(members, None)
        mcore = None
        if key == "mcore_data":  # small values: parsed whole, in one call of the scanner
            raw = cursor.value()
            if raw is not None and type(raw) is not dict:
                raise self.fail("mcore_data is not an object")
            mcore = None if raw is None else self.mcore(raw.items())
            del raw
            key = next(members, None)
        if key is not None:
            return WHOLE
        cursor.end()
        return self.build(head, entries, items, mcore)

    def header(self, doc: dict[str, Any]) -> bool:
        """Whether the index describes ``self.metadata_bytes``; raises where it is not
        an index this library reads."""
        if doc.get("format") != FORMAT:
            raise self.fail("is not a torch_dist metadata index")
        if doc.get("version") != VERSION or type(doc.get("version")) is not int:
            raise self.fail(f"has version {str(doc.get('version'))[:40]}, this library reads 1")
        described = doc.get("metadata")
        if type(described) is not dict or described != {
            "size": len(self.metadata_bytes),
            "crc32c": crc(self.metadata_bytes),
        }:
            logger.info("%s describes another .metadata than the one present: ignored", self.source)
            return False
        return True

    def check_files(self, files: object) -> None:
        if type(files) is not list:
            raise self.fail("entries, files and items must be lists")
        if not all(type(f) is str for f in files):
            raise self.fail("a file name is not a string")

    def converted(self, convert: Callable[..., T], *args: Any) -> T:
        """``convert(*args)``, a malformed entry (JSON of the wrong shape: a string for a
        list, an unknown dtype...) reported as such; the entry at fault is named by the
        checks of ``check_metadata`` where they can."""
        try:
            return convert(*args)
        except json.JSONDecodeError:
            raise
        except MALFORMED as e:
            raise malformed(self.source, e) from None

    def items_at(
        self, cursor: JsonCursor, files: list[str], part: dict[str, Any] | None
    ) -> Mapping[MetadataIndex, Any]:
        """The items of the array at ``cursor``: for the ``part`` of a load (its entries),
        built when the load asks for them (:class:`.PendingItems`), unless it will ask
        for most of them (it reads at least one item of each key); else now."""
        if part is not None:
            count = sum(len(getattr(md, "chunks", ())) or 1 for md in part.values())
            end = items_end(cursor.text, cursor.pos) if len(part) <= SELECTIVE * count else -1
            if end > 0:
                build = (self.keys, self.parts, files)
                span = (cursor.pos, end)
                cursor.pos = end
                return PendingItems(cursor.text, span, self.wanted, count, build, self.source)
        return self.converted(self.items, cursor.elements(self.select(SKIP_ITEM)), files)

    def select(self, tail: re.Pattern[str]) -> tuple[re.Pattern[str], Collection[str]] | None:
        """The ``select`` of :meth:`.JsonCursor.elements`: the elements of the wanted
        keys, the others stepped over where ``tail`` matches (None: every key)."""
        return None if self.wanted is None else (tail, self.wanted)

    def kept(self, elements: Iterable[Any]) -> Iterable[Any]:
        """``elements`` (entries or items of a document parsed whole) as ``select``
        keeps them: those of the wanted keys, and those without a first item (refused
        when built)."""
        wanted = self.wanted
        if wanted is None:
            return elements

        def keep(element: Any) -> bool:
            try:
                return element[0] in wanted
            except (TypeError, LookupError):
                return True

        return filter(keep, elements)

    def entries(self, entries: Iterable[Any]) -> dict[str, Any]:
        state_dict_metadata = dict(map(self.entry, entries))
        self.keys = {key: key for key in state_dict_metadata}  # each item's key: the entry's
        return state_dict_metadata

    def items(self, items: Iterable[Any], files: list[str]) -> dict[MetadataIndex, Any]:
        return dict(map(partial(build_item, self.keys, self.parts, files), items))

    def build(
        self,
        doc: dict[str, Any],
        entries: dict[str, Any],
        storage: Mapping[MetadataIndex, Any],
        mcore: dict[str, Any] | None,
    ) -> Metadata:
        version = doc.get("dcp_version")
        if version is not None and type(version) is not str:
            raise self.fail("dcp_version is not a string")
        metadata = Metadata(
            state_dict_metadata=entries,
            storage_data=storage,
            storage_meta=self.storage_meta(doc.get("storage_meta")),
            version=version,
        )
        if mcore is not None:
            metadata.mcore_data = mcore  # type: ignore[attr-defined]
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
        if n > MAX_DIMS or type(boxes) is not list:
            raise ValueError(f"tensor {str(key)[:200]!r}: malformed size or chunks")
        chunk = self.parts.chunk
        chunks = [chunk(box[:n], box[n:]) for box in boxes]
        properties = self.parts.properties(DTYPES[dtype])
        return key, TensorStorageMetadata(properties, self.parts.size(size), chunks)

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

    def mcore(self, pairs: Iterable[tuple[str, Any]]) -> dict[str, dict[str, tuple[int, ...]]]:
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        no_extras: dict[str, tuple[int, ...]] = {}  # shared by the keys without (read-only)
        wanted = self.wanted
        for key, extra in pairs:
            if wanted is not None and key not in wanted:
                continue
            shape = extra.get(RESHAPE_KEY) if type(extra) is dict else None
            if (
                type(extra) is not dict
                or set(extra) - {RESHAPE_KEY}
                or not (
                    shape is None or (type(shape) is list and all(type(d) is int for d in shape))
                )
            ):
                raise self.fail(f"mcore_data[{key[:200]!r}] is malformed")
            shared: str = self.keys.get(key) or key  # the entry's own string where it has one
            out[shared] = no_extras if shape is None else {RESHAPE_KEY: tuple(shape)}
        return out


__all__ = [
    "DTYPES",
    "FORMAT",
    "MAX_DIMS",
    "MAX_SHARED_SHAPES",
    "RESHAPE_KEY",
    "VERSION",
    "read_index",
]
