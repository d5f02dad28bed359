"""Writing a rank's part of a ``raw_bytes`` checkpoint.

:func:`plan_rank` turns a rank's main-replica leaves into one :class:`RankWrite`
(which bytes go where: a few data files per rank, every item at an aligned
offset) and the rank's :class:`~.index.IndexPiece` (entries built as numpy
arrays from plain lists: no Python object per item beyond the list entries).
:func:`write_rank` writes the files (``os.pwritev``: one system call for up to
1,024 items, straight from the tensors' memory, no copy into a buffer),
checksumming each item's bytes as they go out, and returns the checksums.
It is module-level and takes one picklable argument, so it runs unchanged in a
background process of an async save.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from .. import knobs
from ..storage.base import FileSystemIO
from ..storage.checksums import BlockHasher, block_crcs, crc
from ..storage.host_staging import StagingStep, TensorSlot
from ..storage.names import safe_name
from ..storage.positional import IOV_MAX, descriptor, vectored_all
from ..storage.resolve import filesystem_for
from ..storage.staging_pool import Chunk, CopyAhead, shared_pool
from ..storage.tensor_bytes import byte_view
from ..storage.writeback import Writeback
from .index import (
    DATA_SUFFIX,
    DTYPE_NAMES,
    ENTRY_DTYPE,
    ITEMSIZE,
    KIND_FLAT,
    KIND_GRID,
    KIND_OBJECT,
    IndexPiece,
    dtype_name,
)

_MAX_WRITE = 1 << 30  # bytes per pwritev call (Linux writes at most ~2 GiB per call)
_PIECE = 8 << 20  # large items are checksummed and written in pieces of this size


def data_file_name(rank: int, n: int, save_tag: str = "") -> str:
    """Data file ``n`` of group rank ``rank``: ``__<rank>_<n>[.<tag>].dcpraw``."""
    tag = f".{save_tag}" if save_tag else ""
    return safe_name(f"__{rank}_{n}{tag}{DATA_SUFFIX}", source="save")


@dataclass
class RankWrite:
    """What one rank writes: per file, ``(offset, length, data)`` items in file order;
    ``data`` is a contiguous CPU tensor (after staging) of ``length`` bytes, or bytes."""

    root: str
    names: list[str]
    items: list[list[tuple[int, int, Any]]]
    block_bytes: int
    sync: bool = True
    sizes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StageRankWrite(StagingStep):
    """The staging step of a ``raw_bytes`` save (its request's ``preload_fn``): the
    slots are the tensors of ``write.items``; a non-contiguous one must be copied (the
    writer writes raw memory). Works in place (the result is None).

    With ``deferred`` (a synchronous save with a copy-ahead budget) it copies only the
    non-contiguous host tensors: :func:`write_rank` streams accelerator tensors through
    the staging pool.
    """

    write: RankWrite
    deferred: bool = False

    def slots(self) -> list[TensorSlot]:
        return [
            TensorSlot(file_items, i, 2, required=not data.is_contiguous())
            for file_items in self.write.items
            for i, (_, _, data) in enumerate(file_items)
            if isinstance(data, torch.Tensor)
        ]

    def host_copies(self) -> list[TensorSlot]:
        return [
            TensorSlot(file_items, i, 2, required=True)
            for file_items in self.write.items
            for i, (_, _, data) in enumerate(file_items)
            if isinstance(data, torch.Tensor) and data.is_cpu and not data.is_contiguous()
        ]


@dataclass
class _Leaves:
    """Per-item columns collected from the leaves (plain lists, made arrays at the end)."""

    keys: list[str] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    ndims: list[int] = field(default_factory=list)
    dims: list[int] = field(default_factory=list)
    flat: list[tuple[int, int]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    data: list[Any] = field(default_factory=list)


def _collect(leaves: list[ShardedBase]) -> _Leaves:
    out = _Leaves()
    for sh in leaves:
        rid = sh.replica_id
        if rid != 0 and not is_main_replica(rid):
            continue
        if isinstance(sh, ShardedTensor):
            _add_tensor(out, sh)
        elif isinstance(sh, ShardedObject):
            buf = io.BytesIO()
            torch.save(sh.data, buf)
            payload = buf.getvalue()
            out.keys.append(sh.unique_key)
            out.kinds.append(KIND_OBJECT)
            out.dtypes.append("uint8")
            out.ndims.append(0)
            out.flat.append((0, 0))
            out.lengths.append(len(payload))
            out.data.append(payload)
    return out


def _add_tensor(out: _Leaves, sh: ShardedTensor) -> None:
    """One tensor's columns, from the ShardedTensor's fields (validated on construction:
    ``data`` has ``dtype`` and the local or flat shape)."""
    fr = sh.flattened_range
    data = sh.data
    if data is None:
        raise ValueError(f"ShardedTensor {sh.key!r} has no data to save")
    local = sh.local_shape
    if fr is None:
        count = math.prod(local)
        out.kinds.append(KIND_GRID)
        out.flat.append((0, 0))
    else:
        count = fr.stop - fr.start
        if count <= 0:
            return  # an empty flat range holds nothing
        out.kinds.append(KIND_FLAT)
        out.flat.append((fr.start, fr.stop))
    dtype = sh.dtype
    out.keys.append(sh.key)
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        try:
            name = dtype_name(dtype)
        except ValueError as exc:
            raise ValueError(f"ShardedTensor {sh.key!r}: {exc}") from None
    out.dtypes.append(name)
    gshape = sh.global_shape
    out.ndims.append(len(gshape))
    dims = out.dims
    dims += gshape
    dims += sh.global_offset
    if sh.prepend_axis_num:
        dims += (1,) * sh.prepend_axis_num
    dims += local
    out.lengths.append(count * ITEMSIZE[dtype])
    out.data.append(data)


def _aligned(lengths: np.ndarray, alignment: int) -> np.ndarray:
    return (lengths + (alignment - 1)) // alignment * alignment


def plan_rank(
    leaves: list[ShardedBase],
    root: str,
    rank: int,
    file_count: int,
    alignment: int,
    block_bytes: int,
    save_tag: str = "",
) -> tuple[RankWrite, IndexPiece]:
    """Place the main-replica leaves of one rank into up to ``file_count`` data files
    (contiguous runs of similar total size) at ``alignment``-byte offsets."""
    c = _collect(leaves)
    n = len(c.kinds)
    lengths = np.array(c.lengths, dtype=np.int64)
    padded = _aligned(lengths, alignment)
    starts = np.cumsum(padded) - padded
    total = int(padded.sum())
    files = min(file_count, n) or 1
    file_of = np.minimum(starts * files // max(total, 1), files - 1) if n else lengths
    # Runs of items in file order; a large item may leave a file empty: renumber.
    used, file_of = np.unique(file_of, return_inverse=True)
    files = len(used)
    firsts = np.searchsorted(file_of, np.arange(files))
    offsets = starts - starts[firsts][file_of] if n else lengths
    dtype_names = sorted(set(c.dtypes)) or ["uint8"]
    dtype_ids = {d: i for i, d in enumerate(dtype_names)}
    ndims = np.array(c.ndims, dtype=np.int64)
    key_blob = "".join(c.keys).encode()
    key_lens = np.fromiter(map(len, c.keys), dtype=np.int64, count=n)
    if len(key_blob) != int(key_lens.sum()):  # non-ASCII keys: count bytes
        key_lens = np.fromiter((len(k.encode()) for k in c.keys), dtype=np.int64, count=n)
    if block_bytes:
        crc_counts = np.maximum(-(-lengths // block_bytes), 1)
    else:
        crc_counts = np.zeros(n, dtype=np.int64)
    e = np.zeros(n, dtype=ENTRY_DTYPE)
    e["key_start"] = np.cumsum(key_lens) - key_lens
    e["key_len"] = key_lens
    e["kind"] = c.kinds
    e["dtype"] = [dtype_ids[d] for d in c.dtypes]
    e["ndim"] = ndims
    e["file"] = file_of
    e["crc_count"] = crc_counts
    e["offset"] = offsets
    e["length"] = lengths
    e["dims_start"] = np.cumsum(3 * ndims) - 3 * ndims
    flat = np.array(c.flat, dtype=np.int64).reshape(n, 2)
    e["flat_start"], e["flat_stop"] = flat[:, 0], flat[:, 1]
    e["crc_start"] = np.cumsum(crc_counts) - crc_counts
    names = [data_file_name(rank, f, save_tag) for f in range(files)] if n else []
    items: list[list[tuple[int, int, Any]]] = [[] for _ in names]
    for f, off, length, data in zip(file_of.tolist(), offsets.tolist(), c.lengths, c.data):
        items[f].append((off, length, data))
    sizes = [f_items[-1][0] + f_items[-1][1] for f_items in items]
    write = RankWrite(root, names, items, block_bytes, sizes=sizes)
    piece = IndexPiece(
        files=names,
        file_sizes=sizes,
        entries=e,
        dims=np.array(c.dims, dtype="<i8"),
        crcs=np.zeros(int(crc_counts.sum()), dtype="<u4"),
        keys=key_blob,
        dtypes=dtype_names,
    )
    return write, piece


# --------------------------------------------------------------------------- writing


def buffer_of(data: Any) -> Any:
    """A buffer over the bytes of ``data`` (a contiguous CPU tensor, or bytes) without a
    copy; the caller keeps ``data`` alive while the buffer is used."""
    if not isinstance(data, torch.Tensor):
        return data
    n = data.numel() * data.element_size()
    if n == 0:
        return b""
    return (ctypes.c_char * n).from_address(data.data_ptr())


def _write_file(
    fs: FileSystemIO, path: str, items: list[tuple[int, int, Any]], wr: RankWrite
) -> list[int]:
    """Write one data file; returns the checksums of its items, in order."""
    crcs: list[int] = []
    block = wr.block_bytes
    stream = fs.open_write(path)
    try:
        fd = descriptor(stream)
        wb = fs.writeback(stream) if wr.sync and fd is not None else None
        # A batch of small items goes out by the time write-back is due.
        max_write = _MAX_WRITE if wb is None else min(_MAX_WRITE, wb.every)
        pos = 0
        batch: list[Any] = []
        batch_at = batch_bytes = 0
        chunks = _device_chunks(items)
        for offset, size, data in items:
            on_device = size and isinstance(data, torch.Tensor) and not data.is_cpu
            if on_device or (fd is not None and size > _PIECE):
                # Large or on a device: checksummed and written piece by piece.
                if fd is None:
                    stream.write(bytes(offset - pos))
                elif batch or offset > pos:
                    batch.append(bytes(offset - pos))
                    _pwritev_all(fd, batch, batch_at if batch[:-1] else pos)
                    batch, batch_bytes = [], 0
                if fd is not None and not on_device:
                    _write_large(fd, _host_buffer(data, size), offset, block, crcs, wb)
                else:
                    assert chunks is not None
                    out = stream if fd is None else fd
                    _write_streamed(out, chunks, offset, block, crcs, wb)
                pos = offset + size
                continue
            buf = _host_buffer(data, size)
            if block:  # checksummed as the bytes go out (one call for a small item)
                if size <= block:
                    crcs.append(crc(buf))
                else:
                    crcs += block_crcs(buf, block)
            if fd is None:  # a stream (object storage): write it piece by piece
                if offset > pos:
                    stream.write(bytes(offset - pos))
                stream.write(buf)
                pos = offset + size
                continue
            if not batch:
                batch_at = pos
            if offset > pos:
                batch.append(bytes(offset - pos))
                batch_bytes += offset - pos
            if size:
                batch.append(buf)
                batch_bytes += size
            pos = offset + size
            if len(batch) >= IOV_MAX - 1 or batch_bytes >= max_write:
                _pwritev_all(fd, batch, batch_at)
                batch, batch_bytes = [], 0
                if wb is not None:
                    wb.advance(pos)
        if fd is not None and batch:
            _pwritev_all(fd, batch, batch_at)
        if wr.sync:
            fs.fsync(stream)
    finally:
        if chunks is not None:
            chunks.close()  # an abandoned write gives its staging buffers back
        stream.close()
    return crcs


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
    out: Any,
    chunks: Generator[Chunk, None, None],
    offset: int,
    block: int,
    crcs: list[int],
    wb: Writeback | None = None,
) -> None:
    """Write the next source of ``chunks`` at ``offset`` (``out``: a descriptor, or a
    stream positioned there), checksumming each chunk as it goes out."""
    hasher = BlockHasher(block) if block else None
    for chunk in chunks:
        if hasher is not None:
            hasher.feed(chunk.view, len(chunk.view))
        if isinstance(out, int):
            _pwritev_all(out, [chunk.view], offset + chunk.offset)
            if wb is not None:
                wb.advance(offset + chunk.offset + len(chunk.view))
        else:
            out.write(chunk.view)
        if chunk.last:
            break
    if hasher is not None:
        crcs += hasher.finish()


def _write_large(
    fd: int, buf: Any, offset: int, block: int, crcs: list[int], wb: Writeback | None = None
) -> None:
    """One large item in pieces of about ``_PIECE`` bytes (whole checksum blocks), each
    checksummed just before it is written, while its bytes are still in the CPU cache."""
    view = memoryview(buf).cast("B")
    piece = max(block, _PIECE // block * block) if block else _PIECE
    for start in range(0, len(view), piece):
        part = view[start : start + piece]
        if block:
            crcs += block_crcs(part, block)
        _pwritev_all(fd, [part], offset + start)
        if wb is not None:
            wb.advance(offset + start + len(part))


def _short_write(offset: int) -> Exception:
    return OSError(f"pwritev wrote nothing at offset {offset}")


def _pwritev_all(fd: int, buffers: list[Any], offset: int) -> None:
    """Write ``buffers`` back to back at ``offset`` (a short write continues)."""
    vectored_all(os.pwritev, fd, buffers, offset, _short_write)


def write_rank(wr: RankWrite) -> list[np.ndarray]:
    """Write every data file of ``wr`` (one thread per file); returns each file's item
    checksums. Raises whatever writing raised."""
    fs = filesystem_for(wr.root)
    paths = [fs.join(wr.root, name) for name in wr.names]
    jobs = list(zip(paths, wr.items))
    if len(jobs) <= 1:
        results = [_write_file(fs, p, it, wr) for p, it in jobs]
    else:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: _write_file(fs, job[0], job[1], wr), jobs))
    return [np.array(r, dtype="<u4") for r in results]


__all__ = [
    "RankWrite",
    "StageRankWrite",
    "buffer_of",
    "data_file_name",
    "plan_rank",
    "write_rank",
]
