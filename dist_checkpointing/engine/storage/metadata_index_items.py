"""The item locations (``storage_data``) of a metadata index read for some keys, built
when a load asks for them.

A load of some keys needs all the chunks of those keys (to plan its reads) but the
locations of the chunks it reads only: with tensor parallelism of 8, an eighth of a
key's items; with a distributed optimizer's flat shards over 64 data-parallel ranks, a
64th. :class:`PendingItems` keeps the index's ``items`` array as text (its end found by
:func:`items_end`) and builds in one pass the items a load planned
(:meth:`PendingItems.prepare`): each item's key is read by ``json``'s string scanner;
the items of other keys are stepped over (:data:`SKIP_ITEM`), those of the planned keys
matched as the writer spells them and built where their offsets were planned. Where the
planned reads are most of the wanted keys' items, where an item is spelled otherwise,
and for any other use (a lookup of an item not prepared, iteration, ``len``), every item
of the wanted keys is built by the JSON scanner, so that the mapping answers as the dict
of them would. The array is checked as it is walked: damage fails the first use with
``CorruptCheckpointError`` naming the index. Built items are checked as
``check_metadata`` checks ``storage_data``. The truth value of a ``PendingItems``
(``items or {}``) counts the items, which builds them all: compare with None instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..._torch_compat import StorageInfo
from ...errors import CorruptCheckpointError
from ..safety.metadata_check import check_metadata
from .json_stream import JsonCursor, scan_string
from .metadata_parts import SharedParts, index_at

# What follows the key of an item in the exact compact JSON the index writer makes.
# Possessive quantifiers (no backtracking to remember): about 20% faster matches.
INT = "(?:0|[1-9][0-9]*+)"
INTS = rf"\[(?:{INT}(?:,{INT})*+)?\]"
SKIP_ITEM = re.compile(rf",(?:{INTS}|null),(?:{INT}|null),{INT},{INT},{INT}\]")
# A whole item so written; groups: the key (as JSON: quoted, escaped), the offsets
# (text), the DCP index, file, byte offset, length.
_CHARS = r'[^"\\\x00-\x1f]*+'  # a run of characters that need no escape
_STRING = rf'"{_CHARS}(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{{4}}){_CHARS})*+"'
_ITEM = re.compile(rf"\[({_STRING}),({INTS}|null),({INT}|null),({INT}),({INT}),({INT})\]")
SELECTIVE = 0.6  # see PendingItems.prepare
# Not in a key: inside a JSON string a quote always follows a backslash.
_AFTER_ITEMS = '],"mcore_data":'


def items_end(text: str, start: int) -> int:
    """Where the ``items`` array starting at ``start`` ends (after its ``]``), found as
    the writer lays the document out; -1 where it is not. A walk of the array checks
    that it ends there."""
    end = text.find(_AFTER_ITEMS, start)
    return -1 if end < 0 else end + 1


def build_item(
    keys: Mapping[str, str], parts: SharedParts, files: list[str], item: list[Any]
) -> tuple[MetadataIndex, Any]:
    """The ``storage_data`` pair of one element of ``items`` (its key the entry's own
    string where ``keys`` has it, its offset a shape shared by ``parts``).

    Raises:
        ValueError, TypeError, IndexError: the element is malformed.
    """
    fqn, offset, index, file, start, length = item
    if type(fqn) is not str:
        raise ValueError(f"an item's key is {type(fqn).__name__}, not a string")
    if type(file) is not int or file < 0 or (index is not None and type(index) is not int):
        raise ValueError(f"storage of {str(fqn)[:200]!r}: malformed file or index")
    info = StorageInfo(files[file], start, length)
    shared = None if offset is None else parts.size(offset)
    return index_at(keys.get(fqn, fqn), shared, index), info


# What building an element of the wrong shape raises (a string for a list, an unknown
# dtype, a file out of range...): reported by :func:`malformed`.
MALFORMED = (TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError)


def malformed(source: str, error: BaseException) -> CorruptCheckpointError:
    """The error for an index element that ``error`` showed malformed."""
    return CorruptCheckpointError(
        f"{source}: malformed entry ({type(error).__name__}: {str(error)[:200]})"
    )


class _Spelled(Exception):
    """An item is not spelled as the index writer spells it (see ``_matches``)."""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text[1:-1].split(",")] if text != "[]" else []


def _where(index: MetadataIndex) -> tuple[str, str]:
    """``(key, offsets)`` of ``index``, the offsets as the writer spells them."""
    offset = index.offset
    return index.fqn, "null" if offset is None else "[" + ",".join(map(str, offset)) + "]"


class PendingItems(Mapping[MetadataIndex, Any]):
    """``storage_data`` of the ``wanted`` keys (None: every key; ``count`` items, as
    their entries have chunks), from the text of an ``items`` array that starts at
    ``span[0]`` and ends at ``span[1]`` (:func:`items_end`); see the module docstring."""

    def __init__(
        self,
        text: str,
        span: tuple[int, int],
        wanted: Collection[str] | None,
        count: int,
        build: tuple[Mapping[str, str], SharedParts, list[str]],
        source: str,
    ) -> None:
        self._text: str | None = text
        self._count = count  # items of the wanted keys (one per chunk of their entries)
        self._span = span
        self._wanted = wanted
        self._build = build
        self._source = source
        self._built: dict[MetadataIndex, Any] = {}

    def prepare(self, indexes: Iterable[MetadataIndex]) -> None:
        """Build the items of ``indexes`` (found by key and offset, as a dict finds a
        ``MetadataIndex``), in one pass over the text. Where they are most of the
        wanted keys' items (more than :data:`SELECTIVE`), or an item is spelled
        otherwise than the writer spells it, every item of the wanted keys is built
        instead (which costs less then)."""
        if self._text is None:
            return
        asked = list(indexes)
        if len(asked) > SELECTIVE * self._count:
            self._complete()
            return
        needed = {_where(i) for i in asked if i not in self._built}
        if needed:
            self._add(self._matched(needed))

    def _matches(self, fqns: Collection[str]) -> Iterator[tuple[str, re.Match[str]]]:
        """``(key, match)`` of every item of the keys ``fqns``, matched as the writer
        spells it; the others stepped over after their key. Raises :class:`_Spelled`
        at the first item spelled otherwise."""
        text, match, skip = self._text, _ITEM.match, SKIP_ITEM.match
        assert text is not None
        pos, end = self._span[0] + 1, self._span[1]
        if text[pos] == "]":
            pos += 1
        while pos < end:
            if text[pos : pos + 2] != '["':
                raise _Spelled
            try:
                key, after_key = scan_string(text, pos + 2)
            except ValueError:
                raise _Spelled from None
            m = match(text, pos) if key in fqns else skip(text, after_key)
            if m is None:
                raise _Spelled
            if m.re is _ITEM:
                yield key, m
            pos = m.end()
            if text[pos : pos + 1] == ",":
                pos += 1
            elif text[pos : pos + 1] == "]":
                pos += 1
                break
            else:
                raise _Spelled
        if pos != end:
            raise CorruptCheckpointError(f"{self._source}: the items array is malformed")

    def _matched(self, needed: Collection[tuple[str, str]]) -> Iterator[Any]:
        """The ``(index, info)`` pairs of the items whose key and offsets (as text) are in
        ``needed``; every item of the wanted keys (by the JSON scanner) from the first
        item spelled otherwise."""
        keys, parts, files = self._build
        try:
            for fqn, m in self._matches({key for key, _ in needed}):
                _, offsets, index, file, start, length = m.groups()
                if (fqn, offsets) in needed:
                    shared = None if offsets == "null" else parts.size(_ints(offsets))
                    hint = None if index == "null" else int(index)
                    info = StorageInfo(files[int(file)], int(start), int(length))
                    yield index_at(keys.get(fqn, fqn), shared, hint), info
        except _Spelled:
            yield from self._scanned()

    def _scanned(self) -> Iterator[Any]:
        """Every item of the wanted keys, read by the JSON scanner (any spelling)."""
        assert self._text is not None
        keys, parts, files = self._build
        cursor = JsonCursor(self._text)
        cursor.pos = self._span[0]
        try:
            select = None if self._wanted is None else (SKIP_ITEM, self._wanted)
            for element in cursor.elements(select):
                yield build_item(keys, parts, files, element)
        except json.JSONDecodeError as exc:
            raise CorruptCheckpointError(f"{self._source}: not a JSON index ({exc})") from None
        if cursor.pos != self._span[1]:
            raise CorruptCheckpointError(f"{self._source}: the items array is malformed")

    def files_of(self, fqns: Collection[str]) -> set[str]:
        """The files (relative paths) holding items of the keys ``fqns``, without
        building the items where they are still pending."""
        if self._text is not None:
            files = self._build[2]
            try:
                return {files[int(m[4])] for _, m in self._matches(fqns)}
            except _Spelled:
                self._complete()
            except IndexError:
                raise CorruptCheckpointError(
                    f"{self._source}: an item's file is out of range"
                ) from None
        return {info.relative_path for index, info in self._built.items() if index.fqn in fqns}

    def _complete(self) -> None:
        """Build every item of the wanted keys (then the text is let go)."""
        if self._text is not None:
            self._built = {}
            self._add(self._scanned())
            self._text = None

    def _add(self, pairs: Iterable[tuple[MetadataIndex, Any]]) -> None:
        try:
            new = dict(pairs)
        except MALFORMED as e:
            raise malformed(self._source, e) from None
        check_metadata(Metadata(state_dict_metadata={}, storage_data=new), self._source)
        if self._built:
            self._built.update(new)
        else:
            self._built = new

    def __getitem__(self, index: MetadataIndex) -> Any:
        try:
            return self._built[index]
        except KeyError:
            if self._text is None:
                raise
        self._complete()
        return self._built[index]

    def __iter__(self) -> Iterator[MetadataIndex]:
        self._complete()
        return iter(self._built)

    def __len__(self) -> int:
        self._complete()
        return len(self._built)

    def __repr__(self) -> str:
        state = "complete" if self._text is None else f"{len(self._built)} built"
        return f"PendingItems({state})"


__all__ = [
    "INTS",
    "MALFORMED",
    "PendingItems",
    "SKIP_ITEM",
    "build_item",
    "items_end",
    "malformed",
]
