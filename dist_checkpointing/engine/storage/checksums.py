"""Checksums of checkpoint bytes: CRC32C per block, computed while writing.

Every data item (one tensor chunk or one bytes object in a ``.distcp`` file) is
checksummed in blocks of ``CHECKSUM_BLOCK_BYTES`` (a knob, default 1 MiB) counted
from the item's first byte, as its bytes go to the file: :class:`.item_stream.ChecksumStream`
wraps the open file, so there is no second read pass. Whole small files
(``.metadata``, ``common.pt``, ``metadata.json``) are checksummed the same way,
counted from the file's first byte.

A reader verifies exactly the blocks it reads: :class:`BlockVerifier` collects the
pieces of an item as they arrive (zip headers, the tensor bytes read straight into
their destination, the tail), in any order, and checks each block it touched; the
few bytes of a touched block that were not read (a partial, resharded read) are
fetched once. CRC32C comes from the ``crc32c`` package (hardware-accelerated,
about 15 GB/s per core here). A large item read in place is read a block at a time and
each block is checksummed on a helper thread (:func:`hashing_thread`) while the next
block is read, so that a spare core hides the checksum.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c

from .. import knobs
from ..process import cores_per_rank, spare_core
from .item_checksums import ItemChecksum

ALGORITHM = "crc32c"

# The CRC-32 of the zip format (the records of a ``torch.save`` archive, which the
# ``torch_dist`` layout writes per item): ISA-L's where the ``isal`` extra is installed,
# the same function with the same values at about 10x the speed of zlib's (21-57 against
# 4.2 GB/s per core on the development VM); both release the GIL for large buffers.
zip_crc32: Callable[..., int]
try:
    from isal.isal_zlib import crc32 as zip_crc32
except ImportError:
    from zlib import crc32 as zip_crc32


#: ``crc(data, value=0)``: the CRC32C of ``data`` (bytes-like), continuing from ``value``:
#: the C function itself, no Python frame per call (loops call it per small item).
crc: Callable[..., int] = _crc32c.crc32c


def crc_each(buffers: Iterable[Any]) -> list[int]:
    """The CRC32C of each buffer, in one C-level loop (no Python frame per buffer)."""
    return list(map(_crc32c.crc32c, buffers))


def whole_blocks(lo: int, hi: int, block_bytes: int, length: int) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of an item of ``length`` bytes widened to whole checksum blocks
    (the last one may end at the item's end); unchanged without blocks (0)."""
    if not block_bytes:
        return lo, hi
    return lo // block_bytes * block_bytes, min(-(-hi // block_bytes) * block_bytes, length)


def block_crcs(data: Any, block_bytes: int) -> list[int]:
    """The CRC32C of each ``block_bytes`` block of ``data`` (one entry for empty data)."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return [crc(b"")]
    return [crc(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


_hasher: ThreadPoolExecutor | None = None
_hasher_lock = threading.Lock()


def _forget_hasher() -> None:  # a forked child has the executor but not its thread
    global _hasher
    _hasher = None


os.register_at_fork(after_in_child=_forget_hasher)


def hashing_thread(readers: int = 1) -> ThreadPoolExecutor | None:
    """The threads that checksum blocks of large reads while the reader reads the next
    block (the ``CHECKSUM_THREAD`` knob: 0 never, 1 always, 2 (the default) when the host
    has a core beyond the ``readers`` threads each rank reads with, see
    :func:`..process.spare_core`). None means: checksum inline, each block right after it
    was read, while it is still in the CPU's cache, which costs less CPU than a hand-off
    where every core is busy copying. CRC32C releases the GIL, so the pool's threads (up
    to 4, one core of the rank's share left to the reader) hash blocks side by side."""
    global _hasher
    mode = knobs.CHECKSUM_THREAD.get()
    if mode == 0 or (mode >= 2 and not spare_core(readers)):
        return None
    with _hasher_lock:
        if _hasher is None:
            workers = max(1, min(4, cores_per_rank() - 1))
            _hasher = ThreadPoolExecutor(workers, thread_name_prefix="dist-ckpt-crc32c")
        return _hasher


