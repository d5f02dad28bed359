"""Writing the data files of one rank of a ``raw_bytes`` save (:func:`write_rank`).

Each file of a :class:`~.writer.RankWrite` is written by one thread, front to back:
small items in batches (``os.pwritev``: one system call for up to 1,024 items, straight
from the tensors' memory, no copy into a buffer), large ones in pieces, accelerator
tensors streamed through the staging pool. Every item is checksummed (CRC32C blocks)
as its bytes go out; where the save records an integrity manifest
(``save(..., verify_integrity=True)``), the file's sha256 is computed from the same
bytes, so the manifest needs no second read of the file. :func:`write_rank` is
module-level and takes one picklable argument, so it runs unchanged in a background
process of an async save.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import knobs
from ..storage.base import FileSystemIO
from ..storage.checksums import BlockHasher, block_crcs, crc
from ..storage.positional import IOV_MAX, descriptor, write_all_at
from ..storage.resolve import filesystem_for
from ..storage.staging_pool import Chunk, CopyAhead, shared_pool
from ..storage.tensor_bytes import byte_view
from ..storage.writeback import Writeback
from .writer import RankWrite


@dataclass
class FileWritten:
    """What writing one data file gives back: its items' checksums (CRC32C blocks, in
    item order) and its sha256 (hex; None unless the save records a manifest)."""

    crcs: np.ndarray
    sha256: str | None = None


class _Out:
    """One data file being written: positional writes to a descriptor, or a stream's
    writes (object storage); the write-back started as it grows; and its sha256 when
    asked for. Every byte of the file goes through :meth:`put`, in file order, at most
    about ``piece`` bytes per call (the ``WRITE_CALL_BYTES`` knob)."""

    __slots__ = ("fd", "piece", "sha", "stream", "wb")

    def __init__(self, stream: Any, wb: Writeback | None, sha: Any, piece: int = 0) -> None:
        self.stream = stream
        self.fd = descriptor(stream)
        self.wb = wb
        self.sha = sha
        self.piece = piece or knobs.WRITE_CALL_BYTES.get()

    def put(self, buffers: list[Any], offset: int, nbytes: int = 0) -> None:
        """Write ``buffers`` back to back at ``offset`` (a stream: at its position,
        which the caller keeps at ``offset``); ``nbytes``: their total, if known (then a
        batch that one call writes whole needs no view of each buffer)."""
        sha = self.sha
        if sha is not None:
            for b in buffers:
                sha.update(b)
        if self.fd is not None:
            write_all_at(self.fd, buffers, offset, nbytes)
        else:
            for b in buffers:
                self.stream.write(b)

    def advance(self, end: int) -> None:
        """The bytes before ``end`` were written (starts their write-back when due)."""
        if self.wb is not None:
            self.wb.advance(end)


def _write_file(
    fs: FileSystemIO,
    path: str,
    items: list[tuple[int, int, Any]],
    wr: RankWrite,
    plain: bool = False,
) -> FileWritten:
    """Write one data file (fsynced when ``wr.sync``); ``plain``: its items are known to
    be bytes or contiguous host tensors (no accelerator tensor to stream)."""
    crcs: list[int] = []
    stream = fs.open_write(path)
    chunks = None
    try:
        fd = descriptor(stream)
        wb = fs.writeback(stream) if wr.sync and fd is not None else None
        out = _Out(stream, wb, hashlib.sha256() if wr.digest else None)
        chunks = None if plain else _device_chunks(items)
        _write_items(out, items, wr.block_bytes, crcs, chunks, plain)
        if wr.sync:
            fs.fsync(stream)
    finally:
        if chunks is not None:
            chunks.close()  # an abandoned write gives its staging buffers back
        stream.close()
    sha = out.sha.hexdigest() if out.sha is not None else None
    return FileWritten(np.array(crcs, dtype="<u4"), sha)


def _write_items(
    out: _Out,
    items: list[tuple[int, int, Any]],
    block: int,
    crcs: list[int],
    chunks: Generator[Chunk, None, None] | None,
    plain: bool = False,
) -> None:
    """The items of one file, in order, the gaps before them zero: small host items in
    batches of at most ``out.piece`` bytes, larger or accelerator ones piece by piece
    (each piece checksummed just before it goes out). ``plain``: the plan found every
    tensor item contiguous on the host (its buffer is then made without asking again)."""
    c_char = ctypes.c_char
    piece = out.piece
    # A batch goes out by the time write-back is due, too.
    limit = piece if out.wb is None else min(piece, out.wb.every)
    pos = 0
    batch: list[Any] = []
    batch_at = batch_bytes = 0
    for offset, size, data in items:
        if not batch:
            batch_at = pos
        if offset > pos:
            batch.append(bytes(offset - pos))
            batch_bytes += offset - pos
        on_device = chunks and size and isinstance(data, torch.Tensor) and not data.is_cpu
        if on_device or size > piece:
            if batch:
                out.put(batch, batch_at, batch_bytes)
                batch, batch_bytes = [], 0
            if on_device:
                assert chunks is not None
                _write_streamed(out, chunks, offset, block, crcs)
            else:
                _write_large(out, _host_buffer(data, size), offset, block, crcs)
            pos = offset + size
            continue
        if plain and size and type(data) is not bytes:
            buf = (c_char * size).from_address(data.data_ptr())
        else:
            buf = _host_buffer(data, size)
        if block:  # checksummed as the bytes go out (one call for a small item)
            if size <= block:
                crcs.append(crc(buf))
            else:
                crcs += block_crcs(buf, block)
        if batch and batch_bytes + size > limit:  # one write carries at most ``piece``
            out.put(batch, batch_at, batch_bytes)
            batch, batch_bytes, batch_at = [], 0, offset
            out.advance(offset)
        if size:
            batch.append(buf)
            batch_bytes += size
        pos = offset + size
        if out.fd is None or len(batch) >= IOV_MAX - 1:
            out.put(batch, batch_at, batch_bytes)
            batch, batch_bytes = [], 0
            out.advance(pos)
    if batch:
        out.put(batch, batch_at, batch_bytes)


def _host_buffer(data: Any, size: int) -> Any:
    """The ``size`` bytes of ``data`` (bytes, or a contiguous CPU tensor) as a buffer."""
    if size == 0:
        return b""
    if type(data) is bytes:
        return data
    if not data.is_contiguous():  # the staging step copies these: never write past them
        raise ValueError(f"a non-contiguous tensor of shape {tuple(data.shape)} reached the writer")
    return (ctypes.c_char * size).from_address(data.data_ptr())


def _device_chunks(items: list[tuple[int, int, Any]]) -> Generator[Chunk, None, None] | None:
    """The bytes of the file's accelerator tensors (a synchronous save stages nothing
    up front), streamed through this process's staging pool: the copy of the next
    chunk overlaps the write of this one; None when every item is on the host."""
    sources = [
        byte_view(data.contiguous())
        for _, size, data in items
        if size and isinstance(data, torch.Tensor) and not data.is_cpu
    ]
    if not sources:
        return None
    # With COPY_AHEAD_BYTES=0 the save stages everything first; a caller that did not
    # still gets a bounded copy: a pool of one buffer.
    pool = shared_pool() or shared_pool(budget_bytes=knobs.STAGING_BUFFER_BYTES.get())
    assert pool is not None
    return iter(CopyAhead(pool, sources))


def _write_streamed(
    out: _Out, chunks: Generator[Chunk, None, None], offset: int, block: int, crcs: list[int]
) -> None:
    """Write the next source of ``chunks`` at ``offset`` (a stream: positioned there),
    checksumming each chunk as it goes out."""
    hasher = BlockHasher(block) if block else None
    for chunk in chunks:
        view, at = chunk.view, offset + chunk.offset
        for start in range(0, len(view), out.piece):  # a staging buffer: in pieces
            part = view[start : start + out.piece]
            if hasher is not None:
                hasher.feed(part, len(part))
            out.put([part], at + start, len(part))
            out.advance(at + start + len(part))
        if chunk.last:
            break
    if hasher is not None:
        crcs += hasher.finish()


def _write_large(out: _Out, buf: Any, offset: int, block: int, crcs: list[int]) -> None:
    """One large item in pieces of about ``out.piece`` bytes (whole checksum blocks),
    each checksummed just before it is written, while its bytes are still in the CPU
    cache."""
    view = memoryview(buf).cast("B")
    piece = max(block, out.piece // block * block) if block else out.piece
    for start in range(0, len(view), piece):
        part = view[start : start + piece]
        if block:
            crcs += block_crcs(part, block)
        out.put([part], offset + start, len(part))
        out.advance(offset + start + len(part))


def write_rank(wr: RankWrite) -> list[FileWritten]:
    """Write every data file of ``wr`` (one thread per file); returns what each file's
    writing gave back, in file order. Raises whatever writing raised."""
    fs = filesystem_for(wr.root)
    paths = [fs.join(wr.root, name) for name in wr.names]
    special = None if wr.special is None else {f for f, _ in wr.special}
    plain = [special is not None and f not in special for f in range(len(paths))]
    jobs = list(zip(paths, wr.items, plain))
    if len(jobs) <= 1:
        return [_write_file(fs, p, it, wr, pl) for p, it, pl in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _write_file(fs, job[0], job[1], wr, job[2]), jobs))


__all__ = ["FileWritten", "write_rank"]
