"""Byte ranges of data files: what the reader reads, and the checks on every read.

:class:`DataFile` is one open data file: range checks against its real size,
short-read detection, and a window that serves small neighbouring items with one
read. :class:`ItemBytes` is one item's bytes (from the window or read in place,
straight into a destination tensor), each piece handed to the item's
:class:`~.checksums.BlockVerifier` so that exactly the bytes read are verified.

A large read of a local file may be cut into parts at checksum block boundaries, read
by threads side by side (:attr:`ItemBytes.part_bytes`, set by the reader from its share
of bytes per thread, see :mod:`.read_spans`): each part's blocks are read and
checksummed on its thread, and handed to the verifier in order once all are read.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import ChecksumMismatchError, CorruptCheckpointError
from .base import ReadStream
from .checksums import BlockVerifier, ChecksumMismatch, block_crcs, crc, hashing_thread
from .positional import descriptor, vectored_all
from .tensor_bytes import byte_view

# --------------------------------------------------------------------------- file access


class DataFile:
    """One open data file; serves small items from a window of bytes read at once."""

    def __init__(
        self, stream: ReadStream, path: str, size: int, limits: tuple[int, int, int]
    ) -> None:
        self.stream = stream
        self.path = path
        self.size = size
        self.limits = limits  # FileSystemIO.read_limits(): (small item, max gap, window)
        self.window_start = 0
        self.window = memoryview(b"")
        self.window_address = 0  # address of the window's first byte
        self.readers = 1  # threads keeping a core busy reading (see checksums.hashing_thread)
        self.fd = descriptor(stream)  # None: read in order through the stream

    def check_range(self, offset: int, length: int, read_item: ReadItem) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CorruptCheckpointError(
                f"{self.path} is truncated: item {read_item.storage_index.fqn!r} "
                f"(offset {offset}, length {length}) ends at byte {offset + length}, "
                f"but the file has {self.size} bytes"
            )

    def load_window(
        self, items: Sequence[tuple[ReadItem, Any]], i: int, most: int | None = None
    ) -> int:
        """Fetch items[i:j] of small neighbours with one read (if worth it); return j.
        ``most``: a smaller window than the file's limit.

        Returns ``i + 1`` without reading when items[i] is large (it is read in place).
        """
        # Small items are fetched together with their neighbours, in reads of up to
        # READ_WINDOW_BYTES, skipping gaps of at most READ_MAX_GAP_BYTES (see knobs;
        # object stores, where each request costs, use larger limits).
        small, max_gap, window = self.limits
        if most is not None:
            window = min(window, most)
        start = items[i][1].offset
        end = start + items[i][1].length
        if items[i][1].length > small:
            return i + 1
        j = i + 1
        while j < len(items):
            info = items[j][1]
            if (
                info.length > small
                or info.offset - end > max_gap
                or max(end, info.offset + info.length) - start > window
            ):
                break
            end = max(end, info.offset + info.length)
            j += 1
        # From torch's allocator, which backs a large buffer with huge pages: 16 MiB
        # windows filled from the page cache took 111-125 ms per 512 MiB against 165 ms
        # in a bytearray's 4 KiB pages.
        block = torch.empty(max(1, end - start), dtype=torch.uint8)
        landed = block.numpy().data[: end - start]
        self.readinto(start, landed, items[i][0])
        self.window_start = start
        self.window = landed
        self.window_address = block.data_ptr()
        return j

    def readinto(self, offset: int, buf: memoryview, read_item: ReadItem) -> None:
        self.stream.seek(offset)
        done = 0
        while done < len(buf):
            n = self.stream.readinto(buf[done:])
            if not n:
                raise self.short_read(offset + done, read_item)
            done += n

    def pread_into(self, offset: int, buf: memoryview, read_item: ReadItem) -> None:
        """:meth:`readinto` at ``offset`` without the stream's position (a local file:
        :attr:`fd` is set), so that several threads read the file at once."""
        assert self.fd is not None
        vectored_all(os.preadv, self.fd, [buf], offset, lambda at: self.short_read(at, read_item))

    def short_read(self, at: int, read_item: ReadItem) -> CorruptCheckpointError:
        """The error for a read of ``read_item`` that found the file's end at ``at``."""
        return CorruptCheckpointError(
            f"{self.path}: short read at byte {at} while reading item "
            f"{read_item.storage_index.fqn!r} (the file may have been truncated)"
        )


