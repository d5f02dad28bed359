"""Shared parts for building a DCP ``Metadata`` (and the objects made from one).

A model's ``.metadata`` repeats a few shapes and dtypes thousands of times: the chunk
offsets of unsharded tensors are all zeros, layers have the same shapes, nearly every
tensor has one of two dtypes. :class:`SharedParts` hands out one ``torch.Size`` per
distinct shape, one ``ChunkStorageMetadata`` per distinct pair of shared shapes and one
``TensorProperties`` per dtype, so that pickle writes each once
and refers to it afterwards: 10,000 one-chunk entries pickled in 11-13 instead of 24-27
microseconds each in one run on the development VM, 17-18 instead of 28 in another, and
the file (what Megatron-Core and plain DCP unpickle) is 14% smaller. In memory, a shared
shape is one object instead of one per use. The objects are immutable in practice
(``torch.Size`` is a tuple; nothing changes a ``TensorProperties`` or a chunk once
built): a shared chunk is 88 bytes less per tensor, 8 MiB at 100,000 tensors. The keys
of ``storage_data`` (``MetadataIndex``) make their own ``torch.Size`` of the offset they
are given: :func:`index_at` makes one that holds the shared offset itself.

The keys of the shape cache are tuples of ints, which a crafted file could make collide.
For shapes read from a file, ``SharedParts(max_shapes=n)`` remembers at most ``n``
distinct ones (a lookup then compares with at most ``n`` keys, however their hashes
collide) and builds each ``torch.Size`` before looking it up, so that only values
``torch.Size`` accepts are shared (the metadata index reader uses it); chunks are shared
only where both their shapes are, at most ``n`` of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)


class SharedParts:
    """One ``torch.Size`` per distinct shape, one chunk per distinct pair of shapes and
    one ``TensorProperties`` per dtype (for the lifetime of the object: one ``Metadata``
    being built)."""

    def __init__(self, max_shapes: int | None = None) -> None:
        self._sizes: dict[tuple[int, ...], torch.Size] = {}
        # By the identity of the two shared shapes (which the cache of shapes keeps alive).
        self._chunks: dict[tuple[int, int], ChunkStorageMetadata] = {}
        self._properties: dict[torch.dtype, TensorProperties] = {}
        self._max_shapes = max_shapes

    def size(self, dims: Sequence[int]) -> torch.Size:
        """``torch.Size(dims)``, the same object for equal ``dims`` (with ``max_shapes``:
        for the first ``max_shapes`` distinct ones)."""
        if self._max_shapes is not None:
            made = torch.Size(dims)  # raises for what is not a shape
            shared = self._sizes.get(made)
            if shared is not None:
                return shared
            if len(self._sizes) < self._max_shapes:
                self._sizes[made] = made
            return made
        key = tuple(dims)
        size = self._sizes.get(key)
        if size is None:
            size = self._sizes[key] = torch.Size(key)
        return size

    def chunk(self, offsets: Sequence[int], sizes: Sequence[int]) -> ChunkStorageMetadata:
        """``ChunkStorageMetadata(offsets, sizes)`` of shared shapes, the same object for
        equal shapes where both are shared (with ``max_shapes``: for the first
        ``max_shapes`` such pairs)."""
        at, extent = self.size(offsets), self.size(sizes)
        key = (id(at), id(extent))
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = ChunkStorageMetadata(offsets=at, sizes=extent)
            if (
                (self._max_shapes is None or len(self._chunks) < self._max_shapes)
                and self._sizes.get(at) is at
                and self._sizes.get(extent) is extent
            ):
                self._chunks[key] = chunk
        return chunk

    def properties(self, dtype: torch.dtype) -> TensorProperties:
        """``TensorProperties(dtype=dtype)``, the same object for equal ``dtype``."""
        props = self._properties.get(dtype)
        if props is None:
            props = self._properties[dtype] = TensorProperties(dtype=dtype)
        return props


def index_at(fqn: str, offset: torch.Size | None, hint: int | None = None) -> MetadataIndex:
    """``MetadataIndex(fqn, offset, hint)`` holding ``offset`` itself: the class's
    ``__post_init__`` would make a new ``torch.Size`` of it, undoing the sharing."""
    index = MetadataIndex(fqn, None, hint)
    if offset is not None:
        object.__setattr__(index, "offset", offset)  # a frozen dataclass
    return index


__all__ = ["SharedParts", "index_at"]