def block_size() -> int:
    """The block size new saves use (the ``CHECKSUM_BLOCK_BYTES`` knob)."""
    return knobs.CHECKSUM_BLOCK_BYTES.get()


@dataclass
class FileEntry:
    """One whole file: its size and block checksums (counted from its first byte)."""

    size: int
    blocks: list[int]

    @classmethod
    def of(cls, data: Any, block_bytes: int) -> FileEntry:
        """The entry of a file whose whole content is ``data``."""
        return cls(len(data), block_crcs(data, block_bytes))


class BlockHasher:
    """The CRC32C of each ``block_bytes`` block of one item, fed in pieces of any size.

    The state of the current block is kept inline: most pieces (zip headers, small
    tensors) fall within one block and cost one CRC32C call.
    """

    __slots__ = ("block_bytes", "blocks", "crc", "filled")

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.blocks: list[int] = []
        self.crc = 0
        self.filled = 0

    def feed(self, data: Any, size: int) -> None:
        """Add ``data`` (``size`` bytes) to the item."""
        if self.filled + size < self.block_bytes:
            self.crc = _crc32c.crc32c(data, self.crc)
            self.filled += size
            return
        view = memoryview(data).cast("B")
        pos = 0
        while pos < size:
            take = min(self.block_bytes - self.filled, size - pos)
            self.crc = _crc32c.crc32c(view[pos : pos + take], self.crc)
            self.filled += take
            pos += take
            if self.filled == self.block_bytes:
                self.blocks.append(self.crc)
                self.crc = 0
                self.filled = 0

    def feed_all(self, parts: Sequence[Any], sizes: Sequence[int], total: int) -> None:
        """Add ``parts`` back to back (``sizes`` bytes each, ``total`` together): one
        call for the pieces of a small item (its zip records and its tensor bytes)."""
        if self.filled + total < self.block_bytes:
            value = self.crc
            for part in parts:
                value = _crc32c.crc32c(part, value)
            self.crc = value
            self.filled += total
            return
        for part, size in zip(parts, sizes):
            self.feed(part, size)

    def finish(self) -> list[int]:
        """The item's block checksums (one, of nothing, for an empty item)."""
        if self.filled or not self.blocks:
            self.blocks.append(self.crc)
        return self.blocks


class ChecksumMismatch(Exception):
    """Raised by :class:`BlockVerifier` (the reader turns it into our public error)."""

    def __init__(self, offset: int, expected: int, found: int) -> None:
        super().__init__(f"block at item offset {offset}: crc32c {found:08x} != {expected:08x}")
        self.offset = offset
        self.expected = expected
        self.found = found