def mismatch_error(
    path: str, offset: int, length: int, read_item: ReadItem, at: int, expected: int, found: int
) -> ChecksumMismatchError:
    """The error for the item at ``offset`` (``length`` bytes) of ``path`` whose bytes
    from item offset ``at`` have crc32c ``found`` where ``expected`` was recorded."""
    key = str(read_item.storage_index.fqn)
    return ChecksumMismatchError(
        f"checksum mismatch in {path} at byte {offset + at} (item {key!r} at offset "
        f"{offset}, length {length}; crc32c {found:08x}, recorded {expected:08x}): the "
        f"file was damaged or comes from another save",
        key=key,
        file=path,
        offset=offset + at,
    )


# Checksum blocks read per piece when the hashing thread checksums them.
_BLOCKS_PER_PIECE = 8

# Bytes read at once from each end of a large item: its zip headers and directory.
_EDGE_BYTES = 4096

# Where an unverified read is cut into parts: at multiples of this (from the item's start).
_PART_UNIT = 1 << 20


# What the hashing of one read piece yields: the CRCs of the blocks it starts (for
# BlockVerifier.add; None where it starts inside a block) and the CRCs of blocks it
# completed with the item's edges, by block index.
_PieceChecks = tuple[list[int] | None, dict[int, int]]


