"""The item checksums of a data file, as the commit record holds them.

A save records, for every item (one tensor chunk or one bytes object) of every data
file, where it lies and the CRC32C of each of its blocks (:mod:`.checksums` computes
them as the bytes are written); a load finds an item's checksums by its offset. For a
checkpoint of 100,000 items these are held as columns (:class:`DataFileEntry`), not as
an object per item.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np


@dataclass
class ItemChecksum:
    """Checksums of one item: where it lies in its file and its block CRCs."""

    offset: int
    length: int
    blocks: list[int]


class DataFileEntry:
    """One data file: its size and the checksums of each item in it.

    The items are held as columns, not as an object each: their offsets (in order, a
    list to bisect), lengths, and all their block CRCs in one array with each item's
    first position. The commit record of 100,000 items takes about 6 MiB of them while
    a load reads, instead of 30 MiB of objects, lists and a dict by offset.
    :meth:`item_at` and :attr:`items` make :class:`ItemChecksum` objects on demand.
    """

    __slots__ = ("_crcs", "_lengths", "_offsets", "_starts", "size")

    def __init__(self, size: int, items: Iterable[ItemChecksum] = ()) -> None:
        self.size = size
        rows = list(items)
        self._columns([r.offset for r in rows], [r.length for r in rows], [r.blocks for r in rows])

    @classmethod
    def from_columns(
        cls, size: int, offsets: list[int], lengths: list[int], blocks: list[list[int]]
    ) -> DataFileEntry:
        """The entry of items given as three lists (row ``i`` is one item), in any order.

        Raises:
            ValueError: the lists differ in length, or a value does not fit 64 bits.
        """
        entry = cls.__new__(cls)
        entry.size = size
        entry._columns(offsets, lengths, blocks)
        return entry

    @classmethod
    def from_sorted(
        cls,
        size: int,
        offsets: np.ndarray,
        lengths: np.ndarray,
        crc_starts: np.ndarray,
        crcs: np.ndarray,
    ) -> DataFileEntry:
        """The entry of items given as int64 arrays in offset order: item ``i`` lies at
        ``offsets[i]``, is ``lengths[i]`` bytes long, and its block CRCs are
        ``crcs[crc_starts[i] - crc_starts[0]:crc_starts[i + 1] - crc_starts[0]]``.

        Raises:
            ValueError: the arrays do not agree in length, or the offsets are not in order.
        """
        return cls.split_sorted([size], [0, len(offsets)], offsets, lengths, crc_starts, crcs)[0]

    @classmethod
    def split_sorted(
        cls,
        sizes: Sequence[int],
        cuts: Sequence[int],
        offsets: np.ndarray,
        lengths: np.ndarray,
        crc_starts: np.ndarray,
        crcs: np.ndarray,
    ) -> list[DataFileEntry]:
        """The entries of several files at once (:meth:`from_sorted` of each): file
        ``f`` of size ``sizes[f]`` holds the items of rows ``cuts[f]:cuts[f + 1]``, in
        offset order within the file; checked once for all (a save of thousands of
        ranks commits thousands of files)."""
        n = len(offsets)
        if len(lengths) != n or len(crc_starts) != n + 1 or len(cuts) != len(sizes) + 1:
            raise ValueError("item offsets, lengths and checksums differ in number")
        first = int(crc_starts[0])
        if int(crc_starts[-1]) - first != len(crcs) or cuts[0] != 0 or cuts[-1] != n:
            raise ValueError("item offsets, lengths and checksums differ in number")
        if n > 1:
            falls = offsets[1:] < offsets[:-1]
            inner = np.asarray(cuts[1:-1], dtype=np.int64)
            falls[inner[(inner > 0) & (inner < n)] - 1] = False  # a new file starts again
            if bool(falls.any()):
                raise ValueError("item offsets are not in order")
        listed = offsets.tolist()
        starts = crc_starts - first if first else crc_starts
        out = []
        for f, size in enumerate(sizes):
            a, b = cuts[f], cuts[f + 1]
            entry = cls.__new__(cls)
            entry.size = size
            entry._offsets = listed[a:b]
            entry._lengths = lengths[a:b]
            lo = int(starts[a])
            entry._starts = starts[a : b + 1] - lo if lo else starts[a : b + 1]
            entry._crcs = crcs[lo : int(starts[b])]
            out.append(entry)
        return out

    def _columns(self, offsets: list[int], lengths: list[int], blocks: list[list[int]]) -> None:
        if not len(offsets) == len(lengths) == len(blocks):
            raise ValueError("item offsets, lengths and checksums differ in number")
        try:
            order = np.asarray(offsets, dtype=np.int64)
            if len(order) > 1 and bool((order[1:] < order[:-1]).any()):  # put in offset order
                rows = np.argsort(order, kind="stable").tolist()
                offsets = [offsets[i] for i in rows]
                lengths = [lengths[i] for i in rows]
                blocks = [blocks[i] for i in rows]
            starts = np.zeros(len(blocks) + 1, dtype=np.int64)
            np.cumsum([len(b) for b in blocks], out=starts[1:])
            self._crcs = np.fromiter(chain.from_iterable(blocks), np.int64, int(starts[-1]))
            self._lengths = np.asarray(lengths, dtype=np.int64)
        except OverflowError:
            raise ValueError("an item offset, length or checksum does not fit 64 bits") from None
        self._offsets = offsets
        self._starts = starts

    def __len__(self) -> int:
        return len(self._offsets)

    def columns(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """The items in offset order as plain lists: offsets, lengths, each item's first
        position in the CRCs (one more than there are items), all block CRCs."""
        return self._offsets, self._lengths.tolist(), self._starts.tolist(), self._crcs.tolist()

    def _item(self, row: int) -> ItemChecksum:
        start, end = int(self._starts[row]), int(self._starts[row + 1])
        return ItemChecksum(
            self._offsets[row], int(self._lengths[row]), self._crcs[start:end].tolist()
        )

    @property
    def items(self) -> list[ItemChecksum]:
        """Every item, in offset order (new objects at each call)."""
        return [self._item(row) for row in range(len(self._offsets))]

    def item_at(self, offset: int) -> ItemChecksum | None:
        """The item starting at byte ``offset`` (None if there is none)."""
        row = bisect.bisect_left(self._offsets, offset)
        if row == len(self._offsets) or self._offsets[row] != offset:
            return None
        return self._item(row)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataFileEntry):
            return NotImplemented
        return self.size == other.size and self.items == other.items

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it was

    def __repr__(self) -> str:
        return f"DataFileEntry(size={self.size}, items={len(self)})"


__all__ = ["DataFileEntry", "ItemChecksum"]
