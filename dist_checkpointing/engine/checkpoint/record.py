"""The commit record (``commit.json``): which files make up the committed save.

Written last by a save's coordinator (see :mod:`.commit`), it names the save
(``save_id``), every file of that save with its size, and the CRC32C block
checksums of every data item and of every whole metadata file. It is what binds
``.metadata``, ``metadata.json``, ``common.pt`` and the data files to one save: a
file that does not match its entry was not written by this save.

Format (JSON, version 1)::

    {"format": "dist_checkpointing.commit", "version": 1,
     "save_id": "<32 hex>", "world_size": 2, "created_unix": 1764043200.0,
     "checksum": {"algorithm": "crc32c", "block_bytes": 1048576, "data_items": true},
     "files": {".metadata": {"size": 1234, "blocks": [crc, ...]}, ...},
     "data_files": {"__0_0.<tag>.distcp": {"size": 4096,
                    "items": [[offset, length, [crc, ...]], ...]}},
     "install": {".metadata": ".metadata.<tag>.pending", ...}}

``install`` lists fixed-name files still waiting under their staged name (only
when a commit was interrupted after the record was written; see :mod:`.commit`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ...errors import CorruptCheckpointError, UnsafeCheckpointError
from ..storage.checksums import ALGORITHM, FileEntry
from ..storage.item_checksums import DataFileEntry
from ..storage.json_stream import JsonCursor, json_text
from ..storage.names import safe_name

COMMIT_RECORD = "commit.json"
FORMAT = "dist_checkpointing.commit"
VERSION = 1

# A damaged or hostile record is refused before it is parsed when larger than this
# many bytes per data byte it describes would allow; an absolute cap keeps parsing
# bounded (1 GiB of checkpoint needs about 10 KiB of record at 1 MiB blocks).
MAX_RECORD_BYTES = 1 << 30


@dataclass
class CommitRecord:
    """The parsed commit record of a checkpoint."""

    save_id: str
    world_size: int
    block_bytes: int
    files: dict[str, FileEntry] = field(default_factory=dict)
    data_files: dict[str, DataFileEntry] = field(default_factory=dict)
    install: dict[str, str] = field(default_factory=dict)
    created_unix: float = field(default_factory=time.time)
    data_checksums: bool = True  # False: saved with the WRITE_CHECKSUMS knob off

    def names(self) -> set[str]:
        """Every file the committed save consists of (final names)."""
        return set(self.files) | set(self.data_files) | {COMMIT_RECORD}

    def to_bytes(self) -> bytes:
        """The record as compact JSON. The items of the data files (100,000 of them in a
        save of as many tensors) are written from their columns, not as a list per item
        for ``json.dumps``: the same text, in a tenth of the time."""
        head = {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "checksum": {
                "algorithm": ALGORITHM,
                "block_bytes": self.block_bytes,
                "data_items": self.data_checksums,
            },
            "files": {n: {"size": e.size, "blocks": e.blocks} for n, e in self.files.items()},
        }
        data_files = ",".join(
            f'{_dumps(n)}:{{"size":{_dumps(e.size)},"items":{_items_json(e)}}}'
            for n, e in self.data_files.items()
        )
        text = (
            f'{_dumps(head)[:-1]},"data_files":{{{data_files}}},"install":{_dumps(self.install)}}}'
        )
        return text.encode()

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> CommitRecord:
        """Parse and check a record; :class:`CorruptCheckpointError` naming ``source``."""
        if len(data) > MAX_RECORD_BYTES:
            raise CorruptCheckpointError(f"{source}: commit record of {len(data)} bytes refused")
        try:
            return _parse(_read(json_text(data)), source)
        except UnsafeCheckpointError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{source}: malformed commit record ({exc})") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _items_json(entry: DataFileEntry) -> str:
    """``json.dumps`` of ``[[offset, length, [crc, ...]], ...]`` for the items of
    ``entry``, made from its columns."""
    offsets, lengths, starts, crcs = entry.columns()
    if len(crcs) == len(offsets) and starts == list(range(len(starts))):  # one block each
        rows = [f"[{o},{n},[{c}]]" for o, n, c in zip(offsets, lengths, crcs)]
    else:
        rows = [
            f"[{o},{n},[{','.join(map(str, crcs[a:b]))}]]"
            for o, n, a, b in zip(offsets, lengths, starts, starts[1:])
        ]
    return f"[{','.join(rows)}]"


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r:.60}")
    return value


def _crcs(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list of checksums")
    return [_int(v, what) for v in value]


def _read(text: str) -> Any:
    """``json.loads(text)``, except that the items of each data file are checked and
    kept as text (:class:`_Unparsed`) where written as :meth:`CommitRecord.to_bytes`
    writes them, else read one at a time into columns (:class:`_Columns`): a record of
    100,000 items otherwise makes about 30 MiB of lists and ints that the load drops
    right away."""
    cursor = JsonCursor(text)
    if cursor.peek() != "{":
        return json.loads(text)
    raw: dict[str, Any] = {}
    for key in cursor.members():
        if key != "data_files" or cursor.peek() != "{":
            raw[key] = cursor.value()
            continue
        files: dict[str, Any] = {}
        for name in cursor.members():
            if cursor.peek() != "{":
                files[name] = cursor.value()
                continue
            entry = files[name] = {}
            for field_name in cursor.members():
                is_list = field_name == "items" and cursor.peek() == "["
                entry[field_name] = _items(cursor, name) if is_list else cursor.value()
        raw[key] = files
    cursor.end()
    return raw


# A data file's items exactly as ``to_bytes`` writes them, with every value below
# 10**18 (so that it fits 64 bits): one match checks the text of a whole file's items.
_I = "(?:0|[1-9][0-9]{0,17})"
_ITEM = rf"\[{_I},{_I},\[{_I}(?:,{_I})*+\]\]"
_ITEMS = re.compile(rf"\[(?:{_ITEM}(?:,{_ITEM})*+)?\]")


class _Unparsed(NamedTuple):
    """A data file's items as text that :data:`_ITEMS` matched."""

    text: str