@dataclass
class BlockVerifier:
    """Checks the blocks of one item that a reader touched.

    ``add(offset, view)`` records bytes read at ``offset`` of the item (the view must
    stay valid until :meth:`finish`, unless added ``transient``); ``finish(fetch)``
    checks every touched block, calling ``fetch(offset, n)`` for bytes of a touched
    block nobody read.
    """

    checksum: ItemChecksum
    block_bytes: int
    # Bytes kept for the blocks not covered yet (views of what was read, or copies).
    pieces: list[tuple[int, memoryview]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) read
    # CRCs of the blocks a piece covered whole, computed when it was added (while its
    # bytes were still in the CPU's cache: a reader adds a large read block by block).
    covered: dict[int, int] = field(default_factory=dict)

    def add(
        self, offset: int, data: Any, values: list[int] | None = None, transient: bool = False
    ) -> None:
        """Record ``data`` read at item offset ``offset``. ``values``: the
        :func:`block_crcs` of ``data``, if already computed (used when ``offset`` is at
        a block start; a last value that is not a whole block is not used).
        ``transient``: ``data`` is reused once this returns (a staging buffer): the
        bytes of its blocks not covered whole are copied."""
        view = memoryview(data).cast("B")
        if not len(view):
            return
        self.spans.append((offset, len(view)))
        size, length = self.block_bytes, self.checksum.length
        end = offset + len(view)
        if values is not None and offset % size == 0:
            first = offset // size
            for i, value in enumerate(values):
                if min(offset + (i + 1) * size, length) <= end:  # a whole block
                    self.covered[first + i] = value
        else:
            b = -(-offset // size)  # the first block starting inside the piece
            while b * size < end and min((b + 1) * size, length) <= end:
                start = b * size - offset
                self.covered[b] = crc(view[start : start + min(size, length - b * size)])
                b += 1
        if not transient:
            self.pieces.append((offset, view))
            return
        for b in sorted({offset // size, (end - 1) // size}):  # the partial blocks at its ends
            if b not in self.covered:
                lo, hi = max(b * size, offset), min((b + 1) * size, end)
                self.pieces.append((lo, memoryview(bytes(view[lo - offset : hi - offset]))))

    def touched_blocks(self) -> list[int]:
        touched: set[int] = set()
        for offset, n in self.spans:
            first = offset // self.block_bytes
            last = (offset + n - 1) // self.block_bytes
            touched.update(range(first, last + 1))
        return sorted(touched)

    def check_whole(self, data: Any) -> None:
        """Verify an item held wholly in memory (the fast path: no pieces to sort)."""
        expected = self.checksum.blocks
        if len(data) <= self.block_bytes:  # one block: most small items
            value = int(_crc32c.crc32c(data))
            if len(expected) != 1 or expected[0] != value:
                raise ChecksumMismatch(0, expected[0] if expected else -1, value)
            return
        found = block_crcs(data, self.block_bytes)
        for b in range(max(len(found), len(expected))):
            value = found[b] if b < len(found) else -1
            recorded = expected[b] if b < len(expected) else -1
            if value != recorded:
                raise ChecksumMismatch(b * self.block_bytes, recorded, value)

    def finish(self, fetch: Callable[[int, int], memoryview]) -> None:
        """Verify the touched blocks."""
        pieces = sorted(self.pieces, key=lambda p: p[0])
        blocks = self.touched_blocks()
        for b in blocks:
            start = b * self.block_bytes
            end = min(start + self.block_bytes, self.checksum.length)
            if b >= len(self.checksum.blocks):
                raise ChecksumMismatch(start, -1, -1)
            value = self.covered.get(b)
            if value is None:
                value = _crc_of_range(pieces, start, end, fetch)
            if value != self.checksum.blocks[b]:
                raise ChecksumMismatch(start, self.checksum.blocks[b], value)
        self.pieces.clear()
        self.spans.clear()
        self.covered.clear()


def _crc_of_range(
    pieces: Sequence[tuple[int, memoryview]],
    start: int,
    end: int,
    fetch: Callable[[int, int], memoryview],
) -> int:
    """CRC32C of item bytes [start, end) from the sorted pieces, fetching the gaps."""
    value = 0
    pos = start
    for offset, view in pieces:
        if offset + len(view) <= pos:
            continue
        if offset >= end:
            break
        if offset > pos:
            value = crc(fetch(pos, offset - pos), value)
            pos = offset
        stop = min(end, offset + len(view))
        value = crc(view[pos - offset : stop - offset], value)
        pos = stop
        if pos >= end:
            break
    if pos < end:
        value = crc(fetch(pos, end - pos), value)
    return value


__all__ = [
    "ALGORITHM",
    "BlockHasher",
    "BlockVerifier",
    "ChecksumMismatch",
    "FileEntry",
    "block_crcs",
    "block_size",
    "crc",
    "crc_each",
    "hashing_thread",
    "whole_blocks",
    "zip_crc32",
]
