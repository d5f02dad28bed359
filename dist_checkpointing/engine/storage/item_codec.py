"""Tensor write items as plain tuples, for a bucket that travels to another process.

A DCP ``WriteItem`` is a tree of about ten objects (its ``MetadataIndex``, chunk,
properties, four ``torch.Size``); pickled as it is, it costs about 10 microseconds,
and the persistent async worker receives every item of every save. A plain tuple of
the same facts pickles in well under one. :func:`encode_tensor_items` makes the tuples
(None for a list holding anything the tuple does not express: then the items are
pickled as they are) and :func:`decode_tensor_items` rebuilds items equal to the
originals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .metadata_parts import SharedParts, index_at

# fqn, offset (or None), index hint, chunk offsets, chunk sizes, dtype, global size
ItemRecord = tuple[str, Any, Any, tuple[int, ...], tuple[int, ...], torch.dtype, tuple[int, ...]]


def _plain(props: TensorProperties) -> bool:
    """Whether ``props`` are ``TensorProperties(dtype=props.dtype)``'s defaults."""
    return (
        props.layout is torch.strided
        and props.requires_grad is False
        and props.memory_format is torch.contiguous_format
        and props.pin_memory is False
    )


def encode_tensor_items(items: Sequence[WriteItem]) -> list[ItemRecord] | None:
    """One tuple per tensor item, or None if any item is not a plain tensor shard."""
    out: list[ItemRecord] = []
    for item in items:
        td = item.tensor_data
        if (
            type(item) is not WriteItem
            or item.type is not WriteItemType.SHARD
            or item.bytes_io_data is not None
            or td is None
            or type(item.index) is not MetadataIndex
            or not _plain(td.properties)
        ):
            return None
        offset = item.index.offset
        out.append(
            (
                item.index.fqn,
                None if offset is None else tuple(offset),
                item.index.index,
                tuple(td.chunk.offsets),
                tuple(td.chunk.sizes),
                td.properties.dtype,
                tuple(td.size),
            )
        )
    return out


def decode_tensor_items(records: Sequence[ItemRecord]) -> list[WriteItem]:
    """The items :func:`encode_tensor_items` described (equal shapes shared)."""
    parts = SharedParts()
    shape = parts.size
    out = []
    for fqn, offset, hint, offsets, sizes, dtype, size in records:
        index = index_at(fqn, None if offset is None else shape(offset), hint)
        data = TensorWriteData(
            chunk=parts.chunk(offsets, sizes), properties=parts.properties(dtype), size=shape(size)
        )
        out.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
    return out


__all__ = ["ItemRecord", "decode_tensor_items", "encode_tensor_items"]
