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

A contiguous range of the tensor bytes (a range of a matrix's rows, as a load after a
change of the tensor-parallel size asks for; any range of a flat tensor, as a load of
the distributed optimizer's state after a change of the data-parallel size does) is
read the same way: the range into the destination, with the rest of the checksum
blocks it touches into small buffers, after the records before the tensor bytes (a
small read: they tell apart the layouts of one item length, :func:`choose_layout`).

The records read must be the layout's (all of them for a whole item, those before the
tensor bytes for a range), else the item is read the usual way (its destination is
filled again). The CRCs are compared with the record by :meth:`LargeCheck.verify`,
which the reader calls after the next item was read (as it verifies an item read the
usual way), so that the hashing thread's last piece is hashed meanwhile; damage in a
block read is reported by the same error, naming the same item and block, as on the
usual path (which also reads, and so verifies, the blocks of the item's edges).

Only the plain case is read this way (:func:`region_of`): bytes of the stored tensor
taken as they are by a contiguous CPU destination of its dtype, from a local file, in
one thread (not a read the reader cuts into parts for several threads).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from .byte_ranges import DataFile, mismatch_error
from .checksums import BlockHasher, whole_blocks
from .item_checksums import ItemChecksum
from .item_reader import KnownLayout
from .positional import read_all_at
from .tensor_bytes import buffer_of, element_span

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
    expected: list[int]  # the recorded CRCs of the blocks read, from first_block on
    first_block: int = 0
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
        first block whose CRC differs from the record (once: then there is nothing
        left to compare)."""
        found, expected = self.settle(), self.expected
        self.found, self.expected = [], []
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
            (self.first_block + b) * self.block_bytes,
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


def region_of(
    read_item: ReadItem, layout: KnownLayout, target: torch.Tensor
) -> tuple[int, int] | None:
    """Where the bytes ``read_item`` asks for lie in an item of ``layout``, as ``(item
    offset, bytes)``: where they are one contiguous range of the stored tensor (all of
    it, a range of its rows, any range of a flat one) and ``target`` takes them as they
    are (a contiguous CPU tensor of the stored dtype and the requested shape). Else None:
    the usual path converts, stages or gathers them, and reports a bad request."""
    record = layout.record
    offsets, lengths = tuple(read_item.storage_offsets), tuple(read_item.lengths)
    if (
        not target.is_cpu
        or target.dtype != record.dtype
        or not target.is_contiguous()
        or tuple(target.shape) != lengths
        or len(offsets) != len(record.shape)
    ):
        return None
    numel = target.numel()
    if not numel or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, record.shape)):
        return None
    first, last = element_span(record.shape, record.storage_offset, offsets, lengths)
    if last - first + 1 != numel:  # strided: columns of a matrix, say
        return None
    size = target.element_size()
    return record.data_offset + first * size, numel * size


def _is_whole(layout: KnownLayout, region: tuple[int, int], length: int) -> bool:
    """Whether ``region`` is all the tensor bytes of an item of ``layout``."""
    start, nbytes = region
    return start == len(layout.head) and start + nbytes + layout.tail_length == length


def choose_layout(
    file: DataFile,
    read_item: ReadItem,
    span: tuple[int, int],
    target: torch.Tensor,
    layouts: Sequence[KnownLayout],
) -> tuple[KnownLayout, tuple[int, int]] | None:
    """Which of ``layouts`` (those of the item's length) the item at ``span``
    (``(offset, length)`` in ``file``) has, and the region of it ``read_item`` asks
    for (:func:`region_of`); None: the usual path reads it. Where the request is all of
    a layout's tensor bytes, that layout (its records are checked as the item is read);
    else the records before the tensor bytes are read (a small read) to tell the layouts
    of this length apart: items of several shapes can have the same length."""
    partial = False
    for layout in layouts:
        region = region_of(read_item, layout, target)
        if region is not None and _is_whole(layout, region, span[1]):
            return layout, region
        partial = partial or region is not None
    if not partial:
        return None
    assert file.fd is not None
    head = bytearray(min(span[1], max(len(k.head) for k in layouts)))
    read_all_at(file.fd, [head], span[0], len(head), _short(file, read_item))
    for layout in layouts:
        if head[: len(layout.head)] == layout.head:
            region = region_of(read_item, layout, target)
            return None if region is None else (layout, region)
    return None


def read_large(
    file: DataFile,
    read_item: ReadItem,
    span: tuple[int, int],
    target: torch.Tensor,
    chosen: tuple[KnownLayout, tuple[int, int]],
    checksum: ItemChecksum | None,
    block_bytes: int,
    hasher: ThreadPoolExecutor | None,
) -> LargeCheck | None:
    """Read the region of the item at ``span`` (``(offset, length)`` in ``file``, which
    has a descriptor) that ``read_item`` asks for into ``target``; ``chosen``: the
    item's layout and that region, from :func:`choose_layout`; ``checksum``: the item's
    record (None: not verified), in blocks of ``block_bytes``. Where the region is all
    the tensor bytes, the whole item is read and its records before and after them
    are checked against the layout; else the region is read with the rest of the
    checksum blocks it touches (where verified). Returns the check to run
    (:meth:`LargeCheck.verify`), or None where the records read are not the layout's
    (the caller reads the item the usual way; ``target`` holds the file's bytes
    meanwhile).

    Raises:
        CorruptCheckpointError: the file ended early.
    """
    assert file.fd is not None
    offset, length = span
    layout, region = chosen
    start, nbytes = region
    whole = _is_whole(layout, region, length)
    if whole:
        lo, hi = 0, length
    elif checksum is None or block_bytes <= 0:
        lo, hi = start, start + nbytes
    else:
        lo, hi = whole_blocks(start, start + nbytes, block_bytes, length)
    before, after = _edges(start - lo, hi - start - nbytes, reuse=hasher is None)
    data = memoryview(buffer_of(target)).cast("B")
    buffers = [before, data, after]
    check = LargeCheck(
        file, read_item, offset, length, block_bytes, [], target=(target.data_ptr(), nbytes)
    )
    if checksum is None or block_bytes <= 0:
        read_all_at(file.fd, buffers, offset + lo, hi - lo, _short(file, read_item))
    else:
        check.first_block = lo // block_bytes
        check.expected = checksum.blocks[check.first_block : -(-hi // block_bytes)]
        _read_checked(file, read_item, offset + lo, buffers, check, hasher)
    if whole and (bytes(before) != layout.head or not layout.tail_matches(bytes(after))):
        check.settle()  # the hashing thread is done with the destination
        return None
    return check


_scratch = threading.local()


def _edges(first: int, last: int, reuse: bool) -> tuple[memoryview, memoryview]:
    """Buffers of ``first`` and ``last`` bytes for the bytes read around a region (up
    to a checksum block each). ``reuse``: from this thread's scratch buffer, which the
    next read reuses (the checks are computed before the read returns); else fresh
    ones (the hashing thread reads them later). Fresh buffers of a block each cost
    page faults at every read: a flat optimizer state of 64 ranges took 6% longer."""
    if not reuse:
        return memoryview(bytearray(first)), memoryview(bytearray(last))
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < first + last:
        buf = _scratch.buf = bytearray(first + last)
    view = memoryview(buf)
    return view[:first], view[first : first + last]


def _read_checked(
    file: DataFile,
    read_item: ReadItem,
    at: int,
    buffers: list[memoryview],
    check: LargeCheck,
    hasher: ThreadPoolExecutor | None,
) -> None:
    """Read ``buffers`` (bytes of the item back to back from a block boundary, at file
    offset ``at``) a piece at a time, adding each piece's block CRCs to ``check``."""
    assert file.fd is not None
    size = check.block_bytes
    piece = max(size, (_THREAD_PIECE if hasher else _CACHE_PIECE) // size * size)
    short = _short(file, read_item)
    bounds = []  # (offset of the buffer's first byte from ``at``, buffer)
    total = 0
    for buf in buffers:
        bounds.append((total, buf))
        total += len(buf)
    for lo in range(0, total, piece):
        hi = min(lo + piece, total)
        parts = [
            buf[max(lo, pos) - pos : min(hi, pos + len(buf)) - pos]
            for pos, buf in bounds
            if pos < hi and lo < pos + len(buf)
        ]
        read_all_at(file.fd, parts, at + lo, hi - lo, short)
        if hasher is None:
            check.found.append(_piece_crcs(parts, size))
        else:
            check.found.append(hasher.submit(_piece_crcs, parts, size))


def _short(file: DataFile, read_item: ReadItem) -> Any:
    return lambda at: file.short_read(at, read_item)


__all__ = ["LargeCheck", "choose_layout", "fits", "read_large", "region_of"]
