"""Reading the bytes a load plans (:mod:`.load_plan`) from ``raw_bytes`` data files.

Files are read one after another, or on several threads where the storage says so
(``parallel_reads``: the ``READ_THREADS`` knob on a local file system, whose files' reads
are shared among the threads by bytes, see :mod:`..storage.read_spans`). Reads of one file
are sorted by offset; neighbours (separated by at most
``READ_MAX_GAP_BYTES``) go into one ``os.preadv`` call of up to 1,024 buffers,
each buffer the destination itself (a contiguous CPU tensor, a slice of a flat
block being assembled, or a staging buffer), so tensor bytes are copied once,
by the kernel. Every read is range-checked against the file's real size first
(a truncated file names the key), and every checksum block it covers is
verified right after the file's reads (``ChecksumMismatchError`` names key,
file and offset).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...errors import ChecksumMismatchError, CorruptCheckpointError
from .. import knobs
from ..storage.base import ReadStream
from ..storage.checksums import block_crcs, crc, crc_each, hashing_thread
from ..storage.location import CheckpointDir
from ..storage.positional import IOV_MAX, descriptor, vectored_all
from ..storage.read_spans import reading_threads, span_bytes, split_spans
from ..storage.tensor_bytes import buffer_of
from .index import RawIndex

# Verified reads are cut at about what a core's cache holds, so that an inline CRC reads
# bytes still in the cache: items above this are read and checked piece by piece, batches
# of small items are cut at this size.
_CACHE_BYTES = 1 << 20
_THREAD_PIECE = 8 << 20  # the pieces of a large item checked on the hashing thread


@dataclass
class Staged:
    """How a staged read is delivered: its bytes land ``lead`` bytes into a staging
    buffer (the lead puts the wanted elements on an element boundary), and, once they
    are verified, ``deliver(buffer)`` copies what is wanted out of that buffer (a
    ``uint8`` tensor of ``lead`` + the read's length)."""

    lead: int
    deliver: Callable[[torch.Tensor], None]

    def own_buffer(self, read: Read) -> Callable[[], None]:
        """Give ``read`` a staging buffer of its own (it is then read like any other);
        returns the copy to run once every read is done."""
        buf = torch.empty(self.lead + read.length, dtype=torch.uint8)
        read.dest = buffer_of(buf[self.lead :])
        read.stage = None
        return partial(self.deliver, buf)


@dataclass
class Read:
    """``length`` bytes of entry ``row`` from ``entry_offset`` into buffer ``dest``, or,
    for a staged read (``stage`` set, ``dest`` None until then), into staging memory
    the reader gives it.

    ``entry_offset`` is a multiple of the checksum block size and the read ends at a
    block boundary or at the entry's end, so each block it covers is verified whole.
    """

    row: int
    entry_offset: int
    length: int
    dest: Any
    at: int  # the offset in the data file: the entry's offset + entry_offset
    verified: bool = False
    stage: Staged | None = None


class _Staging:
    """The staging memory of one run of reads (one thread): a buffer that the run's
    staged reads share, those of one batch side by side, reused once they are delivered.
    It grows (at least doubling) when a read, or the batch before it, found no room, to at
    most ``cap`` bytes (the ``STAGING_BUFFER_BYTES`` knob); a staged read larger than that
    gets a buffer of its own, dropped once it is delivered."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.used = 0
        self.alone = False  # a read with a buffer of its own is landed: nothing beside it
        self.landed: list[tuple[Read, torch.Tensor]] = []
        self.wanted = 0  # the bytes the last batch did not find room for

    def land(self, r: Read) -> bool:
        """Give staged read ``r`` its place (its ``dest``); False where it does not fit
        beside those landed already (deliver them first)."""
        assert r.stage is not None
        n = r.stage.lead + r.length
        at = self.used
        if self.landed and (self.alone or at + n > len(self.buf)):
            self.wanted = max(self.wanted, at + n)
            return False
        if n > self.cap:
            self.alone = True
            self._hold(r, torch.empty(n, dtype=torch.uint8))
            return True
        need = max(at + n, self.wanted)
        if not self.landed and need > len(self.buf) and len(self.buf) < self.cap:
            # A larger buffer, for this read or for the batch that found no room.
            self.buf = torch.empty(min(self.cap, max(need, 2 * len(self.buf))), dtype=torch.uint8)
            self.wanted = 0
        self.used = -(-(at + n) // 64) * 64  # the next place starts on a cache line
        self._hold(r, self.buf[at : at + n])
        return True

    def _hold(self, r: Read, region: torch.Tensor) -> None:
        assert r.stage is not None
        r.dest = buffer_of(region[r.stage.lead :])
        self.landed.append((r, region))

    def deliver(self) -> None:
        """Copy out of every staged read landed (their bytes were verified); the
        memory is free again."""
        for r, region in self.landed:
            assert r.stage is not None
            r.stage.deliver(region)
            r.dest = None
        self.landed.clear()
        self.used = 0
        self.alone = False


def _read_all(fd: int, buffers: list[Any], offset: int, describe: Any) -> None:
    def short(at: int) -> Exception:
        return CorruptCheckpointError(f"{describe()}: short read at byte {at}")

    vectored_all(os.preadv, fd, buffers, offset, short)


def _read_stream(stream: ReadStream, buf: Any, offset: int, describe: Any) -> None:
    view = memoryview(buf).cast("B")
    stream.seek(offset)
    done = 0
    while done < len(view):
        n = stream.readinto(view[done:])
        if not n:
            raise CorruptCheckpointError(f"{describe()}: short read at byte {offset + done}")
        done += n


def _at(r: Read) -> int:
    return r.at


def _length(r: Read) -> int:
    return r.length


class RawReader:
    """Executes the reads of one load against the data files of ``index``."""

    def __init__(self, ckpt: CheckpointDir, index: RawIndex, verify: bool) -> None:
        self.ckpt = ckpt
        self.index = index
        self.verify = verify and index.block_bytes > 0
        self.max_gap = knobs.READ_MAX_GAP_BYTES.get()
        self._crcs: list[int] = index.crcs.tolist() if self.verify else []
        self._crc_start: list[int] = index.columns["crc_start"]
        self._readers = 1  # threads of this run that keep a core busy reading

    def threads_for(self, count: int, nbytes: int) -> int:
        """Threads for ``count`` reads of ``nbytes`` bytes in all: the storage's
        ``parallel_reads``, fewer for small reads (:func:`.reading_threads`), one from an
        object store (read in order)."""
        fs = self.ckpt.fs
        if fs.sequential_reads:
            return 1
        return reading_threads(max(1, fs.parallel_reads()), count, nbytes)

    def run(self, reads: Sequence[Read], alongside: int = 0) -> None:
        """Read (and verify) ``reads``, shared among the storage's threads; with
        ``alongside``, on this thread: the caller runs that many of these calls at once,
        each on a thread of its own."""
        if alongside:
            self._readers = self.ckpt.fs.busy_readers(alongside)
            files = self.index.columns["file"]
            for f in sorted({files[r.row] for r in reads}):
                self._run_file(f, [r for r in reads if files[r.row] == f])
            return
        by_file: dict[int, list[Read]] = {}
        files = self.index.columns["file"]
        for r in reads:
            f = files[r.row]
            group = by_file.get(f)
            if group is None:
                by_file[f] = [r]
            else:
                group.append(r)
        fs = self.ckpt.fs
        threads = max(1, fs.parallel_reads())
        jobs = [(f, by_file[f]) for f in sorted(by_file)]
        if threads > 1 and not fs.sequential_reads:  # the threads share bytes, not files
            total = sum(r.length for r in reads)
            threads = reading_threads(threads, len(reads), total)
            target = span_bytes(total, threads)
            if total > target:  # else every file is one run already
                cut = [(f, self._cut(sorted(group, key=_at), target)) for f, group in jobs]
                jobs = split_spans(cut, _length, target)
        threads = min(threads, len(jobs))
        self._readers = fs.busy_readers(threads)
        if threads <= 1:
            for f, group in jobs:
                self._run_file(f, group)
            return
        # Each run of reads on its own job (the copies release the GIL); every run is
        # finished before the first failure, in file order, is raised.
        with ThreadPoolExecutor(threads, thread_name_prefix="dist-ckpt-read") as pool:
            done = [pool.submit(self._run_file, f, group) for f, group in jobs]
        for job in done:
            job.result()

    def _cut(self, reads: list[Read], target: int) -> list[Read]:
        """``reads`` with each one over ``target`` bytes cut into reads of whole checksum
        blocks of about ``target`` bytes, so that several threads share a large item."""
        if all(r.length <= target for r in reads):
            return reads
        bb = self.index.block_bytes or _CACHE_BYTES
        piece = max(bb, target // bb * bb)
        out: list[Read] = []
        for r in reads:
            if r.length <= target or r.stage is not None:  # a staged read is delivered whole
                out.append(r)
                continue
            view = memoryview(r.dest).cast("B")
            for s in range(0, r.length, piece):
                n = min(piece, r.length - s)
                out.append(Read(r.row, r.entry_offset + s, n, view[s : s + n], r.at + s))
        return out

    def _run_file(self, f: int, reads: list[Read]) -> None:
        name = self.index.files[f]
        keys = self.index.key_list
        holds = [keys[r.row] for r in reads[:10]]
        stream, size = self.ckpt.open_data_file(name, holds)
        path = self.ckpt.path(name)
        with stream:
            reads.sort(key=_at)
            for r in reads:
                end = r.at + r.length
                if end > size:
                    raise CorruptCheckpointError(
                        f"{path} is truncated: item {keys[r.row]!r} (offset "
                        f"{r.at}, length {r.length}) ends at byte {end}, but the "
                        f"file has {size} bytes"
                    )
            checks = self._fetch(stream, path, reads)
        for check in checks:  # in file order: the first damaged item is the one named
            check.result()

    def _fetch(self, stream: ReadStream, path: str, reads: list[Read]) -> list[Future[None]]:
        """Read ``reads`` (sorted by offset), checking what was read as soon as its bytes
        landed: inline, or on the hashing thread while the next bytes are read (see
        :func:`~..storage.checksums.hashing_thread`); returns those pending checks."""
        checks: list[Future[None]] = []
        hasher = hashing_thread(self._readers) if self.verify else None
        # A read over _CACHE_BYTES is read and checked piece by piece: pieces of 8 MiB,
        # each checked on the hashing thread while the next is read, or of _CACHE_BYTES,
        # each checked inline while its bytes are in the cache. A batch of small reads
        # is cut at _CACHE_BYTES and always checked inline: handing many small CRCs to
        # another thread costs the reading threads more in waits for the interpreter
        # than it saves (16-core host: +32-42% against +11-20% inline).
        piece = _THREAD_PIECE if hasher else _CACHE_BYTES

        def inline(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except BaseException:
                for pending in checks:  # an earlier read's damage is named first
                    pending.result()
                raise

        def on_thread(fn: Any, *args: Any) -> None:
            if hasher is None:
                inline(fn, *args)
            else:
                checks.append(hasher.submit(fn, *args))

        describe = partial(str, path)
        fd = descriptor(stream)
        staging = _Staging(knobs.STAGING_BUFFER_BYTES.get())
        if fd is None:  # a stream (object storage): read in order, then checked
            self._stream_reads(stream, path, reads, staging, describe)
            return checks
        batch: list[Any] = []
        landed: list[Read] = []
        start = pos = 0

        def flush() -> None:
            _read_all(fd, batch, start, describe)
            if self.verify:
                inline(self._check_all, landed, path)
            staging.deliver()
            batch.clear()
            landed.clear()

        verify = self.verify
        for r in reads:
            at = r.at
            if verify and r.length > _CACHE_BYTES:  # verified piece by piece
                if batch:
                    flush()
                if r.stage is None:
                    self._read_large(fd, r, path, describe, on_thread, piece)
                else:  # checked here, then delivered
                    staging.land(r)
                    self._read_large(fd, r, path, describe, inline, _CACHE_BYTES)
                    staging.deliver()
                continue
            if batch and (
                at < pos
                or at - pos > self.max_gap
                or len(batch) >= IOV_MAX - 1
                or (verify and pos - start >= _CACHE_BYTES)
            ):
                flush()
            if r.stage is not None and not staging.land(r):
                flush()  # delivers the staged reads before it: room for this one
                staging.land(r)
            if not batch:
                start = pos = at
            if at > pos:
                batch.append(bytearray(at - pos))
            if r.length:
                batch.append(r.dest)
            landed.append(r)
            pos = at + r.length
        if batch:
            flush()
        return checks

    def _stream_reads(
        self, stream: ReadStream, path: str, reads: list[Read], staging: _Staging, describe: Any
    ) -> None:
        """Read ``reads`` in order from a stream; each staged read is checked (with the
        reads before it, in order) and delivered as soon as it is read."""
        unchecked: list[Read] = []
        for r in reads:
            if r.stage is not None:
                staging.land(r)
            _read_stream(stream, r.dest, r.at, describe)
            unchecked.append(r)
            if r.stage is not None:
                if self.verify:
                    self._check_all(unchecked, path)
                unchecked.clear()
                staging.deliver()
        if self.verify and unchecked:
            self._check_all(unchecked, path)

    def _read_large(
        self, fd: int, r: Read, path: str, describe: Any, verify: Any, chunk: int
    ) -> None:
        """Read a large item in pieces of about ``chunk`` bytes (whole checksum blocks);
        each piece is checked as soon as it lands."""
        bb = self.index.block_bytes
        view = memoryview(r.dest).cast("B")
        piece = max(bb, chunk // bb * bb)
        for start in range(0, r.length, piece):
            part = view[start : start + piece]
            _read_all(fd, [part], r.at + start, describe)
            verify(self._check_piece, r, start, part, path)
        r.verified = True

    def _check_piece(self, r: Read, start: int, part: memoryview, path: str) -> None:
        bb = self.index.block_bytes
        found = block_crcs(part, bb)
        at = self._crc_start[r.row] + (r.entry_offset + start) // bb
        expected = self._crcs[at : at + len(found)]
        if found != expected:
            bad = next(i for i, v in enumerate(found) if i >= len(expected) or v != expected[i])
            exp = expected[bad] if bad < len(expected) else -1
            self._mismatch(r, path, start // bb + bad, found[bad], exp)

    def _check_all(self, reads: list[Read], path: str) -> None:
        """Verify a batch of reads (in file order). The reads of one block or less (most
        of a batch of small items) are checked together: their CRCs in one call of
        :func:`crc_each`, compared as one list; the others block by block. On any
        mismatch every read is checked in order, so that the first damaged one is named."""
        bb = self.index.block_bytes
        small = [r for r in reads if r.length <= bb]
        if small:
            starts, crcs = self._crc_start, self._crcs
            expected = [crcs[starts[r.row] + r.entry_offset // bb] for r in small]
            if crc_each([r.dest for r in small]) != expected:
                for r in reads:
                    self._check(r, path)
        if len(small) < len(reads):
            for r in reads:
                if r.length > bb:
                    self._check(r, path)

    def _check(self, r: Read, path: str) -> None:
        if r.verified:
            return
        bb = self.index.block_bytes
        first = self._crc_start[r.row] + r.entry_offset // bb
        if r.length <= bb:
            if crc(r.dest) == self._crcs[first]:
                return
            found = [crc(r.dest)]
        else:
            found = block_crcs(r.dest, bb)
            if found == self._crcs[first : first + len(found)]:
                return
        expected = self._crcs[first : first + len(found)]
        bad = next(i for i, v in enumerate(found) if i >= len(expected) or v != expected[i])
        self._mismatch(r, path, bad, found[bad], expected[bad] if bad < len(expected) else -1)

    def _mismatch(self, r: Read, path: str, block: int, found: int, expected: int) -> None:
        c = self.index.columns
        key = self.index.key_list[r.row]
        at = r.at + block * self.index.block_bytes
        raise ChecksumMismatchError(
            f"checksum mismatch in {path} at byte {at} (item {key!r} at offset "
            f"{c['offset'][r.row]}, length {c['length'][r.row]}; crc32c {found:08x}, "
            f"recorded {expected:08x}): the file was damaged or comes from another save",
            key=key,
            file=path,
            offset=at,
        )


__all__ = ["RawReader", "Read"]