def part_count(n: int, part_bytes: int) -> int:
    """Into how many parts a read of ``n`` bytes is cut, for threads that each read about
    ``part_bytes`` (0: never cut); under 2: read in one go."""
    return (n + part_bytes // 2) // part_bytes if part_bytes > 0 else 0


def _piece_checks(
    piece: memoryview,
    size: int,
    block: int,
    before: memoryview | None,
    after: memoryview | None,
    ends_block: bool,
    starts_block: bool = True,
) -> _PieceChecks:
    """The checks of ``piece``, whose first byte lies in block ``block`` of its item.
    ``starts_block``: the piece starts where that block starts; else it lies within
    that one block, and ``before`` holds the bytes of the block before the piece, where
    they are held; ``after``: the bytes of the piece's last block after it, where held;
    ``ends_block``: the piece ends where its last block ends (the item's end included).
    A piece that starts inside a block whose first bytes are not held yields no CRC:
    :meth:`BlockVerifier.finish` reads what the block lacks."""
    if before is not None:
        value = crc(piece, crc(before))
        if after is not None:
            return None, {block: crc(after, value)}
        return None, ({block: value} if ends_block else {})
    if not starts_block:
        return None, {}
    values = block_crcs(piece, size)
    if after is not None:
        return values, {block + len(values) - 1: crc(after, values[-1])}
    return values, {}


class ItemBytes:
    """The bytes of one item: a slice of the file's window, or read from the file."""

    def __init__(self, file: DataFile, offset: int, length: int, read_item: ReadItem) -> None:
        self.file = file
        self.offset = offset
        self.length = length
        self.read_item = read_item
        pos = offset - file.window_start
        in_window = pos >= 0 and pos + length <= len(file.window)
        self.view = file.window[pos : pos + length] if in_window else None
        self.address = file.window_address + pos  # valid when windowed
        self._head: memoryview | None = None  # the first and last _EDGE_BYTES
        self._tail: memoryview | None = None
        self.verifier: BlockVerifier | None = None
        # Reads of 1.5 times this or more are cut into parts read side by side (0: never).
        self.part_bytes = 0
        # Pieces whose block CRCs the hashing thread is computing (see _read_verified).
        self._hashing: list[tuple[int, memoryview, Future[_PieceChecks]]] = []

    def verify(self) -> None:
        """Check every checksum block of the item that was read (see :mod:`.checksums`).
        A reader may call it after reading the next item: the CRCs of this item's last
        pieces are then computed while that read runs."""
        if self.verifier is None:
            return
        try:
            for at, piece, checks in self._hashing:
                self._add_checked(at, piece, checks.result())
            self._hashing.clear()
            if self.view is not None:  # the whole item is in memory: check it all
                self.verifier.check_whole(self.view)
            else:
                self.verifier.finish(self._read_unverified)
        except ChecksumMismatch as exc:
            raise mismatch_error(
                self.file.path,
                self.offset,
                self.length,
                self.read_item,
                exc.offset,
                exc.expected,
                exc.found,
            ) from None
        self.verifier = None

    def _read_unverified(self, offset: int, n: int) -> memoryview:
        buf = memoryview(bytearray(n))
        self.file.readinto(self.offset + offset, buf, self.read_item)
        return buf

    def read_at(self, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset`` of the item (small reads near its ends are cached)."""
        if self.view is not None:
            return self.view[offset : offset + n]
        if n <= _EDGE_BYTES and self.length > 2 * _EDGE_BYTES:
            # Each edge is read when first needed: a streamed file reads in order.
            if offset + n <= _EDGE_BYTES:
                if self._head is None:
                    self._head = self._read(0, _EDGE_BYTES)
                return self._head[offset : offset + n]
            tail_at = self.length - _EDGE_BYTES
            if offset >= tail_at:
                if self._tail is None:
                    self._tail = self._read(tail_at, _EDGE_BYTES)
                return self._tail[offset - tail_at : offset - tail_at + n]
        return self._read(offset, n)

    def _read(self, offset: int, n: int) -> memoryview:
        buf = self._read_unverified(offset, n)
        if self.verifier is not None:
            self.verifier.add(offset, buf)
        return buf

    def read_into_tensor(self, offset: int, t: torch.Tensor, transient: bool = False) -> None:
        """Fill contiguous CPU tensor ``t`` with ``t.nbytes`` bytes from ``offset``.
        ``transient``: ``t`` is reused once this returns (a staging buffer): its bytes
        are checksummed before it returns, and what :meth:`verify` still needs is kept
        as a copy (at most a block at each end)."""
        n = t.nbytes
        if offset < 0 or offset + n > self.length:
            raise CorruptCheckpointError(f"{self.describe()}: tensor bytes out of range")
        if n == 0:
            return
        if self.view is not None:
            ctypes.memmove(t.data_ptr(), self.address + offset, n)
            return
        view = byte_view(t).numpy().data
        parts = None if transient else self._parts(offset, n)
        if parts is not None:
            self._read_parts(offset, view, parts)
        elif self.verifier is None:
            self.file.readinto(self.offset + offset, view, self.read_item)
        else:
            self._read_verified(offset, view, transient)

    def _read_verified(self, offset: int, view: memoryview, transient: bool = False) -> None:
        """Read ``view`` from item offset ``offset`` a checksum block at a time. Each block
        is checksummed as it lands (while in the cache), on the hashing thread when there
        is one (see :func:`~.checksums.hashing_thread`), so that the next blocks are read
        meanwhile; the blocks are checked against the record by :meth:`verify`, before
        the load returns. The first and last block, shared with the zip header and
        directory, are completed from the item's edges already read (not read again)."""
        assert self.verifier is not None
        size, n = self.verifier.block_bytes, len(view)
        hasher = hashing_thread(self.file.readers) if n > size and not transient else None
        # With the hashing thread, read several blocks per piece (fewer hand-offs).
        span = size * (_BLOCKS_PER_PIECE if hasher else 1)
        for at, piece, job in self._pieces(offset, view, span, self.file.readinto):
            if hasher is None:
                self._add_checked(at, piece, job(), transient)
            else:
                self._hashing.append((at, piece, hasher.submit(job)))

    def _pieces(
        self, offset: int, view: memoryview, span: int, read: Callable[..., None]
    ) -> Iterator[tuple[int, memoryview, Callable[[], _PieceChecks]]]:
        """Read ``view`` from item offset ``offset`` with ``read``, in pieces of ``span``
        bytes that end at checksum block boundaries (the first may be shorter); yield each
        piece's item offset, bytes and the job that computes its checks."""
        assert self.verifier is not None
        size, n = self.verifier.block_bytes, len(view)
        pos = 0
        while pos < n:
            at = offset + pos
            step = min(size - at % size if at % size else span, n - pos)
            piece = view[pos : pos + step]
            read(self.offset + at, piece, self.read_item)
            end = at + step
            yield (
                at,
                piece,
                functools.partial(
                    _piece_checks,
                    piece,
                    size,
                    at // size,
                    self._edge_before(at),
                    self._edge_after(end),
                    end % size == 0 or end == self.length,
                    at % size == 0,
                ),
            )
            pos += step

    def _parts(self, offset: int, n: int) -> list[tuple[int, int]] | None:
        """Where to cut a read of ``n`` bytes from item offset ``offset`` into parts read
        side by side, as ``(start, stop)`` item offsets; None: read it in one go (no
        :attr:`part_bytes`, a stream without a descriptor, or too short to share). Parts
        start at checksum block boundaries, so that no block is shared by two threads."""
        count = part_count(n, self.part_bytes)
        if count < 2 or self.file.fd is None:
            return None
        unit = self.verifier.block_bytes if self.verifier is not None else _PART_UNIT
        cuts = [offset]
        for i in range(1, count):
            at = -(-(offset + n * i // count) // unit) * unit
            if cuts[-1] < at < offset + n:
                cuts.append(at)
        cuts.append(offset + n)
        return list(zip(cuts[:-1], cuts[1:])) if len(cuts) > 2 else None

    def _read_parts(self, offset: int, view: memoryview, parts: list[tuple[int, int]]) -> None:
        """Read ``parts`` of ``view`` (which starts at item offset ``offset``) on a thread
        each: a part's blocks are checksummed inline, as they land; the checks are handed
        to the verifier in order. Every part is finished, then the first failure in
        offset order is raised (what the other parts read is still verified)."""
        pread = self.file.pread_into

        def read_part(lo: int, hi: int) -> list[tuple[int, memoryview, _PieceChecks]]:
            sub = view[lo - offset : hi - offset]
            if self.verifier is None:
                pread(self.offset + lo, sub, self.read_item)
                return []
            size = self.verifier.block_bytes
            return [(at, p, job()) for at, p, job in self._pieces(lo, sub, size, pread)]

        with ThreadPoolExecutor(len(parts), thread_name_prefix="dist-ckpt-part") as pool:
            jobs = [pool.submit(read_part, lo, hi) for lo, hi in parts]
        error: BaseException | None = None
        for job in jobs:
            try:
                for at, piece, checks in job.result():
                    self._add_checked(at, piece, checks)
            except BaseException as exc:  # noqa: BLE001 - the first is raised below
                error = error or exc
        if error is not None:
            raise error

    def _edge_before(self, at: int) -> memoryview | None:
        """The item's bytes from the start of ``at``'s block to ``at``, if the head edge
        holds them (the zip header before the tensor bytes)."""
        assert self.verifier is not None
        start = at - at % self.verifier.block_bytes
        if at == start or self._head is None or at > len(self._head):
            return None
        return self._head[start:at]

    def _edge_after(self, end: int) -> memoryview | None:
        """The item's bytes from ``end`` to the end of its block, if the tail edge holds
        them (the zip directory after the tensor bytes)."""
        assert self.verifier is not None
        size = self.verifier.block_bytes
        stop = min(end - end % size + size, self.length)
        tail_at = self.length - _EDGE_BYTES
        if end % size == 0 or end >= stop or self._tail is None or end < tail_at:
            return None
        return self._tail[end - tail_at : stop - tail_at]

    def _add_checked(
        self, at: int, piece: memoryview, checks: _PieceChecks, transient: bool = False
    ) -> None:
        assert self.verifier is not None
        values, covered = checks
        self.verifier.add(at, piece, values, transient)
        self.verifier.covered.update(covered)

    def describe(self) -> str:
        return (
            f"{self.file.path}: item {self.read_item.storage_index.fqn!r} "
            f"(offset {self.offset}, length {self.length})"
        )


__all__ = ["DataFile", "ItemBytes", "mismatch_error", "part_count"]
