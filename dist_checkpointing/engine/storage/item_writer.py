"""Writing a tensor item: :func:`write_tensor`, byte for byte what ``torch.save`` writes.

``torch.save`` has a high fixed cost per call, so the archive is written from a
template (:mod:`.item_template`); the CRC-32 of the tensor bytes is computed unless
``torch.serialization.set_crc32_options(False)``, in a second thread when cores are
spare. On first use per dtype the output is compared with ``torch.save``'s; any
difference (another torch version, another storage alignment) disables the fast
writer for that dtype, and ``torch.save`` is used, as it is for tensors the fast
writer does not handle (subclasses, non-contiguous, views, archives of 4 GiB or more).
"""

from __future__ import annotations

import functools
import io
import logging
import threading
from collections.abc import Iterable
from typing import BinaryIO

import torch

from ..process import cores_per_rank
from .checksums import zip_crc32
from .item_template import _MAX_FAST_BYTES, _itemsize, _record_name_hash, _template, _tensor_pickle
from .tensor_bytes import buffer_of, byte_view

logger = logging.getLogger(__name__)

# A tensor item of at least ALIGNED_ITEM_BYTES tensor bytes starts at a multiple of
# ITEM_ALIGN in its file, so that its tensor bytes (at a multiple of 64 from the start of
# the record) do too: a read into a tensor's memory then copies 64-byte aligned bytes,
# which the kernel does from the page cache about a third faster (6.7-7.7 against 11
# GB/s on the development VM). Small items stay packed (their bytes are copied from a
# window in memory, and 63 bytes each would be felt).
ITEM_ALIGN = 64
ALIGNED_ITEM_BYTES = 64 << 10


def item_padding(offset: int, tensor_bytes: int) -> int:
    """The zero bytes to write at file offset ``offset`` before a tensor item of
    ``tensor_bytes`` bytes. They belong to no item: DCP readers (ours, Megatron-Core's,
    plain DCP's) read items by offset and never read them."""
    if tensor_bytes < ALIGNED_ITEM_BYTES:
        return 0
    return -offset % ITEM_ALIGN


# Large tensors are written in pieces of this size while another thread checksums
# them (from _PARALLEL_CRC_BYTES on, given spare cores) ...
_CHUNK_BYTES = 64 << 20


_PARALLEL_CRC_BYTES = 8 << 20


# ... or else checksummed and written piece by piece, each piece small enough to stay
# in the CPU cache between the two passes, and larger than the write buffer of
# fs_io.LocalFileSystem (so that it is not copied into that buffer).
_CACHE_CHUNK_BYTES = 1 << 20


def write_tensor(stream: BinaryIO, tensor: torch.Tensor, compute_crc: bool | None = None) -> int:
    """Write ``torch.save(tensor)`` to ``stream``; return the number of bytes written.

    ``tensor`` must be on the CPU. The bytes equal ``torch.save``'s output, also with
    ``torch.serialization.set_crc32_options(False)`` (then no checksums are computed).
    ``compute_crc``: torch's crc32 option, when the caller read it already (once for
    many items); None reads it.
    """
    if compute_crc is None:
        compute_crc = torch.serialization.get_crc32_options()
    if not fast_path_applies(tensor, compute_crc):
        start = stream.tell()
        torch.save(tensor, stream)
        return stream.tell() - start
    return write_plain_tensor(stream, tensor, compute_crc)


def write_plain_tensor(stream: BinaryIO, tensor: torch.Tensor, compute_crc: bool) -> int:
    """:func:`write_tensor` of a tensor :func:`fast_path_applies` to (not checked again),
    or of a contiguous copy of a CPU view :func:`can_stream` applies to (its own bytes,
    as :func:`write_tensor_streamed` writes them); ``compute_crc``: torch's crc32 option."""
    nbytes = tensor.nbytes
    pickled = _tensor_pickle(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    template = _template(pickled, nbytes, compute_crc)
    if nbytes <= _CACHE_CHUNK_BYTES:  # one piece: checksummed, then written whole
        view = buffer_of(tensor)
        parts = (template.head, view, template.tail(zip_crc32(view) if compute_crc else 0))
        write_parts = getattr(stream, "write_parts", None)  # an item stream: no copy
        if write_parts is not None:
            written: int = write_parts(parts, tensor)
            return written
        for part in parts:
            stream.write(part)
        return len(parts[0]) + nbytes + len(parts[2])
    data = _byte_view(tensor)
    stream.write(template.head)
    crc = _write_checksummed(stream, data, 0, compute_crc)
    tail = template.tail(crc)
    stream.write(tail)
    return len(template.head) + len(data) + len(tail)


def _write_checksummed(
    stream: BinaryIO, data: memoryview | bytes, crc: int, compute_crc: bool
) -> int:
    """Write ``data``; return the CRC-32 continued from ``crc`` over it (0 without
    ``compute_crc``). A large piece is checksummed on another thread while it is written,
    where the rank has cores to spare; else piece by piece, each written while it is
    still in the CPU cache."""
    if not compute_crc:
        stream.write(data)
        return 0
    if len(data) >= _PARALLEL_CRC_BYTES and _spare_cores():
        return _write_with_parallel_crc(stream, data, crc)
    for start in range(0, len(data), _CACHE_CHUNK_BYTES):
        piece = data[start : start + _CACHE_CHUNK_BYTES]
        crc = zip_crc32(piece, crc)
        stream.write(piece)
    return crc


@functools.cache
def _spare_cores() -> bool:
    """Whether this rank may use enough cores to checksum in a separate thread (each of
    its writer threads with a helper beside it)."""
    return cores_per_rank() >= 4


def _write_with_parallel_crc(stream: BinaryIO, data: memoryview | bytes, crc: int) -> int:
    """Write ``data`` in pieces while another thread computes its CRC-32 (both release
    the GIL), so the checksum costs no extra time when writing is the bottleneck."""
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(zip_crc32(data, crc)), daemon=True)
    worker.start()
    try:
        for start in range(0, len(data), _CHUNK_BYTES):
            stream.write(data[start : start + _CHUNK_BYTES])
    finally:
        worker.join()
    return result[0]