def _items(cursor: JsonCursor, name: str) -> _Columns | _Unparsed:
    match = _ITEMS.match(cursor.text, cursor.pos)
    if match is None:  # another spelling (whitespace, other values): checked item by item
        return _Columns(cursor.elements(), name)
    cursor.pos = match.end()
    return _Unparsed(match.group())


_COLUMNS = frozenset(DataFileEntry.__slots__) - {"size"}
_PARSE_LOCK = threading.Lock()


class _LazyEntry(DataFileEntry):
    """A :class:`DataFileEntry` whose items are parsed on first use, from text that
    :data:`_ITEMS` matched (which cannot fail to parse): a load needs the checksums of
    the files it reads only. A rank of four reads a quarter of the 100,000 items of a
    record; a record is parsed in about a tenth of the time (``json.loads`` of one
    file's items, then columns)."""

    __slots__ = ("_text",)

    def __init__(self, size: int, text: str) -> None:
        self.size = size  # the columns are made by __getattr__, not by super().__init__
        self._text: str | None = text

    def __getattr__(self, name: str) -> Any:
        """Called for a column not made yet: make them all (once, under a lock: read
        threads may ask at the same time)."""
        if name not in _COLUMNS:
            raise AttributeError(name)
        with _PARSE_LOCK:
            text = self._text
            if text is not None:
                rows = json.loads(text)
                self._columns([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
                self._text = None
        return object.__getattribute__(self, name)


class _Columns:
    """A data file's items, checked in one pass (100,000 items parse in well under a
    second), as lists of offsets, lengths and block checksums. Checksum values need no
    check of their own: they are only compared (one that does not fit 64 bits is
    refused when the entry is made)."""

    def __init__(self, items: Iterable[Any], name: str) -> None:
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.blocks: list[list[int]] = []
        for o, n, b in items:
            if type(o) is not int or type(n) is not int or o < 0 or n < 0:
                raise ValueError(f"{name}: item offsets and lengths must be integers >= 0")
            if type(b) is not list or not b or not all(type(v) is int for v in b):
                raise ValueError(f"{name}: item checksums must be a non-empty list of integers")
            self.offsets.append(o)
            self.lengths.append(n)
            self.blocks.append(b)


def _data_file(size: int, raw: Any, name: str) -> DataFileEntry:
    """A data file's entry from its items (read into :class:`_Columns` by :func:`_read`)."""
    if isinstance(raw, _Unparsed):
        return _LazyEntry(size, raw.text)
    if not isinstance(raw, _Columns):
        raise ValueError(f"{name}: items must be a list")
    return DataFileEntry.from_columns(size, raw.offsets, raw.lengths, raw.blocks)


def _parse(raw: Any, source: str) -> CommitRecord:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError("not a dist_checkpointing commit record")
    if raw.get("version") != VERSION or type(raw.get("version")) is not int:
        raise ValueError(f"unsupported commit record version {raw.get('version')!r:.20}")
    checksum = raw["checksum"]
    if checksum.get("algorithm") != ALGORITHM:
        raise ValueError(f"unsupported checksum algorithm {checksum.get('algorithm')!r:.40}")
    save_id = raw["save_id"]
    if not isinstance(save_id, str) or not save_id.isalnum() or len(save_id) > 64:
        raise ValueError("bad save_id")
    record = CommitRecord(
        save_id=save_id,
        world_size=_int(raw["world_size"], "world_size", 1),
        block_bytes=_int(checksum["block_bytes"], "block_bytes", 1),
        created_unix=float(raw.get("created_unix", 0.0)),
        data_checksums=checksum.get("data_items", True) is True,
    )

    # Every name is one plain file of this directory: the record's names are read,
    # renamed and deleted like any other name from a checkpoint.
    def name_of(name: object) -> str:
        return safe_name(name, source=source)

    for name, entry in dict(raw["files"]).items():
        record.files[name_of(name)] = FileEntry(
            _int(entry["size"], f"{name} size"), _crcs(entry["blocks"], f"{name} blocks")
        )
    for name, entry in dict(raw["data_files"]).items():
        size = _int(entry["size"], f"{name} size")
        record.data_files[name_of(name)] = _data_file(size, entry["items"], str(name))
    install = raw.get("install", {})
    if not isinstance(install, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in install.items()
    ):
        raise ValueError("install must map names to names")
    record.install = {name_of(k): name_of(v) for k, v in install.items()}
    return record


__all__ = ["COMMIT_RECORD", "CommitRecord"]
