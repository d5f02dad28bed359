"""Large tensor items of a known layout read straight into their destinations:
:func:`read_large`.

The usual path reads a large item by parsing it first (its zip records at both ends,
read as 4 KiB edges and matched against the template), then reads its tensor bytes
into the destination a checksum block at a time, each block handed to a
:class:`~.checksums.BlockVerifier` with the edges that complete the first and last
block. Where the item's layout is already known (:func:`.item_reader.known_layouts`:
an item of the same length, shape and dtype was parsed before), none of that is
needed: the item is read from its first byte to its last in pieces of whole checksum
blocks, each piece one ``os.preadv`` into the records before the tensor bytes (a small
buffer), the destination itself and the records after them (another small buffer),
and each piece's block CRCs are computed as it lands (while its bytes are in the
CPU's cache, or on the hashing thread where a core is spare, see
:func:`~.checksums.hashing_thread`). Python per item drops from dozens of calls per
block to a few: a 1 GiB load of 200 tensors on one rank of the 2-core development VM
went from 4.2-5.5 to 6.1-6.5 GB/s (``python bench/table.py --ranks 1 --cases big``),
within 15% of the ``raw_bytes`` layout's.

The records read must be the layout's, else the item is read the usual way (its
destination is filled again). The CRCs are compared with the record by
:meth:`LargeCheck.verify`, which the reader calls after the next item was read (as it
verifies an item read the usual way), so that the hashing thread's last piece is
hashed meanwhile; damage is reported by the same error, naming the same item, as on
the usual path.

Only the plain case is read this way (:func:`fits`, as for small items):
a whole stored tensor into a contiguous CPU destination of its dtype, from a local
file, in one thread (not a read the reader cuts into parts for several threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from .byte_ranges import DataFile, mismatch_error
from .checksums import BlockHasher
from .item_checksums import ItemChecksum
from .item_reader import KnownLayout
from .positional import read_all_at
from .tensor_bytes import buffer_of

# Bytes read per piece (whole checksum blocks): checksummed inline while in the cache,
# or handed to the hashing thread (fewer, larger hand-offs).
_CACHE_PIECE = 1 << 20
_THREAD_PIECE = 8 << 20


def _piece_crcs(parts: Sequence[memoryview], block_bytes: int) -> list[int]:
    """The CRC32C of each ``block_bytes`` block of ``parts`` read back to back (a piece
    starts at a block boundary; its last block may be partial only at the item's end)."""
    hasher = BlockHasher(block_bytes)
    for part in parts:
        hasher.feed(part, len(part))
    return hasher.finish()


@dataclass
class LargeCheck:
    """The checksums of one item read by :func:`read_large`, compared by :meth:`verify`."""

    file: DataFile
    read_item: ReadItem
    offset: int
    length: int
    block_bytes: int
    expected: list[int]
    # Each piece's block CRCs, in order: computed, or being computed on the hashing thread.
    found: list[list[int] | Future[list[int]]] = field(default_factory=list)
    target: tuple[int, int] = (0, 0)  # the destination's memory: (address, bytes)

    def settle(self) -> list[int]:
        """Every block's CRC, in order (waits for the hashing thread)."""
        out: list[int] = []
        for piece in self.found:
            out += piece if isinstance(piece, list) else piece.result()
        return out

    def verify(self) -> None:
        """Raise :class:`~dist_checkpointing.errors.ChecksumMismatchError` naming the
        first block whose CRC differs from the record."""
        found, expected = self.settle(), self.expected
        self.found = []
        if found == expected:
            return
        b = next(
            (b for b, (x, y) in enumerate(zip(found, expected)) if x != y),
            min(len(found), len(expected)),
        )
        at_found = found[b] if b < len(found) else -1
        at_expected = expected[b] if b < len(expected) else -1
        raise mismatch_error(
            self.file.path,
            self.offset,
            self.length,
            self.read_item,
            b * self.block_bytes,
            at_expected,
            at_found,
        )

    def overlaps(self, target: torch.Tensor) -> bool:
        """Whether ``target``'s memory overlaps this item's destination."""
        start, n = self.target
        other = target.data_ptr()
        return start < other + target.nbytes and other < start + n


def fits(read_item: ReadItem, layout: KnownLayout, target: torch.Tensor) -> bool:
    """Whether ``read_item`` asks for the whole stored tensor of ``layout`` (which starts
    its storage) and ``target`` takes its bytes as they are."""
    record = layout.record
    return (
        record.storage_offset == 0
        and tuple(read_item.lengths) == record.shape
        and not any(read_item.storage_offsets)
        and target.is_cpu
        and target.dtype == record.dtype
        and target.is_contiguous()
        and target.nbytes == record.data_length
    )


def read_large(
    file: DataFile,
    read_item: ReadItem,
    offset: int,
    length: int,
    target: torch.Tensor,
    layout: KnownLayout,
    checksum: ItemChecksum | None,
    block_bytes: int,
    hasher: ThreadPoolExecutor | None,
) -> LargeCheck | None:
    """Read the item at ``offset`` (``length`` bytes) of ``file`` (which has a descriptor)
    into ``target``, expecting ``layout`` (``target`` takes its tensor bytes as they are:
    :func:`fits`); ``checksum``: its record (None: not verified), in blocks
    of ``block_bytes``. Returns the check to run (:meth:`LargeCheck.verify`), or None
    where the records read are not the layout's (the caller reads the item the usual
    way; ``target`` holds the file's bytes meanwhile).

    Raises:
        CorruptCheckpointError: the file ended early.
    """
    assert file.fd is not None
    head, tail = bytearray(len(layout.head)), bytearray(layout.tail_length)
    data = memoryview(buffer_of(target)).cast("B")
    buffers = [memoryview(head), data, memoryview(tail)]
    check = LargeCheck(
        file, read_item, offset, length, block_bytes, [], target=(target.data_ptr(), len(data))
    )
    if checksum is None or block_bytes <= 0:
        read_all_at(file.fd, buffers, offset, length, _short(file, read_item))
    else:
        check.expected = checksum.blocks
        _read_checked(file, read_item, offset, buffers, check, hasher)
    if bytes(head) != layout.head or not layout.tail_matches(bytes(tail)):
        check.settle()  # the hashing thread is done with the destination
        return None
    return check


def _read_checked(
    file: DataFile,
    read_item: ReadItem,
    offset: int,
    buffers: list[memoryview],
    check: LargeCheck,
    hasher: ThreadPoolExecutor | None,
) -> None:
    """Read ``buffers`` (the item's bytes back to back) a piece at a time, adding each
    piece's block CRCs to ``check``."""
    assert file.fd is not None
    size = check.block_bytes
    piece = max(size, (_THREAD_PIECE if hasher else _CACHE_PIECE) // size * size)
    short = _short(file, read_item)
    bounds = []  # (item offset of the buffer's first byte, buffer)
    pos = 0
    for buf in buffers:
        bounds.append((pos, buf))
        pos += len(buf)
    for lo in range(0, check.length, piece):
        hi = min(lo + piece, check.length)
        parts = [
            buf[max(lo, at) - at : min(hi, at + len(buf)) - at]
            for at, buf in bounds
            if at < hi and lo < at + len(buf)
        ]
        read_all_at(file.fd, parts, offset + lo, hi - lo, short)
        if hasher is None:
            check.found.append(_piece_crcs(parts, size))
        else:
            check.found.append(hasher.submit(_piece_crcs, parts, size))


def _short(file: DataFile, read_item: ReadItem) -> Any:
    return lambda at: file.short_read(at, read_item)


__all__ = ["LargeCheck", "fits", "read_large"]
