"""Copying the requested region of a stored tensor item into its destination.

:func:`copy_region` reads only the bytes the region spans, from an item whose layout
:mod:`.item_reader` parsed: straight into a contiguous CPU destination of the same dtype,
through the staging pool into an accelerator one, else through a host buffer.
:func:`copy_region_torch_load` is the fallback for any other item: ``torch.load`` with
``weights_only`` of the whole item, then a narrow of the region. Both check the region
against the stored shape and the destination's shape first.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import CheckpointingException, CorruptCheckpointError
from .. import knobs
from ..safety import safe_torch_load
from .byte_ranges import ItemBytes
from .checksums import whole_blocks
from .item_reader import TensorRecord
from .staging_pool import fill_from_host, shared_pool
from .tensor_bytes import contiguous_strides, element_span


def _check_request(
    item: ItemBytes, shape: Sequence[int], read_item: ReadItem, target: torch.Tensor
) -> None:
    offsets, lengths = read_item.storage_offsets, read_item.lengths
    if len(offsets) != len(shape) or any(
        o < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)
    ):
        raise CorruptCheckpointError(
            f"{item.describe()} holds a tensor of shape {tuple(shape)}, but the metadata "
            f"places the requested region at offsets {tuple(offsets)} with lengths "
            f"{tuple(lengths)}"
        )
    if target.shape != lengths:
        raise CheckpointingException(
            f"{item.describe()}: the destination tensor for {read_item.dest_index.fqn!r} "
            f"has shape {tuple(target.shape)}, expected {tuple(lengths)}"
        )


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def copy_region(
    item: ItemBytes, rec: TensorRecord, read_item: ReadItem, target: torch.Tensor
) -> None:
    """Copy the requested region of the stored tensor into ``target``, reading only its span."""
    _check_request(item, rec.shape, read_item, target)
    lengths = tuple(read_item.lengths)
    numel = target.numel()
    if numel == 0:
        return
    itemsize = _itemsize(rec.dtype)
    first, last = element_span(rec.shape, rec.storage_offset, read_item.storage_offsets, lengths)
    start = rec.data_offset + first * itemsize
    span = last - first + 1
    if span == numel:  # the region is one contiguous byte range
        if target.is_cpu and target.dtype == rec.dtype and target.is_contiguous():
            item.read_into_tensor(start, target)
            return
        pool = None if target.is_cpu else shared_pool()
        if pool is not None and target.dtype == rec.dtype and target.is_contiguous():
            # An accelerator target: through the staging pool, a buffer at a time.
            fill_from_host(
                target, lambda at, host: item.read_into_tensor(start + at, host, True), pool
            )
            return
        target.copy_(_read_staged(item, start, numel, rec.dtype).view(lengths))
        return
    strides = contiguous_strides(rec.shape)
    target.copy_(_read_staged(item, start, span, rec.dtype).as_strided(lengths, strides))


_scratch = threading.local()


def _read_staged(item: ItemBytes, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` from item offset ``start``, read into host memory
    for a copy into the destination. Up to ``STAGING_BUFFER_BYTES``, into this thread's
    reused buffer (a resharding load reads many regions: one buffer, not a fresh
    allocation and its page faults per region), read from and to whole checksum blocks:
    the reader verifies them before the buffer is reused, with no partial block to keep
    a copy of. Larger, into a buffer of its own."""
    size = _itemsize(dtype)
    nbytes = numel * size
    cap = knobs.STAGING_BUFFER_BYTES.get()
    if nbytes > cap:
        out = torch.empty(numel, dtype=dtype)
        item.read_into_tensor(start, out)
        return out
    block = item.verifier.block_bytes if item.verifier is not None else 0
    lo, hi = whole_blocks(start, start + nbytes, block, item.length)
    lead = -(start - lo) % size  # puts the elements on an element boundary
    need = lead + hi - lo
    buf: torch.Tensor | None = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        grown = max(need, 2 * buf.numel() if buf is not None else 0)
        buf = _scratch.buf = torch.empty(min(grown, max(need, cap + 2 * block)), dtype=torch.uint8)
    item.read_into_tensor(lo, buf[lead:need], True)
    at = lead + start - lo
    return buf[at : at + nbytes].view(dtype)


def copy_region_torch_load(item: ItemBytes, read_item: ReadItem, target: torch.Tensor) -> None:
    # weights_only: tensors and plain containers only; errors name the item.
    tensor = safe_torch_load(item.read_at(0, item.length), source=item.describe())
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(
            f"{item.describe()} holds a {type(tensor).__name__}, expected a tensor"
        )
    _check_request(item, tuple(tensor.shape), read_item, target)
    for dim, (o, n) in enumerate(zip(read_item.storage_offsets, read_item.lengths)):
        tensor = tensor.narrow(dim, o, n)
    target.copy_(tensor)


__all__ = ["copy_region", "copy_region_torch_load"]