def can_stream(t: torch.Tensor) -> bool:
    """Whether :func:`write_tensor_streamed` can write ``t`` (on any device): a plain
    contiguous tensor (a view of a larger storage is fine: its bytes are written as
    ``t.cpu()`` would hold them)."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.requires_grad
        and t.is_contiguous()
        and t.nbytes <= _MAX_FAST_BYTES
        and not t.is_conj()
        and not t.is_neg()
        and fast_path_supported(t.dtype, torch.serialization.get_crc32_options())
    )


def write_tensor_streamed(
    stream: BinaryIO, tensor: torch.Tensor, pieces: Iterable[memoryview | bytes]
) -> int:
    """Like :func:`write_tensor`, with the tensor's bytes taken from ``pieces``.

    ``tensor`` (on any device, :func:`can_stream` true) gives the shape, dtype and
    size; ``pieces`` are its bytes in order, e.g. staged chunks of an accelerator
    tensor (:class:`~.staging_pool.CopyAhead`). The bytes equal those of
    ``torch.save(tensor.cpu())``.
    """
    compute_crc = torch.serialization.get_crc32_options()
    nbytes = tensor.numel() * tensor.element_size()
    pickled = _tensor_pickle(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    template = _template(pickled, nbytes, compute_crc)
    stream.write(template.head)
    crc = written = 0
    for piece in pieces:  # each piece is checksummed before the next is asked for
        crc = _write_checksummed(stream, piece, crc, compute_crc)
        written += len(piece)
    if written != nbytes:
        raise ValueError(f"staged {written} bytes of a tensor of {nbytes} bytes")
    tail = template.tail(crc)
    stream.write(tail)
    return len(template.head) + nbytes + len(tail)


def serialize_tensor(tensor: torch.Tensor) -> bytes:
    """``torch.save(tensor)`` as bytes, through :func:`write_tensor`."""
    buf = io.BytesIO()
    write_tensor(buf, tensor)
    return buf.getvalue()


def fast_path_applies(t: torch.Tensor, compute_crc: bool) -> bool:
    """Whether :func:`write_tensor` writes ``t`` from a template (else through
    ``torch.save``): a plain contiguous CPU tensor owning its whole storage, of a dtype
    the template reproduces. ``compute_crc``: torch's crc32 option."""
    # Cheapest checks first: this runs once per item.
    if type(t) is not torch.Tensor or t.layout != torch.strided or not t.is_cpu:
        return False
    if t.requires_grad or t.storage_offset() or not t.is_contiguous():
        return False
    nbytes = t.nbytes
    return (
        nbytes <= _MAX_FAST_BYTES
        and t.untyped_storage().nbytes() == nbytes
        and not t.is_conj()
        and not t.is_neg()
        and fast_path_supported(t.dtype, compute_crc)
    )


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return byte_view(t).numpy().data


@functools.cache
def fast_path_supported(dtype: torch.dtype, compute_crc: bool = True) -> bool:
    """Whether the fast writer reproduces ``torch.save`` exactly for ``dtype`` (with
    torch's crc32 option set to ``compute_crc``, as it must be when this is called).

    Probed once per dtype, option and process (an empty and a 2x3 tensor), and cached.
    """
    if _record_name_hash() is None:
        return False
    try:
        for shape in ((2, 3), (0,)):
            numel = 1
            for s in shape:
                numel *= s
            raw = torch.arange(numel * _itemsize(dtype), dtype=torch.uint8)
            probe = raw.view(dtype).reshape(shape)
            expected = io.BytesIO()
            torch.save(probe, expected)
            data = _byte_view(probe)
            pickled = _tensor_pickle(dtype, shape, probe.stride())
            template = _template(pickled, len(data), compute_crc)
            crc = zip_crc32(data) if compute_crc else 0
            ours = template.head + bytes(data) + template.tail(crc)
            if ours != expected.getvalue():
                logger.warning(
                    "fast torch.save writer disabled for %s: its output differs from "
                    "torch.save (torch %s); using torch.save",
                    dtype,
                    torch.__version__,
                )
                return False
    except Exception as exc:  # noqa: BLE001 - the fast path is an optimization
        logger.debug("fast torch.save writer disabled for %s: %s", dtype, exc)
        return False
    return True
